"""The multi-process runtime: run any schedule of the IR with its update rule (see :mod:`.executor`)."""

from lightning_pipe.runtime.executor import PipelineExecutor, StepOutput
from lightning_pipe.runtime.failure import PipelineAborted
from lightning_pipe.runtime.launch import LocalRunError, run_local

__all__ = ["LocalRunError", "PipelineAborted", "PipelineExecutor", "StepOutput", "run_local"]

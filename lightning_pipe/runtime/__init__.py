"""The multi-process runtime: run any schedule of the IR with its update rule (see :mod:`.executor`)."""

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.failure import PipelineAborted
from lightning_pipe.runtime.launch import LocalRunError, run_local
from lightning_pipe.runtime.step_output import StepOutput

__all__ = ["LocalRunError", "PipelineAborted", "PipelineExecutor", "StepOutput", "run_local"]

"""The Lightning strategy (:class:`PipelineStrategy`) and what it builds on: the model contract, the
stage optimizers, the logging relay, evaluation and checkpoints (planning at set-up is
:mod:`lightning_pipe.planning`)."""

from lightning_pipe.strategy.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]

"""The Lightning strategy (:class:`PipelineStrategy`) and what it builds on: the model contract, the
stage optimizers, the logging relay and planning at set-up."""

from lightning_pipe.strategy.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]

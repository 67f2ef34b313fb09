"""Batch norm's running statistics over the whole mini-batch (torchgpipe's deferred batch norm).

In a pipeline a batch norm layer in training mode sees micro-batches: it normalises each with that
micro-batch's mean and variance (not the mini-batch's, as the unsplit model does). Left alone, it
would also update its running statistics once per micro-batch, ``m`` times per step with ``m`` times
the momentum's weight on the newest. :class:`DeferredNorms` keeps the running statistics as the
unsplit model updates them, once per step: while the executor runs a micro-batch's forward
(:func:`running_forward`) each layer updates its running statistics with momentum 1, which leaves
there the micro-batch's mean and unbiased variance as the layer computed them; they are kept with
the micro-batch's count and the layer's statistics put back. When the stage applies the step
(:meth:`DeferredNorms.commit`) they are combined (Chan et al.'s parallel variance) into the mean and
unbiased variance of all the step's rows, and the running statistics move once, with the layer's
momentum (or its cumulative average when ``momentum=None``). Kim et al. 2020 (torchgpipe, §3.4) describe the idea.

Forwards outside :func:`running_forward` (evaluation, profiling, the verification of a captured
graph, recomputation in the backward) leave batch norm as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredNorms", "batch_norms", "running_forward"]

_STEP: ContextVar[tuple[int, int] | None] = ContextVar("lightning_pipe_step", default=None)


@contextmanager
def running_forward(step: int, microbatch: int) -> Iterator[None]:
    """The forward of micro-batch ``microbatch`` of step ``step`` runs inside (its batch norm
    statistics count; a forward run again, after an in-place failure, replaces its count)."""
    token = _STEP.set((step, microbatch))
    try:
        yield
    finally:
        _STEP.reset(token)


def batch_norms(module: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The batch norm layers of ``module`` that keep running statistics."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class DeferredNorms:
    """The batch norm layers of one stage, their running statistics updated once per step."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [layer for _, layer in batch_norms(module)]
        # step -> layer index -> micro-batch -> (rows, mean, sum of squared deviations)
        self.pending: dict[int, dict[int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]]] = {}
        self._saved: dict[int, tuple[torch.Tensor, ...]] = {}
        self._handles = [
            handle
            for index, layer in enumerate(self.layers)
            for handle in (
                layer.register_forward_pre_hook(self._before(index)),
                layer.register_forward_hook(self._after(index)),
            )
        ]

    def _before(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: tuple[Any, ...]) -> None:
            running = _STEP.get()
            if running is None or not layer.training:
                return
            # with momentum 1 the layer's own update writes this micro-batch's mean and unbiased
            # variance into its running statistics, as it computes them (no second pass over the input)
            self._saved[index] = (layer.momentum, *(t.detach().clone() for t in _statistics(layer)))
            layer.momentum = 1.0

        return hook

    def _after(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
            saved = self._saved.pop(index, None)
            if saved is None:
                return
            step, microbatch = _STEP.get()
            x = args[0]
            rows = x.numel() // x.shape[1]
            mean, unbiased = layer.running_mean.detach().clone(), layer.running_var.detach().clone()
            self.pending.setdefault(step, {}).setdefault(index, {})[microbatch] = (rows, mean, unbiased * (rows - 1))
            layer.momentum = saved[0]
            for buffer, value in zip(_statistics(layer), saved[1:], strict=True):
                buffer.data.copy_(value)  # .data: the backward node holds these and checks their version

        return hook

    def commit(self, step: int) -> None:
        """Move each layer's running statistics once, by all the rows its forwards of ``step`` saw."""
        for index, by_microbatch in self.pending.pop(step, {}).items():
            layer = self.layers[index]
            parts = [by_microbatch[mb] for mb in sorted(by_microbatch)]
            rows = sum(n for n, _, _ in parts)
            mean = sum(n * m for n, m, _ in parts) / rows
            squares = sum(s + n * (m - mean) ** 2 for n, m, s in parts)
            unbiased = squares / max(rows - 1, 1)
            # through .data: micro-batches of the next step may be in flight (non-flushing schedules), their
            # backward nodes hold these buffers and check their version
            layer.num_batches_tracked.data.add_(1)
            momentum = layer.momentum
            if momentum is None:
                momentum = 1.0 / float(layer.num_batches_tracked)
            running_mean, running_var = layer.running_mean.data, layer.running_var.data
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

    def forget(self) -> None:
        """Drop what steps not applied yet have gathered (a stage's state is being replaced)."""
        self.pending.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _statistics(layer: _BatchNorm) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (layer.running_mean, layer.running_var, layer.num_batches_tracked) if t is not None)

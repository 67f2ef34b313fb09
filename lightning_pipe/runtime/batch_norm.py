"""Batch norm's running statistics over the whole mini-batch (torchgpipe's deferred batch norm).

In a pipeline a batch norm layer in training mode sees micro-batches: it normalises each with that
micro-batch's mean and variance (not the mini-batch's, as the unsplit model does). Left alone, it
would also update its running statistics once per micro-batch, ``m`` times per step with ``m`` times
the momentum's weight on the newest. :class:`DeferredNorms` keeps the running statistics as the
unsplit model updates them, once per step: while the executor runs a micro-batch's forward
(:func:`running_forward`) each layer's running statistics are swapped for zeroed scratch rows and its
momentum set to 1, so the layer writes there the micro-batch's mean and unbiased variance as it
computes them, and its own statistics are not touched (no copies: on a GPU each would be a kernel
launch, and a ResNet-50 has 53 batch norm layers). When the stage applies the step
(:meth:`DeferredNorms.commit`) they are combined (Chan et al.'s parallel variance) into the mean and
unbiased variance of all the step's rows, and the running statistics move once, with the layer's
momentum (or its cumulative average when ``momentum=None``), in multi-tensor (``torch._foreach_*``)
operations over all the stage's layers at once. Kim et al. 2020 (torchgpipe, §3.4) describe the idea.

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

from lightning_pipe.cost.saved_bytes import mark_model_state

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
        # step -> micro-batch -> layer index -> (rows, mean, unbiased variance) of that forward
        self.pending: dict[int, dict[int, dict[int, tuple[int, torch.Tensor, torch.Tensor]]]] = {}
        # layer index -> the layer called (it or its copy), what its forward swapped out, its scratch rows
        self._swapped: dict[int, tuple[Any, ...]] = {}
        # (step, micro-batch, dtype, device) -> the forward's scratch rows by layer, and the layers handed theirs
        self._blocks: dict[tuple[Any, ...], tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], set[int]]] = {}
        self._handles = [
            handle
            for index, layer in enumerate(self.layers)
            for handle in (
                layer.register_forward_pre_hook(self._before(index)),
                layer.register_forward_hook(self._after(index)),
            )
        ]

    def _scratch(self, step: int, microbatch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s zeroed mean and variance rows for this forward: views of one block shared
        by all the stage's layers of its dtype and device (one allocation, one fill and two splits per
        forward). A layer called again in the same forward gets rows of its own: the first call's
        backward holds its rows and checks their version."""
        dtype, device = key = _key(self.layers[index])
        rows, handed = self._blocks.get((step, microbatch, *key), ({}, set()))
        if index in handed:
            own = mark_model_state(torch.zeros(2, self.layers[index].running_mean.numel(), dtype=dtype, device=device))
            return own[0], own[1]
        if not rows:
            alike = [i for i, layer in enumerate(self.layers) if _key(layer) == key]
            widths = [self.layers[i].running_mean.numel() for i in alike]
            # model state, not activations: the memory count leaves them out, as the running statistics
            block = mark_model_state(torch.zeros(2, sum(widths), dtype=dtype, device=device))
            means, variances = block[0].split(widths), block[1].split(widths)
            rows.update(zip(alike, zip(means, variances, strict=True), strict=True))
            self._blocks[(step, microbatch, *key)] = (rows, handed)
        handed.add(index)
        return rows[index]

    def _before(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: tuple[Any, ...]) -> None:
            running = _STEP.get()
            if running is None or not layer.training:
                return
            self._restore(index)  # a forward that failed half-way left its swap behind
            mean, variance = self._scratch(*running, index)
            # the layer called: a copy of the stage (a kept weight version's replica) runs these hooks too
            own = (layer.momentum, layer.running_mean, layer.running_var, layer.num_batches_tracked)
            self._swapped[index] = (layer, *own, mean, variance)
            # momentum 1 writes the micro-batch's own statistics into the scratch rows; no count moves
            layer.momentum, layer.running_mean, layer.running_var = 1.0, mean, variance
            layer.num_batches_tracked = None

        return hook

    def _after(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
            scratch = self._restore(index)
            if scratch is None:
                return
            step, microbatch = _STEP.get()
            rows = args[0].numel() // args[0].shape[1]
            self.pending.setdefault(step, {}).setdefault(microbatch, {})[index] = (rows, *scratch)

        return hook

    def _restore(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Put back what layer ``index``'s forward swapped out; the mean and variance rows it wrote
        (None if nothing was swapped)."""
        swapped = self._swapped.pop(index, None)
        if swapped is None:
            return None
        layer = swapped[0]
        layer.momentum, layer.running_mean, layer.running_var, layer.num_batches_tracked = swapped[1:5]
        return swapped[5], swapped[6]

    def commit(self, step: int) -> None:
        """Move each layer's running statistics once, by all the rows its forwards of ``step`` saw."""
        by_microbatch = self.pending.pop(step, {})
        for key in [key for key in self._blocks if key[0] == step]:
            del self._blocks[key]  # its rows live on in the parts kept here and in the backward nodes
        seen: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for microbatch in sorted(by_microbatch):
            for index, part in by_microbatch[microbatch].items():
                seen.setdefault(index, []).append(part)
        groups: dict[tuple[Any, ...], list[int]] = {}  # layers alike in parts, dtype and device combine together
        for index, parts in seen.items():
            groups.setdefault((len(parts), *_key(self.layers[index])), []).append(index)
        for indices in groups.values():
            self._combine_and_move(indices, [seen[index] for index in indices])

    def _combine_and_move(self, indices: list[int], parts: list[list[tuple[int, torch.Tensor, torch.Tensor]]]) -> None:
        """Chan et al.'s parallel mean and unbiased variance of layers ``indices`` over their parts
        (``Σ nₖ/N · meanₖ`` and ``Σ ((nₖ - 1) varₖ + nₖ (meanₖ - mean)²) / (N - 1)``), then one
        momentum step of their running statistics, each a multi-tensor operation over the layers."""
        totals = [sum(part[0] for part in layer_parts) for layer_parts in parts]
        ks = range(len(parts[0]))

        def across(k: int, which: int) -> list[torch.Tensor]:  # part k's means (1) or variances (2)
            return [layer_parts[k][which] for layer_parts in parts]

        def factors(k: int, factor: Any) -> list[float]:  # a per-layer scalar of part k's rows and the total
            return [factor(layer_parts[k][0], total) for layer_parts, total in zip(parts, totals, strict=True)]

        mean = _weighted_sum([across(k, 1) for k in ks], [factors(k, lambda n, total: n / total) for k in ks])
        deviations = [torch._foreach_sub(across(k, 1), mean) for k in ks]
        for squared in deviations:
            torch._foreach_mul_(squared, squared)
        within = [factors(k, lambda n, total: (n - 1) / max(total - 1, 1)) for k in ks]
        between = [factors(k, lambda n, total: n / max(total - 1, 1)) for k in ks]
        variance = _weighted_sum([across(k, 2) for k in ks] + deviations, within + between)
        _move([self.layers[index] for index in indices], mean, variance)

    def forget(self) -> None:
        """Drop what steps not applied yet have gathered (a stage's state is being replaced)."""
        self.pending.clear()
        self._blocks.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _key(layer: _BatchNorm) -> tuple[torch.dtype, torch.device]:
    return layer.running_mean.dtype, layer.running_mean.device


def _weighted_sum(terms: list[list[torch.Tensor]], weights: list[list[float]]) -> list[torch.Tensor]:
    """``Σ_k weights[k] · terms[k]``, each a list over layers (a multi-tensor operation per term)."""
    total = torch._foreach_mul(terms[0], weights[0])
    for term, weight in zip(terms[1:], weights[1:], strict=True):
        torch._foreach_add_(total, torch._foreach_mul(term, weight))
    return total


def _move(layers: list[_BatchNorm], mean: list[torch.Tensor], variance: list[torch.Tensor]) -> None:
    """One step of each layer's running statistics toward ``mean`` and ``variance``, by its momentum
    (its cumulative average for ``momentum=None``), and its count by one."""
    # through .data: a recomputed forward's backward node (``recompute``) holds these buffers and checks
    # their version, and micro-batches of the next step may be in flight (non-flushing schedules)
    counts = [layer.num_batches_tracked.data for layer in layers if layer.num_batches_tracked is not None]
    if counts:
        torch._foreach_add_(counts, 1)
    by_momentum: dict[float | None, list[int]] = {}
    for position, layer in enumerate(layers):
        by_momentum.setdefault(layer.momentum, []).append(position)
    for momentum, positions in by_momentum.items():
        running_means = [layers[i].running_mean.data for i in positions]
        running_vars = [layers[i].running_var.data for i in positions]
        means, variances = [mean[i] for i in positions], [variance[i] for i in positions]
        if momentum is not None:
            torch._foreach_lerp_(running_means, means, momentum)
            torch._foreach_lerp_(running_vars, variances, momentum)
            continue
        # the cumulative average: each layer's own count, read from the device in one transfer
        counted = torch.stack([layers[i].num_batches_tracked for i in positions]).tolist()
        for running_mean, running_var, m, v, count in zip(
            running_means, running_vars, means, variances, counted, strict=True
        ):
            running_mean.lerp_(m, 1.0 / count)
            running_var.lerp_(v, 1.0 / count)

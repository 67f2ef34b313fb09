"""Weight versions, gradient accumulation and updates of one stage on one worker.

A stage computes with a *version* of its weights: version ``v`` is the weights after ``v`` updates
(DESIGN.md, update rules). Forward passes run on the leaves of the version they use (through
:func:`torch.func.functional_call` for a snapshot), so a backward always differentiates the weights
its forward saw, however many updates happened in between (weight stashing, Narayanan et al. 2019
§3.3).

- When every use of a version ends before the next update (flushing schedules), the live parameters
  are those leaves: no copy.
- Otherwise each version in use is a detached snapshot taken while it is current; the optimizer then
  updates the live parameters in place without disturbing pending backwards. Snapshots no future
  action needs are dropped.

Gradients are accumulated per step (two steps can be in flight): the step's first backward keeps the
gradients autograd made (nothing to zero), later ones are added into them in place. An update sums
them across the stage's replicas (all-reduce in the stage's own process group), hands them to the
optimizer and steps it.
Everything that carries over between calls is in :meth:`StageWeights.state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

__all__ = ["StageWeights"]


class StageWeights:
    """Versions, gradients and optimizer of one stage.

    Args:
        module: the stage's layers (its parameters are the live weights).
        optimizer: builds the stage's optimizer from its parameters.
        snapshots: keep versions as snapshots (non-flushing schedules).
        group: process group of the stage's replicas (``None``: not replicated).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        snapshots: bool,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self._live = dict(zip(self.names, self.params, strict=True))
        self.optimizer = optimizer(self.params)
        self.snapshots = snapshots
        self.group = group
        self.version = 0
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.gradients: dict[int, list[torch.Tensor]] = {}

    def leaves(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors to compute with for ``version`` (the current version or a kept snapshot)."""
        if not self.snapshots:
            if version != self.version:
                raise RuntimeError(f"version {version} asked while the stage is at version {self.version}")
            return self._live
        if version not in self.versions:
            if version != self.version:
                raise RuntimeError(
                    f"version {version} is gone (the stage is at version {self.version}, keeps "
                    f"{sorted(self.versions)}): the schedule uses a version it did not keep"
                )
            self.versions[version] = {
                name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in zip(self.names, self.params, strict=True)
            }
        return self.versions[version]

    def forward(self, leaves: dict[str, torch.Tensor], inputs: Any) -> Any:
        """The stage's forward with ``leaves`` as its weights (a plain call for the live ones)."""
        if leaves is self._live:
            return self.module(inputs)
        return functional_call(self.module, leaves, (inputs,))

    def _buffer(self, step: int) -> list[torch.Tensor | None]:
        """``step``'s gradients so far (``None`` for a weight none reached yet)."""
        return self.gradients.pop(step, None) or [None] * len(self.params)

    def add(self, step: int, grads: list[torch.Tensor | None]) -> None:
        """Add weight gradients computed elsewhere (a split backward's ``W``, fresh tensors) to
        ``step``'s buffer."""
        buffer = self._buffer(step)
        for index, grad in enumerate(grads):
            if grad is not None and buffer[index] is None:
                buffer[index] = grad
            elif grad is not None:
                buffer[index].add_(grad)
        self.gradients[step] = buffer

    def backward(
        self,
        step: int,
        leaves: dict[str, torch.Tensor],
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor] | None,
        inputs: list[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """Backward of one micro-batch: weight gradients accumulate in place into ``step``'s buffer
        (lent to the leaves as their ``.grad``, so autograd adds into it without allocating; the
        step's first backward keeps what autograd made, with nothing to zero), the gradients of
        ``inputs`` are returned."""
        buffer = self._buffer(step)
        weights = list(leaves.values())
        for leaf, grad in zip(weights, buffer, strict=True):
            leaf.grad = grad
        del buffer  # the leaves hold the only reference: autograd accumulates in place
        torch.autograd.backward(roots, root_grads, inputs=inputs + weights)
        self.gradients[step] = [leaf.grad for leaf in weights]
        for leaf in weights:
            leaf.grad = None
        grads = [x.grad for x in inputs]
        for x in inputs:
            x.grad = None
        return grads

    def update(self, step: int, keep: set[int]) -> None:
        """Apply ``step``'s gradient (summed over replicas); versions outside ``keep`` are dropped."""
        if self.snapshots and self.version in keep:
            self.leaves(self.version)  # the outgoing version stays usable after the in-place update
        buffer = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, self._buffer(step), strict=True)]
        if self.group is not None:
            for grad in buffer:
                dist.all_reduce(grad, group=self.group)
        for param, grad in zip(self.params, buffer, strict=True):
            param.grad = grad
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        self.version += 1
        self.versions = {v: leaves for v, leaves in self.versions.items() if v in keep}

    def state_dict(self) -> dict[str, object]:
        """What carries over between calls: version counter, kept versions, pending gradients."""
        return {
            "version": self.version,
            "versions": {v: {k: t.detach().clone() for k, t in leaves.items()} for v, leaves in self.versions.items()},
            "gradients": {s: [None if g is None else g.clone() for g in grads] for s, grads in self.gradients.items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.version = int(state["version"])
        self.versions = {
            int(v): {k: t.clone().requires_grad_(True) for k, t in leaves.items()}
            for v, leaves in state["versions"].items()
        }
        self.gradients = {
            int(s): [None if g is None else g.clone() for g in grads] for s, grads in state["gradients"].items()
        }
        self.optimizer.load_state_dict(state["optimizer"])

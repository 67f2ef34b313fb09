"""Gradient clipping of a pipeline's stages, as ``torch.nn.utils.clip_grad_norm_`` and
``clip_grad_value_`` define it for one model.

- Flushing schedules clip by the *global* norm: every stage's gradient of a step exists before any
  stage updates, so the executor holds the step's updates back to the end of the call, sums every
  stage's squared norm across the workers (one all-reduce) and scales all gradients by
  ``min(1, max_norm / (norm + 1e-6))`` — the unsplit model's clipping exactly.
- Non-flushing schedules (PipeDream, 2BW, CDP) update each stage as soon as its last backward of the
  step is done, while other stages are still computing that step: waiting for a global norm would
  be a flush. Each stage clips its own gradient by its own norm instead, so the global norm is at
  most ``max_norm · √P`` for ``P`` stages.
- Clipping by value is elementwise and the same for every schedule.
"""

from __future__ import annotations

import math

import torch

__all__ = ["clip_by_value", "norm_coefficient", "scale", "squared_norm"]

Gradients = list[torch.Tensor | None]


def squared_norm(grads: Gradients) -> torch.Tensor:
    """``Σ ‖g‖²`` over the gradients present, in float64 (a 0-dim tensor on the gradients' device)."""
    present = [g.detach() for g in grads if g is not None]
    if not present:
        return torch.zeros((), dtype=torch.float64)
    # one multi-tensor kernel per dtype and device, as torch.nn.utils.clip_grad_norm_ (not ~5 per gradient)
    return torch.stack(torch._foreach_norm(present, 2, dtype=torch.float64)).square().sum()


def norm_coefficient(norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor: ``max_norm / (norm + 1e-6)`` capped at 1."""
    if not math.isfinite(norm):
        return 1.0  # as torch does without error_if_nonfinite: the non-finite gradient goes through
    return min(1.0, max_norm / (norm + 1e-6))


def scale(grads: Gradients, coefficient: float) -> None:
    """Multiply every gradient present by ``coefficient`` in place (nothing when it is 1)."""
    present = [g for g in grads if g is not None]
    if coefficient != 1.0 and present:
        torch._foreach_mul_(present, coefficient)


def clip_by_value(grads: Gradients, value: float) -> None:
    """Clamp every gradient present to ``[-value, value]`` in place."""
    present = [g for g in grads if g is not None]
    if present:
        torch._foreach_clamp_min_(present, -value)
        torch._foreach_clamp_max_(present, value)

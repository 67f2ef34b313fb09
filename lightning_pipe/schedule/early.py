"""Backwards that send their input gradient before computing their weight gradients.

In a flushing schedule the stages drain at the end of each step: an upstream stage waits, idle, for
the gradients of its last micro-batches (the cool-down). A backward of stage ``s > 0`` there can
compute its input gradient first, send it, then compute its weight gradients (the ``I``/``W`` split of
zero-bubble pipelines, Qi et al. 2024 §2, kept inside one ``B`` action), so the upstream stage starts
``W`` earlier on every hop: the step ends up to ``(P - 1) * W`` sooner, with the same order, memory
and arithmetic. In steady state (and in non-flushing schedules, which have no cool-down) the
upstream stage has other work, so the split, which costs a few extra autograd calls, is not done.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedule.ir import Action, Kind

__all__ = ["cooldown_backwards"]


def cooldown_backwards(order: Sequence[Action], flush: bool) -> set[int]:
    """Positions in a worker's ``order`` of the backwards of stages ``> 0`` that come after its last
    forward of the same step (none unless the schedule flushes)."""
    if not flush:
        return set()
    last_forward: dict[int, int] = {}
    for position, action in enumerate(order):
        if action.kind is Kind.F:
            last_forward[action.step] = position
    return {
        position
        for position, action in enumerate(order)
        if action.kind is Kind.B and action.stage > 0 and position > last_forward.get(action.step, -1)
    }

"""Backwards that send their input gradient before computing their weight gradients.

In a flushing schedule the stages drain at the end of each step: an upstream stage waits, idle, for
the gradients of its last micro-batches (the cool-down). A backward of stage ``s > 0`` there can
compute its input gradient first, send it, then compute its weight gradients (the ``I``/``W`` split of
zero-bubble pipelines, Qi et al. 2024 §2, kept inside one ``B`` action), so the upstream stage starts
``W`` earlier on every hop: the step ends up to ``(P - 1) * W`` sooner, with the same order, memory
and arithmetic.

The split is not free: besides a few extra autograd calls, the weight gradients are computed after
the whole input-gradient pass instead of next to it, from inputs no longer in cache. On two CPU
cores it costs 1.1 ms on a 32-row backward of 1.9 ms and 3.5 ms on a 512-row one of 14 ms
(``docs/runtime.md``). The gain is at most one ``W`` per hop and step, however many backwards are
split, so only a short cool-down is split: at most ``P - s`` backwards of stage ``s`` in a step, as in
1F1B's, where each is one hop of the drain. GPipe's cool-down is all ``m`` backwards of the step,
which would pay the split ``m`` times for the same single ``W``: it is not split. Nor is a backward
whose input gradient stays on its worker (DDP: every stage on every worker). In steady state
(and in non-flushing schedules, which have no cool-down) the upstream stage has other work, so the
split is not done either.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedule.ir import Action, Kind

__all__ = ["cooldown_backwards"]


def cooldown_backwards(order: Sequence[Action], flush: bool, stages: int) -> set[int]:
    """Positions in a worker's ``order`` of the backwards of stages ``s > 0`` that come after its last
    forward of the same step and send their input gradient to another worker (the backward of stage
    ``s - 1`` is not in ``order``), for each stage and step with at most ``stages - s`` of them (none
    unless the schedule flushes)."""
    if not flush:
        return set()
    last_forward: dict[int, int] = {}
    for position, action in enumerate(order):
        if action.kind is Kind.F:
            last_forward[action.step] = position
    here = {(a.stage, a.microbatch, a.step) for a in order if a.kind in (Kind.B, Kind.I)}
    cooldown: dict[tuple[int, int], list[int]] = {}
    for position, action in enumerate(order):
        cooling = action.kind is Kind.B and action.stage > 0 and position > last_forward.get(action.step, -1)
        if cooling and (action.stage - 1, action.microbatch, action.step) not in here:  # its gradient leaves
            cooldown.setdefault((action.stage, action.step), []).append(position)
    return {
        position
        for (stage, _), positions in cooldown.items()
        if len(positions) <= stages - stage
        for position in positions
    }

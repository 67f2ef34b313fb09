"""ZB-H1, the zero-bubble schedule with 1F1B's memory (Qi et al., ICLR 2024, §3).

The backward is split into ``I`` (gradient of the input, on the critical path) and ``W`` (gradient
of the weights, needed only by the update). Every stage starts, whenever it is free, the ready job
of highest priority — ``I`` before ``F`` before ``W`` — with at most ``P - s`` micro-batches in flight
on stage ``s`` (forward started, ``W`` not done), 1F1B's activation memory. ``W`` passes then fill bubbles
of the cool-down, and the backward chain through the stages is made of ``I`` only. Activations are
counted until their ``W`` (the stricter accounting: ``W`` still reads the layer inputs), so ZB-H1 keeps
exactly 1F1B's ``min(P - s, m)``; with ``u_F = u_I = u_W`` it saves ``P - 1`` of 1F1B's ``3(P - 1)``
bubble (the paper's ``(P - 1)(u_F + u_I - u_W)`` assumes most memory is freed after ``I``). The
order is recorded from a greedy run on the given durations (:mod:`lightning_pipe.schedule.greedy`).
"""

from __future__ import annotations

from collections import Counter

from lightning_pipe.schedule.greedy import list_schedule
from lightning_pipe.schedule.ir import Action, Kind, Schedule
from lightning_pipe.schedule.pipeline import check_sizes, with_updates

__all__ = ["zb_h1"]

_RANK = {Kind.I: 0, Kind.F: 1, Kind.W: 2}


def _admissible(action: Action, started: Counter, stages: int) -> bool:
    """At most ``P - s`` micro-batches in flight on stage ``s``: a forward waits for a ``W`` to free one."""
    if action.kind is Kind.F:
        return started[(Kind.F, action.stage)] - started[(Kind.W, action.stage)] < stages - action.stage
    return True


def zb_h1(
    stages: int,
    microbatches: int,
    steps: int = 1,
    *,
    forward: float = 1.0,
    input_grad: float = 1.0,
    weight_grad: float = 1.0,
) -> Schedule:
    """ZB-H1 orders for ``stages`` workers, one flush per step."""
    check_sizes("zb_h1", stages, microbatches, steps)
    seconds = {Kind.F: forward, Kind.I: input_grad, Kind.W: weight_grad}
    orders: list[list[Action]] = [[] for _ in range(stages)]
    for t in range(steps):
        jobs = [
            Action(kind, s, i, t)
            for i in range(microbatches)
            for s in range(stages)
            for kind in (Kind.F, Kind.I, Kind.W)
        ]
        step_orders = list_schedule(
            jobs,
            stages,
            worker_of=lambda a: a.stage,
            duration=lambda a: seconds[a.kind],
            priority=lambda a: (_RANK[a.kind], a.microbatch),
            last_stage=stages - 1,
            admissible=lambda a, started: _admissible(a, started, stages),
        )
        for s in range(stages):
            orders[s] += with_updates(step_orders[s], [s])
    return Schedule(
        family="zb_h1",
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        orders=orders,
        owners=[(s,) for s in range(stages)],
        params={"forward": forward, "input_grad": input_grad, "weight_grad": weight_grad},
    )

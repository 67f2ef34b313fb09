"""Stage costs measured in a running pipeline, for the simulator.

A profile taken layer by layer, or stage by stage on its own, misses what the pipeline does to its
own compute: the transfers' processor time and memory traffic, the other workers on the same
machine, the schedule's order. The executor's timeline records every action it ran with the seconds
it waited for messages; an action's own compute is its duration less those waits. Their means per
stage and kind, pooled over the ranks (and over a stage's replicas), are costs the simulator can
replay for any schedule, micro-batch count or network (:func:`lightning_pipe.schedule.simulate`):
measure a few steps of one schedule, then predict the others.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Kind
from lightning_pipe.schedule.simulate import Interval, StageCosts

__all__ = ["measured_seconds", "stage_costs"]

Totals = dict[tuple[int, Kind], tuple[float, int]]
"""``(stage, kind) -> (seconds of compute, actions)`` of one rank."""

_MEASURED = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE)


def measured_seconds(timeline: Iterable[Interval], since_step: int = 0) -> Totals:
    """This rank's compute seconds and action counts per stage and kind, waits for messages
    excluded, over the actions of steps ``>= since_step`` (leave out the warm-up)."""
    totals: Totals = {}
    for interval in timeline:
        action = interval.action
        if action.kind in _MEASURED and action.step >= since_step:
            key = (action.stage, action.kind)
            seconds, count = totals.get(key, (0.0, 0))
            totals[key] = (seconds + max(interval.end - interval.start - interval.waited, 0.0), count + 1)
    return totals


def stage_costs(ranks: Sequence[Totals], stages: int, **network: object) -> StageCosts:
    """Mean seconds per action of each stage and kind, pooled over ``ranks`` (every rank's
    :func:`measured_seconds`), as :class:`StageCosts`; ``network`` holds its other fields
    (``bandwidth``, ``latency``, ``overhead``, ``activation_bytes``, ...).

    A backward measured as input and weight halves (zero bubble) gives ``input_grad`` and
    ``weight_grad``, and ``backward`` is their sum; a stage without an update (none ran) costs 0 there.
    """
    seconds: dict[tuple[int, Kind], float] = defaultdict(float)
    counts: dict[tuple[int, Kind], int] = defaultdict(int)
    for totals in ranks:
        for key, (spent, count) in totals.items():
            seconds[key] += spent
            counts[key] += count
    mean = {key: seconds[key] / count for key, count in counts.items() if count}
    backward = [_backward(mean, s) for s in range(stages)]
    missing = [s for s in range(stages) if (s, Kind.F) not in mean or backward[s] is None]
    if missing:
        raise PlanningError(
            f"no forward and backward of stage(s) {missing} in the measured timelines: run more steps, measure "
            "from an earlier step (since_step), or keep more of the timeline (timeline_length)"
        )
    split = all((s, Kind.I) in mean and (s, Kind.W) in mean for s in range(stages))
    return StageCosts(
        forward=[mean[(s, Kind.F)] for s in range(stages)],
        backward=backward,
        input_grad=[mean[(s, Kind.I)] for s in range(stages)] if split else None,
        weight_grad=[mean[(s, Kind.W)] for s in range(stages)] if split else None,
        update=[mean.get((s, Kind.UPDATE), 0.0) for s in range(stages)],
        **network,
    )


def _backward(mean: Mapping[tuple[int, Kind], float], stage: int) -> float | None:
    """A whole backward: measured as one, or as its two halves (``None``: neither was measured)."""
    if (stage, Kind.B) in mean:
        return mean[(stage, Kind.B)]
    if (stage, Kind.I) in mean and (stage, Kind.W) in mean:
        return mean[(stage, Kind.I)] + mean[(stage, Kind.W)]
    return None

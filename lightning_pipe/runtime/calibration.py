"""Stage costs measured in a running pipeline, for the simulator.

A profile taken layer by layer, or stage by stage on its own, misses what the pipeline does to its
own compute: the transfers' processor time and memory traffic, the other workers on the same
machine, the schedule's order. The executor's timeline records every action it ran with the seconds
it waited for messages; an action's own compute is its duration less those waits. Their means per
stage and kind, pooled over the ranks (and over a stage's replicas), are costs the simulator can
replay for any schedule, micro-batch count or network (:func:`lightning_pipe.schedule.simulate`):
measure a few steps of one schedule, then predict the others.

On workers that share one machine (``StageCosts.contention`` > 1) a measured action also holds the
slowdown of the others computing at the same time, which depends on the schedule it ran in (a
flushing schedule's bubble lets a worker run alone; a non-flushing one keeps all busy):
:func:`alone_costs` takes it out, so the simulator can put back what another schedule would cause.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Kind, Schedule
from lightning_pipe.schedule.simulate import Interval, Simulation, StageCosts, simulate

__all__ = ["alone_costs", "measured_seconds", "stage_costs"]

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

    A backward measured as input and weight halves (zero bubble's ``I`` and ``W``, or a cool-down
    backward that sent its input gradient early) gives ``input_grad`` and ``weight_grad``: what a
    split backward costs, more than a whole one on a CPU (``schedule/early.py``). A stage measured
    only as halves has ``backward`` their sum; a stage measured only whole has halves of half its
    backward each (when another stage has them). A stage without an update (none ran) costs 0 there.
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
    halves = [(s, Kind.I) in mean and (s, Kind.W) in mean for s in range(stages)]
    split = {
        kind: [mean[(s, kind)] if halves[s] else backward[s] / 2 for s in range(stages)] if any(halves) else None
        for kind in (Kind.I, Kind.W)
    }
    return StageCosts(
        forward=[mean[(s, Kind.F)] for s in range(stages)],
        backward=backward,
        input_grad=split[Kind.I],
        weight_grad=split[Kind.W],
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


_FIELDS = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input_grad", Kind.W: "weight_grad", Kind.UPDATE: "update"}
_SIBLINGS = {Kind.B: (Kind.I, Kind.W), Kind.I: (Kind.B, Kind.W), Kind.W: (Kind.B, Kind.I)}


def alone_costs(
    measured: StageCosts, schedule: Schedule, early_gradients: bool = False, tolerance: float = 1e-6
) -> StageCosts:
    """Each action's seconds alone, from means measured while running ``schedule`` on workers that
    share one machine (``measured.contention``): the costs that, replayed on ``schedule`` with that
    contention, give back the measured means.

    Found by fixed-point iteration: each stage's seconds of each kind become the measured ones divided
    by how much longer the replay makes those actions than they take alone, until the replay gives
    back the mean of every kind the schedule runs to ``tolerance`` (relative to it or to the largest
    mean, whichever is larger: the replay's times resolve no finer). Several costs alone
    can give the same means (ties between workers' actions); any of them predicts alike. A kind the
    schedule never runs is scaled like its halves or whole, or not at all; a backward only run as
    its two halves is their sum.
    """
    if measured.contention == 1:
        return measured
    # what the replay's floating-point times can resolve: relative to the largest cost, not to each one
    scale = max(v for name in _FIELDS.values() for v in getattr(measured, name) or ())
    costs = measured
    for _ in range(100):
        shared = simulate(schedule, costs, early_gradients=early_gradients)
        alone = simulate(schedule, replace(costs, contention=1.0), early_gradients=early_gradients)
        stretch = _stretch(shared, alone)
        fields = {}
        settled = True
        for kind, name in _FIELDS.items():
            if getattr(measured, name) is None:
                continue
            values = []
            for stage, (want, now) in enumerate(zip(getattr(measured, name), getattr(costs, name), strict=True)):
                if (stage, kind) in stretch:  # a kind the schedule runs: its replayed mean is the measured one
                    replayed = now * stretch[(stage, kind)]
                    settled &= math.isclose(replayed, want, rel_tol=tolerance, abs_tol=tolerance * scale)
                values.append(want / _factor(stretch, stage, kind))
            fields[name] = values
        if settled:
            return costs
        if "input_grad" in fields and "weight_grad" in fields:  # a backward run as halves is their sum
            for stage in range(measured.stages):
                if (stage, Kind.B) not in stretch:
                    fields["backward"][stage] = fields["input_grad"][stage] + fields["weight_grad"][stage]
        costs = replace(measured, **fields)
    raise PlanningError("alone_costs: the replay's slowdowns did not settle in 100 rounds")


def _stretch(shared: Simulation, alone: Simulation) -> dict[tuple[int, Kind], float]:
    """Per stage and kind: the replay's seconds with sharing over its seconds alone."""
    totals: dict[tuple[int, Kind], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for with_others, by_itself in zip(shared.timeline, alone.timeline, strict=True):
        if with_others.action.kind in _FIELDS:
            total = totals[(with_others.action.stage, with_others.action.kind)]
            total[0] += with_others.end - with_others.start
            total[1] += by_itself.end - by_itself.start
    return {key: longer / short for key, (longer, short) in totals.items() if short > 0}


def _factor(stretch: Mapping[tuple[int, Kind], float], stage: int, kind: Kind) -> float:
    for candidate in (kind, *_SIBLINGS.get(kind, ())):
        if (stage, candidate) in stretch:
            return stretch[(stage, candidate)]
    return 1.0

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

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Action, Kind, Schedule
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.simulation import Interval, Simulation
from lightning_pipe.schedule.stage_costs import StageCosts, adds_gradients

__all__ = ["alone_costs", "gathered_stage_costs", "measured_seconds", "stage_costs"]

Totals = dict[tuple[int, Kind, bool], tuple[float, int]]
"""``(stage, kind, adds) -> (seconds of compute, actions)`` of one rank; ``adds``: a ``B`` or ``W``
that added its weight gradients into its step's (:func:`~lightning_pipe.schedule.stage_costs.adds_gradients`)."""

_MEASURED = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE)


def measured_seconds(timeline: Iterable[Interval], since_step: int = 0, to_next: bool = False) -> Totals:
    """This rank's compute seconds and action counts per stage and kind, waits for messages
    excluded, over the actions of steps ``>= since_step`` (leave out the warm-up). A ``B`` or ``W``
    that added into gradients its step already had on this rank is counted apart from the step's
    first (``timeline`` in the order the rank ran it, from each measured step's first backward on).
    With ``to_next``, an action lasts until the worker's next measured action of the same call starts,
    the last of a call until the end of the call's last action (the waits in between left out): the
    executor's own time between actions counts with the action before it, so a replay with these
    costs keeps the actions where they ran, and the time between two calls (the training loop's, not
    the executor's) counts with none: a non-flushing call ends on a forward or a backward, which would
    otherwise take in the whole loop (on 2 CPU processes an MLP's CDP run on 2 micro-batches put
    1.1 ms of it on each action, whose executor's own time is 8-15 µs)."""
    by_worker: dict[int, list[Interval]] = defaultdict(list)  # a simulated timeline holds every worker's
    for interval in timeline:
        by_worker[interval.worker].append(interval)
    totals: Totals = {}
    for intervals in by_worker.values():
        waited = list(itertools.accumulate((i.waited for i in intervals), initial=0.0))  # before each position
        measured = [p for p, i in enumerate(intervals) if i.action.kind in _MEASURED]
        following, last_of_call = {}, {}
        if to_next:
            following = {p: q for p, q in itertools.pairwise(measured) if intervals[p].call == intervals[q].call}
            last_of_call = {i.call: p for p, i in enumerate(intervals)}
        adds = adds_gradients(i.action for i in intervals)
        for p in measured:
            interval, action = intervals[p], intervals[p].action
            if action.step < since_step:
                continue
            seconds = interval.end - interval.start - interval.waited
            if to_next:
                q = following.get(p)
                if q is not None:
                    seconds = intervals[q].start - interval.start - (waited[q] - waited[p])
                else:
                    r = last_of_call[interval.call]
                    seconds = intervals[r].end - interval.start - (waited[r + 1] - waited[p])
            key = (action.stage, action.kind, adds[p])
            spent, count = totals.get(key, (0.0, 0))
            totals[key] = (spent + max(seconds, 0.0), count + 1)
    return totals


def stage_costs(
    ranks: Sequence[Totals], stages: int, gradient_bytes: Sequence[float] | None = None, **network: object
) -> StageCosts:
    """Mean seconds per action of each stage and kind, pooled over ``ranks`` (every rank's
    :func:`measured_seconds`), as :class:`StageCosts`; ``network`` holds its other fields
    (``bandwidth``, ``latency``, ``overhead``, ``activation_bytes``, ...).

    A backward measured as input and weight halves (zero bubble's ``I`` and ``W``, or a cool-down
    backward that sent its input gradient early) gives ``input_grad`` and ``weight_grad``: what a
    split backward costs, more than a whole one on a CPU (``schedule/early.py``). A stage measured
    only as halves has ``backward`` their sum; a stage measured only whole has halves of half its
    backward each (when another stage has them). A stage without an update (none ran) costs 0 there.
    ``backward`` and ``weight_grad`` are the seconds of a step's first one on a rank; ``accumulate``
    what each later one took more (from the whole backwards, else the weight halves; ``None`` when no
    rank ran two of a step). A stage whose adding backwards were not measured apart from its first
    ones (e.g. 1F1B's last stage at m = 2, whose second backward is split to send its input gradient
    early) gets, with ``gradient_bytes`` (bytes of each stage's trainable weights), the measured
    stages' price per byte: the extra is one pass over the stage's gradients.
    """
    return _costs(_pooled(ranks), stages, gradient_bytes, **network)


def gathered_stage_costs(
    timeline: Iterable[Interval],
    weights: Mapping[int, Any],
    group: Any,
    world: int,
    stages: int,
    since_step: int = 0,
    to_next: Sequence[bool] = (False,),
    **network: object,
) -> list[StageCosts]:
    """:func:`stage_costs` of a pipeline's run, one per entry of ``to_next``: each rank's
    :func:`measured_seconds` of its ``timeline`` (with ``to_next``, each action until the next) and
    the gradient bytes of the stages it holds (``weights``: stage -> its
    :class:`~lightning_pipe.runtime.weights.StageWeights`), gathered over ``group`` (of ``world``
    ranks) at once. A collective."""
    timeline = list(timeline)
    gradients = {
        stage: float(sum(p.numel() * p.element_size() for p in held.params if p.requires_grad))
        for stage, held in weights.items()
    }
    mine = [measured_seconds(timeline, since_step, until_next) for until_next in to_next]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, gradients), group=group)
    sizes = {stage: size for _, theirs in gathered for stage, size in theirs.items()}
    gradient_bytes = [sizes.get(stage, 0.0) for stage in range(stages)]
    return [
        stage_costs([totals[way] for totals, _ in gathered], stages, gradient_bytes, **network)
        for way in range(len(to_next))
    ]


def _pooled(ranks: Sequence[Totals]) -> dict[tuple[int, Kind, bool], float]:
    """Mean seconds per ``(stage, kind, adds)`` over every rank's totals."""
    seconds: dict[tuple[int, Kind, bool], float] = defaultdict(float)
    counts: dict[tuple[int, Kind, bool], int] = defaultdict(int)
    for totals in ranks:
        for key, (spent, count) in totals.items():
            seconds[key] += spent
            counts[key] += count
    return {key: seconds[key] / count for key, count in counts.items() if count}


def _costs(
    mean: Mapping[tuple[int, Kind, bool], float],
    stages: int,
    gradient_bytes: Sequence[float] | None = None,
    **network: object,
) -> StageCosts:
    """:class:`StageCosts` of mean seconds per ``(stage, kind, adds)`` (see :func:`stage_costs`)."""
    first = {(s, k): value for (s, k, adds), value in mean.items() if not adds}
    for (s, k, adds), value in mean.items():  # a kind measured only adding (its first cut off) stands for it
        if adds:
            first.setdefault((s, k), value)
    backward = [_backward(first, s) for s in range(stages)]
    missing = [s for s in range(stages) if (s, Kind.F) not in first or backward[s] is None]
    if missing:
        raise PlanningError(
            f"no forward and backward of stage(s) {missing} in the measured timelines: run more steps, measure "
            "from an earlier step (since_step), or keep more of the timeline (timeline_length)"
        )
    halves = [(s, Kind.I) in first and (s, Kind.W) in first for s in range(stages)]
    split = {
        kind: [first[(s, kind)] if halves[s] else backward[s] / 2 for s in range(stages)] if any(halves) else None
        for kind in (Kind.I, Kind.W)
    }
    costs = StageCosts(
        forward=[first[(s, Kind.F)] for s in range(stages)],
        backward=backward,
        input_grad=split[Kind.I],
        weight_grad=split[Kind.W],
        update=[first.get((s, Kind.UPDATE), 0.0) for s in range(stages)],
        **network,
    )
    extra = [_extra(mean, s) for s in range(stages)]
    return costs if all(e is None for e in extra) else _with_accumulate(costs, _per_byte(extra, gradient_bytes))


def _with_accumulate(costs: StageCosts, extra: Sequence[float]) -> StageCosts:
    """``costs`` with ``accumulate`` ``extra``, each raised where needed so that neither the stage's
    backward nor its weight half, adding, takes less than no time (one stage's whole and split
    backwards, measured apart, may disagree)."""
    floor = [min(costs.duration(Action(Kind.B, s)), costs.duration(Action(Kind.W, s))) for s in range(costs.stages)]
    return replace(costs, accumulate=[max(e, -f) for e, f in zip(extra, floor, strict=True)])


def _per_byte(extra: Sequence[float | None], gradient_bytes: Sequence[float] | None) -> list[float]:
    """The measured ``extra`` of each stage; one not measured (``None``) priced at the measured
    stages' seconds per byte of gradient, or 0 without ``gradient_bytes``."""
    sizes = gradient_bytes or [0.0] * len(extra)
    measured = [s for s, e in enumerate(extra) if e is not None and sizes[s] > 0]
    rate = sum(extra[s] for s in measured) / sum(sizes[s] for s in measured) if measured else 0.0
    return [rate * sizes[s] if e is None else e for s, e in enumerate(extra)]


def _backward(first: Mapping[tuple[int, Kind], float], stage: int) -> float | None:
    """A whole backward: measured as one, or as its two halves (``None``: neither was measured)."""
    if (stage, Kind.B) in first:
        return first[(stage, Kind.B)]
    if (stage, Kind.I) in first and (stage, Kind.W) in first:
        return first[(stage, Kind.I)] + first[(stage, Kind.W)]
    return None


def _extra(mean: Mapping[tuple[int, Kind, bool], float], stage: int) -> float | None:
    """What a backward adding into its step's gradients took more than the step's first (less, where
    it ran with fewer workers computing beside it), from the whole backwards, else from the weight
    halves; ``None``: not measured."""
    for kind in (Kind.B, Kind.W):
        if (stage, kind, True) in mean and (stage, kind, False) in mean:
            return mean[(stage, kind, True)] - mean[(stage, kind, False)]
    return None


def alone_costs(
    measured: StageCosts, schedule: Schedule, early_gradients: bool = False, tolerance: float = 1e-6
) -> StageCosts:
    """Each action's seconds alone, from means measured while running ``schedule`` on workers that
    share one machine (``measured.contention``): the costs that, replayed on ``schedule`` with that
    contention, give back the measured means.

    Found by fixed-point iteration: each stage's seconds of each kind (a backward adding into its
    step's gradients apart from the step's first, when ``measured`` tells them apart with
    ``accumulate``) become the measured ones divided by how much longer
    the replay makes those actions than they take alone, until the replay gives back the mean of
    every kind the schedule runs to ``tolerance`` (relative to it or to the largest mean, whichever is
    larger: the replay's times resolve no finer). Several costs alone can give the same means (ties
    between workers' actions); any of them predicts alike. A kind the schedule never runs is scaled
    like its halves or whole, or not at all; a backward only run as its two halves is their sum.
    """
    if measured.contention == 1:
        return measured
    targets = _means(measured)
    scale = max(targets.values())  # what the replay's floating-point times can resolve
    costs = measured
    for _ in range(100):
        shared = simulate(schedule, costs, early_gradients=early_gradients)
        alone = simulate(schedule, replace(costs, contention=1.0), early_gradients=early_gradients)
        stretch = _stretch(shared, alone, apart=measured.accumulate is not None)
        now = _means(costs)
        if all(
            math.isclose(now[key] * stretch[key], want, rel_tol=tolerance, abs_tol=tolerance * scale)
            for key, want in targets.items()
            if key in stretch
        ):
            return costs
        costs = _with_means(measured, {key: want / _factor(stretch, key) for key, want in targets.items()}, stretch)
    raise PlanningError("alone_costs: the replay's slowdowns did not settle in 100 rounds")


_Means = dict[tuple[int, Kind, bool], float]
_SIBLINGS = {Kind.B: (Kind.I, Kind.W), Kind.I: (Kind.B, Kind.W), Kind.W: (Kind.B, Kind.I)}


def _means(costs: StageCosts) -> _Means:
    """Seconds per ``(stage, kind, adds)`` of every kind ``costs`` gives."""
    means: _Means = {}
    for s in range(costs.stages):
        kinds = {Kind.F: costs.forward, Kind.B: costs.backward, Kind.I: costs.input_grad}
        kinds |= {Kind.W: costs.weight_grad, Kind.UPDATE: costs.update}
        for kind, values in kinds.items():
            if values is not None:
                means[(s, kind, False)] = values[s]
                if kind in (Kind.B, Kind.W) and costs.accumulate is not None:
                    means[(s, kind, True)] = values[s] + costs.accumulate[s]
    return means


def _with_means(base: StageCosts, means: _Means, ran: Mapping[tuple[int, Kind, bool], float]) -> StageCosts:
    """``base`` with the seconds of ``means``; a stage's backward that ran only as its two halves (not
    in ``ran``) is their sum, and its extra for adding comes from the kind that ran adding."""
    stages = range(base.stages)
    for s in stages:
        if (s, Kind.B, False) not in ran and (s, Kind.I, False) in means and (s, Kind.W, False) in means:
            means[(s, Kind.B, False)] = means[(s, Kind.I, False)] + means[(s, Kind.W, False)]
    fields: dict[str, list[float]] = {}
    for kind, name in ((Kind.F, "forward"), (Kind.B, "backward"), (Kind.I, "input_grad"), (Kind.W, "weight_grad")):
        if getattr(base, name) is not None:
            fields[name] = [means[(s, kind, False)] for s in stages]
    if base.update is not None:
        fields["update"] = [means[(s, Kind.UPDATE, False)] for s in stages]
    costs = replace(base, accumulate=None, **fields)
    if base.accumulate is None:
        return costs
    kind = [Kind.W if (s, Kind.W, True) in ran and (s, Kind.B, True) not in ran else Kind.B for s in stages]
    return _with_accumulate(
        costs, [means[(s, k, True)] - means[(s, k, False)] for s, k in zip(stages, kind, strict=True)]
    )


def _stretch(shared: Simulation, alone: Simulation, apart: bool) -> dict[tuple[int, Kind, bool], float]:
    """Per ``(stage, kind, adds)``: the replay's seconds with sharing over its seconds alone (a
    step's first backward and the adding ones pooled, as ``adds=False``, unless ``apart``)."""
    totals: dict[tuple[int, Kind, bool], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for index, timeline in enumerate((shared.timeline, alone.timeline)):
        for (stage, kind, adds), (spent, _) in measured_seconds(timeline).items():
            totals[(stage, kind, adds and apart)][index] += spent
    return {key: longer / short for key, (longer, short) in totals.items() if short > 0}


def _factor(stretch: Mapping[tuple[int, Kind, bool], float], key: tuple[int, Kind, bool]) -> float:
    """The stretch of ``key``'s kind, else of the same kind first or adding, else of its halves or whole."""
    stage, kind, adds = key
    for candidate in (kind, *_SIBLINGS.get(kind, ())):
        for which in (adds, not adds):
            if (stage, candidate, which) in stretch:
                return stretch[(stage, candidate, which)]
    return 1.0

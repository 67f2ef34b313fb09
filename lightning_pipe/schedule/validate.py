"""Reject schedules that could not run: missing or repeated work, broken dependencies, deadlock.

Checks, each failure naming the worker, its position and the action:

- every forward and backward of every (stage, micro-batch, step) exactly once: one ``F``, and one
  ``B`` or one ``I`` plus one ``W``;
- an ``UPDATE`` of every stage and step on each worker that owns the stage, and nowhere else, after
  the last gradient it sums when on the same worker;
- weight versions assigned, the backward halves of a micro-batch using its forward's version, no
  version used before the update that produces it;
- the dependency graph (:mod:`lightning_pipe.schedule.graph`) has no cycle: the per-worker orders
  cannot deadlock with non-blocking sends and blocking receives.
"""

from __future__ import annotations

from collections import Counter

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import Graph, build_graph
from lightning_pipe.schedule.ir import COMPUTE, Kind, Schedule

__all__ = ["validate"]


def _where(schedule: Schedule, worker: int, position: int) -> str:
    return f"{schedule.family}: worker {worker} position {position} ({schedule.orders[worker][position]})"


def _check_ranges(schedule: Schedule) -> None:
    if len(schedule.owners) != schedule.stages:
        raise PlanningError(f"{schedule.family}: {len(schedule.owners)} owner lists for {schedule.stages} stages")
    for stage, owners in enumerate(schedule.owners):
        if not owners or any(not 0 <= w < schedule.workers for w in owners):
            raise PlanningError(f"{schedule.family}: stage {stage} has invalid owners {owners}")
    for worker, position, action in schedule.actions():
        bad = not 0 <= action.stage < schedule.stages or not 0 <= action.step < schedule.steps
        if action.microbatch is not None:
            bad = bad or not 0 <= action.microbatch < schedule.microbatches
        if action.kind in COMPUTE and action.microbatch is None:
            bad = True
        if bad:
            raise PlanningError(
                f"{_where(schedule, worker, position)} is outside {schedule.stages} stages, "
                f"{schedule.microbatches} micro-batches, {schedule.steps} steps"
            )


def _check_work(schedule: Schedule) -> None:
    counts = Counter(a.key for _, _, a in schedule.actions() if a.kind in COMPUTE)
    for t in range(schedule.steps):
        for s in range(schedule.stages):
            for i in range(schedule.microbatches):
                forward = counts[(Kind.F, s, i, t)]
                full, half, weight = counts[(Kind.B, s, i, t)], counts[(Kind.I, s, i, t)], counts[(Kind.W, s, i, t)]
                if forward != 1 or (full, half, weight) not in ((1, 0, 0), (0, 1, 1)):
                    raise PlanningError(
                        f"{schedule.family}: stage {s}, micro-batch {i}, step {t} has {forward} F, {full} B, "
                        f"{half} I and {weight} W; it needs exactly one F and either one B or one I and one W"
                    )


def _check_updates(schedule: Schedule) -> None:
    """Each owner of a stage updates it once per step; a relayed stage (its state passed from worker
    to worker, CDP's ZeRO form) is updated once per step by whichever worker then holds it."""
    if schedule.relays:
        _check_relayed_updates(schedule)
        return
    updates = Counter()
    for worker, position, action in schedule.actions():
        if action.kind is Kind.UPDATE:
            if worker not in schedule.owners[action.stage]:
                raise PlanningError(
                    f"{_where(schedule, worker, position)}: worker {worker} does not own stage {action.stage} "
                    f"(owners {list(schedule.owners[action.stage])})"
                )
            updates[(worker, action.stage, action.step)] += 1
    for t in range(schedule.steps):
        for s, owners in enumerate(schedule.owners):
            for w in owners:
                if updates[(w, s, t)] != 1:
                    raise PlanningError(
                        f"{schedule.family}: worker {w} owns stage {s} but updates it {updates[(w, s, t)]} times "
                        f"in step {t} (needs exactly one UPDATE)"
                    )
    for worker, order in enumerate(schedule.orders):
        update_at = {(a.stage, a.step): p for p, a in enumerate(order) if a.kind is Kind.UPDATE}
        for position, action in enumerate(order):
            update = update_at.get((action.stage, action.step), len(order))
            if action.kind in (Kind.B, Kind.W) and update < position:
                raise PlanningError(
                    f"{_where(schedule, worker, position)}: its gradient comes after UPDATE of stage "
                    f"{action.stage} step {action.step} at position {update}"
                )
            producer = update_at.get((action.stage, (action.version or 0) - 1), -1)
            if action.kind in COMPUTE and action.version and producer > position:
                raise PlanningError(
                    f"{_where(schedule, worker, position)} uses version {action.version} before this worker's "
                    f"UPDATE of step {action.version - 1} produces it"
                )


def _check_relayed_updates(schedule: Schedule) -> None:
    updates = Counter((action.stage, action.step) for _, _, action in schedule.actions() if action.kind is Kind.UPDATE)
    for t in range(schedule.steps):
        for s in range(schedule.stages):
            if updates[(s, t)] != 1:
                raise PlanningError(
                    f"{schedule.family}: relayed stage {s} is updated {updates[(s, t)]} times in step {t} "
                    "(needs exactly one UPDATE, by the worker holding it)"
                )


def _check_versions(schedule: Schedule) -> None:
    forward_version = {}
    for worker, position, action in schedule.actions():
        if action.kind in COMPUTE:
            if action.version is None:
                raise PlanningError(f"{_where(schedule, worker, position)} has no weight version assigned")
            if action.version > action.step:
                raise PlanningError(
                    f"{_where(schedule, worker, position)} uses version {action.version}, but step {action.step} "
                    f"can see at most version {action.step} (the update of step t makes version t + 1)"
                )
        if action.kind is Kind.F:
            forward_version[(action.stage, action.microbatch, action.step)] = action.version
    for worker, position, action in schedule.actions():
        if action.kind in (Kind.B, Kind.I, Kind.W):
            expected = forward_version[(action.stage, action.microbatch, action.step)]
            if action.version != expected:
                raise PlanningError(
                    f"{_where(schedule, worker, position)} uses version {action.version} but its forward used "
                    f"{expected}: a micro-batch's gradient must be taken at the weights of its forward"
                )


def validate(schedule: Schedule) -> Graph:
    """Check ``schedule`` (see the module docstring); returns its dependency graph."""
    if schedule.workers < 1 or not any(schedule.orders):
        raise PlanningError(f"{schedule.family}: the schedule has no workers or no actions")
    _check_ranges(schedule)
    _check_work(schedule)
    _check_versions(schedule)  # first: a version beyond its step is the cause, not a late update
    _check_updates(schedule)
    graph = build_graph(schedule)
    graph.order()
    return graph

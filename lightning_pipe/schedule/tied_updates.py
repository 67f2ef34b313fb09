"""A one-worker non-flushing program whose tied stages update together.

Stages sharing a parameter (tied weights, :mod:`~lightning_pipe.runtime.ties`) sum its gradient
over themselves before each of their updates of a step. On workers of their own, a stage's update
waits in the collective for the other stages' parts. On one worker (CDP's single form) nothing
waits: an update placed before another sharing stage's last backward of the step would miss that
part. :func:`with_tied_updates` moves such an update, and every action that needs the version it
makes (a forward of the next step under CDP-v2), after the last backward of the step of every
stage sharing with it, keeping everything else where it was: among the actions ready to run it
always takes the one first in the original order (a topological sort with that priority), so a
program without such an update is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import data_dependencies
from lightning_pipe.schedule.ir import COMPUTE, Kind, Schedule
from lightning_pipe.util.ordering import smallest_first

__all__ = ["with_tied_updates"]

_GRADIENTS = (Kind.B, Kind.W)


def with_tied_updates(schedule: Schedule, groups: Sequence[Sequence[int]]) -> Schedule:
    """``schedule`` (one worker) with each update of a stage in one of ``groups`` (stages sharing a
    parameter) after every gradient of the same step of the stages of its group, and what depends
    on it after it (module docstring).

    Raises:
        PlanningError: the schedule has more than one worker.
    """
    if schedule.workers != 1:
        raise PlanningError(f"{schedule.family}: tied updates are reordered on one worker, not {schedule.workers}")
    order = schedule.orders[0]
    grouped = {stage: tuple(group) for group in groups for stage in group}
    if not grouped:
        return schedule
    where = {action.key: position for position, action in enumerate(order) if action.kind in COMPUTE}
    split = {(a.stage, a.microbatch, a.step) for a in order if a.kind is Kind.I}
    gradients: dict[tuple[int, int], list[int]] = {}
    updates: dict[tuple[int, int], int] = {}
    for position, action in enumerate(order):
        if action.kind in _GRADIENTS:
            gradients.setdefault((action.stage, action.step), []).append(position)
        elif action.kind is Kind.UPDATE:
            updates[(action.stage, action.step)] = position
    waits: list[list[int]] = [[] for _ in order]
    for position, action in enumerate(order):
        if action.kind in COMPUTE:
            waits[position] += [where[key] for key in data_dependencies(action, schedule.stages - 1, split)]
            if action.version:
                waits[position].append(updates[(action.stage, action.version - 1)])
        elif action.kind is Kind.UPDATE:
            for stage in grouped.get(action.stage, (action.stage,)):
                waits[position] += gradients.get((stage, action.step), [])
        else:
            waits[position] += range(position)  # anything else keeps its place after what came before it
    dependents: list[list[int]] = [[] for _ in order]
    for position, before in enumerate(waits):
        for earlier in set(before):
            dependents[earlier].append(position)
    positions = smallest_first(dependents, [len(set(before)) for before in waits])
    if len(positions) != len(order):
        raise PlanningError(f"{schedule.family}: its tied updates together, the program's dependencies form a cycle")
    return replace(schedule, orders=(tuple(order[p] for p in positions),))

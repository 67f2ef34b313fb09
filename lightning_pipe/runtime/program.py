"""What one worker runs on each call of the training loop, from a schedule.

The training loop hands the runtime one mini-batch (one step) per call (docs/design.md). A flushing
schedule runs a whole step per call. A non-flushing one (PipeDream, 2BW, CDP) must not wait for the
step to end: call ``t`` runs every action that can run once the data of steps ``<= t`` is there, and
the rest carries over. Formally an action belongs to *segment*
``seg(a) = max(step(a), seg(each action a waits for))`` (program order and cross-worker
dependencies), so a segment never waits for a later one and each worker's segments are contiguous.

A schedule generated for a few steps reaches a steady state: from some step ``t0`` on, segment
``t + 1`` is segment ``t`` with every step and version one higher. The program keeps segments
``0 .. t0 - 1`` (the fill), segment ``t0`` as the template of every later call, and the actions after
the template in the last generated segment as the drain, run on demand (end of epoch, validation,
checkpoint) to finish the steps in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import build_graph
from lightning_pipe.schedule.ir import Action, Schedule

__all__ = ["Program", "repeated", "segments", "shift"]


def shift(action: Action, steps: int) -> Action:
    """``action`` moved ``steps`` steps (and weight versions) later."""
    if steps == 0:
        return action
    version = None if action.version is None else action.version + steps
    # built directly: dataclasses.replace costs twice as much, on every action of every call
    return Action(action.kind, action.stage, action.microbatch, action.step + steps, version, action.peer)


def segments(schedule: Schedule) -> list[list[list[Action]]]:
    """``result[worker][t]``: the actions worker ``worker`` runs on call ``t``."""
    graph = build_graph(schedule)
    segment: dict[tuple[int, int], int] = {}
    for node in graph.order():
        worker, position = node
        value = schedule.orders[worker][position].step
        if position:
            value = max(value, segment[(worker, position - 1)])
        for dep in graph.deps.get(node, ()):
            value = max(value, segment[dep])
        segment[node] = value
    result = [[[] for _ in range(schedule.steps)] for _ in range(schedule.workers)]
    for worker, order in enumerate(schedule.orders):
        for position, action in enumerate(order):
            result[worker][segment[(worker, position)]].append(action)
    return result


@dataclass(frozen=True)
class Program:
    """The fill, the repeating template and the drains of one worker.

    Attributes:
        fill: actions of calls ``0 .. base - 1``.
        template: actions of calls ``base .. base + period - 1``; call ``t >= base`` runs
            ``template[(t - base) % period]`` shifted by ``t - base - (t - base) % period`` steps.
        base, period: where the steady state starts and after how many calls it repeats.
        drains: per phase of the last call, what remains after it (steps relative to the template).
        early: what remains after call ``t < base`` when it is the last one.
    """

    fill: tuple[tuple[Action, ...], ...]
    template: tuple[tuple[Action, ...], ...]
    base: int
    period: int
    drains: tuple[tuple[Action, ...], ...]
    early: tuple[tuple[Action, ...], ...] = ()

    @classmethod
    def build(cls, make: Callable[[int], Schedule]) -> list[Program]:
        """One program per worker from ``make(k)``, the schedule of ``k`` steps; enough steps are
        generated to see the steady state repeat twice after the fill."""
        for steps, periods in ((12, range(1, 5)), (40, range(1, 13))):
            schedule = make(steps)
            per_worker = segments(schedule)
            if schedule.flush:
                return [cls((), (tuple(parts[0]),), 0, 1, ((),)) for parts in per_worker]
            for period in periods:
                for base in range(steps - 2 * period):
                    if all(_periodic(parts, base, period, steps - 1) for parts in per_worker):
                        return cls._assemble(make, per_worker, steps, base, period)
        raise PlanningError(f"{schedule.family}: no steady state repeating within 12 steps in 40 generated steps")

    @classmethod
    def _assemble(
        cls, make: Callable[[int], Schedule], per_worker: list[list[list[Action]]], steps: int, base: int, period: int
    ) -> list[Program]:
        drains = _by_worker([_drains(make, steps + extra, base, period) for extra in range(period)], period)
        workers = len(per_worker)
        early: list[list[tuple[Action, ...]]] = [[] for _ in range(workers)]
        for t in range(base):
            short = segments(make(t + 1))
            for w in range(workers):
                early[w].append(tuple(short[w][t][len(per_worker[w][t]) :]))
        return [
            cls(
                fill=tuple(tuple(p) for p in parts[:base]),
                template=tuple(tuple(parts[base + k]) for k in range(period)),
                base=base,
                period=period,
                drains=tuple(worker_drains),
                early=tuple(worker_early),
            )
            for parts, worker_drains, worker_early in zip(per_worker, drains, early, strict=True)
        ]

    def entry_of(self, index: int) -> tuple[int, int]:
        """``(k, steps)``: call ``index`` runs entry ``k`` of ``fill + template`` shifted by ``steps``
        steps (every call of the same phase of the steady state shares ``k``)."""
        if index < self.base:
            return index, 0
        phase = (index - self.base) % self.period
        return self.base + phase, index - self.base - phase

    def call(self, index: int) -> list[Action]:
        """The actions of call ``index``."""
        entry, steps = self.entry_of(index)
        actions = self.fill[entry] if entry < self.base else self.template[entry - self.base]
        return [shift(a, steps) for a in actions]

    def finish(self, last_call: int) -> list[Action]:
        """The actions that complete every step in flight after call ``last_call``."""
        if last_call < self.base:
            return list(self.early[last_call])
        phase = (last_call - self.base) % self.period
        return [shift(a, last_call - self.base - phase) for a in self.drains[phase]]


def _drains(make: Callable[[int], Schedule], steps: int, base: int, period: int) -> tuple[int, list[list[Action]]]:
    """The phase of the last call of a ``steps``-step schedule and each worker's drain after it."""
    last = steps - 1
    phase = (last - base) % period
    offset = last - base - phase
    drains = []
    for parts in segments(make(steps)):
        head = len(parts[base + phase])
        drains.append([shift(a, -offset) for a in parts[last][head:]])
    return phase, drains


def _by_worker(drains: list[tuple[int, list[list[Action]]]], period: int) -> list[list[tuple[Action, ...]]]:
    """Regroup ``[(phase, per-worker drain)]`` into per-worker drains ordered by phase."""
    workers = len(drains[0][1])
    result: list[list[tuple[Action, ...]]] = [[() for _ in range(period)] for _ in range(workers)]
    for phase, per_worker in drains:
        for worker, drain in enumerate(per_worker):
            result[worker][phase] = tuple(drain)
    return result


def _periodic(parts: list[list[Action]], base: int, period: int, last: int) -> bool:
    """Segments from ``base`` repeat with ``period``, and the last segment starts like its template."""
    for t in range(base + period, last):
        if parts[t] != [shift(a, period) for a in parts[t - period]]:
            return False
    phase = (last - base) % period
    head = [shift(a, last - base - phase) for a in parts[base + phase]]
    return parts[last][: len(head)] == head


def repeated(schedule: Schedule) -> Callable[[int], Schedule]:
    """``make(k)`` of a flushing ``schedule``: its one step, repeated. A non-flushing one is refused:
    the runtime needs its steady state, from a function building it for any number of steps."""
    if not schedule.flush:
        # a non-flushing family's params are its make_schedule options (tests/test_schedule_slack.py)
        options = {"rule": schedule.rule, **schedule.params}
        example = f"{schedule.family!r}, {schedule.stages}, {schedule.microbatches}, k" + "".join(
            f", {name}={value!r}" for name, value in options.items()
        )
        raise PlanningError(
            f"{schedule.family} does not flush: give the executor a function steps -> schedule built with the "
            f"same options (lambda k: make_schedule({example})) so it can follow the steady state"
        )
    return lambda steps: schedule

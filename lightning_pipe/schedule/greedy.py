"""Greedy list scheduling: turn a placement and a priority into per-worker orders.

Rahimi (2025, "One code to schedule them all") runs every worker as a loop that starts, among its
ready jobs, the one of highest priority ``n(s, b, d)`` as soon as it is free. Running that loop once
on the given durations records the order each worker follows; the recorded orders are then a
schedule like any other (validated, simulated, executed).

Jobs are compute actions. A job is ready once its data dependencies (those of
:mod:`lightning_pipe.schedule.graph`) have finished; transfers are free here. An optional cap limits,
per worker and stage, the micro-batches in flight (forward started, last backward half not done),
which is how memory-bounded schedules such as ZB-H1 keep 1F1B's activation memory.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import data_dependencies
from lightning_pipe.schedule.ir import Action, Kind

__all__ = ["list_schedule"]


def list_schedule(
    jobs: Sequence[Action],
    workers: int,
    worker_of: Callable[[Action], int],
    duration: Callable[[Action], float],
    priority: Callable[[Action], tuple],
    last_stage: int,
    admissible: Callable[[Action, Counter], bool] | None = None,
) -> list[list[Action]]:
    """Orders of a greedy run: whenever a worker is free it starts its ready job of smallest
    ``priority`` among those ``admissible(job, started)`` allows, ``started`` counting the jobs of
    each ``(kind, stage)`` started so far on that worker (how memory caps are written)."""
    keys = {job.key: job for job in jobs}
    split = {(a.stage, a.microbatch, a.step) for a in jobs if a.kind is Kind.I}
    waiting: dict[tuple, int] = {}
    dependents: dict[tuple, list[Action]] = defaultdict(list)
    for job in jobs:
        deps = data_dependencies(job, last_stage, split)
        waiting[job.key] = len(deps)
        for dep in deps:
            if dep not in keys:
                raise PlanningError(f"greedy schedule: {job} depends on {Action(*dep)}, which is not a job")
            dependents[dep].append(job)
    tie = itertools.count()
    released: list[list[tuple[float, int, Action]]] = [[] for _ in range(workers)]  # by release time
    available: list[list[tuple[tuple, int, Action]]] = [[] for _ in range(workers)]  # by priority
    for job in jobs:
        if waiting[job.key] == 0:
            heapq.heappush(released[worker_of(job)], (0.0, next(tie), job))
    free = [0.0] * workers
    started: list[Counter] = [Counter() for _ in range(workers)]
    running: list[float] = []
    orders: list[list[Action]] = [[] for _ in range(workers)]
    blocked: set[int] = set()
    for _ in range(len(jobs)):
        job = None
        while job is None:
            busy = [w for w in range(workers) if released[w] or available[w]]
            if not busy:
                raise PlanningError("greedy schedule: jobs remain but none can ever start (a dependency is never met)")
            now = min(free[w] for w in busy)
            while running and running[0] <= now:
                heapq.heappop(running)
            waiting_now = [w for w in busy if free[w] == now and w not in blocked]
            if not waiting_now:
                later = running[:1] + [released[w][0][0] for w in busy if released[w] and released[w][0][0] > now]
                later += [free[w] for w in busy if free[w] > now]
                if not later:
                    raise PlanningError(f"greedy schedule: stuck at time {now}: no ready job is admissible")
                for w in blocked:
                    free[w] = min(later)
                blocked.clear()
                continue
            worker = waiting_now[0]
            while released[worker] and released[worker][0][0] <= now:
                _, _, ready = heapq.heappop(released[worker])
                heapq.heappush(available[worker], (priority(ready), next(tie), ready))
            job = _pick(available[worker], started[worker], admissible)
            if job is None:
                blocked.add(worker)
        finish = now + duration(job)
        orders[worker].append(job)
        free[worker] = finish
        started[worker][(job.kind, job.stage)] += 1
        heapq.heappush(running, finish)
        for dependent in dependents[job.key]:
            waiting[dependent.key] -= 1
            if waiting[dependent.key] == 0:
                heapq.heappush(released[worker_of(dependent)], (finish, next(tie), dependent))
    return orders


def _pick(
    available: list[tuple[tuple, int, Action]],
    started: Counter,
    admissible: Callable[[Action, Counter], bool] | None,
) -> Action | None:
    """Pop the best available job that is admissible; the others go back."""
    skipped = []
    chosen = None
    while available:
        entry = heapq.heappop(available)
        if admissible is None or admissible(entry[2], started):
            chosen = entry[2]
            break
        skipped.append(entry)
    for entry in skipped:
        heapq.heappush(available, entry)
    return chosen

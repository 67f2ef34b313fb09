"""Peak memory of a replay: the activations and weight copies each worker holds over time.

An activation lives from its forward's start to the end of its micro-batch's last backward half on
that stage; the most alive at once on a stage is its NCA (Beaumont et al. §3.2). An owner holds a
weight version from the update that makes it until the next one exists and its last use is over; a
worker computing a stage it does not own holds the fetched version for its run (FSDP-style, Rahimi
2025); a relayed stage (CDP's ZeRO form, Fournier & Oyallon 2024 §4.4) is held by the worker computing
it and the one it passes to. Peaks sweep the allocations and frees in time order (:func:`sweep`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from lightning_pipe.schedule.graph import Graph, Node
from lightning_pipe.schedule.ir import Kind, Schedule
from lightning_pipe.schedule.simulation import Interval
from lightning_pipe.schedule.stage_costs import StageCosts

__all__ = ["WeightCopies", "activation_peaks", "relayed_weight_peaks", "sweep", "weight_peaks"]


def sweep(events: list[tuple[float, int, float]]) -> tuple[int, float, list[tuple[float, float]]]:
    """Peak count and peak bytes of +1/-1 events (frees before allocations at equal times), and
    the bytes-over-time curve."""
    if not events:
        return 0, 0.0, [(0.0, 0.0)]
    times, deltas, sizes = (np.asarray(column, dtype=np.float64) for column in zip(*events, strict=True))
    order = np.lexsort((deltas, times))
    counts = np.cumsum(deltas[order])
    held = np.cumsum((deltas * sizes)[order])
    curve = [(0.0, 0.0), *zip(times[order].tolist(), held.tolist(), strict=True)]
    return int(max(counts.max(), 0)), float(max(held.max(), 0.0)), curve


def activation_peaks(
    schedule: Schedule, costs: StageCosts, timeline: list[Interval]
) -> tuple[list[int], list[tuple[int, float, list[tuple[float, float]]]]]:
    """NCA per stage, and per worker the peak count, peak bytes and curve of live activations (from a
    forward's start to the end of its micro-batch's last backward half on that stage)."""
    born: dict[tuple[int, int, int], tuple[int, float]] = {}
    freed: dict[tuple[int, int, int], float] = {}
    for interval in timeline:
        a = interval.action
        key = (a.stage, a.microbatch, a.step)
        if a.kind is Kind.F:
            born[key] = (interval.worker, interval.start)
        elif a.kind in (Kind.B, Kind.W):
            freed[key] = interval.end
    per_stage: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    per_worker: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    for key, (worker, birth) in born.items():
        nbytes = costs.stage_bytes("saved_bytes", key[0])
        for events in (per_stage[key[0]], per_worker[worker]):
            events += [(birth, 1, nbytes), (freed[key], -1, nbytes)]
    nca = [sweep(per_stage[s])[0] for s in range(schedule.stages)]
    return nca, [sweep(per_worker[w]) for w in range(schedule.workers)]


@dataclass
class WeightCopies:
    """What a replay records of the weight copies its workers hold.

    Attributes:
        updated: ``(worker, stage, version)`` → when the owner's update that made it ended.
        last_use: ``(worker, stage, version)`` → when the last action using it ended.
        fetched: ``(worker, stage, since, release)`` of each fetched copy: held from when its fetch
            was issued, ``release`` -1 until it is freed.
    """

    updated: dict[tuple[int, int, int], float] = field(default_factory=dict)
    last_use: dict[tuple[int, int, int], float] = field(default_factory=dict)
    fetched: list[tuple[int, int, float, float]] = field(default_factory=list)

    def hold(self, worker: int, stage: int, since: float) -> None:
        """``worker`` holds a fetched copy of ``stage``'s weights from ``since`` until it is released."""
        self.fetched.append((worker, stage, since, -1.0))

    def release(self, worker: int, at: float) -> None:
        """Free at ``at`` the fetched copy that ``worker`` holds."""
        for index in range(len(self.fetched) - 1, -1, -1):
            w, stage, since, release = self.fetched[index]
            if w == worker and release < 0:
                self.fetched[index] = (w, stage, since, at)
                break


def weight_peaks(
    schedule: Schedule, costs: StageCosts, copies: WeightCopies, makespan: float
) -> list[tuple[int, float]]:
    """Peak number and bytes of weight copies (stage, version) held by each worker of a schedule
    without relays (those: :func:`relayed_weight_peaks`).

    An owner holds version ``v`` from its update (version 0: from the start) until version ``v + 1``
    exists and the last action using ``v`` is over; a fetched copy lives for its run.
    """
    events: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    for s, owners in enumerate(schedule.owners):
        nbytes = costs.stage_bytes("weight_bytes", s)
        for w in owners:
            for v in range(schedule.steps + 1):
                born = 0.0 if v == 0 else copies.updated.get((w, s, v))
                if born is None:
                    continue
                dies = max(copies.updated.get((w, s, v + 1), makespan), copies.last_use.get((w, s, v), born))
                events[w] += [(born, 1, nbytes), (dies, -1, nbytes)]
    for w, s, since, release in copies.fetched:
        nbytes = costs.stage_bytes("weight_bytes", s)
        events[w] += [(since, 1, nbytes), (release, -1, nbytes)]
    return [sweep(events[w])[:2] for w in range(schedule.workers)]


def relayed_weight_peaks(
    schedule: Schedule, costs: StageCosts, graph: Graph, end: dict[Node, float]
) -> list[tuple[int, float]]:
    """Relayed stages (CDP's ZeRO form), each action of the schedule's ``graph`` having ended at
    ``end``: the worker of each action of a stage's relay holds the stage's weights from the end of
    the relay's previous action (it is being passed on) to the end of its own, so a worker holds the
    stage it computes and the one coming to it."""
    events: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    updates = {(a.stage, a.step): (w, p) for w, p, a in schedule.actions() if a.kind is Kind.UPDATE}
    for stage, relay in enumerate(schedule.relays):
        nbytes = costs.stage_bytes("weight_bytes", stage)
        arrives = 0.0
        for action in relay:
            node = updates[(stage, action.step)] if action.kind is Kind.UPDATE else graph.where[action.key]
            events[node[0]] += [(arrives, 1, nbytes), (end[node], -1, nbytes)]
            arrives = end[node]
    return [sweep(events[w])[:2] for w in range(schedule.workers)]

"""Predict a schedule's timeline, bubble, memory and traffic from per-stage costs.

Every worker runs its actions in order, each as soon as its worker is free and its inputs have
arrived (the dependency graph of :mod:`lightning_pipe.schedule.graph`): an input from another worker
arrives ``bytes / bandwidth`` after its producer ends. Transfers overlap compute by default (a copy
engine or ``isend``); with ``overlap=False`` the sender is busy while it sends. A worker that computes
a stage it does not own fetches the version it needs from an owner once and keeps it until its last
use (FSDP-style, Rahimi 2025). An ``UPDATE`` waits for the gradients of other workers (reduce).

Reported: makespan, per-step completion and steady-state time per step, throughput, per-worker busy
and idle time and bubble fraction, NCA per stage (Beaumont et al. §3.2), peak activations (count and
bytes) and weight versions held per worker, bytes moved per worker, and the timeline itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import Graph, Node
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule
from lightning_pipe.schedule.validate import validate

__all__ = ["Interval", "Simulation", "StageCosts", "simulate"]


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs for one micro-batch (lists of length ``P``; scalars broadcast).

    Attributes:
        forward, backward: ``F`` and full ``B`` seconds.
        input_grad, weight_grad: the halves of a split backward (default: half of ``backward`` each).
        update: optimizer step seconds.
        activation_bytes: bytes of the stage's output (and of the gradient sent back to it).
        saved_bytes: activation bytes kept from a forward until its last backward half.
        weight_bytes: bytes of the stage's parameters (a fetched or reduced copy).
        bandwidth: bytes per second between workers (``inf``: transfers are free).
        overlap: transfers overlap compute (else the sender is busy while sending).
    """

    forward: Sequence[float]
    backward: Sequence[float]
    input_grad: Sequence[float] | None = None
    weight_grad: Sequence[float] | None = None
    update: Sequence[float] | None = None
    activation_bytes: Sequence[float] | None = None
    saved_bytes: Sequence[float] | None = None
    weight_bytes: Sequence[float] | None = None
    bandwidth: float = math.inf
    overlap: bool = True

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward: float = 2.0, **kwargs: object) -> StageCosts:
        """Identical stages (the papers' unit-cost examples)."""
        return cls(forward=[forward] * stages, backward=[backward] * stages, **kwargs)

    def __post_init__(self) -> None:
        stages = len(self.forward)
        for name in (
            "backward",
            "input_grad",
            "weight_grad",
            "update",
            "activation_bytes",
            "saved_bytes",
            "weight_bytes",
        ):
            values = getattr(self, name)
            if values is not None and len(values) != stages:
                raise PlanningError(f"costs: {name} has {len(values)} entries, forward has {stages}")
            for value in values or ():
                if not math.isfinite(value) or value < 0:
                    raise PlanningError(f"costs: {name} must hold finite numbers >= 0, got {value!r}")
        if math.isnan(self.bandwidth) or self.bandwidth <= 0:
            raise PlanningError(f"costs: bandwidth must be > 0 (or inf), got {self.bandwidth!r}")

    @property
    def stages(self) -> int:
        return len(self.forward)

    def duration(self, action: Action) -> float:
        s = action.stage
        if action.kind is Kind.F:
            return self.forward[s]
        if action.kind is Kind.B:
            return self.backward[s]
        if action.kind is Kind.I:
            return self.input_grad[s] if self.input_grad is not None else self.backward[s] / 2
        if action.kind is Kind.W:
            if self.weight_grad is not None:
                return self.weight_grad[s]
            half = self.input_grad[s] if self.input_grad is not None else self.backward[s] / 2
            return self.backward[s] - half
        if action.kind is Kind.UPDATE:
            return self.update[s] if self.update is not None else 0.0
        return 0.0

    def transfer(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth

    def _bytes(self, name: str, stage: int) -> float:
        values = getattr(self, name)
        return 0.0 if values is None else float(values[stage])


@dataclass(frozen=True)
class Interval:
    """One executed action."""

    worker: int
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    """What :func:`simulate` predicts (times in the unit of the costs, sizes in bytes)."""

    schedule: Schedule
    makespan: float
    step_end: list[float]
    steady_step: float
    throughput: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    nca: list[int]
    peak_activations: list[int]
    peak_activation_bytes: list[float]
    weight_versions: list[int]
    peak_weight_bytes: list[float]
    bytes_sent: list[float]
    bytes_received: list[float]
    weight_bytes_received: list[float]
    timeline: list[Interval] = field(repr=False)
    memory_timeline: list[list[tuple[float, float]]] = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.schedule.family,
            "rule": self.schedule.rule,
            "stages": self.schedule.stages,
            "microbatches": self.schedule.microbatches,
            "steps": self.schedule.steps,
            "workers": self.schedule.workers,
            "makespan": self.makespan,
            "step_end": self.step_end,
            "steady_step": self.steady_step,
            "throughput": self.throughput,
            "bubble_fraction": self.bubble_fraction,
            "busy": self.busy,
            "idle": self.idle,
            "nca": self.nca,
            "peak_activations": {"count": self.peak_activations, "bytes": self.peak_activation_bytes},
            "weight_versions": self.weight_versions,
            "peak_weight_bytes": self.peak_weight_bytes,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "weight_bytes_received": self.weight_bytes_received,
        }


def _edge_bytes(costs: StageCosts, action: Action, dep: Action, label: str) -> float:
    if label == "weight":
        return costs._bytes("weight_bytes", action.stage)
    if label == "grad":
        return costs._bytes("weight_bytes", action.stage)
    if dep.kind is Kind.F and action.kind is Kind.F:
        return costs._bytes("activation_bytes", dep.stage)
    if action.kind in (Kind.RECV_F,):
        return costs._bytes("activation_bytes", dep.stage)
    if action.kind is Kind.RECV_B:
        return costs._bytes("activation_bytes", action.stage)
    return costs._bytes("activation_bytes", action.stage)


def _sweep(events: list[tuple[float, int, float]]) -> tuple[int, float, list[tuple[float, float]]]:
    """Peak count and peak bytes of +1/-1 events (frees before allocations at equal times)."""
    events.sort(key=lambda e: (e[0], e[1]))
    count = peak = 0
    size = peak_size = 0.0
    curve: list[tuple[float, float]] = [(0.0, 0.0)]
    for time, delta, nbytes in events:
        count += delta
        size += delta * nbytes
        peak = max(peak, count)
        peak_size = max(peak_size, size)
        curve.append((time, size))
    return peak, peak_size, curve


def simulate(schedule: Schedule, costs: StageCosts, graph: Graph | None = None) -> Simulation:
    """Replay ``schedule`` with ``costs``; validates it first unless its ``graph`` is given."""
    if costs.stages != schedule.stages:
        raise PlanningError(f"costs describe {costs.stages} stages, the schedule has {schedule.stages}")
    graph = graph or validate(schedule)
    orders = schedule.orders
    workers = schedule.workers
    end: dict[Node, float] = {}
    start: dict[Node, float] = {}
    free = [0.0] * workers
    sent = [0.0] * workers
    received = [0.0] * workers
    fetched = [0.0] * workers
    fetch_arrival: dict[tuple[int, int, int], float] = {}
    version_end: dict[tuple[int, int, int], float] = {}
    production: dict[tuple[int, int], float] = {}
    updated: dict[tuple[int, int, int], float] = {}
    owners = [set(o) for o in schedule.owners]
    for node in graph.order():
        worker, position = node
        action = orders[worker][position]
        ready = free[worker]
        for dep, label in zip(graph.deps.get(node, ()), graph.kinds.get(node, ()), strict=True):
            arrival = end[dep]
            if dep[0] != worker:
                nbytes = _edge_bytes(costs, action, orders[dep[0]][dep[1]], label)
                if label != "weight":
                    sent[dep[0]] += nbytes
                    received[worker] += nbytes
                    arrival += costs.transfer(nbytes)
                    if not costs.overlap:
                        free[dep[0]] = max(free[dep[0]], end[dep] + costs.transfer(nbytes))
                else:
                    arrival = end[dep]  # the weight fetch below prices the copy
            ready = max(ready, arrival)
        if action.kind in COMPUTE and worker not in owners[action.stage]:
            key = (worker, action.stage, action.version or 0)
            if key not in fetch_arrival:
                nbytes = costs._bytes("weight_bytes", action.stage)
                fetched[worker] += nbytes
                produced = production.get((action.stage, action.version or 0), 0.0)
                fetch_arrival[key] = max(produced, ready - costs.transfer(nbytes)) + costs.transfer(nbytes)
            ready = max(ready, fetch_arrival[key])
        duration = costs.duration(action)
        start[node] = ready
        end[node] = ready + duration
        free[worker] = max(free[worker], end[node])
        if action.kind is Kind.UPDATE:
            production.setdefault((action.stage, action.step + 1), end[node])
            updated[(worker, action.stage, action.step + 1)] = end[node]
        if action.kind in COMPUTE:
            key = (worker, action.stage, action.version or 0)
            version_end[key] = max(version_end.get(key, 0.0), end[node])
    return _report(schedule, costs, start, end, sent, received, fetched, fetch_arrival, version_end, updated)


def _report(
    schedule: Schedule,
    costs: StageCosts,
    start: dict[Node, float],
    end: dict[Node, float],
    sent: list[float],
    received: list[float],
    fetched: list[float],
    fetch_arrival: dict[tuple[int, int, int], float],
    version_end: dict[tuple[int, int, int], float],
    updated: dict[tuple[int, int, int], float],
) -> Simulation:
    workers = schedule.workers
    timeline = [
        Interval(w, schedule.orders[w][p], start[(w, p)], end[(w, p)])
        for w in range(workers)
        for p in range(len(schedule.orders[w]))
    ]
    makespan = max((i.end for i in timeline), default=0.0)
    busy = [0.0] * workers
    for interval in timeline:
        busy[interval.worker] += interval.end - interval.start
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (workers * makespan) if makespan > 0 else 0.0
    step_end = [0.0] * schedule.steps
    for interval in timeline:
        step_end[interval.action.step] = max(step_end[interval.action.step], interval.end)
    steady = _steady(step_end)
    throughput = schedule.microbatches / steady if steady > 0 else math.inf

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
        nbytes = costs._bytes("saved_bytes", key[0])
        for events in (per_stage[key[0]], per_worker[worker]):
            events += [(birth, 1, nbytes), (freed[key], -1, nbytes)]
    nca = [_sweep(per_stage[s])[0] for s in range(schedule.stages)]
    sweeps = [_sweep(per_worker[w]) for w in range(workers)]
    versions = _weight_versions(schedule, costs, updated, version_end, fetch_arrival, makespan)
    return Simulation(
        schedule=schedule,
        makespan=makespan,
        step_end=step_end,
        steady_step=steady,
        throughput=throughput,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        nca=nca,
        peak_activations=[s[0] for s in sweeps],
        peak_activation_bytes=[s[1] for s in sweeps],
        weight_versions=[v[0] for v in versions],
        peak_weight_bytes=[v[1] for v in versions],
        bytes_sent=sent,
        bytes_received=received,
        weight_bytes_received=fetched,
        timeline=timeline,
        memory_timeline=[s[2] for s in sweeps],
    )


def _steady(step_end: list[float]) -> float:
    """Time per step once the pipeline is full: the mean spacing of the later half of the steps."""
    if len(step_end) == 1:
        return step_end[0]
    half = len(step_end) // 2
    return (step_end[-1] - step_end[half - 1]) / (len(step_end) - half)


def _weight_versions(
    schedule: Schedule,
    costs: StageCosts,
    updated: dict[tuple[int, int, int], float],
    version_end: dict[tuple[int, int, int], float],
    fetch_arrival: dict[tuple[int, int, int], float],
    makespan: float,
) -> list[tuple[int, float]]:
    """Peak number and bytes of (stage, version) weight copies alive on each worker.

    An owner holds version ``v`` from its update (version 0: from the start) until version ``v + 1``
    exists and the last action using ``v`` is over; a fetched copy lives from its arrival to its
    last use.
    """
    events: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    for s, owners in enumerate(schedule.owners):
        nbytes = costs._bytes("weight_bytes", s)
        for w in owners:
            for v in range(schedule.steps + 1):
                born = 0.0 if v == 0 else updated.get((w, s, v))
                if born is None:
                    continue
                dies = max(updated.get((w, s, v + 1), makespan), version_end.get((w, s, v), born))
                events[w] += [(born, 1, nbytes), (dies, -1, nbytes)]
    for (w, s, v), arrival in fetch_arrival.items():
        nbytes = costs._bytes("weight_bytes", s)
        events[w] += [(arrival, 1, nbytes), (version_end[(w, s, v)], -1, nbytes)]
    return [_sweep(events[w])[:2] for w in range(schedule.workers)]

"""Replay a schedule with per-stage costs: when each of its actions runs.

Every worker runs its actions in order, each as soon as its worker is free and its inputs have
arrived (the dependency graph of :mod:`lightning_pipe.schedule.graph`): an input from another worker
arrives ``latency + bytes / bandwidth`` after its producer ends. Transfers overlap compute by default (a
copy engine or ``isend``); with ``overlap=False`` the sender is busy while it sends. Each message also
costs the processors at both ends ``overhead`` seconds of their own time (packing, the transport's
threads, unpacking: the *o* of the LogP model, Culler et al. 1993), added to the action that sends it
and to the one that receives it. A worker that computes
a stage it does not own fetches the version it needs from an owner once and keeps it until its last
use (FSDP-style, Rahimi 2025). An ``UPDATE`` waits for the gradients of other workers (reduce).
Workers sharing one machine (``contention`` above 1) are replayed from event to event, as processor
sharing.

The costs are :class:`~lightning_pipe.schedule.stage_costs.StageCosts`; the messages are counted
and logged by :mod:`~lightning_pipe.schedule.traffic`, the memory held by
:mod:`~lightning_pipe.schedule.peak_memory`; the result is a
:class:`~lightning_pipe.schedule.simulation.Simulation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.early import cooldown_backwards
from lightning_pipe.schedule.graph import Graph, Node
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule
from lightning_pipe.schedule.peak_memory import WeightCopies, activation_peaks, relayed_weight_peaks, weight_peaks
from lightning_pipe.schedule.simulation import Interval, Simulation, steady_step
from lightning_pipe.schedule.stage_costs import StageCosts, adds_gradients
from lightning_pipe.schedule.traffic import Message, Traffic, category_of, edge_bytes, is_message, message_costs
from lightning_pipe.schedule.validate import validate

__all__ = ["simulate"]


@dataclass
class _Replay:
    """State of one replay: times, traffic and weight copies."""

    schedule: Schedule
    costs: StageCosts
    graph: Graph
    early: set[Node] = field(default_factory=set)

    def __post_init__(self) -> None:
        workers = self.schedule.workers
        self.start: dict[Node, float] = {}
        self.end: dict[Node, float] = {}
        self.free = [0.0] * workers
        self.traffic = Traffic(workers)
        self.owners = [set(o) for o in self.schedule.owners]
        self.produced: dict[tuple[int, int], float] = {}
        self.weights = WeightCopies()
        self.run: list[tuple[int, int] | None] = [None] * workers
        self.accumulating = {
            (worker, position)
            for worker, order in enumerate(self.schedule.orders)
            for position, adds in enumerate(adds_gradients(order))
            if adds
        }
        self.previous_start = [0.0] * workers
        self.left: dict[Node, float] = {}  # when the early input gradient of a cool-down backward left
        # messages an action sends or receives; seconds its sender stays busy after it
        self.messages, self.sending = message_costs(self.schedule, self.graph, self.costs)

    def transfer(self, worker: int, dep: Node, action: Action, label: str) -> float:
        """Arrival time at ``worker`` of what ``dep`` produced."""
        category = category_of(action, label)
        nbytes = edge_bytes(self.costs, action, self.schedule.orders[dep[0]][dep[1]], category)
        # an early input gradient leaves before the weight gradients are computed; a reduce carries those
        sent = self.left[dep] if dep in self.early and label not in ("grad", "ring") else self.end[dep]
        self.traffic.send(Message(sent, dep[0], worker, category, nbytes))
        return sent + self.costs.transfer(nbytes)

    def input_grad_seconds(self, node: Node) -> float:
        """The input-gradient share of a backward's own time (it leaves early after it)."""
        return self.costs.duration(replace(self.schedule.orders[node[0]][node[1]], kind=Kind.I))

    def has_left(self, dep: Node, label: str) -> bool:
        """Whether what ``dep`` sends along an edge labelled ``label`` has left it."""
        return dep in self.end or (label not in ("grad", "ring") and dep in self.left)

    def fetch(self, worker: int, action: Action, ready: float) -> float:
        """Weights of a stage this worker does not own: fetched (prefetched while its previous action
        runs) for each run of consecutive actions on the same stage and version, freed after it."""
        version = action.version or 0
        if self.run[worker] == (action.stage, version):
            return ready
        nbytes = self.costs.stage_bytes("weight_bytes", action.stage)
        issued = max(self.produced.get((action.stage, version), 0.0), self.previous_start[worker])
        message = Message(issued, self.schedule.first_owner(action.stage), worker, "weight", nbytes)
        self.traffic.send(message, self.owners[action.stage])
        arrival = issued + self.costs.transfer(nbytes)
        self.weights.hold(worker, action.stage, issued)
        return max(ready, arrival)

    def execute(self, node: Node) -> None:
        """Run ``node`` alone on its worker: as soon as it can start, for its own seconds."""
        ready, seconds = self.prepare(node)
        self.commit(node, ready, ready + seconds)

    def prepare(self, node: Node) -> tuple[float, float]:
        """When ``node`` can start (its worker free, its inputs and weights arrived) and the seconds it
        takes alone; every action it depends on has ended."""
        worker, position = node
        action = self.schedule.orders[worker][position]
        ready = self.free[worker]
        deps = self.graph.deps.get(node)
        if deps:
            for dep, label in zip(deps, self.graph.kinds[node], strict=True):
                arrival = self.transfer(worker, dep, action, label) if is_message(node, dep, label) else self.end[dep]
                if arrival > ready:
                    ready = arrival
        if action.kind in COMPUTE:
            ready = self._weights(worker, action, ready)
        return ready, self.own_seconds(node, action) + self.costs.overhead * self.messages.get(node, 0)

    def own_seconds(self, node: Node, action: Action) -> float:
        """An action's compute: a cool-down backward that sends its input gradient early costs its two
        halves, ``I + W`` (more than ``B`` when measured so: ``runtime/calibration.py``); a weight
        gradient added to its step's, :attr:`StageCosts.accumulate` more."""
        accumulating = node in self.accumulating
        if node in self.early:
            return self.input_grad_seconds(node) + self.costs.duration(replace(action, kind=Kind.W), accumulating)
        return self.costs.duration(action, accumulating)

    def commit(self, node: Node, start: float, end: float) -> None:
        """Record that ``node`` ran from ``start`` to ``end``."""
        worker, position = node
        action = self.schedule.orders[worker][position]
        compute = action.kind in COMPUTE
        self.start[node] = start
        self.end[node] = end
        if node in self.early:
            self.left.setdefault(node, start + self.input_grad_seconds(node))
        if compute or action.kind is Kind.UPDATE:  # prefetches start with the previous real work
            self.previous_start[worker] = start
        self.free[worker] = max(self.free[worker], end + self.sending.get(node, 0.0))
        if action.kind is Kind.UPDATE:
            version = (action.stage, action.step + 1)
            self.produced[version] = min(self.produced.get(version, end), end)
            self.weights.updated[(worker, action.stage, action.step + 1)] = end
        elif compute:
            key = (worker, action.stage, action.version or 0)
            if end > self.weights.last_use.get(key, 0.0):
                self.weights.last_use[key] = end

    def _weights(self, worker: int, action: Action, ready: float) -> float:
        """When the weights ``action`` needs are on ``worker``: owners have them; others fetch."""
        owned = worker in self.owners[action.stage] or bool(self.schedule.relays)  # a relayed state comes along
        current = self.run[worker]
        if owned:
            if current is not None:
                self._release(worker)
            return ready
        if current is not None and current != (action.stage, action.version or 0):
            self._release(worker)
        ready = self.fetch(worker, action, ready)
        self.run[worker] = (action.stage, action.version or 0)
        return ready

    def _release(self, worker: int) -> None:
        """The fetched copy of the current run on ``worker`` is freed at the end of its last use."""
        self.weights.release(worker, self.free[worker])
        self.run[worker] = None

    def finish(self) -> None:
        for worker in range(self.schedule.workers):
            if self.run[worker] is not None:
                self._release(worker)


def simulate(
    schedule: Schedule, costs: StageCosts, graph: Graph | None = None, early_gradients: bool = False
) -> Simulation:
    """Replay ``schedule`` with ``costs``; validates it first unless its ``graph`` is given. With
    ``early_gradients``, the cool-down backwards send their input gradient after its share of the
    backward, as the runtime does (:mod:`lightning_pipe.schedule.early`)."""
    if costs.stages != schedule.stages:
        raise PlanningError(f"costs describe {costs.stages} stages, the schedule has {schedule.stages}")
    early = set()
    if early_gradients:
        for worker, order in enumerate(schedule.orders):
            early |= {(worker, position) for position in cooldown_backwards(order, schedule.flush, schedule.stages)}
    replay = _Replay(schedule, costs, graph or validate(schedule), early)
    if costs.contention == 1 or schedule.workers == 1:
        for node in replay.graph.order():
            replay.execute(node)
    else:
        _share(replay, costs.contention)
    replay.finish()
    return _report(replay)


def _share(replay: _Replay, contention: float) -> None:
    """Replay with the workers sharing one machine: time advances from event to event (an action
    ready to start, an action done, an early input gradient computed); between two events the ``n``
    computing workers each progress at ``1 / (1 + (contention - 1)(n - 1)/(W - 1))`` seconds of their
    own work per second (processor sharing). With ``contention = 1`` the timeline equals the one-pass
    replay's."""
    orders, deps, kinds = replay.schedule.orders, replay.graph.deps, replay.graph.kinds
    workers = len(orders)
    cursor = [0] * workers
    waiting: dict[int, tuple[Node, float, float]] = {}  # worker -> (node, start, seconds alone)
    running: dict[int, tuple[Node, float, float]] = {}  # worker -> (node, start, seconds alone left)
    early: dict[Node, float] = {}  # running cool-down backward -> seconds left once its input gradient is done
    now, left = 0.0, sum(len(order) for order in orders)
    while left:
        moved = False  # anything started, reached or ended at ``now``: look again before time moves
        for worker in range(workers):
            node = (worker, cursor[worker])
            idle = worker not in waiting and worker not in running and node[1] < len(orders[worker])
            if idle and all(
                replay.has_left(d, k) for d, k in zip(deps.get(node, ()), kinds.get(node, ()), strict=True)
            ):
                ready, seconds = replay.prepare(node)
                waiting[worker] = (node, max(ready, now), seconds)
                moved = True
        for worker in [w for w, (_, start, _) in waiting.items() if start <= now]:
            node, _, seconds = running[worker] = waiting.pop(worker)
            if node in replay.early:
                early[node] = seconds - replay.input_grad_seconds(node)
            moved = True
        for node in [n for n, rest in early.items() if running[n[0]][2] <= rest]:
            replay.left[node] = now
            del early[node]
            moved = True
        for worker in [w for w, (_, _, rest) in running.items() if rest <= 0]:
            node, start, _ = running.pop(worker)
            replay.commit(node, start, now)
            cursor[worker] += 1
            left -= 1
            moved = True
        if moved:
            continue
        slowdown = 1 + (contention - 1) * (len(running) - 1) / (workers - 1)
        ends = {w: now + rest * slowdown for w, (_, _, rest) in running.items()}
        marks = {n: now + (running[n[0]][2] - rest) * slowdown for n, rest in early.items()}
        later = min([*ends.values(), *marks.values(), *(start for _, start, _ in waiting.values())], default=math.inf)
        if math.isinf(later):
            raise PlanningError("the replay stalled: no action can start (the schedule deadlocks)")
        for worker, (node, start, rest) in running.items():
            if ends[worker] <= later:
                rest = 0.0
            elif marks.get(node, math.inf) <= later:
                rest = early[node]
            else:
                rest -= (later - now) / slowdown
            running[worker] = (node, start, rest)
        now = later


def _report(replay: _Replay) -> Simulation:
    schedule, costs = replay.schedule, replay.costs
    workers = schedule.workers
    timeline = [
        Interval(w, action, replay.start[(w, p)], replay.end[(w, p)])
        for w in range(workers)
        for p, action in enumerate(schedule.orders[w])
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
    steady = steady_step(step_end)
    throughput = schedule.microbatches / steady if steady > 0 else math.inf
    nca, activations = activation_peaks(schedule, costs, timeline)
    if schedule.relays:
        versions = relayed_weight_peaks(schedule, costs, replay.graph, replay.end)
    else:
        versions = weight_peaks(schedule, costs, replay.weights, makespan)
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
        peak_activations=[a[0] for a in activations],
        peak_activation_bytes=[a[1] for a in activations],
        weight_versions=[v[0] for v in versions],
        peak_weight_bytes=[v[1] for v in versions],
        received_bytes=replay.traffic.received,
        sent_bytes=replay.traffic.sent,
        transfers=replay.traffic.count,
        timeline=timeline,
        memory_timeline=[a[2] for a in activations],
        messages=sorted(replay.traffic.log, key=lambda message: message.sent),
    )

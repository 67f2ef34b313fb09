"""The dependency graph of a schedule: who waits for whom.

Nodes are the actions of all workers. Edges:

- program order: each action after the previous action of its worker;
- data (Beaumont et al. Fig. 1): ``F(s)`` after ``F(s-1)``; the first backward half (``B`` or ``I``)
  of stage ``s`` after ``F(s)`` (its saved activations) and after the backward of ``s+1`` (its
  output gradient); ``W(s)`` after ``I(s)``;
- weights: an action using version ``v >= 1`` of stage ``s`` after the ``UPDATE`` of step ``v - 1``
  of that stage; an ``UPDATE`` of step ``t`` after every backward of step ``t`` of that stage, and,
  when replicas update together (a collective reduce), after every other replica reached its update;
- rings (:class:`~lightning_pipe.schedule.ir.Ring`, CDP's dp form): a worker's last gradient of a stage
  and step after the previous owner's (the partial sum), an update after the update of the owner
  passing it the sum, or after the reducer's last gradient (instead of after every replica's
  gradients);
- relays (CDP's ZeRO form): a compute action of a stage after the stage's previous action, whose
  worker passes it the stage's state; an update after its own worker's gradients only;
- transfers, when the schedule spells them out: ``RECV`` after its ``SEND``; cues: ``WAIT`` after
  its peer's ``SIGNAL``.

A data edge between two workers is a transfer (implicit unless spelled out); the simulator prices
it. Sends never block (``isend``), receives do, so the schedule deadlocks exactly when this graph
has a cycle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["Graph", "Node", "build_graph", "data_dependencies", "message_kinds"]

Node = tuple[int, int]
"""``(worker, position)`` of an action."""

_Key = tuple
"""Identity of an action: ``(kind, stage, microbatch, step)`` for compute, plus the worker for
per-worker actions (updates, transfers)."""

_PER_WORKER = frozenset({Kind.UPDATE, Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B, Kind.SIGNAL, Kind.WAIT})


def _identity(worker: int, action: Action) -> _Key:
    return (*action.key, worker) if action.kind in _PER_WORKER else action.key


@dataclass
class Graph:
    """Predecessors of every action, split into same-worker order and cross-action dependencies.

    Attributes:
        schedule: the schedule.
        where: action key → node (the worker and position of the action).
        deps: node → nodes it waits for besides its worker's previous action.
        transfers: node → for each dependency, whether it is an activation/gradient (``"act"``), a
            weight (``"weight"``) or a spelled-out transfer (``"msg"``) edge.
    """

    schedule: Schedule
    where: dict[_Key, Node]
    deps: dict[Node, list[Node]]
    kinds: dict[Node, list[str]]
    _order: list[Node] | None = None

    def action(self, node: Node) -> Action:
        return self.schedule.orders[node[0]][node[1]]

    def order(self) -> list[Node]:
        """All nodes in an order that respects every edge; raises a PlanningError on deadlock."""
        if self._order is None:
            self._order = self._topological()
        return self._order

    def _topological(self) -> list[Node]:
        orders = self.schedule.orders
        waiting: dict[Node, int] = {}
        dependents: dict[Node, list[Node]] = defaultdict(list)
        for node, deps in self.deps.items():
            waiting[node] = len(deps)
            for dep in deps:
                dependents[dep].append(node)
        done: list[Node] = []
        cursor = [0] * len(orders)
        ready = [w for w, order in enumerate(orders) if order and waiting.get((w, 0), 0) == 0]
        while ready:
            worker = ready.pop()
            position = cursor[worker]
            node = (worker, position)
            done.append(node)
            cursor[worker] = position + 1
            for dependent in dependents.get(node, ()):
                waiting[dependent] -= 1
                if waiting[dependent] == 0 and cursor[dependent[0]] == dependent[1]:
                    ready.append(dependent[0])
            nxt = (worker, position + 1)
            if position + 1 < len(orders[worker]) and waiting.get(nxt, 0) == 0:
                ready.append(worker)
        if len(done) != sum(len(order) for order in orders):
            raise PlanningError(self._deadlock(cursor))
        return done

    def _deadlock(self, cursor: list[int]) -> str:
        stuck = []
        for worker, position in enumerate(cursor):
            if position < len(self.schedule.orders[worker]):
                node = (worker, position)
                blockers = [
                    f"{self.action(dep)} on worker {dep[0]}"
                    for dep in self.deps.get(node, ())
                    if cursor[dep[0]] <= dep[1]
                ]
                stuck.append(
                    f"worker {worker} at position {position} ({self.action(node)}) waits for {', '.join(blockers)}"
                )
        return f"{self.schedule.family}: the schedule deadlocks: " + "; ".join(stuck)


def data_dependencies(action: Action, last_stage: int, split: set[tuple[int, int, int]]) -> list[_Key]:
    """Keys of the compute actions ``action`` needs data from; ``split`` holds the (stage,
    micro-batch, step) whose backward is split into ``I`` and ``W``."""
    s, mb, t = action.stage, action.microbatch, action.step
    if action.kind is Kind.F:
        return [(Kind.F, s - 1, mb, t)] if s > 0 else []
    if action.kind in (Kind.B, Kind.I):
        deps: list[_Key] = [(Kind.F, s, mb, t)]
        if s < last_stage:
            later = Kind.I if (s + 1, mb, t) in split else Kind.B
            deps.append((later, s + 1, mb, t))
        return deps
    if action.kind is Kind.W:
        return [(Kind.I, s, mb, t)]
    return []


@dataclass
class _Index:
    """Where every action is, which backwards are split, and the gradients and updates of each
    (stage, step)."""

    where: dict[_Key, Node]
    split: set[tuple[int, int, int]]
    gradients: dict[tuple[int, int], list[Node]]
    updates: dict[tuple[int, int], list[Node]]


def _index(schedule: Schedule) -> _Index:
    index = _Index({}, set(), defaultdict(list), defaultdict(list))
    for worker, order in enumerate(schedule.orders):
        for position, action in enumerate(order):
            if action.kind is Kind.FETCH:  # nothing waits for a fetch by name; a worker may fetch a stage often
                continue
            key = _identity(worker, action)
            if key in index.where:
                first = index.where[key]
                raise PlanningError(
                    f"{schedule.family}: {action} appears twice: worker {first[0]} position {first[1]} and worker "
                    f"{worker} position {position}"
                )
            index.where[key] = (worker, position)
            kind = action.kind
            if kind is Kind.I:
                index.split.add((action.stage, action.microbatch, action.step))
            elif kind is Kind.B or kind is Kind.W:
                index.gradients[(action.stage, action.step)].append((worker, position))
            elif kind is Kind.UPDATE:
                index.updates[(action.stage, action.step)].append((worker, position))
    return index


def _where(schedule: Schedule, node: Node, action: Action) -> str:
    return f"{schedule.family}: worker {node[0]} position {node[1]} ({action})"


def _weight_producer(schedule: Schedule, index: _Index, node: Node, action: Action) -> Node:
    """The UPDATE that made the version ``action`` uses: on its own worker when it owns the stage."""
    producers = index.updates.get((action.stage, action.version - 1))
    if not producers:
        raise PlanningError(
            f"{_where(schedule, node, action)} uses version {action.version} of stage {action.stage}, but no "
            f"UPDATE of step {action.version - 1} produces it"
        )
    return next((p for p in producers if p[0] == node[0]), producers[0])


def _sender(schedule: Schedule, index: _Index, node: Node, action: Action) -> Node:
    """The SEND a spelled-out RECV waits for."""
    kind = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
    stage = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
    if action.peer is None:
        raise PlanningError(f"{_where(schedule, node, action)} names no peer")
    dep = index.where.get((kind, stage, action.microbatch, action.step, action.peer))
    if dep is None:
        raise PlanningError(f"{_where(schedule, node, action)} has no matching {kind.value} on worker {action.peer}")
    return dep


def _signal(schedule: Schedule, index: _Index, node: Node, action: Action) -> Node:
    """The ``SIGNAL`` a ``WAIT`` waits for: its peer's, of the same stage, micro-batch and step."""
    dep = None if action.peer is None else index.where.get((Kind.SIGNAL, *action.key[1:], action.peer))
    if dep is None:
        raise PlanningError(f"{_where(schedule, node, action)} has no matching SIGNAL on worker {action.peer}")
    return dep


def message_kinds(action: Action, producer: Action) -> tuple[Kind, Kind] | None:
    """``(send kind, receive kind)`` of the message carrying the data ``action`` takes from ``producer``
    when they run on different workers (an activation or a gradient), else ``None``."""
    if action.kind is Kind.F and producer.kind is Kind.F:
        return Kind.SEND_F, Kind.RECV_F
    if producer.kind in (Kind.B, Kind.I) and producer.stage == action.stage + 1:
        return Kind.SEND_B, Kind.RECV_B
    return None


def _received(schedule: Schedule, index: _Index, worker: int, action: Action, dep: Node) -> Node:
    """Where ``action`` gets the data made at ``dep``: from the spelled-out ``RECV`` on its own worker
    when the schedule has one (the message is then the ``RECV``'s, not counted twice), else from the
    producer itself."""
    kinds = None if dep[0] == worker else message_kinds(action, schedule.orders[dep[0]][dep[1]])
    if kinds is None:
        return dep
    return index.where.get((kinds[1], action.stage, action.microbatch, action.step, worker), dep)


def _last_gradient(index: _Index, stage: int, step: int, worker: int) -> Node | None:
    """The node of ``worker``'s last gradient action of ``stage`` in ``step``."""
    nodes = [node for node in index.gradients.get((stage, step), ()) if node[0] == worker]
    return max(nodes, default=None)


def _ring_gather(schedule: Schedule, index: _Index, node: Node, action: Action) -> list[tuple[Node, str]]:
    """A worker's last gradient of a stage and step takes the partial sum its ring's previous owner
    passed on after its own last gradient (:class:`~lightning_pipe.schedule.ir.Ring`)."""
    worker = node[0]
    if _last_gradient(index, action.stage, action.step, worker) != node:
        return []
    previous = schedule.rings[action.stage].gathered_from(worker)
    if previous is None:
        return []
    dep = _last_gradient(index, action.stage, action.step, previous)
    if dep is None:
        raise PlanningError(f"{_where(schedule, node, action)}: ring owner {previous} computes no gradient of it")
    return [(dep, "ring")]


def _ring_update(schedule: Schedule, index: _Index, worker: int, action: Action) -> list[tuple[Node, str]]:
    """An update on a ring: after the worker's own gradients of the step (the reducer's sum includes
    every owner's, passed along the ring) and the update of the owner that passes it the sum (the
    reducer passes it after its last gradient)."""
    edges = [(dep, "grad") for dep in index.gradients.get((action.stage, action.step), ()) if dep[0] == worker]
    ring = schedule.rings[action.stage]
    previous = ring.spread_from(worker)
    if previous == ring.reducer:  # it passes the sum on as soon as it has it
        edges.append((_last_gradient(index, action.stage, action.step, previous), "ring"))
    elif previous is not None:
        dep = index.where.get((Kind.UPDATE, action.stage, None, action.step, previous))
        if dep is None:
            raise PlanningError(f"{schedule.family}: ring owner {previous} has no {action}")
        edges.append((dep, "ring"))
    return edges


def _relay_key(schedule: Schedule, index: _Index, action: Action) -> _Key:
    """How a relayed action is indexed: an update with the worker that makes it (the one holding the
    stage then, not necessarily its owner, where it rests between runs)."""
    if action.kind is not Kind.UPDATE:
        return action.key
    makers = index.updates.get((action.stage, action.step))
    if not makers:
        raise PlanningError(f"{schedule.family}: the relay of stage {action.stage} has {action}, which no worker runs")
    return (*action.key, makers[0][0])


def _relayed(previous: dict[_Key, _Key], index: _Index, key: _Key) -> list[tuple[Node, str]]:
    """An action of a relayed stage (``key``: its :func:`_relay_key`) waits for the stage's previous
    action, whose worker passes it the stage's state (:attr:`~lightning_pipe.schedule.ir.Schedule.relays`)."""
    before = previous.get(key)
    return [] if before is None else [(index.where[before], "relay")]


def build_graph(schedule: Schedule) -> Graph:
    """Index the actions and derive every dependency; raises a PlanningError for an action that
    appears twice or a dependency that never happens. Dependencies already implied by the worker's
    own order are left out; one on a later action of the same worker is kept (it is a cycle)."""
    index = _index(schedule)
    relays = {
        _relay_key(schedule, index, a): _relay_key(schedule, index, relay[i - 1])
        for relay in schedule.relays
        for i, a in enumerate(relay)
        if i
    }
    deps: dict[Node, list[Node]] = {}
    kinds: dict[Node, list[str]] = {}
    last_stage = schedule.stages - 1
    for worker, order in enumerate(schedule.orders):
        for position, action in enumerate(order):
            node = (worker, position)
            edges: list[tuple[Node, str]] = []
            kind = action.kind
            if kind in COMPUTE:
                for key in data_dependencies(action, last_stage, index.split):
                    dep = index.where.get(key)
                    if dep is None:
                        raise PlanningError(
                            f"{_where(schedule, node, action)} needs {Action(*key)} which no worker runs"
                        )
                    edges.append((_received(schedule, index, worker, action, dep), "act"))
                if action.version:
                    edges.append((_weight_producer(schedule, index, node, action), "weight"))
                if schedule.rings and kind in (Kind.B, Kind.W):
                    edges += _ring_gather(schedule, index, node, action)
                if schedule.relays:
                    edges += _relayed(relays, index, action.key)
            elif kind is Kind.UPDATE and schedule.rings:
                edges += _ring_update(schedule, index, worker, action)
            elif kind is Kind.UPDATE and schedule.relays:  # the gradient travelled with the stage's state
                edges += _relayed(relays, index, _relay_key(schedule, index, action))
            elif kind is Kind.UPDATE:
                edges += [(dep, "grad") for dep in index.gradients.get((action.stage, action.step), ())]
                # replicas reduce together: none finishes before every other one has reached its update
                edges += [
                    ((other, spot - 1), "sync")
                    for other, spot in index.updates[(action.stage, action.step)]
                    if other != worker and spot > 0
                ]
            elif kind is Kind.RECV_F or kind is Kind.RECV_B:
                edges.append((_sender(schedule, index, node, action), "msg"))
            elif kind is Kind.WAIT:
                edges.append((_signal(schedule, index, node, action), "cue"))
            edges = [(dep, label) for dep, label in edges if dep[0] != worker or dep[1] > position]
            if edges:
                deps[node] = [dep for dep, _ in edges]
                kinds[node] = [label for _, label in edges]
    return Graph(schedule=schedule, where=index.where, deps=deps, kinds=kinds)

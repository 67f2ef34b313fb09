"""The dependency graph of a schedule: who waits for whom.

Nodes are the actions of all workers. Edges:

- program order: each action after the previous action of its worker;
- data (Beaumont et al. Fig. 1): ``F(s)`` after ``F(s-1)``; the first backward half (``B`` or ``I``)
  of stage ``s`` after ``F(s)`` (its saved activations) and after the backward of ``s+1`` (its
  output gradient); ``W(s)`` after ``I(s)``;
- weights: an action using version ``v >= 1`` of stage ``s`` after the ``UPDATE`` of step ``v - 1``
  of that stage; an ``UPDATE`` of step ``t`` after every backward of step ``t`` of that stage;
- transfers, when the schedule spells them out: ``RECV`` after its ``SEND``.

A data edge between two workers is a transfer (implicit unless spelled out); the simulator prices
it. Sends never block (``isend``), receives do, so the schedule deadlocks exactly when this graph
has a cycle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["Graph", "Node", "build_graph", "data_dependencies"]

Node = tuple[int, int]
"""``(worker, position)`` of an action."""

_Key = tuple
"""Identity of an action: ``(kind, stage, microbatch, step)`` for compute, plus the worker for
per-worker actions (updates, transfers)."""

_PER_WORKER = frozenset({Kind.UPDATE, Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B, Kind.FETCH})


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

    def action(self, node: Node) -> Action:
        return self.schedule.orders[node[0]][node[1]]

    def order(self) -> list[Node]:
        """All nodes in an order that respects every edge; raises a PlanningError on deadlock."""
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


def build_graph(schedule: Schedule) -> Graph:
    """Index the actions and derive every dependency; raises a PlanningError for an action that
    appears twice or a dependency that never happens."""
    where: dict[_Key, Node] = {}
    for worker, position, action in schedule.actions():
        key = _identity(worker, action)
        if key in where:
            first = where[key]
            raise PlanningError(
                f"{schedule.family}: {action} appears twice: worker {first[0]} position {first[1]} and worker "
                f"{worker} position {position}"
            )
        where[key] = (worker, position)
    split = {(a.stage, a.microbatch, a.step): True for _, _, a in schedule.actions() if a.kind is Kind.I}
    gradients: dict[tuple[int, int], list[Node]] = defaultdict(list)
    updates: dict[tuple[int, int], list[Node]] = defaultdict(list)
    for worker, position, action in schedule.actions():
        if action.kind in (Kind.B, Kind.W):
            gradients[(action.stage, action.step)].append((worker, position))
        elif action.kind is Kind.UPDATE:
            updates[(action.stage, action.step)].append((worker, position))

    deps: dict[Node, list[Node]] = {}
    kinds: dict[Node, list[str]] = {}
    last_stage = schedule.stages - 1
    for worker, position, action in schedule.actions():
        node = (worker, position)
        mine: list[Node] = []
        labels: list[str] = []
        for key in data_dependencies(action, last_stage, split):
            dep = where.get(key)
            if dep is None:
                raise PlanningError(
                    f"{schedule.family}: worker {worker} position {position} ({action}) needs "
                    f"{Action(*key)} which no worker runs"
                )
            if dep[0] != worker or dep[1] > position:  # same worker, later: a cycle the order check reports
                mine.append(dep)
                labels.append("act")
        if action.kind in COMPUTE and action.version:
            producers = updates.get((action.stage, action.version - 1))
            if not producers:
                raise PlanningError(
                    f"{schedule.family}: worker {worker} position {position} ({action}) uses version "
                    f"{action.version} of stage {action.stage}, but no UPDATE of step {action.version - 1} produces it"
                )
            local = [p for p in producers if p[0] == worker]
            producer = local[0] if local else producers[0]
            if producer[0] != worker or producer[1] > position:
                mine.append(producer)
                labels.append("weight")
        if action.kind is Kind.UPDATE:
            for dep in gradients.get((action.stage, action.step), []):
                if dep[0] != worker or dep[1] > position:
                    mine.append(dep)
                    labels.append("grad")
        if action.kind in (Kind.RECV_F, Kind.RECV_B):
            sender_kind = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
            sender_stage = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
            if action.peer is None:
                raise PlanningError(f"{schedule.family}: worker {worker} position {position} ({action}) names no peer")
            dep = where.get((sender_kind, sender_stage, action.microbatch, action.step, action.peer))
            if dep is None:
                raise PlanningError(
                    f"{schedule.family}: worker {worker} position {position} ({action}) has no matching "
                    f"{sender_kind.value} on worker {action.peer}"
                )
            mine.append(dep)
            labels.append("msg")
        if mine:
            deps[node] = mine
            kinds[node] = labels
    return Graph(schedule=schedule, where=where, deps=deps, kinds=kinds)

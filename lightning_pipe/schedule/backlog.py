"""The most bytes a schedule can leave sent but not yet taken on each link between two workers.

A message (an activation or a gradient crossing from one worker to another) is *sent* when the
action that makes it runs and *taken* when the first action that needs it, or any later message of
the same link, runs: the receiver completes a link's messages in the order they were sent. Sends
never wait, so a sender runs ahead of its receiver as far as the dependency graph
(:mod:`~lightning_pipe.schedule.graph`) lets it, whatever the actions' durations. That bound is what
a link's buffer must hold for no message to find it full (:mod:`lightning_pipe.runtime.shared_memory`).

Every run of the schedule passes through states that are *cuts* of the graph: sets of actions closed
under "waits for". With the first ``k`` messages of link ``a -> b`` taken and message ``k`` not yet,
the action ``t_k`` of ``b`` that takes message ``k`` has not run, nor has anything that waits for it;
everything else may have run. So the backlog with ``k`` taken is at most the bytes of the messages
``>= k`` sent by the actions of ``a`` that do not wait (directly or not) for ``t_k``, and that many is
reached by the cut of every action not waiting for ``t_k``. The bound is the largest over ``k``; it is
exact for the graph (tested against every reachable state of small schedules).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from lightning_pipe.schedule.graph import Graph, Node, build_graph
from lightning_pipe.schedule.ir import Action, Schedule

__all__ = ["LinkLoad", "Message", "link_loads", "messages"]

Message = tuple[int, int, float]
"""``(sender position, receiver position, bytes)`` of one message of a link."""


def messages(graph: Graph, size: Callable[[Action, Action], float]) -> dict[tuple[int, int], list[Message]]:
    """The messages of every link ``(sender, receiver)``, in the order they are sent: one per
    dependency of an action on data made on another worker; ``size(producer, consumer)`` is its bytes."""
    links: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for node, deps in graph.deps.items():
        for dep, label in zip(deps, graph.kinds[node], strict=True):
            if label == "act" and dep[0] != node[0]:
                links[(dep[0], node[0])].append((dep[1], node[1], size(graph.action(dep), graph.action(node))))
    return {link: sorted(items) for link, items in links.items()}


@dataclass(frozen=True)
class LinkLoad:
    """What one link carries: ``backlog``, the most bytes sent on it and not yet taken in any run;
    ``largest``, its largest message."""

    backlog: float
    largest: float


def link_loads(schedule: Schedule, size: Callable[[Action, Action], float]) -> dict[tuple[int, int], LinkLoad]:
    """What every link ``(sender, receiver)`` of ``schedule`` carries (the module docstring gives the
    backlog's argument); ``size(producer, consumer)`` gives a message's bytes."""
    graph = build_graph(schedule)
    links = messages(graph, size)
    first = _first_waiting(graph, {sender for sender, _ in links})
    loads: dict[tuple[int, int], LinkLoad] = {}
    for (sender, receiver), items in links.items():
        sent_at = [position for position, _, _ in items]
        sent_bytes = [0.0, *itertools.accumulate(nbytes for _, _, nbytes in items)]
        # the position of the receiver's action that takes message k: the first to need it or a later one
        takes = list(itertools.accumulate(reversed([taken for _, taken, _ in items]), min))[::-1]
        best = 0.0
        for k, take in enumerate(takes):
            if k and takes[k - 1] == take:  # taken together with the message before it
                continue
            limit = first[(receiver, take)].get(sender, math.inf)
            sent = max(k, bisect.bisect_left(sent_at, limit))
            best = max(best, sent_bytes[sent] - sent_bytes[k])
        loads[(sender, receiver)] = LinkLoad(best, max(nbytes for _, _, nbytes in items))
    return loads


def _first_waiting(graph: Graph, workers: set[int]) -> dict[Node, dict[int, int]]:
    """For every action, the first position on each of ``workers`` that waits for it (itself
    included), directly or through others; absent: no action there does."""
    dependents: dict[Node, list[Node]] = defaultdict(list)
    for node, deps in graph.deps.items():
        for dep in deps:
            dependents[dep].append(node)
    orders = graph.schedule.orders
    first: dict[Node, dict[int, int]] = {}
    for node in reversed(graph.order()):
        worker, position = node
        reached: dict[int, int] = {worker: position} if worker in workers else {}
        successors = dependents.get(node, [])
        if position + 1 < len(orders[worker]):
            successors = [*successors, (worker, position + 1)]
        for successor in successors:
            for other, spot in first[successor].items():
                if spot < reached.get(other, math.inf):
                    reached[other] = spot
        first[node] = reached
    return first

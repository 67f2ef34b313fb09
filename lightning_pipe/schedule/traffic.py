"""The messages of a replay: what each cross-worker edge carries, what it costs, and the log.

An input from another worker is one message: an activation (to a forward), a gradient (to a
backward), a reduce (gradients to an update, or a partial or whole sum passed along a ring), a
weight (a stage's state relayed on, or fetched from its owner: FSDP-style, Rahimi 2025) or a cue
(nothing: a worker telling another it has come this far). Each costs the processors at both ends
``overhead`` seconds (the *o* of the LogP model, Culler et al. 1993) and, with blocking transfers,
keeps its sender busy while it goes. :class:`Traffic` counts the bytes and messages per category and
worker and logs every message, which
:meth:`~lightning_pipe.schedule.simulation.Simulation.sent_per_time_step` counts per time step
(Fournier & Oyallon 2024, Table 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from lightning_pipe.schedule.graph import Graph, Node
from lightning_pipe.schedule.ir import Action, Kind, Schedule
from lightning_pipe.schedule.stage_costs import StageCosts

__all__ = ["CATEGORIES", "Message", "Traffic", "category_of", "edge_bytes", "is_message", "message_costs"]

CATEGORIES = ("activation", "gradient", "reduce", "weight", "cue")


@dataclass(frozen=True)
class Message:
    """One transfer between workers: when it left ``source`` for ``destination``, what it carried
    (``activation``, ``gradient``, ``reduce``, ``weight`` or ``cue``) and its bytes. A fetched
    stage's weights come from its first owner."""

    sent: float
    source: int
    destination: int
    category: str
    nbytes: float


def category_of(action: Action, label: str) -> str:
    """What a cross-worker edge carries: activation, gradient, reduce (gradients to an update), weight
    or cue (nothing: a worker telling another it has come this far)."""
    if label == "cue":
        return "cue"
    if label == "relay":  # a stage's state passed on to the next worker computing it
        return "weight"
    if label in ("grad", "ring"):  # to an update, or a partial or whole sum passed along a ring
        return "reduce"
    if action.kind in (Kind.F, Kind.RECV_F):
        return "activation"
    return "gradient"


def edge_bytes(costs: StageCosts, action: Action, dep: Action, category: str) -> float:
    """Bytes of a message of ``category`` from ``dep`` to ``action``: none for a cue, the weights of
    ``action``'s stage for a reduce or weight, else the output of the stage before the boundary it
    crosses (``dep``'s for an activation, ``action``'s for a gradient)."""
    if category == "cue":
        return 0.0
    if category in ("reduce", "weight"):
        return costs.stage_bytes("weight_bytes", action.stage)
    if category == "activation":
        return costs.stage_bytes("activation_bytes", dep.stage)
    return costs.stage_bytes("activation_bytes", action.stage)


def is_message(node: Node, dep: Node, label: str) -> bool:
    """Whether ``node`` gets what ``dep`` produced (along an edge labelled ``label``) in a message: from
    another worker, and not a wait for a weight version's update or for replicas reaching theirs."""
    return dep[0] != node[0] and label not in ("weight", "sync")


def message_costs(schedule: Schedule, graph: Graph, costs: StageCosts) -> tuple[dict[Node, int], dict[Node, float]]:
    """Per action, the messages it sends or receives (each costs it ``overhead``), and the seconds its
    sender stays busy after it: every message's, for a blocking sender (``overlap=False``); else the
    share of its gradients' all-reduce that does not run beside compute (``1 - reduce_overlap``: one
    all-reduce, however many replicas it reaches)."""
    messages: dict[Node, int] = defaultdict(int)
    sending: dict[Node, float] = defaultdict(float)
    for node, deps in graph.deps.items():
        action = schedule.orders[node[0]][node[1]]
        for dep, label in zip(deps, graph.kinds[node], strict=True):
            if is_message(node, dep, label):
                messages[node] += 1
                messages[dep] += 1
                category = category_of(action, label)
                if costs.overlap and (category != "reduce" or costs.reduce_overlap == 1):
                    continue
                nbytes = edge_bytes(costs, action, schedule.orders[dep[0]][dep[1]], category)
                if not costs.overlap:
                    sending[dep] += costs.transfer(nbytes)
                else:
                    sending[dep] = max(sending[dep], (1 - costs.reduce_overlap) * costs.transfer(nbytes))
    return messages, sending


class Traffic:
    """Bytes and messages per category and worker, and every message, as a replay sends them."""

    def __init__(self, workers: int) -> None:
        self.received = {c: [0.0] * workers for c in CATEGORIES}
        self.sent = {c: [0.0] * workers for c in CATEGORIES}
        self.count = {c: [0] * workers for c in CATEGORIES}
        self.log: list[Message] = []

    def send(self, message: Message, owners: Collection[int] = ()) -> None:
        """Count ``message`` for its receiver and log it. A fetch of a stage's weights comes from all its
        ``owners``, each sending an equal share (it is logged from the first)."""
        senders = owners or (message.source,)
        for sender in senders:
            self.sent[message.category][sender] += message.nbytes / len(senders)
        self.received[message.category][message.destination] += message.nbytes
        self.count[message.category][message.destination] += 1
        self.log.append(message)

"""Read PipeDream's profile format (``graph.txt``) as a DAG of layers, or as a chain of layers.

PipeDream's profiler (Narayanan et al. 2019, github.com/msr-fiddle/pipedream, MIT licence) writes
one line per node (shown folded here) and one per edge::

    node4 -- Conv2d(64, 64, kernel_size=(3, 3)) -- forward_compute_time=3.852, \\
        backward_compute_time=9.775, activation_size=205520896.0, parameter_size=147456.000
    <TAB>node3 -- node4

Times are milliseconds for one mini-batch of the profiled size, sizes are bytes; ``activation_size``
may be a list ``[a; b; c]`` for a node with several outputs. ``Input`` nodes only carry the data
loading time, which PipeDream's optimizer zeroes out, so they are dropped here.

:func:`parse_pipedream_dag` keeps the graph (:class:`LayerDag`: the layers in node-number order and
the edges between them), which the antichain partitioner splits
(:mod:`lightning_pipe.partition.antichain`). :func:`parse_pipedream_graph` lays it out as a chain in a
topological order (Kahn's algorithm, ties by node number so the order is stable), and the bytes
crossing a cut after position ``i`` count every node before the cut that feeds a node after it,
skip connections included. The result's notes say so. PipeDream records no saved-for-backward
bytes, so ``saved_bytes`` is taken to be the output size, as PipeDream's own memory estimate does.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.ordering import smallest_first

__all__ = ["LayerDag", "load_pipedream_dag", "parse_pipedream_dag", "parse_pipedream_graph"]

_NODE = re.compile(r"^(?P<id>\S+) -- (?P<desc>.*) -- (?P<fields>forward_compute_time=.*)$")
_EDGE = re.compile(r"^\s*(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


@dataclass
class _Node:
    id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation: float
    params: float


def _number(text: str, field: str, where: str) -> float:
    text = text.strip()
    try:
        if text.startswith("["):
            return sum(float(part) for part in text.strip("[]").split(";") if part.strip())
        return float(text)
    except ValueError:
        raise PlanningError(f"{where}: {field}={text!r} is not a number") from None


def _parse_node(match: re.Match[str], where: str) -> _Node:
    values: dict[str, str] = {}
    for item in re.split(r",\s*(?=[a-z_]+=)", match.group("fields")):
        key, _, value = item.partition("=")
        values[key.strip()] = value
    missing = [field for field in _FIELDS if field not in values]
    if missing:
        raise PlanningError(f"{where}: node {match.group('id')} lacks {', '.join(missing)}")
    return _Node(
        id=match.group("id"),
        desc=match.group("desc").strip(),
        forward_ms=_number(values["forward_compute_time"], "forward_compute_time", where),
        backward_ms=_number(values["backward_compute_time"], "backward_compute_time", where),
        activation=_number(values["activation_size"], "activation_size", where),
        params=_number(values["parameter_size"], "parameter_size", where),
    )


@dataclass(frozen=True)
class LayerDag:
    """Layers and the edges between them: a branching model before it is laid out as a chain.

    Attributes:
        layers: the nodes' costs, as in a chain (``activation_bytes``: the output every consumer receives).
        edges: ``(producer, consumer)`` pairs of indices into ``layers``.
        name, notes, meta: as in :class:`ChainCosts`, which :meth:`chain` passes them on to.
        order: a topological order (Kahn's algorithm, the lowest index first among ready nodes);
            computed, and the graph refused if it has a cycle.
    """

    layers: tuple[LayerCost, ...]
    edges: tuple[tuple[int, int], ...] = ()
    name: str = ""
    notes: tuple[str, ...] = ()
    meta: dict[str, object] = field(default_factory=dict, compare=False)
    order: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        what = self.name or "the graph"
        if not self.layers:
            raise PlanningError(f"{what} has no layers: nothing to partition (give at least one node)")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "notes", tuple(self.notes))
        try:
            edges = tuple(dict.fromkeys((operator.index(src), operator.index(dst)) for src, dst in self.edges))
        except (TypeError, ValueError):
            raise PlanningError(
                f"{what}: edges must be (producer, consumer) pairs of integer indices into the layers, "
                f"got {self.edges!r}"
            ) from None
        for src, dst in edges:
            if not (0 <= src < len(self.layers) and 0 <= dst < len(self.layers)):
                raise PlanningError(
                    f"{what}: edge {src} -> {dst} names a layer outside 0..{len(self.layers) - 1}: "
                    "edges are pairs of indices into the layers"
                )
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "order", self._kahn())

    def _kahn(self) -> tuple[int, ...]:
        waiting = [0] * len(self.layers)
        consumers: list[list[int]] = [[] for _ in self.layers]
        for src, dst in self.edges:
            consumers[src].append(dst)
            waiting[dst] += 1
        order = smallest_first(consumers, waiting)
        if len(order) != len(self.layers):
            placed = set(order)
            stuck = [layer.name for node, layer in enumerate(self.layers) if node not in placed]
            raise PlanningError(
                f"{self.name or 'the graph'} has a cycle through {', '.join(stuck[:5])}: a layer graph must be "
                "acyclic (every edge from a producer to a later consumer)"
            )
        return tuple(order)

    def chain(self, order: Sequence[int] | None = None) -> ChainCosts:
        """The layers laid out in ``order`` (default :attr:`order`), any topological order of the graph.

        The bytes crossing the cut after position ``i`` count every layer up to ``i`` that feeds a layer
        after it, skip connections included.
        """
        order = self.order if order is None else tuple(order)
        position = {node: i for i, node in enumerate(order)}
        if sorted(position) != list(range(len(self.layers))) or len(order) != len(self.layers):
            raise PlanningError(
                f"{self.name or 'the graph'}: an order must list each of the {len(self.layers)} layers once, "
                f"got {list(order)}"
            )
        last_use = list(range(len(order)))
        for src, dst in self.edges:
            if position[dst] < position[src]:
                raise PlanningError(
                    f"{self.name or 'the graph'}: the order puts layer {dst} before its producer {src}: "
                    "give a topological order (every producer before its consumers), e.g. the graph's own .order"
                )
            last_use[position[src]] = max(last_use[position[src]], position[dst])
        crossing = [0.0] * (len(order) - 1)
        for i, node in enumerate(order):
            for cut in range(i, last_use[i]):
                crossing[cut] += self.layers[node].activation_bytes
        notes = list(self.notes)
        consecutive = sum(1 for src, dst in self.edges if position[dst] == position[src] + 1)
        if consecutive != len(self.edges) or consecutive != len(order) - 1:
            notes.append(
                f"the profile is a DAG ({len(order)} nodes, {len(self.edges)} edges): laid out as a chain in "
                "topological order; bytes crossing each cut include skip connections"
            )
        return ChainCosts(
            layers=tuple(self.layers[node] for node in order),
            boundary_bytes=tuple(crossing),
            name=self.name,
            notes=tuple(notes),
            meta=dict(self.meta),
        )


def parse_pipedream_dag(text: str, source: str = "graph.txt", name: str | None = None) -> LayerDag:
    """Parse the text of a PipeDream ``graph.txt`` into a :class:`LayerDag` (see the module docstring):
    its layers in node-number order, ``Input`` nodes dropped."""
    nodes: dict[str, _Node] = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        if node := _NODE.match(line.strip()):
            parsed = _parse_node(node, where)
            nodes[parsed.id] = parsed
        elif edge := _EDGE.match(line):
            edges.append((edge.group("src"), edge.group("dst")))
        else:
            raise PlanningError(
                f"{where}: not a PipeDream profile line (expected 'nodeN -- Desc -- forward_compute_time=...' "
                f"or a tab-indented 'nodeA -- nodeB' edge): {line[:80]!r}"
            )
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise PlanningError(f"{source}: edge {src} -- {dst} names unknown node {end}")
    inputs = {node.id for node in nodes.values() if node.desc.startswith("Input")}
    kept = sorted((node_id for node_id in nodes if node_id not in inputs), key=_order_key)
    if not kept:
        raise PlanningError(f"{source}: no layers (only Input nodes or an empty file)")
    index = {node_id: i for i, node_id in enumerate(kept)}
    notes = [f"loaded PipeDream profile {source}: times converted from ms to s"]
    if inputs:
        notes.append(f"dropped {len(inputs)} Input node(s) (data loading time, zeroed by PipeDream's optimizer)")
    notes.append("saved_bytes taken as the output activation size (PipeDream records no saved tensors)")
    return LayerDag(
        layers=tuple(_layer(nodes[node_id]) for node_id in kept),
        edges=tuple((index[src], index[dst]) for src, dst in edges if src in index and dst in index),
        name=name or Path(source).parent.name or source,
        notes=tuple(notes),
        meta={"source": source, "format": "pipedream"},
    )


def load_pipedream_dag(path: str | Path) -> LayerDag:
    """:func:`parse_pipedream_dag` of the file at ``path``."""
    return parse_pipedream_dag(Path(path).read_text(), source=str(path))


def parse_pipedream_graph(text: str, source: str = "graph.txt", name: str | None = None) -> ChainCosts:
    """Parse the text of a PipeDream ``graph.txt`` into a chain (see the module docstring)."""
    return parse_pipedream_dag(text, source, name).chain()


def _order_key(node_id: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", node_id)
    return (int(digits) if digits else 0, node_id)


def _layer(node: _Node) -> LayerCost:
    return LayerCost(
        name=f"{node.id}:{node.desc}",
        forward_seconds=node.forward_ms / 1e3,
        backward_seconds=node.backward_ms / 1e3,
        activation_bytes=node.activation,
        saved_bytes=node.activation,
        param_bytes=node.params,
    )

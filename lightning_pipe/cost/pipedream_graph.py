"""Read PipeDream's profile format (``graph.txt``) as a chain of layers.

PipeDream's profiler (Narayanan et al. 2019, github.com/msr-fiddle/pipedream, MIT licence) writes
one line per node (shown folded here) and one per edge::

    node4 -- Conv2d(64, 64, kernel_size=(3, 3)) -- forward_compute_time=3.852, \\
        backward_compute_time=9.775, activation_size=205520896.0, parameter_size=147456.000
    <TAB>node3 -- node4

Times are milliseconds for one mini-batch of the profiled size, sizes are bytes; ``activation_size``
may be a list ``[a; b; c]`` for a node with several outputs. ``Input`` nodes only carry the data
loading time, which PipeDream's optimizer zeroes out, so they are dropped here.

A DAG (ResNet, Inception, GNMT) is laid out in a topological order (Kahn's algorithm, ties by node
number so the order is stable), and the bytes crossing a cut after position ``i`` count every node
before the cut that feeds a node after it, skip connections included. The result's notes say so.
PipeDream records no saved-for-backward bytes, so ``saved_bytes`` is taken to be the output size,
as PipeDream's own memory estimate does.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from pathlib import Path

from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError

__all__ = ["parse_pipedream_graph"]

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


def _order_key(node_id: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", node_id)
    return (int(digits) if digits else 0, node_id)


def _topological(nodes: dict[str, _Node], edges: list[tuple[str, str]], source: str) -> list[str]:
    indegree = dict.fromkeys(nodes, 0)
    successors: dict[str, list[str]] = {node: [] for node in nodes}
    for src, dst in edges:
        successors[src].append(dst)
        indegree[dst] += 1
    ready = [(_order_key(node), node) for node, degree in indegree.items() if degree == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for nxt in successors[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, (_order_key(nxt), nxt))
    if len(order) != len(nodes):
        stuck = sorted(node for node, degree in indegree.items() if degree > 0)
        raise PlanningError(f"{source}: the graph has a cycle through {', '.join(stuck[:5])}")
    return order


def parse_pipedream_graph(text: str, source: str = "graph.txt", name: str | None = None) -> ChainCosts:
    """Parse the text of a PipeDream ``graph.txt`` into a chain (see the module docstring)."""
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
    kept = {node_id: node for node_id, node in nodes.items() if node_id not in inputs}
    if not kept:
        raise PlanningError(f"{source}: no layers (only Input nodes or an empty file)")
    kept_edges = [(src, dst) for src, dst in edges if src in kept and dst in kept]
    order = _topological(kept, kept_edges, source)
    return _as_chain(kept, kept_edges, order, source, name, dropped=len(inputs))


def _as_chain(
    nodes: dict[str, _Node],
    edges: list[tuple[str, str]],
    order: list[str],
    source: str,
    name: str | None,
    dropped: int,
) -> ChainCosts:
    position = {node: i for i, node in enumerate(order)}
    last_use = {node: position[node] for node in order}
    for src, dst in edges:
        last_use[src] = max(last_use[src], position[dst])
    crossing = [0.0] * (len(order) - 1)
    for node in order:
        for cut in range(position[node], last_use[node]):
            crossing[cut] += nodes[node].activation
    layers = tuple(
        LayerCost(
            name=f"{node}:{nodes[node].desc}",
            forward_seconds=nodes[node].forward_ms / 1e3,
            backward_seconds=nodes[node].backward_ms / 1e3,
            activation_bytes=nodes[node].activation,
            saved_bytes=nodes[node].activation,
            param_bytes=nodes[node].params,
        )
        for node in order
    )
    chain_edges = sum(1 for src, dst in edges if position[dst] == position[src] + 1)
    notes = [f"loaded PipeDream profile {source}: times converted from ms to s"]
    if dropped:
        notes.append(f"dropped {dropped} Input node(s) (data loading time, zeroed by PipeDream's optimizer)")
    if chain_edges != len(edges) or chain_edges != len(order) - 1:
        notes.append(
            f"the profile is a DAG ({len(order)} nodes, {len(edges)} edges): laid out as a chain in topological "
            "order; bytes crossing each cut include skip connections"
        )
    notes.append("saved_bytes taken as the output activation size (PipeDream records no saved tensors)")
    return ChainCosts(
        layers=layers,
        boundary_bytes=tuple(crossing),
        name=name or Path(source).parent.name or source,
        notes=tuple(notes),
        meta={"source": source, "format": "pipedream"},
    )

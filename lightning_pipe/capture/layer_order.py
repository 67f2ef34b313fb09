"""Lay a branching forward's layers out in the topological order that splits best.

The layers (:mod:`.layers`) are runs of the graph's nodes in the order ``forward`` recorded them, and a
stage is a run of consecutive layers. Where the layers branch (an Inception block's parallel branches,
split into layers of their own once a pipeline has four stages or more) the recorded order is only one
of the orders the pipeline could run them in, and its best split may cut the model less evenly than
another's. PipeDream (Narayanan et al. 2019, §3.1 "Work partitioning") splits the graph itself: a stage
is the difference of two nested downsets, hence a run of some topological order
(:func:`~lightning_pipe.partition.antichain.antichain_plan`).

:func:`searched_order` weighs each layer by its measured forward and backward times, searches the
straight split into ``stages`` stages with the smallest bottleneck over every downset of the layer
graph, and returns that split's order when its bottleneck is at least :data:`GAIN` below the best split
of the recorded order (which is among the candidates, so the search is never worse). Where the layers
branch (:func:`branches`) the strategy profiles them on rank 0 in the recorded order (the profile is
kept from run to run, so the same machine keeps one order, and the plan reuses it where the order
stays), sends the order to every rank and rebuilds the layers in it
(:meth:`~lightning_pipe.capture.CapturedForward.reordered`); the profiler then measures them in that
order and every partitioner splits that chain. Without times the layers are weighed by their FLOPs,
which rank a CPU's times poorly: on a two-tower model at 4 stages FLOPs chose an order whose best
split measured 2-4% slower than the recorded one's, where measured times chose one 4-5% faster (9-11%
at 8 stages; ``python bench/layer_order.py``). A graph whose layers form a chain, one with split points
(:func:`~lightning_pipe.capture.pipe_split`: the user chose the cuts) or one whose downsets outnumber
``max_states`` keeps the recorded order.

What must keep its place does: layers that draw random numbers (a dropout module or function, a
``torch.nn`` leaf holding one or a dropout probability), run code the tracer did not see into (a leaf
module from outside ``torch.nn``) or have side effects keep their relative order, so that the
random draws and effects happen as in ``forward``; the calls of one module (its buffers' updates) keep
theirs; an in-place operation keeps its place before or after every other reader of the tensor it
changes, of its views and of what it is a view of.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from torch import nn
from torch.fx.node import Node

from lightning_pipe.capture.graph import CapturedGraph, changes_operand
from lightning_pipe.capture.tracer import split_marker
from lightning_pipe.cost.pipedream_graph import LayerDag
from lightning_pipe.cost.records import LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.antichain import antichain_plan

__all__ = ["GAIN", "MAX_ORDER_STATES", "branches", "layer_dag", "searched_order"]

MAX_ORDER_STATES = 2_000
"""Downsets searched before keeping the recorded order (Inception-v3 in 70 layers has 256)."""

GAIN = 0.05
"""How much lower the searched order's bottleneck must be: the layers' times carry the noise of a few
runs, and a split across branches carries more values, so a smaller gain keeps the recorded order."""

Grouped = list[tuple[list[Node], int]]

_RANDOM = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential", "cauchy")
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)
_VIEW_NAMES = (
    "view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose t permute movedim narrow select "
    "expand expand_as as_strided chunk split unbind tensor_split getitem detach contiguous diagonal unfold"
)
_VIEWS = frozenset(_VIEW_NAMES.split())  # operations whose result may share its operand's storage


def searched_order(
    captured: CapturedGraph,
    grouped: Grouped,
    stages: int,
    seconds: Sequence[tuple[float, float]] | None = None,
    max_states: int = MAX_ORDER_STATES,
) -> tuple[int, ...] | None:
    """The order of ``grouped`` (the layers as recorded) whose best split into ``stages`` straight stages
    has the smallest bottleneck, with each layer's (forward, backward) ``seconds`` (default: FLOPs),
    when at least :data:`GAIN` below the recorded order's; None to keep the recorded order (module
    docstring)."""
    if stages < 2 or len(grouped) <= stages or _split_by_user(grouped):
        return None
    dag = layer_dag(captured, grouped, seconds)
    if _is_chain(dag) or not any(layer.seconds for layer in dag.layers):
        return None  # one order only, or nothing to weigh the layers by
    try:
        searched = antichain_plan(dag, stages, straight=True, max_states=max_states)
    except PlanningError:
        return None  # more orders than the search can afford: the recorded one is a topological order
    recorded = LayerDag(dag.layers, (*dag.edges, *_consecutive(len(grouped))), name=dag.name)
    if searched.bottleneck_seconds > (1 - GAIN) * antichain_plan(recorded, stages, straight=True).bottleneck_seconds:
        return None
    return searched.order


def branches(captured: CapturedGraph, grouped: Grouped) -> bool:
    """Whether the layers could run in another order: no split points, and two consecutive layers with
    no edge between them."""
    return not _split_by_user(grouped) and not _is_chain(layer_dag(captured, grouped))


def _split_by_user(grouped: Grouped) -> bool:
    return any(node.target is split_marker for group, _ in grouped for node in group)


def _is_chain(dag: LayerDag) -> bool:
    return set(_consecutive(len(dag.layers))) <= set(dag.edges)


def _consecutive(layers: int) -> Iterable[tuple[int, int]]:
    return ((i, i + 1) for i in range(layers - 1))


def layer_dag(
    captured: CapturedGraph, grouped: Grouped, seconds: Sequence[tuple[float, float]] | None = None
) -> LayerDag:
    """The layers as a graph: an edge where a layer uses a value another computed, or where two must
    keep their order (module docstring); a layer's times are ``seconds`` (forward, backward), or else
    its forward FLOPs and twice them. No bytes: the search prices straight stages over free links."""
    layer_of = {node: i for i, (group, _) in enumerate(grouped) for node in group}
    last = len(grouped) - 1
    edges = [(i, j) for node, i in layer_of.items() for j in {layer_of.get(user, last) for user in node.users} - {i}]
    edges.extend(_kept_in_order(captured, grouped, layer_of))
    costs = []
    for i, (group, _) in enumerate(grouped):
        flops = float(sum(_flops(captured, node) for node in group))
        forward, backward = (flops, 2 * flops) if seconds is None else seconds[i]
        costs.append(LayerCost(f"layer {i}", forward, backward, 0.0, 0.0, 0.0, flops=3 * flops))
    return LayerDag(tuple(costs), tuple(edges), name="the captured forward")


def _kept_in_order(captured: CapturedGraph, grouped: Grouped, layer_of: dict[Node, int]) -> Iterable[tuple[int, int]]:
    """Edges that keep in their recorded order the layers with random draws or effects, the calls of
    each module, and each in-place operation with the other readers of what it changes."""
    ordered = sorted({layer_of[node] for node in layer_of if _has_effects(captured, node)})
    yield from itertools.pairwise(ordered)
    calls: dict[str, list[int]] = {}
    for group, _ in grouped:
        for node in group:
            if node.op == "call_module":
                calls.setdefault(str(node.target), []).append(layer_of[node])
    for layers in calls.values():
        layers = sorted(set(layers))
        yield from itertools.pairwise(layers)
    for node, i in layer_of.items():
        changed = node.args[0] if node.args and _in_place(captured, node) else None
        if isinstance(changed, Node):
            for reader in (user for alias in _aliases(changed) for user in alias.users):
                j = layer_of.get(reader, i)
                if j != i:
                    yield (min(i, j), max(i, j))


def _aliases(value: Node) -> set[Node]:
    """``value`` and every node that may share its storage: up through the views it was taken from
    to their base, and down through every view of that base (``view``, ``transpose``, ``x[i]`` ...)."""
    base = value
    while _is_view(base) and isinstance(base.args[0], Node):
        base = base.args[0]
    found, waiting = {base}, [base]
    while waiting:
        for user in waiting.pop().users:
            if _is_view(user) and user not in found:
                found.add(user)
                waiting.append(user)
    return found


def _is_view(node: Node) -> bool:
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _VIEWS


def _has_effects(captured: CapturedGraph, node: Node) -> bool:
    """Whether ``node`` draws random numbers, runs code the tracer did not see into, or has effects."""
    if node.op == "call_module":
        module = captured.attributes.get(str(node.target))
        if not isinstance(module, nn.Module) or not type(module).__module__.startswith("torch.nn"):
            return True
        return any(_draws(inner) for inner in module.modules())
    if node.op in ("call_function", "call_method"):
        name = (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")).lower()
        return node.is_impure() or any(word in name for word in _RANDOM)
    return False


def _draws(module: nn.Module) -> bool:
    """Whether a ``torch.nn`` module draws random numbers itself: a dropout module, or a dropout
    probability it applies functionally (``nn.MultiheadAttention(dropout=0.1)``)."""
    probability = getattr(module, "dropout", None)
    return isinstance(module, _RANDOM_MODULES) or (isinstance(probability, float) and probability > 0)


def _in_place(captured: CapturedGraph, node: Node) -> bool:
    """Whether ``node`` changes its first operand (``x.add_(y)``, ``F.relu(x, inplace=True)``,
    ``nn.ReLU(inplace=True)``)."""
    if node.op == "call_module":
        return bool(getattr(captured.attributes.get(str(node.target)), "inplace", False))
    return changes_operand(node)


def _flops(captured: CapturedGraph, node: Node) -> int:
    shadow = captured.shadows.get(node)
    return shadow.flops if shadow is not None else 0

"""Group a captured graph's nodes into layers, and build each layer as a module.

**Layers.** The profiler and the partitioners see a chain of layers; a graph's nodes are grouped into
layers by the modules they were recorded in (their *scope*: ``transformer.h.3`` for a GPT block,
``model.layer2.1`` for a ResNet block). Grouping starts from the whole ``forward`` and splits the
heaviest group (by forward FLOPs) into the calls it makes, one level down the module tree, while
there are fewer than ``min_layers`` groups or a splittable group holds more than ``max_share`` of the
FLOPs. Code between module calls that computes nothing by itself (``x + y``, ``view``,
``log_softmax``) joins the group before it. Split points (:func:`~lightning_pipe.capture.pipe_split`)
replace all this: each segment between two of them is a layer.

**Carried values.** A layer takes the tuple of values that cross the cut before it and returns the
tuple that crosses the cut after it: every value computed or received earlier that a later layer (or
the output) uses — skip connections, the targets a loss needs, a position index, a sequence length.
So a cut's cost is everything that crosses it. The first layer takes the tensors of ``forward``'s
call; the last returns ``forward``'s output. Parameters are not carried: each layer reads the ones it
uses from their modules, which the layer holds (the model's own, not copies).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import Node, map_aggregate, map_arg

from lightning_pipe.capture.graph import CapturedGraph
from lightning_pipe.capture.module_attributes import LiveRead
from lightning_pipe.capture.tracer import split_marker
from lightning_pipe.util.nested import unflatten

__all__ = ["GraphLayer", "LayerSpec", "build_layers", "group_nodes", "layer_specs"]

_SKIPPED = ("placeholder", "output", "get_attr")


@dataclass(frozen=True)
class LayerSpec:
    """A layer: the positions of its nodes in the graph, its name, what crosses the cut after it."""

    name: str
    nodes: tuple[int, ...]
    carried: tuple[int, ...]  # positions of the values crossing the cut after the layer ((): the last)


def _path(node: Node, captured: CapturedGraph) -> tuple[str, ...]:
    shadow = captured.shadows.get(node)
    scope = shadow.scope if shadow is not None else ()
    return (*scope, str(node.target)) if node.op == "call_module" else scope


def group_nodes(captured: CapturedGraph, min_layers: int, max_share: float) -> list[tuple[list[Node], int]]:
    """The graph's computing nodes in layers, each with the module depth it was grouped at (see the
    module docstring)."""
    nodes = [n for n in captured.graph.nodes if n.op not in _SKIPPED]
    if any(n.target is split_marker for n in nodes):
        groups: list[list[Node]] = [[]]
        for node in nodes:
            if node.target is split_marker:
                groups.append([])
            else:
                groups[-1].append(node)
        return [(group, 1) for group in groups if group]
    weigh = _weigher(captured, nodes)
    units: list[tuple[list[Node], int]] = [(nodes, 0)]
    total = weigh(nodes) or 1.0
    while True:
        splits = {i: _split(unit, depth, captured) for i, (unit, depth) in enumerate(units)}
        splittable = [i for i, parts in splits.items() if len(parts) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda i: weigh(units[i][0]))
        if len(units) >= min_layers and weigh(units[heaviest][0]) <= max_share * total:
            break
        units[heaviest : heaviest + 1] = splits[heaviest]
    return units


def _weigher(captured: CapturedGraph, nodes: list[Node]) -> Callable[[list[Node]], float]:
    """Weight of a group: its forward FLOPs, or its node count when nothing has FLOPs."""
    flops = {n: _flops(captured, n) for n in nodes}
    if not any(flops.values()):
        return lambda group: float(len(group))
    return lambda group: float(sum(flops[n] for n in group))


def _split(unit: list[Node], depth: int, captured: CapturedGraph) -> list[tuple[list[Node], int]]:
    """``unit`` cut into the runs of nodes recorded under the same module, at the first depth below
    ``depth`` where there are several (light runs joined to their neighbour)."""
    deepest = max(len(_path(n, captured)) for n in unit)
    for level in range(depth + 1, deepest + 1):
        runs: list[list[Node]] = []
        keys: list[tuple[str, ...]] = []
        for node in unit:
            key = _path(node, captured)[:level]
            if runs and keys[-1] == key:
                runs[-1].append(node)
            else:
                runs.append([node])
                keys.append(key)
        merged = _merge_light(runs, captured)
        if len(merged) > 1:
            return [(run, level) for run in merged]
    return [(unit, deepest)]


def _merge_light(runs: list[list[Node]], captured: CapturedGraph) -> list[list[Node]]:
    """Runs that call no module and compute nothing join the run before them (the first, the next)."""
    merged: list[list[Node]] = []
    pending: list[Node] = []
    for run in runs:
        light = all(n.op != "call_module" and not _flops(captured, n) for n in run)
        if light and merged:
            merged[-1].extend(run)
        elif light:
            pending.extend(run)
        else:
            merged.append(pending + run)
            pending = []
    if pending:
        merged.append(pending)
    return merged


def _flops(captured: CapturedGraph, node: Node) -> int:
    shadow = captured.shadows.get(node)
    return shadow.flops if shadow is not None else 0


def _name(group: list[Node], depth: int, captured: CapturedGraph) -> str:
    """The modules a layer calls at its depth (``transformer.h.0``, ``model.conv1+model.bn1``), or its
    first operation's name when it calls none."""
    names: list[str] = []
    for node in group:
        path = _path(node, captured)
        if path and path[min(depth, len(path)) - 1] not in names:
            names.append(path[min(depth, len(path)) - 1])
    if not names:
        return group[0].name
    return "+".join(names[:3]) + ("+..." if len(names) > 3 else "")


def layer_specs(captured: CapturedGraph, grouped: list[tuple[list[Node], int]]) -> list[LayerSpec]:
    """Each group with the values crossing the cut after it."""
    groups = [group for group, _ in grouped]
    order = {node: i for i, node in enumerate(captured.graph.nodes)}
    layer_of = {node: i for i, group in enumerate(groups) for node in group}
    last = len(groups)
    last_use: dict[Node, int] = {}
    for node in captured.graph.nodes:
        if node.op == "get_attr":
            continue
        uses = [layer_of.get(user, last) for user in node.users]
        last_use[node] = max(uses, default=-1)
    specs = []
    for i, group in enumerate(groups):
        crossing = () if i == last - 1 else _crossing(captured, layer_of, last_use, order, i + 1)
        name = _name(group, grouped[i][1], captured)
        specs.append(LayerSpec(name, tuple(order[n] for n in group), crossing))
    return specs


def _crossing(
    captured: CapturedGraph, layer_of: dict[Node, int], last_use: dict[Node, int], order: dict[Node, int], cut: int
) -> tuple[int, ...]:
    """Positions of the values defined before layer ``cut`` and used from it on."""
    return tuple(
        order[node]
        for node in captured.graph.nodes
        if node in last_use and layer_of.get(node, -1) < cut <= last_use[node]
    )


class GraphLayer(nn.Module):
    """One layer of a captured ``forward``: ``forward(carried) -> carried`` (see the module docstring).

    ``training`` chooses the code: the train-mode graph's or the eval-mode graph's (they differ only in
    operands such as a dropout probability). The strategy sets it from the LightningModule's mode
    without touching the submodules' own modes."""

    def __init__(
        self,
        name: str,
        code: fx.GraphModule,
        eval_code: fx.GraphModule | None,
        devices: tuple[int, ...],
        output: Any = None,
    ):
        super().__init__()
        self.pipeline_name = name
        self.code = code
        self.eval_code = eval_code
        self._device_slots = devices
        self._output = output  # the last layer's: forward's output skeleton, its tensors' slots in order

    def forward(self, carried: tuple[Any, ...]) -> Any:
        if self._device_slots:
            carried = self._localised(carried)
        # the generated code's forward itself: the graph module's own __call__ has no hooks to run
        if self.training or self.eval_code is None:
            result = self.code.forward(carried)
        else:
            result = self.eval_code.forward(carried)
        return result if self._output is None else unflatten(self._output, list(result))

    def _localised(self, carried: tuple[Any, ...]) -> tuple[Any, ...]:
        """Devices carried from another rank's stage, as this one's (``idx.device`` read upstream)."""
        here = next((t.device for t in carried if isinstance(t, torch.Tensor)), None)
        if here is None:
            here = next((t.device for t in self.parameters()), None)
        if here is None:
            return carried
        return tuple(here if i in self._device_slots else value for i, value in enumerate(carried))

    def extra_repr(self) -> str:
        return self.pipeline_name


def build_layers(captured: CapturedGraph, specs: list[LayerSpec]) -> list[GraphLayer]:
    """The :class:`GraphLayer` of each spec, over the captured model's own modules and parameters."""
    train_nodes = list(captured.graph.nodes)
    eval_nodes = list(captured.eval_graph.nodes)
    placeholders = tuple(i for i, n in enumerate(train_nodes) if n.op == "placeholder")
    output = next(i for i, n in enumerate(train_nodes) if n.op == "output")
    same = captured.same_in_eval
    layers = []
    incoming = placeholders
    for spec in specs:
        code = _code(train_nodes, spec, incoming, output, captured.attributes)
        eval_code = None if same else _code(eval_nodes, spec, incoming, output, captured.attributes)
        devices = tuple(
            slot
            for slot, position in enumerate(incoming)
            if isinstance(getattr(captured.shadows.get(train_nodes[position]), "value", None), torch.device)
        )
        structure = captured.output if not spec.carried else None
        layers.append(GraphLayer(spec.name, code, eval_code, devices, structure))
        incoming = spec.carried
    return layers


def _read_live(graph: fx.Graph, node: Node) -> None:
    """``node``'s :class:`~lightning_pipe.capture.tracer.LiveRead` operands read from their module
    (``getattr``) just before it runs."""
    reads: dict[LiveRead, Node] = {}

    def read(value: Any) -> Any:
        if not isinstance(value, LiveRead):
            return value
        if value not in reads:
            with graph.inserting_before(node):
                reads[value] = graph.call_function(getattr, (graph.get_attr(value.target), value.name))
        return reads[value]

    node.args, node.kwargs = map_aggregate(node.args, read), map_aggregate(node.kwargs, read)


def _code(
    nodes: list[Node], spec: LayerSpec, incoming: tuple[int, ...], output: int, attributes: dict[str, Any]
) -> fx.GraphModule:
    graph = fx.Graph()
    carried = graph.placeholder("carried")
    env: dict[Node, Node] = {}
    for slot, position in enumerate(incoming):
        env[nodes[position]] = graph.call_function(operator.getitem, (carried, slot))
        env[nodes[position]].name = nodes[position].name

    def remap(node: Node) -> Node:
        if node not in env:
            if node.op != "get_attr":
                raise AssertionError(f"{node.name} is used by a layer but neither carried nor computed in it")
            env[node] = graph.get_attr(str(node.target))
        return env[node]

    for position in spec.nodes:
        node = env[nodes[position]] = graph.node_copy(nodes[position], remap)
        _read_live(graph, node)
    if spec.carried:
        graph.output(tuple(remap(nodes[position]) for position in spec.carried))
    else:
        graph.output(map_arg(nodes[output].args[0], remap))
    used = {str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    return fx.GraphModule({target: attributes[target] for target in used}, graph, class_name="Layer")

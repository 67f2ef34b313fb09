"""Capture a module's ``forward`` as a graph, checked to be the same for every batch size and mode.

:func:`capture_graph` traces ``forward`` on one real micro-batch with the :class:`ShadowTracer`,
and keeps tracing until the graph is one the pipeline can trust:

1. A submodule whose own ``forward`` cannot be traced (a decision on tensor values, an operation a
   proxy cannot go through) becomes a *leaf*: one layer, run as it is. Only a failure in the traced
   root's own code is refused (:class:`UntraceableForward`, with the line and the ways out).
2. The graph is traced again on another number of rows and in eval mode (both on two or three rows:
   a fraction of a forward). Python decisions are baked into a graph,
   so one that depends on the number of rows (``x.view(len(x), -1)``) or on the mode (``if
   self.training:`` around extra operations) would make a graph right for one case only. The first
   node at which the traces differ names the module whose code decided: it becomes a leaf (or, in
   the root's own code, the difference is refused with the line). Operands that differ by mode only
   (``dropout_p=p if self.training else 0``) are kept: the layers run the eval trace's code in eval
   mode.

Tracing runs the model for real (no autograd); the module is left as it was: attributes its code
set while tracing, buffers (batch norm's statistics), training modes and the random number
generators are restored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.fx.node import Node, map_aggregate

from lightning_pipe.capture.module_attributes import Decided, LiveRead
from lightning_pipe.capture.tracer import DataDependent, Shadow, ShadowTracer, TraceFailure
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.nested import flatten, unflatten

__all__ = ["CapturedGraph", "UntraceableForward", "capture_graph", "changes_operand", "signature"]

_MAX_RETRACES = 64


class UntraceableForward(PlanningError):
    """The root's own ``forward`` code cannot be a graph."""


class _DiffersByCase(TraceFailure):
    """``forward`` records other operations (or returns another structure) with another number of rows
    or in the other mode: a Python decision on them."""


@dataclass
class CapturedGraph:
    """A traced ``forward``.

    Attributes:
        root: the traced module.
        graph: the train-mode graph (placeholders: the tensors of the call, in flatten order).
        eval_graph: the eval-mode graph, node for node like ``graph`` (its operands may differ).
        shadows: what the shadow execution saw of each node of ``graph`` (values, FLOPs, scope).
        skeleton: the call's arguments with the tensors taken out (``nested.flatten``): the non-tensor
            arguments the graph was traced with.
        attributes: the objects the graphs' ``get_attr`` and ``call_module`` nodes name.
        leaves: module path -> why it runs whole (a module of torch.nn is not listed).
        decided: module attributes whose values the graph holds (read as constants, or decided on): a
            change to one is caught (:meth:`changed_attributes`); floats computed with are read live.
        read: every module attribute the graphs read, ``(module path, name) -> module`` (decided or live):
            what the step code may change for the layers (:mod:`lightning_pipe.strategy.effects`).
        output: ``forward``'s output with its tensors taken out (:func:`lightning_pipe.util.nested.flatten`):
            the graphs return the tensors, the last layer rebuilds the output's own types from this.
    """

    root: nn.Module
    graph: fx.Graph
    eval_graph: fx.Graph
    shadows: dict[Node, Shadow]
    skeleton: Any
    attributes: dict[str, Any]
    output: Any = ("value", None)
    decided: dict[tuple[str, str], Decided] = field(default_factory=dict)
    read: dict[tuple[str, str], nn.Module] = field(default_factory=dict)
    leaves: dict[str, str] = field(default_factory=dict)

    def changed_attributes(self) -> list[Decided]:
        """The attributes whose values the graph holds that user code has changed since the capture."""
        return [entry for entry in self.decided.values() if entry.changed()]

    @property
    def same_in_eval(self) -> bool:
        return signature(self.graph) == signature(self.eval_graph)


def capture_graph(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: dict[str, str] | None = None
) -> CapturedGraph:
    """Trace ``root.forward(*args, **kwargs)`` (see the module docstring).

    Raises:
        UntraceableForward: the root's own code decides on tensor values, on the number of rows, or
            cannot be traced, with the line and the ways out.
    """
    leaves = dict(leaves or {})
    paths = {module: path for path, module in root.named_modules()}
    rows = _rows((args, kwargs))
    few = 2 if rows != 2 else 3  # the other traces run on few rows: they cost a fraction of a forward
    small = _with_rows(args, kwargs, min(few, rows)) if rows is not None else (args, kwargs)
    other = _with_rows(args, kwargs, few) if rows is not None else None
    for _ in range(_MAX_RETRACES):
        try:
            train = _trace(root, args, kwargs, leaves, paths, training=True, count_flops=True)
            evaluated = _trace(root, *small, leaves, paths, training=False)
            _compare(train, evaluated, "in eval mode", operands=False)
            if other is not None:
                grown = _trace(root, *other, leaves, paths, training=True)
                _compare(train, grown, f"with {few} rows instead of {rows}", operands=True)
        except TraceFailure as failure:
            if not failure.scope or failure.scope in leaves:
                raise _untraceable(failure) from None
            leaves[failure.scope] = str(failure)
            continue
        skeleton, _ = flatten((args, kwargs))
        return CapturedGraph(
            root,
            train.graph,
            evaluated.graph,
            train.shadows,
            skeleton,
            {**evaluated.attributes, **train.attributes},
            train.output,
            {**evaluated.tracer.decided, **train.tracer.decided},
            {**evaluated.tracer.attributes_read, **train.tracer.attributes_read},
            leaves,
        )
    raise PlanningError(f"tracing {type(root).__name__}.forward did not settle after {_MAX_RETRACES} attempts")


class _Traced(NamedTuple):
    """One trace of ``forward``: its graph, the shadows of its nodes, the objects its nodes name, its
    output's skeleton and the tracer (what the traced code read of the modules' attributes)."""

    graph: fx.Graph
    shadows: dict[Node, Shadow]
    attributes: dict[str, Any]
    output: Any
    tracer: ShadowTracer


def _trace(
    root: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: dict[str, str],
    paths: dict[nn.Module, str],
    training: bool,
    count_flops: bool = False,
) -> _Traced:
    ids = {id(module) for module, path in paths.items() if path in leaves}
    tracer = ShadowTracer(ids, count_flops)
    with _untouched(root):
        root.train(training)
        graph = tracer.trace_call(root, args, kwargs)
        _eliminate_dead_code(graph)
        _fold_live_reads(graph, tracer)
        attributes = {
            str(node.target): _resolve(root, str(node.target))
            for node in graph.nodes
            if node.op in ("get_attr", "call_module")
        }
        attributes.update(tracer.live)
    return _Traced(graph, tracer.shadows, attributes, tracer.output_skeleton, tracer)


def _eliminate_dead_code(graph: fx.Graph) -> None:
    """Drop unused operations (what ``forward`` computed and threw away); module calls stay (a module
    may change its state), as do operations with side effects (``x[i] = y``, split points) and those
    that change an operand in place (``p.mul_(2)``, whose result is not needed to be seen)."""
    for node in reversed(graph.nodes):
        computing = node.op in ("call_function", "call_method", "get_attr")
        if computing and not node.users and not node.is_impure() and not changes_operand(node):
            graph.erase_node(node)


def changes_operand(node: Node) -> bool:
    """Whether a function or method call changes its first operand in place: a name ending in one
    underscore (``x.add_(y)``, ``torch.relu_``) or ``inplace=True`` (``F.relu(x, inplace=True)``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True


def _fold_live_reads(graph: fx.Graph, tracer: ShadowTracer) -> None:
    """Each read of a module's float (``getattr`` on a :class:`LiveAttributes` node) becomes a
    :class:`LiveRead` operand of the nodes using it: the layers' code reads it afresh
    (:mod:`.layers`), the graph keeps one node per operation."""
    for node in list(graph.nodes):
        holder = node.args[0] if node.op == "call_function" and node.target is getattr else None
        if not (isinstance(holder, Node) and holder.op == "get_attr" and holder.target in tracer.live):
            continue
        live = LiveRead(str(holder.target), node.args[1], tracer.shadows[node].value)
        for user in list(node.users):
            user.args = map_aggregate(user.args, lambda a, n=node, r=live: r if a is n else a)
            user.kwargs = map_aggregate(user.kwargs, lambda a, n=node, r=live: r if a is n else a)
        graph.erase_node(node)
        tracer.shadows.pop(node, None)
        if not holder.users:
            graph.erase_node(holder)
            tracer.shadows.pop(holder, None)


def _resolve(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


@contextmanager
def _untouched(root: nn.Module) -> Iterator[None]:
    """Restore what tracing may change: module attributes, buffers, modes, random state."""
    modules = list(root.modules())
    saved = [(module, dict(module.__dict__)) for module in modules]
    buffers = [(buffer, buffer.detach().clone()) for buffer in root.buffers()]
    devices = sorted({b.device for b, _ in buffers if b.device.type != "cpu"} | _param_devices(root), key=str)
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type=_device_type(devices)))
        try:
            yield
        finally:
            for module, attributes in saved:
                module.__dict__.clear()
                module.__dict__.update(attributes)
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)


def _param_devices(root: nn.Module) -> set[torch.device]:
    return {p.device for p in root.parameters() if p.device.type not in ("cpu", "meta")}


def _device_type(devices: list[torch.device]) -> str:
    return devices[0].type if devices else "cuda"


def _with_rows(args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call with ``count`` rows in every tensor that has the batch's rows (its first rows, repeated
    when there are fewer)."""
    rows = _rows((args, kwargs))
    skeleton, found = flatten((args, kwargs))
    index = torch.arange(count) % rows if rows else None
    resized = [t[index.to(t.device)] if t.dim() and t.shape[0] == rows else t for t in found]
    new_args, new_kwargs = unflatten(skeleton, resized)
    return tuple(new_args), dict(new_kwargs)


def _rows(call: Any) -> int | None:
    first = next((t for t in flatten(call)[1] if t.dim()), None)
    return None if first is None else first.shape[0]


def signature(graph: fx.Graph, operands: bool = True) -> list[tuple[Any, ...]]:
    """A comparable form of ``graph``: each node's kind, target and (with ``operands``) arguments,
    other nodes named by position."""
    index = {node: i for i, node in enumerate(graph.nodes)}

    def operand(value: Any) -> Any:
        if isinstance(value, Node):
            return ("node", index[value])
        if isinstance(value, torch.device):
            return ("device", value.type)
        return value if operands else None

    rows = []
    for node in graph.nodes:
        shape = map_aggregate((node.args, node.kwargs), operand)
        target = (
            node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
        )
        rows.append((node.op, target, shape))  # operands compared by ==: 0 and 0.0 agree
    return rows


def _compare(
    reference: _Traced,
    other: _Traced,
    how: str,
    operands: bool,
) -> None:
    """Raise a :class:`TraceFailure` at the first node where ``other`` differs from ``reference``."""
    first, second = signature(reference.graph, operands), signature(other.graph, operands)
    if first == second:
        if not _same(reference.output, other.output):
            raise _DiffersByCase(f"forward returns another structure {how}", "", "its return statement")
        return
    position = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first), len(second))
    )
    nodes = list(reference.graph.nodes)
    node = nodes[min(position, len(nodes) - 1)]
    shadow = reference.shadows.get(node) or other.shadows.get(list(other.graph.nodes)[min(position, len(second) - 1)])
    scope = shadow.scope[-1] if shadow is not None and shadow.scope else ""
    line = shadow.line if shadow is not None else ""
    raise _DiffersByCase(f"forward records other operations {how} from {line or 'its start'}", scope, line)


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for two output skeletons, ``False`` where a constant in them cannot say."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _untraceable(failure: TraceFailure) -> UntraceableForward:
    where = f"in {failure.scope}.forward" if failure.scope else "in forward"
    if isinstance(failure, DataDependent | _DiffersByCase):
        why = (
            "A graph holds every operation of forward, so forward may only decide on shapes, not on tensor values, "
            "the number of rows or the mode."
        )
    elif "argument of type" in str(failure):
        why = (
            "forward hands an object of that type to an operation or returns it, and a graph (and a message between "
            "stages) carries tensors, shapes and Python constants only; a cache or state object made in forward can "
            "be turned off while training (transformers: use_cache=False)."
        )
    else:
        why = "torch.fx cannot record that operation."
    return UntraceableForward(
        f"the pipeline cannot capture forward as a graph: {failure} ({where}, at {failure.line}). {why} Two ways "
        "out: move that code into a submodule of its own (a submodule whose forward cannot be traced runs whole, as "
        "one layer; mark where stages may split with lightning_pipe.pipe_split()), or define "
        "configure_pipeline(self) returning the ordered layers whose chain computes forward"
    )

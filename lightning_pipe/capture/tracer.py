"""Trace a module's ``forward`` into a ``torch.fx`` graph while running it for real.

:class:`ShadowTracer` is ``torch.fx``'s symbolic tracer with one addition: every node it records is
also executed on the real values of its inputs (the *shadow* execution, on one real micro-batch, no
autograd). So the Python code of ``forward`` can look at what symbolic tracing alone cannot:

- **shapes**: ``b, t = idx.size()``, ``len(x)``, ``if x.dim() == 3``, ``range(n_layers)`` work;
  the graph keeps ``size()`` calls symbolic where the code passes them on as values, and Python
  decisions taken on them are *baked* into the graph (:mod:`.capture` checks that they do not depend
  on the number of rows by tracing twice);
- **data**: a decision on tensor *values* (``if x.sum() > 0``, ``.item()`` in a condition,
  ``torch.equal``) cannot be a graph: it raises :class:`DataDependent`, naming the line.

Each node also records its forward FLOPs (``torch.utils.flop_counter``) and the real value, for the
layer grouping and the sizes of what crosses each cut.

Modules are *leaves* (one ``call_module`` node, run as they are at training time) when they are
``torch.nn`` building blocks (as ``torch.fx`` decides), carry hooks, or are named in ``leaves``; the
caller (:func:`~lightning_pipe.capture.capture`) turns any module whose own ``forward`` cannot be
traced into a leaf and traces again.
"""

from __future__ import annotations

import builtins
import inspect
import linecache
import operator
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx import _symbolic_trace
from torch.fx.node import Node, has_side_effect, map_aggregate
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe.errors import PlanningError
from lightning_pipe.nested import flatten, map_tensors, unflatten

__all__ = [
    "DataDependent",
    "ForwardFailed",
    "ShadowTracer",
    "TraceFailure",
    "pipe_split",
    "source_line",
    "split_marker",
]

# reading these from a tensor gives its metadata, not its values (deciding on them is not data-dependent)
_METADATA = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "shape",
        "ndim",
        "dtype",
        "device",
        "is_cuda",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "requires_grad",
        "layout",
        "get_device",
        "is_sparse",
    }
)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# torch.nn modules made of layers whose forward traces well: their layers become the graph's
_TRACED_TORCH_MODULES = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_ACTIVE: list[ShadowTracer] = []


def pipe_split() -> None:
    """Mark a stage boundary in ``forward`` (as ``torch.distributed.pipelining.pipe_split``).

    Outside tracing it does nothing. When ``forward`` holds split points, the code between two of them
    is one layer of the plan (the partitioner then groups these layers into stages; with as many
    segments as stages, each segment is a stage)."""
    if _ACTIVE:
        _ACTIVE[-1].split_point()


def source_line(frames: Iterable[tuple[str, int]] | None = None) -> str:
    """``file:line: code`` of the innermost user frame (not torch's, not this package's) among
    ``frames`` (``(file, line)``, innermost first; default: the caller's stack)."""
    for filename, lineno in frames if frames is not None else _stack():
        if _is_user(filename):
            code = linecache.getline(filename, lineno).strip()
            return f"{filename}:{lineno}: {code}"
    return "an unknown line"


def _stack() -> Iterator[tuple[str, int]]:
    frame = sys._getframe(1)
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


_USER: dict[str, bool] = {}


def _is_user(filename: str) -> bool:
    known = _USER.get(filename)
    if known is None:
        path = os.path.abspath(filename)
        known = _USER[filename] = not (path.startswith(_TORCH) or path.startswith(_HERE) or filename.startswith("<"))
    return known


class TraceFailure(PlanningError):
    """Tracing stopped inside the ``forward`` of module ``scope`` (``""``: the traced root)."""

    def __init__(self, message: str, scope: str, line: str) -> None:
        super().__init__(message)
        self.scope, self.line = scope, line


class ForwardFailed(PlanningError):
    """``forward`` itself fails on the sample micro-batch (not a tracing problem)."""


class DataDependent(TraceFailure):
    """A Python decision on tensor values (not shapes): a graph cannot represent it."""


@dataclass
class Shadow:
    """What the shadow execution learnt of one node."""

    value: Any
    flops: int = 0
    tainted: bool = False  # derived from tensor values by Python (``.item()``, ``torch.equal``)
    scope: tuple[str, ...] = ()  # the traced modules the node was recorded in, outermost first
    line: str = ""


class _ShadowProxy(fx.Proxy):
    """A proxy that answers Python's questions from its node's real value."""

    def __len__(self) -> int:
        return len(self.tracer.concrete(self, "len()"))

    def __index__(self) -> int:
        return operator.index(self.tracer.concrete(self, "an index"))

    def __int__(self) -> int:
        return int(self.tracer.concrete(self, "int()"))

    def __float__(self) -> float:
        return float(self.tracer.concrete(self, "float()"))

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


@dataclass
class _Call:
    """The captured call of ``forward``: its arguments' skeleton, the tensors in it in order."""

    skeleton: Any
    tensors: list[torch.Tensor]
    names: list[str] = field(default_factory=list)


class ShadowTracer(fx.Tracer):
    """``torch.fx.Tracer`` that runs every node on real values (see the module docstring).

    Args:
        leaves: modules to keep whole (by identity), besides ``torch.nn``'s building blocks.
        count_flops: record each node's forward FLOPs (``torch.utils.flop_counter``; the dispatch mode
            slows the shadow execution down).
    """

    def __init__(self, leaves: set[int] | None = None, count_flops: bool = True) -> None:
        super().__init__(param_shapes_constant=True)
        self.record_stack_traces = False
        self.leaves = leaves or set()
        self.shadows: dict[Node, Shadow] = {}
        self.scope_stack: list[str] = []
        self._placeholder_values: list[torch.Tensor] = []
        self._counter: FlopCounterMode | None = None
        self._count_flops = count_flops

    # -- what is a leaf -------------------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.leaves or m._forward_hooks or m._forward_pre_hooks:
            return True
        if isinstance(m, _CONTAINERS + _TRACED_TORCH_MODULES):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        self.scope_stack.append(path)
        try:
            result = super().call_module(m, forward, args, kwargs)
        except (TraceFailure, ForwardFailed):
            raise
        except Exception as error:
            raise self._failure(error) from error
        self.scope_stack.pop()
        return result

    def _failure(self, error: Exception) -> TraceFailure:
        frames = [(frame.filename, frame.lineno) for frame in inspect.trace()[::-1]]
        line = source_line(frames)
        scope = self.scope_stack[-1] if self.scope_stack else ""
        return TraceFailure(f"{type(error).__name__}: {error}", scope, line)

    # -- the call ---------------------------------------------------------------------------------
    def trace_call(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Graph:
        """Trace ``root.forward(*args, **kwargs)``: its tensors become the graph's placeholders (in
        the order of :func:`lightning_pipe.nested.flatten`), everything else is taken as given."""
        skeleton, found = flatten((args, kwargs))
        self._call = _Call(skeleton, found, _placeholder_names(root, args, kwargs, len(found)))
        _ACTIVE.append(self)
        try:
            counting = FlopCounterMode(display=False) if self._count_flops else nullcontext()
            with torch.no_grad(), _factories_traced(), _masks_traced(), counting as self._counter:
                try:
                    return self.trace(root)
                except (TraceFailure, ForwardFailed):
                    raise
                except Exception as error:
                    raise self._failure(error) from error
        finally:
            _ACTIVE.pop()
            self._counter = None
            for shadow in self.shadows.values():  # the proxies still alive at the end: the graph keeps shapes
                _keep_shape_only(shadow)

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None) -> Any:
        call = self._call
        placeholders = [self.create_proxy("placeholder", name, (), {}) for name in call.names]

        def forward(module: nn.Module, *tensors: Any) -> Any:
            args, kwargs = unflatten(call.skeleton, list(tensors))
            return root_fn(module, *args, **kwargs)

        forward.__annotations__ = {}
        return forward, [self.root, *placeholders]

    # -- every node, run for real -------------------------------------------------------------
    def proxy(self, node: Node) -> fx.Proxy:
        return _ShadowProxy(node, self)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Callable[[Node], fx.Proxy] | None = None,
    ) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind == "output":
            return proxy
        inputs = [self.shadows[a.node] for a in _proxies((args, kwargs))]
        shadow = Shadow(None, scope=tuple(self.scope_stack), line=source_line() if kind != "placeholder" else "")
        if kind == "placeholder":
            shadow.value = self._call.tensors[len(self._placeholder_values)]
            self._placeholder_values.append(shadow.value)
        else:
            before = self._counter.get_total_flops() if self._counter is not None else 0
            # a module's forward and an attribute read must not meet the tracer's patches of nn.Module;
            # torch's functions and tensor methods on real tensors go through them untouched
            patched = kind in ("call_module", "get_attr")
            with _symbolic_trace._maybe_revert_all_patches() if patched else nullcontext():
                try:
                    shadow.value = self._run(kind, target, _values(args, self), _values(kwargs, self))
                except Exception as error:
                    raise ForwardFailed(
                        f"forward fails on the first micro-batch at {shadow.line}: {type(error).__name__}: {error}"
                    ) from error
            shadow.flops = (self._counter.get_total_flops() if self._counter is not None else 0) - before
            shadow.tainted = any(s.tainted for s in inputs) or _reads_values(kind, target, inputs, shadow.value)
        self.shadows[proxy.node] = shadow
        if kind != "placeholder":
            weakref.finalize(proxy, _keep_shape_only, shadow).atexit = False
        return proxy

    def _run(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        if kind == "get_attr":
            return _attribute(self.root, target)
        if kind == "call_module":
            return self.root.get_submodule(target)(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    def concrete(self, proxy: fx.Proxy, use: str) -> Any:
        """The real value behind ``proxy``, for a Python decision (refused when it reads tensor values)."""
        shadow = self.shadows[proxy.node]
        if shadow.tainted or (isinstance(shadow.value, torch.Tensor) and use in ("a condition", "int()", "float()")):
            line = source_line()
            raise DataDependent(
                f"forward takes a Python decision on tensor values ({use}) at {line}", self._scope(), line
            )
        return shadow.value

    def _scope(self) -> str:
        return self.scope_stack[-1] if self.scope_stack else ""

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(self.concrete(obj, "a condition"))

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = self.concrete(obj, "iteration")
        return iter([obj[i] for i in range(len(value))])

    def keys(self, obj: fx.Proxy) -> Any:
        return self.concrete(obj, "keys()").keys()

    def split_point(self) -> None:
        """A :func:`pipe_split` call while tracing: a marker node (the layers are cut there)."""
        node = self.create_node("call_function", split_marker, (), {}, name="pipe_split")
        self.shadows[node] = Shadow(None, scope=tuple(self.scope_stack))


# torch's factories parse their sizes before any ``__torch_function__``: ``torch.ones(t, t)`` with
# traced sizes is recorded through these wrappers instead
_FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "eye", "tensor", "as_tensor")


@contextmanager
def _factories_traced() -> Iterator[None]:
    originals = {name: getattr(torch, name) for name in _FACTORIES}

    def wrapped(function: Callable[..., Any]) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if _ACTIVE and _proxies((args, kwargs)):
                return _ACTIVE[-1].create_proxy("call_function", function, args, kwargs)
            return function(*args, **kwargs)

        return factory

    for name, function in originals.items():
        setattr(torch, name, wrapped(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)


@contextmanager
def _masks_traced() -> Iterator[None]:
    """``F._none_or_dtype``, with which ``nn.TransformerEncoderLayer`` and its kin check their masks,
    refuses anything but a tensor: a traced mask answers with its dtype, as the tensor would."""
    original = F._none_or_dtype
    F._none_or_dtype = lambda mask: mask.dtype if isinstance(mask, fx.Proxy) else original(mask)
    try:
        yield
    finally:
        F._none_or_dtype = original


@has_side_effect
def split_marker() -> None:
    """The target of a split point's node (layers are cut there: it never runs)."""


def _keep_shape_only(shadow: Shadow) -> None:
    """Called when the last proxy of a node is gone: no later operation can read its value any more,
    so the shadow keeps its shape, type and size only (on the meta device). The shadow execution then
    holds what the untraced forward would, not every value it computed."""
    shadow.value = map_tensors(_on_meta, shadow.value)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("meta")


def _proxies(obj: Any) -> list[fx.Proxy]:
    found: list[fx.Proxy] = []
    map_aggregate(obj, lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return found


def _values(obj: Any, tracer: ShadowTracer) -> Any:
    return map_aggregate(obj, lambda a: tracer.shadows[a.node].value if isinstance(a, fx.Proxy) else a)


def _attribute(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _reads_values(kind: str, target: Any, inputs: list[Shadow], value: Any) -> bool:
    """Whether a node turns tensor values into a Python value (``.item()``, ``torch.equal``), as
    opposed to reading a tensor's metadata (``size()``, ``.shape``, ``.device``)."""
    if isinstance(value, torch.Tensor | torch.Size | torch.dtype | torch.device) or value is None:
        return False
    parts = value if isinstance(value, tuple | list) else ()
    if any(isinstance(v, torch.Tensor) for v in parts) and all(isinstance(v, torch.Tensor | None) for v in parts):
        return False  # tensors still (x.split(n), attention's (output, None)): no value has left them
    if not any(isinstance(s.value, torch.Tensor) for s in inputs):
        return False
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target is builtins.getattr:
        return False  # an attribute read (x.shape, x.dtype): the attribute's name is an argument
    return name not in _METADATA


def _placeholder_names(root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> list[str]:
    """Names for the placeholders, from ``forward``'s parameters (``idx``, ``targets``, ``batch_1``)."""
    try:
        bound = inspect.signature(root.forward).bind(*args, **kwargs)
        names = []
        for name, value in bound.arguments.items():
            found = len(flatten(value)[1])
            names += [name] if found == 1 else [f"{name}_{i}" for i in range(found)]
    except TypeError:
        names = []
    return names if len(names) == count else [f"input_{i}" for i in range(count)]

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
import dis
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
from torch.fx.node import Node, has_side_effect, map_aggregate
from torch.fx.proxy import ParameterProxy
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe.capture.module_attributes import Decided, LiveAttributes
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.nested import flatten, map_tensors, unflatten

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
        inside = (_TORCH + os.sep, _HERE + os.sep)  # the separator: torchvision's files are the user's, not torch's
        known = _USER[filename] = not (path.startswith(inside) or filename.startswith("<"))
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
    origin: str = ""  # where those values were read (the line of the first node that read them)
    attributes: frozenset[tuple[str, str]] = frozenset()  # the module attributes (path, name) it derives from
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

    def __iter__(self) -> Iterator[fx.Proxy]:
        """Its parts, as many as its real value has (``a, b = proxy``; torch.fx disassembles the caller's
        bytecode at every unpacking to count them). A value read out of a tensor, whose length must
        not decide, is counted from the unpacking as torch.fx does."""
        shadow = self.tracer.shadows.get(self.node)
        if shadow is not None and not shadow.tainted:
            return self.tracer.iter(self)
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is not None:
            unpacking = next((i for i in dis.get_instructions(caller.f_code) if i.offset == caller.f_lasti), None)
            if unpacking is not None and unpacking.opname == "UNPACK_SEQUENCE":
                return iter([self[i] for i in range(unpacking.argval)])
        return self.tracer.iter(self)


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
        self.output_skeleton: Any = None  # ``forward``'s output with its tensors taken out (nested.flatten)
        self.live: dict[str, LiveAttributes] = {}  # get_attr target -> the module whose floats a node reads
        self.decided: dict[tuple[str, str], Decided] = {}  # attributes whose values the graph holds
        self.read_live: dict[tuple[str, str], nn.Module] = {}  # floats the layers read when they run
        self.written: set[tuple[int, str]] = set()  # (id(module), name) the traced code assigned
        self._paths: dict[int, str] = {}
        self._parameters: dict[int, str] = {}  # id(parameter) -> its name in the traced module
        self._real = False  # a node runs on real values: the patched nn.Module hands over its own results

    # -- what is a leaf -------------------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.leaves or m._forward_hooks or m._forward_pre_hooks:
            return True
        if isinstance(m, _CONTAINERS + _TRACED_TORCH_MODULES):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
        if self._real:  # a node's module running on real values (:meth:`_run`)
            return forward(*args, **kwargs)
        path = self._installed_path(m)
        if path is None:  # made by forward itself (``CrossEntropyLoss()(logits, labels)``): its code is forward's
            return forward(*args, **kwargs)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        self.scope_stack.append(path)
        try:
            with _watched(m):
                result = super().call_module(m, forward, args, kwargs)
        except (TraceFailure, ForwardFailed):
            raise
        except Exception as error:
            raise self._failure(error) from error
        self.scope_stack.pop()
        return result

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._real:  # read by a node's module running on real values (:meth:`_run`)
            return attr_val
        name = self._parameters.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None:  # not a parameter of the root when the trace began: torch.fx's own search
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        # torch.fx's answer, found by name at once rather than by a walk over every parameter per read
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy(
                "get_attr", name, (), {}, proxy_factory_fn=lambda node: ParameterProxy(self, node, name, attr_val)
            )
        return parameter_proxy_cache[name]

    def attribute_read(self, module: nn.Module, name: str, value: Any) -> Any:
        """``module.name`` read by traced code (a Python scalar of the module's own). A float becomes a
        node that reads it when the layer runs (a gate's scale, a temperature); any other value, or a
        float a Python decision is taken on, is held by the graph as it was: it goes into
        :attr:`decided`, so that a later change is caught (:func:`changed_attributes`)."""
        path = self._paths.get(id(module))
        if path is None or self._real:  # a node's module reads it when it runs, every time
            return value
        if (id(module), name) in self.written:  # forward's own value, which it sets on every call
            return value
        if type(value) is not float:
            self._hold(module, path, name, value)
            return value
        self.read_live[(path, name)] = module
        target = "live_attributes_" + (path.replace(".", "_") if path else "root")
        self.live.setdefault(target, LiveAttributes(module))
        holder = self.create_proxy("get_attr", target, (), {})
        proxy = self.create_proxy("call_function", getattr, (holder, name), {})
        self.shadows[proxy.node].attributes = frozenset({(path, name)})
        return proxy

    def _installed_path(self, m: nn.Module) -> str | None:
        """``m``'s path in the traced module, ``None`` for a module that ``forward`` creates on every call
        (traced through as its code; refused when it holds parameters or buffers, which every call
        would create anew, so no update could train them)."""
        try:
            return self.path_of_module(m)
        except NameError:
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                line = source_line()
                raise TraceFailure(
                    f"forward creates a {type(m).__name__} holding parameters or buffers at {line}: create it in "
                    "__init__, so that it is trained and saved",
                    self._scope(),
                    line,
                ) from None
            return None

    def _failure(self, error: Exception) -> TraceFailure:
        frames = [(frame.filename, frame.lineno) for frame in inspect.trace()[::-1]]
        line = source_line(frames)
        scope = self.scope_stack[-1] if self.scope_stack else ""
        return TraceFailure(f"{type(error).__name__}: {error}", scope, line)

    # -- the call ---------------------------------------------------------------------------------
    def trace_call(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Graph:
        """Trace ``root.forward(*args, **kwargs)``: its tensors become the graph's placeholders (in
        the order of :func:`lightning_pipe.util.nested.flatten`), everything else is taken as given."""
        skeleton, found = flatten((args, kwargs))
        self._call = _Call(skeleton, found, _placeholder_names(root, args, kwargs, len(found)))
        self._paths = {id(module): path for path, module in root.named_modules()}
        self._parameters = {id(parameter): name for name, parameter in root.named_parameters()}
        _ACTIVE.append(self)
        try:
            counting = FlopCounterMode(display=False) if self._count_flops else nullcontext()
            with torch.no_grad(), _factories_traced(), _masks_traced(), counting as self._counter, _watched(root):
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
            # the graph returns the output's tensors; its structure (a ModelOutput, a dataclass, a dict
            # subclass: types torch.fx would rebuild as plain dicts) is kept apart, to rebuild it
            self.output_skeleton, values = flatten(root_fn(module, *args, **kwargs), leaf=(torch.Tensor, fx.Proxy))
            return tuple(values)

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
            try:
                shadow.value = self._run(kind, target, _values(args, self), _values(kwargs, self))
            except Exception as error:
                raise ForwardFailed(
                    f"forward fails on the first micro-batch at {shadow.line}: {type(error).__name__}: {error}"
                ) from error
            shadow.flops = (self._counter.get_total_flops() if self._counter is not None else 0) - before
            derived = [s.attributes for s in inputs if s.attributes]
            if derived:
                shadow.attributes = frozenset().union(*derived)
            tainted = next((s for s in inputs if s.tainted), None)
            if tainted is not None:
                shadow.tainted, shadow.origin = True, tainted.origin
            elif _reads_values(kind, target, inputs, shadow.value):
                shadow.tainted, shadow.origin = True, shadow.line
        self.shadows[proxy.node] = shadow
        if kind != "placeholder":
            weakref.finalize(proxy, _keep_shape_only, shadow).atexit = False
        return proxy

    def _run(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_function":
            return target(*args, **kwargs)
        # a module's forward and an attribute read pass through the tracer's patches of nn.Module's
        # ``__call__`` and ``__getattr__``: while they run for real, the patches hand over the module's
        # own result (:meth:`call_module`, :meth:`getattr`). Reverting the patches instead would
        # rewrite nn.Module's attributes twice a node, which empties the type caches of every one of
        # its subclasses: half the time of a capture.
        real, self._real = self._real, True
        try:
            if kind == "get_attr":
                return self.live[target] if target in self.live else _attribute(self.root, target)
            return self.root.get_submodule(target)(*args, **kwargs)
        finally:
            self._real = real

    def concrete(self, proxy: fx.Proxy, use: str) -> Any:
        """The real value behind ``proxy``, for a Python decision (refused when it reads tensor values)."""
        shadow = self.shadows[proxy.node]
        if shadow.tainted or (isinstance(shadow.value, torch.Tensor) and use in ("a condition", "int()", "float()")):
            line = source_line()
            read = f" (read from tensor values at {shadow.origin})" if shadow.tainted and shadow.origin != line else ""
            raise DataDependent(
                f"forward takes a Python decision on tensor values ({use}) at {line}{read}", self._scope(), line
            )
        for key in shadow.attributes:  # a decision on a module's float: the graph holds its outcome
            module = self.read_live[key]
            self._hold(module, *key, vars(module).get(key[1]))
        return shadow.value

    def attribute_written(self, module: nn.Module, name: str) -> None:
        """``module.name = ...`` in traced code (transformers' Swin sets its window's shift from the
        input's size): what ``forward`` reads of it afterwards is what ``forward`` itself set, on every
        call, so a change made outside ``forward`` is not one the graph misses."""
        if not self._real:
            self.written.add((id(module), name))

    def _hold(self, module: nn.Module, path: str, name: str, value: Any) -> None:
        """Record ``module.name`` (at ``path``) as held by the graph with ``value``, where first held."""
        if (path, name) not in self.decided:
            self.decided[(path, name)] = Decided(module, path, name, value, source_line())

    @property
    def attributes_read(self) -> dict[tuple[str, str], nn.Module]:
        """Every module attribute the traced code read, held or live: ``(path, name) -> module``."""
        return {key: entry.module for key, entry in self.decided.items()} | self.read_live

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


_SCALARS = (bool, int, float, str)
_WATCHING: dict[type, type] = {}  # a class -> its watching subclass
_WATCHERS: set[type] = set()  # the watching subclasses


def _watching_class(cls: type) -> type:
    """A subclass of ``cls`` whose instances report reads of their own Python scalars, and assignments
    to their attributes, to the active tracer (:meth:`ShadowTracer.attribute_read`,
    :meth:`ShadowTracer.attribute_written`); its name is ``cls``'s."""
    watching = _WATCHING.get(cls)
    if watching is None:
        base_get = cls.__getattribute__

        def __getattribute__(self: nn.Module, name: str) -> Any:
            value = base_get(self, name)
            if type(value) in _SCALARS and name != "training" and _ACTIVE and name in base_get(self, "__dict__"):
                return _ACTIVE[-1].attribute_read(self, name, value)
            return value

        base_set = cls.__setattr__

        def __setattr__(self: nn.Module, name: str, value: Any) -> None:
            if _ACTIVE:
                _ACTIVE[-1].attribute_written(self, name)
            base_set(self, name, value)

        namespace = {"__getattribute__": __getattribute__, "__setattr__": __setattr__, "__module__": cls.__module__}
        namespace["__qualname__"] = cls.__qualname__
        watching = _WATCHING[cls] = type(cls.__name__, (cls,), namespace)
        _WATCHERS.add(watching)
    return watching


@contextmanager
def _watched(module: nn.Module) -> Iterator[None]:
    """While tracing ``module``'s own code, its reads of its Python scalars are seen (its class swapped
    for a watching subclass, then restored)."""
    cls = type(module)
    if cls in _WATCHERS:
        yield
        return
    module.__class__ = _watching_class(cls)
    try:
        yield
    finally:
        module.__class__ = cls


# torch's factories parse their sizes before any ``__torch_function__``: ``torch.ones(t, t)`` with
# traced sizes is recorded through these wrappers instead (and ``torch.finfo(x.dtype).min``, whose
# dtype is traced: the masks transformers builds in ``forward``)
_FACTORIES = (
    *("ones", "zeros", "empty", "full", "rand", "randn", "randint", "eye", "tensor", "as_tensor"),
    *("finfo", "iinfo"),
)


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
    if _metadata_or_tensors(value):
        return False
    if not any(isinstance(s.value, torch.Tensor) for s in inputs):
        return False
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target is builtins.getattr:
        return False  # an attribute read (x.shape, x.dtype): the attribute's name is an argument
    return name not in _METADATA


def _metadata_or_tensors(value: Any) -> bool:
    """Whether ``value`` holds tensors and tensor metadata only (``x.split(n)``'s tuple, ``x.size()``, an
    attention's ``(output, None)``):
    what an operation on tensors returns without reading their values into Python."""
    if isinstance(value, torch.Tensor | torch.Size | torch.dtype | torch.device) or value is None:
        return True
    if isinstance(value, tuple | list):
        return all(_metadata_or_tensors(item) for item in value)
    if isinstance(value, dict):
        return all(_metadata_or_tensors(item) for item in value.values())
    return False


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

"""Compiled modules: the settings ``torch.compile`` was given, and the original modules it wraps.

A model holds compiled code in one of three ways; the pipeline captures the original modules and
compiles each stage instead (:mod:`lightning_pipe.strategy.compiling`):

- ``self.net = torch.compile(net)``: an ``OptimizedModule`` whose ``_orig_mod`` is ``net`` (the two
  share the parameters; the state-dict keys carry ``_orig_mod.``, and stay so);
- ``net.compile()``: ``net`` itself, its compiled call in ``_compiled_call_impl``;
- ``torch.compile(model)`` of the whole LightningModule: Lightning's Trainer unwraps it (its
  ``from_compiled``), and the strategy takes the original back (``to_uncompiled``) with the settings.

:func:`uncompiled` is the model as its code is written, while ``forward`` is traced and verified:
every ``OptimizedModule`` makes way for its original in its parent (so the layers hold the original
modules, and call them) and every compiled call is set aside. :func:`settings_of` reads what
``torch.compile`` was given (backend, mode, options, dynamic, fullgraph) back from the dynamo context
it made, which an ``OptimizedModule`` keeps as ``dynamo_ctx`` and a compiled call in its closure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext, innermost_backend

__all__ = [
    "CompileSettings",
    "compiled_settings",
    "put_back_calls",
    "set_aside_calls",
    "settings_of",
    "uncompiled",
]

_DEFAULT_BACKEND = "inductor"  # torch.compile's


@dataclass(frozen=True)
class CompileSettings:
    """What ``torch.compile`` is given: its defaults, unless read from a compiled object."""

    backend: str | Callable[..., Any] = _DEFAULT_BACKEND
    mode: str | None = None
    options: Mapping[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False

    def compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` compiled with these settings (lazily: dynamo compiles at the first call)."""
        options = dict(self.options) if self.options is not None else None  # torch.compile pops keys from it
        return torch.compile(
            function,
            backend=self.backend,
            mode=self.mode,
            options=options,
            dynamic=self.dynamic,
            fullgraph=self.fullgraph,
        )

    def __str__(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", self.backend)
        parts = [f"backend={backend!r}"]
        if self.mode is not None:
            parts.append(f"mode={self.mode!r}")
        if self.options:
            parts.append(f"options={dict(self.options)!r}")
        return ", ".join([*parts, f"dynamic={self.dynamic}", f"fullgraph={self.fullgraph}"])


def settings_of(context: Any) -> CompileSettings:
    """The settings of a dynamo context (an ``OptimizedModule``'s ``dynamo_ctx``): ``torch.compile``
    wraps its backend in an object holding the mode (inductor: as the options it stands for), the
    options and ``dynamic``; the context holds ``fullgraph``."""
    backend = innermost_backend(context.callback)
    fullgraph = bool(getattr(context, "fullgraph", False))
    if isinstance(backend, torch._TorchCompileInductorWrapper):
        mode, options = _inductor_mode(backend.config)
        return CompileSettings(_DEFAULT_BACKEND, mode, options, backend.dynamic, fullgraph)
    if isinstance(backend, torch._TorchCompileWrapper):
        name = backend.compiler_name  # a registered backend's name, or a callable's __name__
        chosen = name if _registered(name) is backend.compiler_fn else backend.compiler_fn
        kwargs = backend.kwargs
        return CompileSettings(chosen, kwargs.get("mode"), kwargs.get("options"), backend.dynamic, fullgraph)
    return CompileSettings(backend, dynamic=getattr(context, "_dynamic", None), fullgraph=fullgraph)


def _inductor_mode(config: Mapping[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The inductor mode whose options are ``config`` exactly, or ``config`` as options."""
    for mode, options in torch._inductor.list_mode_options().items():
        if options and options == dict(config):
            return mode, None
    return None, dict(config) or None


def _registered(name: str) -> Callable[..., Any] | None:
    try:
        return lookup_backend(name)
    except Exception:  # not a registered backend's name
        return None


def compiled_settings(root: nn.Module) -> list[tuple[str, CompileSettings | None]]:
    """Each compiled module under ``root`` by path (``root``'s class name for itself), with its
    settings (``None``: a compiled call whose dynamo context is not found)."""
    found: list[tuple[str, CompileSettings | None]] = []
    for path, module in root.named_modules():
        name = path.replace("._orig_mod", "") or type(root).__name__  # the path as the user's code names it
        if isinstance(module, OptimizedModule):
            found.append((name, settings_of(module.dynamo_ctx)))
        call = getattr(module, "_compiled_call_impl", None)
        if call is not None:
            context = _context_of(call)
            found.append((name, settings_of(context) if context is not None else None))
    return found


def _context_of(call: Callable[..., Any]) -> Any:
    """The dynamo context a compiled function was made by (held in its closure), or ``None``."""
    for cell in getattr(call, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def set_aside_calls(root: nn.Module) -> list[tuple[nn.Module, Callable[..., Any]]]:
    """Remove the compiled call of every module under ``root`` compiled in place (``module.compile()``):
    the module runs its own code again. Returns what :func:`put_back_calls` puts back."""
    removed = []
    for module in root.modules():
        call = getattr(module, "_compiled_call_impl", None)
        if call is not None:
            removed.append((module, call))
            module._compiled_call_impl = None
    return removed


def put_back_calls(removed: list[tuple[nn.Module, Callable[..., Any]]]) -> None:
    """Give the modules :func:`set_aside_calls` removed their compiled calls back."""
    for module, call in removed:
        module._compiled_call_impl = call


@contextmanager
def uncompiled(root: nn.Module) -> Iterator[None]:
    """Inside, the modules under ``root`` are the ones its code was written with: each
    ``OptimizedModule`` is replaced by its original in its parent, and no module has a compiled call
    (everything is put back on leaving). The parameters are the same tensors throughout."""
    wrapped = [
        (parent, name, child)
        for parent in root.modules()
        for name, child in parent._modules.items()
        if isinstance(child, OptimizedModule)
    ]
    for parent, name, child in wrapped:
        original = child
        while isinstance(original, OptimizedModule):  # torch.compile of a compiled module
            original = original._orig_mod
        parent._modules[name] = original
    removed = set_aside_calls(root)
    try:
        yield
    finally:
        put_back_calls(removed)
        for parent, name, child in reversed(wrapped):
            parent._modules[name] = child

"""What the step code changes besides its logs, made the same on every rank.

Only the last stage runs the step code to its end, so what it builds — torchmetrics ``Metric``
states (``self.train_acc(preds, y)``, ``self.val_loss.update(loss)``) and lists kept on the module for
the epoch-end hooks (``self.validation_step_outputs.append(loss)``, the pattern Lightning 2
documents) — would exist on that rank only, and an epoch-end hook on another rank would find an empty
metric or list; so would a new value the step code gives an attribute that ``forward`` reads (a gate's
``scale``, a temperature: :func:`watch_attributes`), which the layers on other ranks read when they run.
:func:`recording_effects` records these changes while the step runs on the last stage (the outermost
calls of each metric's ``forward``/``update`` with their arguments; the items appended to each list
attribute of the module; the watched attributes' new values), and :func:`replay` makes them on every
other rank, in order:
every rank then holds the states an unsplit run would hold (as under DDP, where each rank holds its
own). Metric arguments and list items travel detached, on the CPU; they come back on the rank's
device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.util.nested import map_tensors

__all__ = ["Effects", "metric_modules", "recording_effects", "replay", "watch_attributes"]

try:  # a dependency of Lightning's
    from torchmetrics import Metric
except ImportError:  # pragma: no cover
    Metric = None  # type: ignore[assignment,misc]


@dataclass
class Effects:
    """The changes one run of the step code made: metric calls, items appended to list attributes."""

    calls: list[tuple[str, str, Any, Any]] = field(default_factory=list)  # (metric path, method, args, kwargs)
    appended: dict[str, list[Any]] = field(default_factory=dict)
    attributes: dict[tuple[str, str], Any] = field(default_factory=dict)  # (module path, name) -> new value


_WATCHED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], nn.Module]] = weakref.WeakKeyDictionary()


def watch_attributes(module: nn.Module, read: dict[tuple[str, str], nn.Module]) -> None:
    """Record the step code's changes of these attributes of ``module``'s submodules (``(path, name) ->
    submodule``: the ones ``forward``'s captured graph reads)."""
    _WATCHED[module] = dict(read)


_FOUND: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()


def metric_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The torchmetrics ``Metric`` objects of ``module`` by path (looked up once per module: the
    step code runs once per micro-batch)."""
    if Metric is None:
        return {}
    found = _FOUND.get(module)
    if found is None:
        found = _FOUND[module] = {path: m for path, m in module.named_modules() if isinstance(m, Metric)}
    return found


def _portable(obj: Any) -> Any:
    return map_tensors(lambda t: t.detach().cpu(), obj)


@contextmanager
def recording_effects(module: nn.Module, effects: Effects) -> Iterator[None]:
    """Within the context, the metrics of ``module`` and its list attributes record their changes into
    ``effects`` (the changes themselves happen as usual)."""
    metrics = metric_modules(module)
    depth = [0]

    def recorder(path: str, method: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                effects.calls.append((path, method, _portable(args), _portable(kwargs)))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    patched = []
    for path, metric in metrics.items():
        for method in ("forward", "update"):
            had = method in vars(metric)
            patched.append((metric, method, had, vars(metric).get(method)))
            setattr(metric, method, recorder(path, method, getattr(metric, method)))
    lengths = {name: len(value) for name, value in vars(module).items() if isinstance(value, list)}
    watched = _WATCHED.get(module, {})
    before = {key: vars(owner).get(key[1]) for key, owner in watched.items()}
    try:
        yield
    finally:
        for key, owner in watched.items():
            value = vars(owner).get(key[1])
            if value is not before[key] and value != before[key]:
                effects.attributes[key] = value
        for metric, method, had, previous in reversed(patched):
            if had:
                setattr(metric, method, previous)
            else:
                delattr(metric, method)
        for name, length in lengths.items():
            value = vars(module).get(name)
            if isinstance(value, list) and len(value) > length:
                effects.appended[name] = [_portable(item) for item in value[length:]]


def replay(module: nn.Module, effects: Effects, device: torch.device) -> None:
    """Make the changes ``effects`` recorded on another rank (metric calls, list items) on ``module``."""
    metrics = metric_modules(module)
    local = (lambda obj: map_tensors(lambda t: t.to(device), obj)) if device.type != "cpu" else (lambda obj: obj)
    with torch.no_grad():
        for path, method, args, kwargs in effects.calls:
            getattr(metrics[path], method)(*local(args), **local(kwargs))
    for (path, name), value in effects.attributes.items():
        setattr(module.get_submodule(path), name, value)
    for name, items in effects.appended.items():
        value = vars(module).get(name)
        if isinstance(value, list):
            value.extend(local(item) for item in items)

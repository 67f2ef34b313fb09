"""``self.log`` from a pipeline's last stage.

The step code runs once per micro-batch on the last stage, so each ``self.log`` call is recorded
(:func:`recording`) instead of reaching Lightning, and the micro-batches' values of a step are
combined into what the unsplit step would have logged (:func:`combine`): the mean weighted by
rows for ``reduce_fx="mean"`` (a per-batch mean of a per-sample quantity, e.g. a loss or an
accuracy, comes out exact), the sum, maximum or minimum otherwise. An explicit ``batch_size`` is
summed. Every rank then calls the real ``self.log`` with the combined values, so the loggers and the
progress bar on rank 0 and the callbacks on every rank (checkpoint monitors, early stopping) see them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_pipe.errors import PipelineRuntimeError
from lightning_pipe.strategy.effects import Effects, metric_modules, recording_effects

__all__ = ["Record", "combine", "logged_metrics", "recording"]

_SIGNATURE = inspect.signature(LightningModule.log)
_CALL = ("self", "name", "value")  # what self.log is called with; the other parameters are its options
_OPTIONS = {key: p.default for key, p in _SIGNATURE.parameters.items() if key not in _CALL}
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class Record:
    """What one run of the step code logged and changed: its ``self.log`` calls of numbers, of
    torchmetrics ``Metric`` objects (by path: Lightning computes them at the epoch's end, from the
    states :mod:`.effects` keeps alike on every rank), and its other :class:`~.effects.Effects`."""

    rows: int
    calls: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    metrics: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    effects: Effects = field(default_factory=Effects)
    extras: dict[str, Any] | None = None  # keys other than "loss" of the dict training_step returned


def _number(name: str, value: Any) -> float:
    """A logged value as a number (a torchmetrics ``Metric`` is taken apart, by :func:`recording`)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise PipelineRuntimeError(
        f"self.log({name!r}, {type(value).__name__}): under a pipeline each micro-batch logs separately and the "
        "values are combined, so log a number, a one-element tensor or a torchmetrics Metric"
    )


def _reduction(name: str, reduce_fx: Any) -> str:
    key = _TORCH_REDUCTIONS.get(reduce_fx) if callable(reduce_fx) else _REDUCTIONS.get(str(reduce_fx).lower())
    if key is None:
        raise PipelineRuntimeError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): a pipeline combines micro-batches with mean, sum, max or min"
        )
    return key


@contextmanager
def recording(module: LightningModule, record: Record) -> Iterator[None]:
    """Within the context, ``module.log`` (and ``log_dict``, which calls it) appends to ``record``, and
    the step's other effects (:mod:`.effects`) are recorded too."""
    paths = {id(metric): path for path, metric in metric_modules(module).items()}

    def log(*args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and kwargs.keys() <= _OPTIONS.keys():  # the usual call, without binding (~40 us)
            (name, value), options = args, {**_OPTIONS, **kwargs}
        else:
            bound = _SIGNATURE.bind(module, *args, **kwargs)
            bound.apply_defaults()
            options = {k: v for k, v in bound.arguments.items() if k not in _CALL}
            name, value = bound.arguments["name"], bound.arguments["value"]
        if id(value) in paths:
            record.metrics.append((name, paths[id(value)], options))
            return
        _reduction(name, options["reduce_fx"])
        record.calls.append((name, _number(name, value), options))

    module.log = log
    try:
        with recording_effects(module, record.effects):
            yield
    finally:
        del module.log


def logged_metrics(records: list[Record]) -> list[tuple[str, str, dict[str, Any]]]:
    """The ``Metric`` objects the records logged, once per name, in the order first logged."""
    seen: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for record in records:
        for name, path, options in record.metrics:
            seen.setdefault(name, (name, path, options))
    return list(seen.values())


def combine(records: list[Record]) -> list[tuple[str, float, dict[str, Any]]]:
    """One ``(name, value, options)`` per logged name, the micro-batches of a step combined, in the
    order the names were first logged."""
    total_rows = sum(record.rows for record in records)
    values: dict[str, list[tuple[int, float]]] = {}
    options: dict[str, dict[str, Any]] = {}
    batch_sizes: dict[str, int] = {}
    for record in records:
        for name, value, opts in record.calls:
            values.setdefault(name, []).append((record.rows, value))
            options.setdefault(name, opts)
            if opts.get("batch_size") is not None:
                batch_sizes[name] = batch_sizes.get(name, 0) + int(opts["batch_size"])
    combined = []
    for name, pairs in values.items():
        how = _reduction(name, options[name]["reduce_fx"])
        numbers = [value for _, value in pairs]
        if how == "mean":
            rows = sum(r for r, _ in pairs)
            value = math.fsum(r * v for r, v in pairs) / (rows or total_rows or 1)
        elif how == "sum":
            value = math.fsum(numbers)
        else:
            value = max(numbers) if how == "max" else min(numbers)
        opts = dict(options[name])
        if name in batch_sizes:
            opts["batch_size"] = batch_sizes[name]
        combined.append((name, value, opts))
    return combined

"""Lightning's hooks that read a step's gradients before its update, ``on_after_backward`` and
``on_before_optimizer_step``, under a pipeline.

Plain Lightning runs them between the backward and the optimizer's step, with every gradient in the
parameters' ``.grad``. A pipeline step runs forward, backward and each stage's update inside the
strategy's closure, each rank for its own stages. Where the module or a callback overrides one of
them (:func:`gradient_hooks`), a flushing schedule *holds* its updates past the call
(:attr:`~lightning_pipe.runtime.updates.Updates.hold`): the hooks then run on every rank with the
gradients of its stages in place (summed over the micro-batches, replicas and tied copies, and
unscaled), what they change in them is what the updates apply, and the updates follow. A
non-flushing schedule has no moment that holds one step's gradients: it is refused
(:mod:`.refusals`).

What the hooks log is gathered from the pipeline's ranks and logged on every rank
(:func:`merged`), so the loggers on rank 0 see every stage's: a name one rank logs (a parameter's
gradient norm from ``lightning.pytorch.utilities.grad_norm``) as it is, one several ranks log
combined: ``grad_norm``'s total as the p-norm of the ranks' totals (the whole model's norm), any
other by its ``reduce_fx``.

:class:`GradientHooks` holds the strategy's part (one of the parts its class is assembled from).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pipe.strategy.effects import metric_modules
from lightning_pipe.strategy.logs import Record, combine, logged_metrics, recording

if TYPE_CHECKING:  # annotations only: the class differs under the standalone pytorch_lightning
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["GRADIENT_HOOKS", "GradientHooks", "gradient_hooks", "lightning_class", "merged"]

GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
"""Lightning's hooks that read a step's gradients before the optimizer applies them."""

_PACKAGES = ("lightning", "pytorch_lightning")
_NORM_TOTAL = re.compile(r"grad_(.+)_norm_total$")  # lightning.pytorch.utilities.grad_norm's total


def gradient_hooks(module: LightningModule, trainer: Trainer) -> list[str]:
    """The :data:`GRADIENT_HOOKS` a fit of ``module`` by ``trainer`` runs with code of the user's: the
    module's overrides and its callbacks' (``"LightningModule.on_after_backward"``,
    ``"GradNorm.on_before_optimizer_step"``); none outside a fit."""
    if trainer.state.fn != TrainerFn.FITTING:
        return []
    found = [f"LightningModule.{hook}" for hook in GRADIENT_HOOKS if _overrides(module, "LightningModule", hook)]
    for callback in trainer.callbacks:
        name = type(callback).__name__
        found += [f"{name}.{hook}" for hook in GRADIENT_HOOKS if _overrides(callback, "Callback", hook)]
    return found


def _overrides(instance: object, base: str, hook: str) -> bool:
    """Whether ``instance`` overrides ``hook`` of its Lightning class ``base`` (``LightningModule``,
    ``Callback``) from whichever package it derives from: ``lightning`` and ``pytorch_lightning``
    hold the same code with other docstrings, so the hook of the other package's class differs."""
    parent = lightning_class(instance, base)
    return parent is not None and is_overridden(hook, instance, parent)


def lightning_class(instance: object, name: str) -> type | None:
    """The class named ``name`` of either Lightning package (``lightning``, ``pytorch_lightning``)
    that ``instance`` derives from, if any."""
    return next(
        (cls for cls in type(instance).__mro__ if cls.__name__ == name and cls.__module__.split(".")[0] in _PACKAGES),
        None,
    )


def merged(records: list[Record]) -> list[tuple[str, float, dict[str, Any]]]:
    """What the pipeline's ranks logged in the gradient hooks (one record per rank), one value per
    name in the order first logged: ``grad_norm``'s total (``grad_{p}_norm_total``) logged by several
    ranks as ``(Σ total_r^p)^(1/p)`` (the largest for ``p = inf``: the whole model's, a parameter
    tied across ranks counted on each); any other name as one rank logged it, or as every rank logged
    it alike, or else by its ``reduce_fx`` over the ranks."""
    by_rank = [dict((name, (value, options)) for name, value, options in record.calls) for record in records]
    names = list(dict.fromkeys(name for logged in by_rank for name in logged))
    result = []
    for name in names:
        values = [logged[name][0] for logged in by_rank if name in logged]
        options = next(logged[name][1] for logged in by_rank if name in logged)
        total = _NORM_TOTAL.match(name)
        if total is not None and len(values) > 1:
            p = float(total.group(1))
            value = max(values) if math.isinf(p) else math.fsum(abs(v) ** p for v in values) ** (1 / p)
        elif len(set(values)) == 1:  # one rank's, or the same on every rank that logged it (a learning rate)
            value = values[0]
        else:
            value = combine([Record(1, calls=[(name, v, options)]) for v in values])[0][1]
        result.append((name, value, options))
    return result


class GradientHooks:
    """The strategy's part that runs :data:`GRADIENT_HOOKS` where a schedule holds its updates."""

    _hook_record: Record | None = None  # what the hooks logged on this rank in the running step

    def _holding(self) -> bool:
        """Whether the step that just ran holds its updates for the hooks (a batch that only
        accumulates, or a schedule that does not hold, holds none)."""
        return self.executor is not None and bool(self.executor.updates.deferred)

    @contextlib.contextmanager
    def _gradients_shown(self) -> Iterator[None]:
        """Where the step holds its updates: this rank's gradients in the parameters' ``.grad``
        (:meth:`~lightning_pipe.runtime.updates.Updates.gradients_shown`) and ``self.log`` recorded
        for :meth:`_log_gradient_hooks`; as it was elsewhere."""
        if not self._holding():
            yield
            return
        if self._hook_record is None:
            self._hook_record = Record(1)
        with self.executor.updates.gradients_shown(), recording(self.lightning_module, self._hook_record):
            yield

    def _before_optimizer_step(self, optimizer: Any) -> None:
        """After the closure of a step that holds its updates: ``on_before_optimizer_step`` (callbacks
        first, as Lightning calls it) with the gradients in place, then the updates, then what the
        hooks logged on every rank. Decided by the schedule's ``hold`` alone, the same on every rank
        (Lightning steps the optimizer only after a batch that updates): the logs' gather is a
        collective."""
        if self.executor is None or not self.executor.updates.hold:
            return
        trainer = self.lightning_module.trainer
        with self._gradients_shown():
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self.executor.release_updates()
        record, self._hook_record = self._hook_record, None
        self._log_gradient_hooks(self._gather(record))

    def _log_gradient_hooks(self, records: list[Record]) -> None:
        """Log :func:`merged` ``records`` with Lightning's ``self.log``, as from
        ``on_before_optimizer_step``."""
        module = self.lightning_module
        before, module._current_fx_name = module._current_fx_name, "on_before_optimizer_step"
        try:
            for name, value, options in merged(records):
                module.log(name, torch.tensor(value), **options)
            metrics = metric_modules(module)  # a torchmetrics Metric: each rank's, as Lightning logs it
            for name, path, options in logged_metrics(records):
                module.log(name, metrics[path], **options)
        finally:
            module._current_fx_name = before

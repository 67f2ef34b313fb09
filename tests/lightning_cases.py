"""A LightningModule of the common shape and the workers that train it, for the strategy tests.

:class:`Chain` keeps its network in one ``nn.Sequential`` that ``forward`` calls, logs from every
step and returns the loss, as a user's module would; nothing in it knows about pipelines.
:func:`fit_case` is the worker of :func:`lightning_pipe.runtime.run_local` (torchrun's way: the
processes exist and join the process group before Lightning starts) and :func:`plain_fit` the same
training on one device without the strategy, the oracle of the synchronous schedules.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.cost.allocated import AllocatedPeak

ROWS, FEATURES, CLASSES = 10, 6, 3


class Chain(L.LightningModule):
    """``layers`` Linear+Tanh blocks and a classifier in ``self.net``; SGD with momentum and weight
    decay (as the runtime references) or Adam, optionally a per-step LR scheduler."""

    def __init__(
        self, blocks: int = 3, width: int = 8, optimizer: str = "sgd", scheduler: bool = False, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(FEATURES, width), nn.Tanh()]
        for _ in range(blocks - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, CLASSES))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log_dict({"test_loss": nn.functional.cross_entropy(self(x), y), "test_max": self(x).max()})

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(-1)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=0.01)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        if not self.hparams.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset(batches: int, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * ROWS, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (batches * ROWS,), generator=generator))


def loader(batches: int, seed: int = 1, rows: int = ROWS) -> DataLoader:
    """``batches`` batches of ``ROWS`` rows, in batches of ``rows`` (fewer: the same data cut finer)."""
    return DataLoader(dataset(batches, seed), batch_size=rows)


def batch_list(batches: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches :func:`loader` yields, in order (for the runtime's references)."""
    return [(x, y) for x, y in loader(batches, seed)]


def trainer(root: str | Path, strategy: Any, devices: int, **options: Any) -> L.Trainer:
    settings = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "logger": CSVLogger(root, name="", version=""),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "max_epochs": 1,
    }
    settings.update(options)
    return L.Trainer(**settings)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def final_state(run: L.Trainer, model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained module's full state, on every rank: a pipeline's ranks hold only their stages, so
    it is gathered by the strategy on global rank 0 (as for a checkpoint) and shared by the test."""
    strategy = run.strategy
    if not hasattr(strategy, "stage_plan"):
        return state(model)
    return strategy.broadcast(strategy.full_state_dict())


def held(model: nn.Module) -> set[str]:
    """The state-dict entries this rank holds (the others are on the meta device)."""
    return {name for name, value in model.state_dict().items() if not value.is_meta}


def plain_fit(root: str | Path, case: dict[str, Any]) -> dict[str, Any]:
    """The case trained on one device by Lightning alone: the final state, and what validate, test
    and predict give when the case evaluates."""
    model = Chain(**case.get("model", {}))
    callbacks = [*_callbacks(root, case), Placements()]
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    options = {
        **case.get("trainer", {}),
        **_precision(case),
        "callbacks": callbacks,
        "enable_checkpointing": checkpoints,
    }
    run = trainer(root, "auto", 1, **options)
    run.fit(
        model, loader(case["batches"], rows=case.get("rows", ROWS)), loader(2, seed=7), ckpt_path=case.get("resume")
    )
    if "save_after" in case:
        run.save_checkpoint(case["save_after"])
    result: dict[str, Any] = {
        "final": state(model),
        "global_step": run.global_step,
        "precision": run.precision_plugin.state_dict(),
        "callbacks": callback_outcome(run),
    }
    if case.get("evaluate"):
        result.update(_evaluations(run, model))
    return result


def _evaluations(run: L.Trainer, model: Chain) -> dict[str, Any]:
    return {
        "validate": run.validate(model, loader(2, seed=7), verbose=False),
        "test": run.test(model, loader(3, seed=8), verbose=False),
        "predict": run.predict(model, loader(2, seed=9)),
    }


def fit_case(rank: int, root: str, case: dict[str, Any]) -> dict[str, Any]:
    """Worker: train ``case`` with the strategy; the final full state (every rank has it after fit),
    the initial one, and what validate/test/predict gave on this rank."""
    os.environ["LOCAL_RANK"] = str(rank)
    model = Chain(**case.get("model", {}))
    initial = state(model)
    callbacks = [*_callbacks(root, case), Placements()]
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    options = {
        **case.get("trainer", {}),
        **_precision(case),
        "callbacks": callbacks,
        "enable_checkpointing": checkpoints,
    }
    strategy = case.get("lightning_strategy") or PipelineStrategy(**case["strategy"])
    run = trainer(root, strategy, torch.distributed.get_world_size(), **options)
    run.fit(model, loader(case["batches"]), loader(2, seed=7), ckpt_path=case.get("resume"))
    if "save_after" in case:  # train, save, continue later (a collective, as under DDP)
        run.save_checkpoint(case["save_after"])
    result: dict[str, Any] = {
        "collectives": next((c.seen for c in callbacks if isinstance(c, Collectives)), None),
        "callbacks": callback_outcome(run),
        "bounds": getattr(run.strategy, "stage_plan", None) and run.strategy.stage_plan.bounds,
        "setup_seconds": getattr(run.strategy, "setup_seconds", None),
        "final": final_state(run, model),
        "global_step": run.global_step,
        "held": held(model),
        "initial": initial,
        "precision": run.precision_plugin.state_dict(),
        "placements": next(c.during for c in callbacks if isinstance(c, Placements)),
        "placements_after": placements(),
        "after_fit": after_fit(model),
    }
    if case.get("evaluate"):
        result.update(_evaluations(run, model))
    return result


def after_fit(model: nn.Module) -> dict[str, Any]:
    """What the module holds after ``fit`` (the entries on the meta device) and what calling it gives
    (its output, or the error's message), as user code after ``fit`` would meet them."""
    released = sorted(name for name, value in model.state_dict().items() if value.is_meta)
    try:
        output: Any = model(torch.ones(2, FEATURES)).detach()
    except RuntimeError as error:
        output = str(error)
    return {"released": released, "output": output}


def placements() -> list[tuple[int, ...]]:
    """The distinct sets of cores this process's threads may run on."""
    found = set()
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            found.add(tuple(sorted(os.sched_getaffinity(int(thread)))))
    return sorted(found)


def _precision(case: dict[str, Any]) -> dict[str, Any]:
    """``case["fp16"]``: float16 mixed precision on the CPU with a ``GradScaler`` of these settings
    (Lightning turns ``precision="16-mixed"`` into bf16 on the CPU; its plugin given explicitly runs
    float16 autocast and loss scaling as on a GPU)."""
    if "fp16" not in case:
        return {}
    scaler = torch.amp.GradScaler("cpu", **case["fp16"])
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


def _callbacks(root: str | Path, case: dict[str, Any]) -> list[L.Callback]:
    callbacks: list[L.Callback] = []
    if case.get("checkpoint"):
        callbacks.append(ModelCheckpoint(dirpath=Path(root) / "checkpoints", save_last=True, save_top_k=-1))
    if "checkpoint_every" in case:  # every n steps, all kept, and last.ckpt
        every = case["checkpoint_every"]
        directory = Path(root) / "checkpoints"
        callbacks.append(ModelCheckpoint(directory, every_n_train_steps=every, save_last=True, save_top_k=-1))
    if case.get("early_stopping"):
        callbacks.append(EarlyStopping(monitor="val_loss", patience=0, min_delta=1.0, check_on_train_epoch_end=False))
    if "monitor" in case:  # the best k by val_loss, as users keep them
        best = ModelCheckpoint(Path(root) / "best", "{epoch}-{val_loss:.5f}", "val_loss", save_top_k=case["monitor"])
        callbacks.append(best)
    if "every_n_train_steps" in case:
        callbacks.append(ModelCheckpoint(Path(root) / "steps", every_n_train_steps=case["every_n_train_steps"]))
    if "fill_disk_at" in case:
        callbacks.append(FillDisk(case["fill_disk_at"], Path(root)))
    if case.get("lr_monitor"):
        callbacks.append(LearningRateMonitor("step"))
    if case.get("collectives"):
        callbacks.append(Collectives())
    if "accumulation_schedule" in case:  # {epoch: accumulate_grad_batches from that epoch on}
        callbacks.append(GradientAccumulationScheduler(case["accumulation_schedule"]))
    if "save_at" in case:
        callbacks.append(SaveAt(*case["save_at"]))
    return callbacks


class SaveAt(L.Callback):
    """At the end of training batch ``batch`` of the first epoch, every rank saves a checkpoint to
    ``path`` (under ``accumulate_grad_batches``, a batch may end mid-accumulation)."""

    def __init__(self, batch: int, path: str) -> None:
        self.batch, self.path = batch, path

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.batch:
            trainer.save_checkpoint(self.path)


class FillDisk(L.Callback):
    """At the end of training step ``step``, rank 0 fills the disk holding ``directory`` with a file
    ``ballast`` there, leaving a page free, so that the checkpoint saved next finds the disk full."""

    def __init__(self, step: int, directory: Path) -> None:
        self.step, self.directory = step, directory

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            free = shutil.disk_usage(self.directory).free
            with open(self.directory / "ballast", "wb") as handle:
                handle.truncate(0)
                handle.write(b"\0" * max(free - 4096, 0))


class Placements(L.Callback):
    """The cores this process's threads may run on at the end of training (:func:`placements`)."""

    def __init__(self) -> None:
        self.during: list[tuple[int, ...]] | None = None

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.during = placements()


class Collectives(L.Callback):
    """Calls the strategy's collectives as a user's code would, each rank with a value of its
    data-parallel replica (DDP: its rank; a pipeline: its copy), and keeps what they returned."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy = trainer.strategy
        replica = getattr(strategy, "pipeline_index", trainer.global_rank)
        value = torch.tensor(float(replica + 1))
        self.seen = {op: float(strategy.reduce(value.clone(), reduce_op=op)) for op in ("mean", "sum", "max")}
        self.seen["gather"] = strategy.all_gather(value.clone()).tolist()
        self.seen["broadcast"] = strategy.broadcast(replica + 10)
        self.seen["all"] = strategy.reduce_boolean_decision(replica == 0, all=True)
        self.seen["any"] = strategy.reduce_boolean_decision(replica == 0, all=False)
        strategy.barrier()


def callback_outcome(run: L.Trainer) -> dict[str, Any]:
    """What the checkpoint and early-stopping callbacks decided: the files kept, the best score."""
    outcome: dict[str, Any] = {
        "stopped_epoch": run.early_stopping_callback.stopped_epoch if run.early_stopping_callback else None
    }
    for callback in run.checkpoint_callbacks:
        directory = Path(callback.dirpath)
        outcome[directory.name] = {
            "files": sorted(p.name for p in directory.glob("*.ckpt")) if directory.exists() else [],
            "best": Path(callback.best_model_path).name,
            "score": None if callback.best_model_score is None else float(callback.best_model_score),
        }
    return outcome


def stage_modules(model: Chain, balance: list[int]) -> list[nn.Module]:
    """The stages ``balance`` makes of a copy of ``model``'s layers (for the runtime's references)."""
    layers = list(copy.deepcopy(model.net))
    starts = [sum(balance[:i]) for i in range(len(balance))]
    return [nn.Sequential(*layers[s : s + n]) for s, n in zip(starts, balance, strict=True)]


def step_losses(losses: list[float], microbatches: int) -> list[float]:
    """The per-step losses of plain Lightning fed micro-batches (``accumulate_grad_batches``): each
    micro-batch's loss is divided by their number, so a step's is their sum."""
    return [sum(losses[i : i + microbatches]) for i in range(0, len(losses), microbatches)]


def assert_states_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float) -> None:
    """The same entries; floating ones within ``tolerance``, the others (counters) equal."""
    assert got.keys() == expected.keys()
    for key in expected:
        if expected[key].is_floating_point():
            gap = float((got[key] - expected[key]).abs().max()) if expected[key].numel() else 0.0
            assert gap <= tolerance, (key, gap)
        else:
            assert torch.equal(got[key], expected[key]), key


def deferred_statistics(package: Any) -> type:
    """The callback class (of ``package``: ``lightning`` or ``pytorch_lightning``) that makes plain
    Lightning fed micro-batches the exact reference of a pipeline's batch norm."""

    class DeferredStatistics(package.Callback):
        """The micro-batch reference's batch norm: each layer normalises its micro-batch (Lightning
        with ``accumulate_grad_batches`` feeds micro-batches), and its running statistics move once
        per optimizer step, by the mean and unbiased variance of all the step's rows."""

        def __init__(self, microbatches: int) -> None:
            self.microbatches = microbatches
            self.inputs: dict[nn.Module, list[torch.Tensor]] = {}
            self.before: dict[nn.Module, list[torch.Tensor]] = {}

        def on_train_start(self, trainer: Any, module: Any) -> None:
            for layer in module.modules():
                if isinstance(layer, _BatchNorm):
                    layer.register_forward_pre_hook(self._keep)

        def _keep(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
            if layer.training:
                self.inputs.setdefault(layer, []).append(args[0].detach().clone())

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % self.microbatches == 0:
                self.inputs.clear()
                self.before = {
                    layer: [layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone()]
                    for layer in module.modules()
                    if isinstance(layer, _BatchNorm)
                }

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            with torch.no_grad():
                for layer, (mean, var, count) in self.before.items():
                    if layer not in self.inputs:  # not called by forward (a U-Net's unused encoder stage)
                        continue
                    rows = torch.cat(self.inputs[layer])
                    dims = [d for d in range(rows.dim()) if d != 1]
                    batch_var, batch_mean = torch.var_mean(rows, dim=dims, correction=1)
                    m = layer.momentum
                    layer.running_mean.copy_(mean * (1 - m) + batch_mean * m)
                    layer.running_var.copy_(var * (1 - m) + batch_var * m)
                    layer.num_batches_tracked.copy_(count + 1)

    return DeferredStatistics


def one_step_late(package: Any) -> type:
    """The callback class (of ``package``) that makes plain Lightning fed micro-batches the
    single-process reference of PipeDream-2BW's update rule."""

    class OneStepLate(package.Callback):
        """PipeDream-2BW's rule (Narayanan et al. 2021, §3.1; ``tests/reference.py``'s
        ``one_step_late``) on one device: step ``t``'s gradients are taken at the weights of ``t - 1``
        updates and applied to those of ``t`` (``θ_{t+1} = θ_t - γ ∇f(θ_{t-1})``). A drain (an
        epoch's end) starts the rule over: a run's first two steps both take their gradients at the
        weights it began with. Steps are ``microbatches`` of Lightning's batches
        (``accumulate_grad_batches``); only parameters are swapped, the optimizer's state is the
        live one's."""

        def __init__(self, microbatches: int) -> None:
            self.microbatches = microbatches
            self.previous: list[torch.Tensor] | None = None
            self.current: list[torch.Tensor] = []

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.previous = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % self.microbatches == 0:
                self.current = [p.detach().clone() for p in module.parameters()]
                with torch.no_grad():
                    for param, old in zip(module.parameters(), self.previous or self.current, strict=True):
                        param.copy_(old)

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            with torch.no_grad():
                for param, live in zip(module.parameters(), self.current, strict=True):
                    param.copy_(live)  # the gradients stay: those of the older weights
            self.previous = self.current

    return OneStepLate


class AllocatedFrom(L.Callback):
    """The bytes of tensors alive at a fit's peak from batch ``first`` on (``peak``), counted at the
    dispatcher (:class:`~lightning_pipe.cost.allocated.AllocatedPeak`, the CPU's
    ``torch.cuda.max_memory_allocated``); a failed fit leaves no mode behind."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.meter = AllocatedPeak("cpu")
        self.peak = 0
        self._counting = False

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.meter.__enter__()
        self._counting = True

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if index == self.first:
            self.meter.reset()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.peak = self.meter.peak
        self._stop()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._counting:
            self.meter.__exit__(None, None, None)
            self._counting = False

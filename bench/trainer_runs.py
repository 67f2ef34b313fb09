"""What the benchmarks that train through the Trainer share: a classifier around any network, the
step clock, and a quiet Trainer on 2 CPU processes (imported by the scripts beside it)."""

from __future__ import annotations

import shutil
import tempfile
import time
from multiprocessing import util
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

__all__ = ["Classifier", "StepTimes", "quiet_trainer", "timed_trainer"]


class Classifier(L.LightningModule):
    """Cross-entropy on ``net``'s logits; SGD with momentum."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimes(L.Callback):
    """The ``perf_counter`` at each ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def quiet_trainer(root: str | Path, callbacks: list[L.Callback], **options: Any) -> L.Trainer:
    """A Trainer for one epoch without logger, progress bar, summary or checkpoints, writing under
    ``root``; ``options`` (accelerator, devices, strategy, precision, ...) go to the Trainer."""
    return L.Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        default_root_dir=root,
        **options,
    )


def timed_trainer(strategy: Any, prefix: str, **options: Any) -> tuple[L.Trainer, StepTimes]:
    """A quiet Trainer (:func:`quiet_trainer`) on 2 CPU devices, its steps clocked; the pipeline's
    end-of-fit report goes to a new directory named ``prefix...``, removed when the process exits."""
    timer = StepTimes()
    root = tempfile.mkdtemp(prefix=prefix)
    # a worker of run_local ends through os._exit: multiprocessing's finalizers run there, atexit's do not
    util.Finalize(None, shutil.rmtree, args=(root,), kwargs={"ignore_errors": True}, exitpriority=0)
    return quiet_trainer(root, [timer], accelerator="cpu", devices=2, strategy=strategy, **options), timer

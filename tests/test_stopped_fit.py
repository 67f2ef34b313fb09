"""A fit stopped between the ends of its epoch (``trainer.should_stop``, as ``EarlyStopping`` and
users' callbacks set it), validated there (``val_check_interval``) or saving a checkpoint there
(``ModelCheckpoint(every_n_train_steps=...)``) goes on or ends on every rank at the same step under
every delayed schedule, a tied weight's gradient sum owed by a step still in flight included."""

from __future__ import annotations

import csv
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from tests.lightning_cases import trainer
from tests.user_modules import GPTModule

BATCHES, STOP_AT = 12, 5


class _StopAt(L.Callback):
    """Sets ``trainer.should_stop`` after ``steps`` batches, and counts the batches run."""

    def __init__(self, steps: int) -> None:
        self.steps, self.ran = steps, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ran += 1
        if self.ran >= self.steps:
            trainer.should_stop = True


def _tokens(batches: int) -> DataLoader:
    tokens = torch.randint(0, 64, (8 * batches, 17), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def _worker(rank: int, root: str, families: list[str], every: int | None) -> list[int]:
    """Each family's fit of the GPT: stopped after :data:`STOP_AT` batches, or run whole, validated
    and saving a checkpoint every ``every`` batches; the batches each ran."""
    os.environ["LOCAL_RANK"] = str(rank)
    ran = []
    for family in families:
        torch.manual_seed(0)
        strategy = PipelineStrategy(family, microbatches=2, profile_cache=False, timeout=timedelta(seconds=30))
        stop = _StopAt(STOP_AT if every is None else BATCHES)
        callbacks: list[L.Callback] = [stop]
        if every is not None:
            callbacks.append(ModelCheckpoint(Path(root) / family / "saved", every_n_train_steps=every, save_top_k=-1))
        saves = {"enable_checkpointing": every is not None, "val_check_interval": every}
        run = trainer(Path(root) / family, strategy, 2, callbacks=callbacks, **saves)
        run.fit(GPTModule(), _tokens(BATCHES), _tokens(2) if every else None)
        ran.append(stop.ran)
    return ran


@pytest.mark.timeout(240)
def test_a_fit_stopped_mid_epoch_ends_on_every_rank_with_tied_weights(tmp_path: Path) -> None:
    """A GPT whose embedding and head share their weight, under CDP, PipeDream and 2BW, stopped after
    5 of its 12 batches: every rank ends after the same 5 steps. The end of the fit drains the steps
    in flight before it waits for their logs: a rank can still be in its last call, owing the tied
    weight's gradient sum that the other makes in its drain (CDP and PipeDream hung until the timeout
    when the logs were awaited first). A delayed schedule logs each step's loss with the next step;
    the last one's comes in the drain, where Lightning takes no more logs: 4 of the 5 are logged."""
    families = ["cdp", "pipedream", "2bw"]
    results = run_local(_worker, 2, str(tmp_path), families, None, timeout=200)
    assert results == [[STOP_AT] * len(families)] * 2
    for family in families:
        with open(tmp_path / family / "metrics.csv") as rows:
            steps = [int(row["step"]) for row in csv.DictReader(rows) if row.get("train_loss")]
        assert steps == list(range(1, STOP_AT)), family


@pytest.mark.timeout(240)
def test_a_fit_validated_and_saved_mid_epoch_goes_on_on_every_rank_with_tied_weights(tmp_path: Path) -> None:
    """The same GPT under CDP and PipeDream, validated after batches 5 and 10 of 12
    (``val_check_interval=5``) and at the epoch's end, and saving a checkpoint after batches 5 and
    10 (``ModelCheckpoint(every_n_train_steps=5)``): every rank runs all 12 batches, logs the three
    validations and writes both checkpoints. Validation drains the steps in flight first, as the end
    of a fit does (both hung at the first validation when the logs were awaited before the drain);
    so do ``ModelCheckpoint``'s collectives between steps (both hung at the first save while a rank
    still owed the tied weight's gradient sum of its last call)."""
    families = ["cdp", "pipedream"]
    results = run_local(_worker, 2, str(tmp_path), families, 5, timeout=200)
    assert results == [[BATCHES] * len(families)] * 2
    for family in families:
        with open(tmp_path / family / "metrics.csv") as rows:
            validated = [int(row["step"]) for row in csv.DictReader(rows) if row.get("val_loss")]
        assert len(validated) == 3, family
        assert sorted(path.name for path in (tmp_path / family / "saved").iterdir()) == [
            "epoch=0-step=10.ckpt",
            "epoch=0-step=5.ckpt",
        ], family

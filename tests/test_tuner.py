"""Lightning's tuner through the pipeline: ``Tuner.lr_find`` saves a checkpoint, runs trial steps, and
restores it after the pipeline ran (the strategy then closes its pipeline and builds it again from the
restored values). Oracle: plain Lightning on one process, the same module and data: the same learning
rates tried, the same losses recorded, the same pick, the trial steps undone, and the fit that follows
ends with the same parameters (1F1B's micro-batches' mean gradient is the batch's: SGD on a mean
loss). ``Tuner.scale_batch_size`` runs on one process only, as under DDP: refused, saying so, before
the ranks connect, so the same processes go on to the next fit at once (a failure after they connected
closes the default group on every rank, which the next fit opens again: .connection)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy, PlanningError
from lightning_pipe.runtime import run_local
from tests.lightning_cases import ROWS, Chain, assert_states_close, dataset, final_state, trainer

BATCHES = 24


class Tuned(Chain):
    """What the tuner asks of a module: a ``lr`` and a ``batch_size`` it reads, its own loader."""

    def __init__(self) -> None:
        super().__init__()
        self.lr, self.batch_size = 0.1, ROWS

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(BATCHES), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(2, seed=7), batch_size=self.batch_size)


def _tuned(root: str, strategy: Callable[[], Any], devices: int) -> dict[str, Any]:
    """The learning rate finder's trials and pick, the module's state after it (restored to the one
    before), and the state after the fit that follows; what the batch size scaler gives (its error)."""
    module = Tuned()
    run = trainer(f"{root}/lr", strategy(), devices, default_root_dir=f"{root}/lr")
    found = Tuner(run).lr_find(module, num_training=20, min_lr=1e-3, max_lr=1.0, early_stop_threshold=None)
    result: dict[str, Any] = {"tried": found.results, "lr": module.lr, "after_lr_find": final_state(run, module)}
    run.fit(module)
    result["fitted"] = final_state(run, module)
    run = trainer(f"{root}/size", strategy(), devices, default_root_dir=f"{root}/size")
    try:
        result["batch_size"] = Tuner(run).scale_batch_size(Tuned(), init_val=ROWS, max_trials=2, steps_per_trial=2)
    except PlanningError as error:
        result["batch_size"] = str(error)
    return result


def _worker(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    result = _tuned(root, lambda: PipelineStrategy("1f1b", microbatches=2), 2)
    module = Tuned()  # a non-flushing pipeline's weight versions and stashes are closed and rebuilt too
    run = trainer(f"{root}/2bw", PipelineStrategy("2bw", microbatches=2), 2, default_root_dir=f"{root}/2bw")
    Tuner(run).lr_find(module, num_training=20, min_lr=1e-3, max_lr=1.0, early_stop_threshold=None)
    result["2bw_after_lr_find"] = final_state(run, module)
    return result


@pytest.mark.timeout(300)
def test_the_tuner_finds_what_plain_lightning_finds(tmp_path: Path) -> None:
    per_rank = run_local(_worker, 2, str(tmp_path), timeout=280)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = _tuned(str(tmp_path / "plain"), lambda: "auto", 1)
    finally:
        torch.set_num_threads(threads)
    initial = Tuned().state_dict()
    for got in per_rank:
        assert got["tried"]["lr"] == pytest.approx(expected["tried"]["lr"])
        assert got["tried"]["loss"] == pytest.approx(expected["tried"]["loss"], abs=1e-5)
        assert got["lr"] == pytest.approx(expected["lr"]) and got["lr"] != 0.1
        assert_states_close(got["after_lr_find"], initial, 0.0)  # the trial steps undone
        assert_states_close(got["fitted"], expected["fitted"], 1e-5)
        assert_states_close(got["2bw_after_lr_find"], initial, 0.0)
        assert "batch size finder (Tuner.scale_batch_size, BatchSizeFinder) runs on one process" in got["batch_size"]
    assert isinstance(expected["batch_size"], int) and expected["batch_size"] > ROWS  # plain Lightning scales it

"""The step's code before ``forward`` runs once per batch, on every rank, as under plain Lightning:
a random augmentation drawn there draws once, so the random streams (the draws and what the model
trains on) are plain Lightning's. A draw after ``forward`` from a stream the code before it does not
draw from is not replayed: on the last stage, each micro-batch draws anew."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy
import pytest
import torch
from torch import nn

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.log_relay import RING_BYTES
from tests.lightning_cases import Chain, assert_states_close, final_state, loader, trainer

BATCHES = 4


class Augmented(Chain):
    """Adds noise drawn from torch's and NumPy's global generators to the batch before ``forward``,
    draws from Python's after it, and keeps the draws."""

    def __init__(self) -> None:
        super().__init__(blocks=3)
        self.draws: list[float] = []
        self.after: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        noise = float(torch.randn(())) + float(numpy.random.randn())
        self.draws.append(noise)
        loss = nn.functional.cross_entropy(self(x + 0.1 * noise), y)
        self.after.append(random.random())
        return loss


class _Relay(L.Callback):
    """What carries the logs during the fit: the relay's class and rings, and the rings counted."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if not self.seen and isinstance(strategy, PipelineStrategy):
            relay = strategy._log_relay
            self.seen = {
                "relay": type(relay).__name__,
                "relay_rings": relay.ring_bytes,
                "pipeline_rings": strategy.executor.transport.links.ring_bytes,
                "counted": strategy.ring_bytes,
            }


def _fit(root: str, strategy: Any, devices: int, rows: int) -> dict[str, Any]:
    torch.manual_seed(5)
    numpy.random.seed(5)
    random.seed(5)
    model = Augmented()
    relay = _Relay()
    run = trainer(root, strategy, devices, callbacks=[relay])
    run.fit(model, loader(BATCHES, rows=rows))
    return {"draws": model.draws, "after": model.after, "final": final_state(run, model), **relay.seen}


def _worker(rank: int, root: str, schedule: str, shared_memory_bytes: int | None) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    strategy = PipelineStrategy(schedule, microbatches=2, shared_memory_bytes=shared_memory_bytes)
    return _fit(f"{root}/{schedule}", strategy, 2, 10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("schedule", "shared_memory_bytes"), [("1f1b", None), ("2bw", None), ("2bw", 0)], ids=["1f1b", "2bw", "2bw-gloo"]
)
def test_a_draw_before_forward_happens_once_per_batch(
    tmp_path: Path, schedule: str, shared_memory_bytes: int | None
) -> None:
    """Under 1F1B the run ends as plain Lightning's with the same seed (the first batch's draw is not
    repeated by the pipeline's set-up, and nothing the set-up does draws from the stream); under 2BW
    the draws are the same. The logs and the draws after ``forward`` reach every rank through
    shared-memory rings of 64 KiB each way, counted in the rank's rings, or through gloo
    (``shared_memory_bytes=0``: none counted)."""
    plain = _fit(str(tmp_path / "plain"), "auto", 1, 10)
    assert len(plain["draws"]) == BATCHES and len(set(plain["draws"])) == BATCHES
    for got in run_local(_worker, 2, str(tmp_path), schedule, shared_memory_bytes, timeout=220):
        shared = shared_memory_bytes is None
        assert got["relay"] == ("SharedMemoryRelay" if shared else "LogRelay")
        assert got["relay_rings"] == (2 * RING_BYTES if shared else 0)
        assert got["counted"] == got["pipeline_rings"] + got["relay_rings"]
        # the last stage's reruns of the step (one per micro-batch) draw what the first run drew
        assert list(dict.fromkeys(got["draws"])) == plain["draws"]
        # the draw after forward: every micro-batch's its own, relayed to every rank
        assert len(got["after"]) == 2 * BATCHES and len(set(got["after"])) == len(got["after"])
        if schedule == "1f1b":
            assert_states_close(got["final"], plain["final"], 1e-5)

"""The predicted memory of a rank (``PipelineStrategy.predicted_memory``, ``lightning_pipe/strategy/building.py``)
against what the run allocates, on one device (``form="single"``: every stage on one worker, so every
family's program runs in one process).

Oracle: the bytes of tensors alive at the run's peak, counted at the dispatcher from the first timed
batch to the end of the fit (``lightning_pipe/cost/allocated.py``, the CPU's
``torch.cuda.max_memory_allocated``). The prediction is the worker's peak as its actions hold its
stages' weights, optimizer state, activations, gradients and transients
(``lightning_pipe/worker_memory.py``), not each stage's own peak summed: those come at different times
(the stage sums an H100 measured on 2026-11-27 were 3.7 times a ResNet-50's ``ddp`` peak)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models.resnet import BasicBlock, ResNet

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.parent_watch import LAUNCHER_PID
from tests.lightning_cases import AllocatedFrom, trainer

STAGES = MICROBATCHES = 4
ROWS, WARMUP, STEPS = 8, 1, 2
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved": {"schedule": "interleaved"},
    "zb_h1": {"schedule": "zb_h1"},
    "ddp": {"schedule": "ddp"},
    "cdp P=2": {"schedule": "cdp", "stages": 2},  # delayed weights: a stage keeps the versions its actions use
}
TOLERANCE = 0.05


class _Classifier(L.LightningModule):
    """torchvision's ResNet with one block per stage, SGD with momentum, as a user writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        images, labels = batch
        return torch.nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _fit(rank: int, root: str, options: dict[str, Any]) -> dict[str, Any]:
    """Worker of :func:`run_local` (a process of its own: a fit leaves the process group and its
    environment behind): the prediction and the measured peak of one fit on one device."""
    torch.manual_seed(0)
    strategy = PipelineStrategy(**{"stages": STAGES, "microbatches": MICROBATCHES, **options}, form="single")
    peak = AllocatedFrom(WARMUP)
    run = trainer(root, strategy, 1, max_steps=WARMUP + STEPS, callbacks=[peak])
    count = ROWS * (WARMUP + STEPS)
    data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    run.fit(_Classifier(), DataLoader(data, batch_size=ROWS))
    plan = strategy.stage_plan.plan
    return {
        "summed": sum(stage.memory_bytes for stage in plan.stages),
        "predicted": strategy.predicted_memory - strategy.ring_bytes,
        "measured": peak.peak,
        "launcher": os.environ.get(LAUNCHER_PID),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_one_device_allocates_the_predicted_peak(tmp_path, name: str) -> None:
    fit = run_local(_fit, 1, str(tmp_path), CONFIGURATIONS[name], timeout=240)[0]
    assert fit["predicted"] == pytest.approx(fit["measured"], rel=TOLERANCE), fit
    assert fit["predicted"] <= fit["summed"] * (1 + 1e-9)  # the stages' own peaks do not come together
    # a fit on one device launched no process: nothing started later may take it for its launcher
    assert fit["launcher"] is None

"""Data parallelism over whole pipelines (``PipelineExecutor(pipelines=...)``): each pipeline trains
on its own mini-batches and every stage's gradient is averaged over the pipelines.

Oracle: the single-process reference trained on the pipelines' mini-batches of each step put
together (the mean gradient of equal-sized mini-batches is the gradient of their union's mean), for
rules whose weight version does not depend on the micro-batch (sync, 2BW).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages, one_step_late, reference, sync

PIPELINES = [[0, 1], [2, 3]]
STEPS = 4


def _worker(rank: int, family: str) -> dict[int, list[torch.Tensor]]:
    pipeline = next(p for p, ranks in enumerate(PIPELINES) if rank in ranks)
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, 2, k),
        build_stages(2),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        pipelines=PIPELINES,
    )
    for inputs, targets in batches(STEPS, seed=1 + pipeline):
        executor.step(inputs, targets)
    executor.drain()
    executor.close()
    return {s: [p.detach().clone() for p in w.params] for s, w in executor.weights.items()}


def _union() -> list[tuple[torch.Tensor, torch.Tensor]]:
    per_pipeline = [batches(STEPS, seed=1 + p) for p in range(len(PIPELINES))]
    return [
        (torch.cat([b[t][0] for b in per_pipeline]), torch.cat([b[t][1] for b in per_pipeline])) for t in range(STEPS)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("family", "rule"), [("1f1b", sync), ("2bw", one_step_late)])
def test_pipelines_average_their_gradients(family: str, rule) -> None:
    """Two 2-stage pipelines on 4 processes end with the reference's parameters on every rank, and
    not with what one pipeline alone would train (the averaging is real)."""
    results = run_local(_worker, 4, family, timeout=100)
    expected = reference(build_stages(2), _union(), 4, rule, "sgd")
    alone = reference(build_stages(2), batches(STEPS, seed=1), 2, rule, "sgd")
    for rank, result in enumerate(results):
        (stage,) = result
        for got, want in zip(result[stage], expected[stage], strict=True):
            assert torch.allclose(got, want, atol=1e-6), (rank, (got - want).abs().max())
        assert any((g - a).abs().max() > 1e-4 for g, a in zip(result[stage], alone[stage], strict=True))


def _bad_pipelines_worker(rank: int) -> str:
    try:
        PipelineExecutor(
            make_schedule("1f1b", 2, 2),
            build_stages(2),
            nn.functional.cross_entropy,
            OPTIMIZERS["sgd"],
            pipelines=[[0, 1], [1, 2]],
        )
    except PlanningError as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(60)
def test_pipelines_must_partition_the_ranks() -> None:
    for message in run_local(_bad_pipelines_worker, 3, timeout=50):
        assert "pipelines [[0, 1], [1, 2]] must hold every rank 0..2 exactly once" in message

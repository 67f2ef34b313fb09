"""CDP's ZeRO form (Fournier & Oyallon 2024, §4.4): each stage's whole state passed from worker to
worker (:mod:`lightning_pipe.runtime.stage_relays`). Equality with the rules' references is in
``test_runtime_rules.py``; here, what a worker holds."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_pipe.runtime import PipelineExecutor, run_local
from lightning_pipe.schedule import StageCosts, make_schedule, simulate


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    widths = [8, 64, 16, 32, 8]  # stages of unequal size: the bound is on the largest two
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)]


def _held(rank: int, runs: list[int]) -> dict[str, object]:
    """Train ``runs`` steps, drained after each."""
    executor = PipelineExecutor(
        lambda k: make_schedule("cdp", 4, 4, k, form="zero", rule="cdp_v2"),
        _stages(),
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    )
    generator = torch.Generator().manual_seed(1)
    held_between: list[list[int]] = []
    for steps in runs:
        for _ in range(steps):
            executor.step(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator))
        executor.drain()
        held_between.append(sorted(executor.relays.held))
    executor.close()
    return {
        "peak": executor.relays.peak_bytes,
        "taken": executor.relays.taken_bytes,
        "held after": held_between,
        "received": executor.relays.received,
    }


@pytest.mark.timeout(120)
def test_a_worker_holds_the_stage_it_computes_and_the_one_it_receives() -> None:
    """Four workers, four stages of unequal size, CDP-v2 for 3 steps, a drain, then 2 more: at every
    take, a worker holds at most the state of two stages (measured bytes of every stage on it:
    weights, kept versions, gradients, optimizer state; a copy not freed when its stage was passed
    on counts), never the whole model's; after each drain every stage rests on its owner, stage j on
    worker j: spread over the workers, so that none holds the whole model between runs either, and
    the next run starts from there. The states each worker received are the transfers the simulator
    predicts for each run."""
    runs = [3, 2]
    results = run_local(_held, 4, runs, timeout=100)
    taken: dict[int, int] = {}
    for result in results:
        for stage, nbytes in result["taken"].items():
            taken[stage] = max(taken.get(stage, 0), nbytes)
    largest_two = sum(sorted(taken.values())[-2:])
    assert sorted(taken) == [0, 1, 2, 3]
    for result in results:
        assert 0 < result["peak"] <= largest_two, (result["peak"], taken)
        assert result["peak"] < sum(taken.values())
    assert [result["held after"] for result in results] == [[[0]] * 2, [[1]] * 2, [[2]] * 2, [[3]] * 2]
    # the simulator prices one transfer per relay edge: each is one state the runtime passed
    predicted = [
        simulate(make_schedule("cdp", 4, 4, steps, form="zero", rule="cdp_v2"), StageCosts.uniform(4)).transfers[
            "weight"
        ]
        for steps in runs
    ]
    assert [result["received"] for result in results] == [sum(counts) for counts in zip(*predicted, strict=True)]

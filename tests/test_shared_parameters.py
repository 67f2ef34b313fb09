"""Parameters several layers use (tied weights) in the cost records and the memory a worker holds,
and what a step's first backward holds beyond the gradient it leaves (``first_backward_bytes``).

- The profiler finds a parameter used by two layers and records it once (``ChainCosts.shared``);
  a profile file keeps it.
- A worker holding several of the sharing stages (every stage on one device) holds the parameter
  and its optimizer state once under a flushing schedule (``WorkerMemory``); on workers of their
  own, or under a non-flushing schedule, each stage keeps a copy.
  Oracle: the same costs without ``shared`` and the bytes counted by hand.
- A stage's first backward holds, at layer ``l``, ``first_l`` beside the gradients of the layers after
  ``l``, the gradients of those before it still to come: ``max_l(first_l − Σ_{j<l} param_j)``, by hand
  and against a brute force over the order the backward runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.memory import EXTRA_COPIES, MemoryModel
from lightning_pipe.cost.profile_file import profile_from_dict, profile_to_dict
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.cost.records import ChainCosts, LayerCost, SharedParameters
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import evaluate
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.worker_memory import WorkerMemory

FLOAT = 4


class _Head(nn.Module):
    """An LM head whose weight is the embedding's."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embedding.weight.t()


def _tied_chain() -> list[nn.Module]:
    embedding = nn.Embedding(50, 8)
    return [embedding, nn.Linear(8, 8), nn.Linear(8, 8), _Head(embedding)]


def test_the_profiler_records_a_tied_weight_once_and_a_profile_file_keeps_it() -> None:
    costs = profile_layers(_tied_chain(), torch.randint(0, 50, (4, 6)), repeats=1, count_flops=False)
    assert costs.shared == (SharedParameters((0, 3), 50 * 8 * FLOAT),)
    assert costs.layers[0].param_bytes == costs.layers[3].param_bytes == 50 * 8 * FLOAT  # each counts it
    assert profile_from_dict(profile_to_dict(costs)) == costs
    untied = profile_layers([nn.Embedding(50, 8), nn.Linear(8, 8)], torch.randint(0, 50, (4, 6)), repeats=1)
    assert untied.shared == ()


@pytest.mark.parametrize(
    ("layers", "param_bytes", "message"),
    [((3,), 1.0, "two or more"), ((3, 1), 1.0, "in order"), ((1, 1), 1.0, "distinct"), ((0, 1), -1.0, ">= 0")],
)
def test_shared_parameters_are_checked(layers: tuple[int, ...], param_bytes: float, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        SharedParameters(layers, param_bytes)


def test_shared_parameters_name_layers_of_the_chain() -> None:
    with pytest.raises(PlanningError, match="name layer 5 of 2"):
        ChainCosts(layers=ChainCosts.from_lists([1.0, 1.0]).layers, shared=(SharedParameters((0, 5), 1.0),))


def _costs(shared: float) -> ChainCosts:
    costs = ChainCosts.from_lists(
        [1.0] * 4, [2.0] * 4, activation=[3.0] * 4, params=[100.0, 10.0, 10.0, 100.0], transient=[5.0] * 4
    )
    return replace(costs, shared=(SharedParameters((0, 3), shared),))


@pytest.mark.parametrize("optimizer", sorted(EXTRA_COPIES))
@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved", "ddp"])
def test_a_worker_holds_a_tied_weight_once(family: str, optimizer: str) -> None:
    """One worker holding stages 0 and 3, which share 100 bytes: less one weight and its optimizer
    state (``EXTRA_COPIES - 1`` copies: each stage keeps its own part of the gradient) than the stages
    counted apart; four workers: each stage its copy, nothing less."""
    bounds = ((0, 0), (1, 1), (2, 2), (3, 3))
    memory = MemoryModel(family if family in ("gpipe", "1f1b") else "1f1b", 4, extra_copies=EXTRA_COPIES[optimizer])
    tied, untied = _costs(100.0), replace(_costs(100.0), shared=())
    plan = evaluate(tied, [[0], [1], [2], [3]], partitioner="hand", devices=4, memory=memory)
    single = ScheduleOptions(family, 4, form="single").on_workers(1).make(4, 4)(2)
    assert single.workers == 1
    once = WorkerMemory.of(single, tied, bounds).bytes_under(plan, [False] * 4)
    apart = WorkerMemory.of(single, untied, bounds).bytes_under(plan, [False] * 4)
    assert once[0] == pytest.approx(apart[0] - 100.0 * EXTRA_COPIES[optimizer])
    spread = ScheduleOptions("1f1b", 4).make(4, 4)(2)
    assert WorkerMemory.of(spread, tied, bounds).bytes_under(plan, [False] * 4) == WorkerMemory.of(
        spread, untied, bounds
    ).bytes_under(plan, [False] * 4)


def test_a_non_flushing_worker_keeps_a_copy_per_sharing_stage() -> None:
    """CDP's single form keeps a copy of the tied weight per sharing stage, each with its versions and
    optimizer state (``runtime/weights.py``): nothing is counted once."""
    bounds = ((0, 0), (1, 1), (2, 2), (3, 3))
    tied, untied = _costs(100.0), replace(_costs(100.0), shared=())
    plan = evaluate(tied, [[0], [1], [2], [3]], partitioner="hand", devices=4, memory=MemoryModel("1f1b", 4))
    single = ScheduleOptions("cdp", 4, form="single").on_workers(1).make(4, 4)(2)
    assert single.workers == 1 and not single.flush
    assert WorkerMemory.of(single, tied, bounds).bytes_under(plan, [False] * 4) == WorkerMemory.of(
        single, untied, bounds
    ).bytes_under(plan, [False] * 4)


def test_a_stages_first_backward_by_hand() -> None:
    """Layers with first-backward bytes 10, 50, 5 and parameters 20, 30, 40 in one stage: at layer 1
    the 20 bytes of layer 0's gradient are still to come, at layer 2 the 50 of layers 0 and 1:
    ``max(10 − 0, 50 − 20, 5 − 50) = 30``; a layer without the measure counts its ``backward_bytes``."""
    layers = [
        LayerCost(f"l{i}", 1.0, 1.0, 1.0, 1.0, param, backward_bytes=60.0, first_backward_bytes=first)
        for i, (first, param) in enumerate([(10.0, 20.0), (50.0, 30.0), (5.0, 40.0)])
    ]
    plan = evaluate(ChainCosts(tuple(layers)), [[0, 1, 2]], partitioner="hand", devices=1)
    assert plan.stages[0].first_backward_bytes == 30.0
    unmeasured = ChainCosts(tuple(replace(layer, first_backward_bytes=None) for layer in layers))
    assert evaluate(unmeasured, [[0, 1, 2]], partitioner="hand", devices=1).stages[0].first_backward_bytes == 60.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=6))
def test_a_stages_first_backward_is_its_peak_beside_the_gradients_it_leaves(pairs: list[tuple[int, int]]) -> None:
    """Brute force: run the backward layer by layer from the last, holding the gradients made so
    far; the stage's peak less its whole gradient, at least 0."""
    layers = tuple(
        LayerCost(f"l{i}", 1.0, 1.0, 1.0, 1.0, float(param), backward_bytes=float(first), first_backward_bytes=first)
        for i, (first, param) in enumerate(pairs)
    )
    made, peak = 0.0, 0.0
    for layer in reversed(layers):
        peak = max(peak, made + layer.first_bytes + layer.param_bytes)
        made += layer.param_bytes
    stage = evaluate(ChainCosts(layers), [list(range(len(layers)))], partitioner="hand", devices=1).stages[0]
    assert stage.first_backward_bytes == pytest.approx(max(peak - made, 0.0))

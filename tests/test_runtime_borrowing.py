"""Who lends which stage's weights in FSDP and FSLPP, what a borrower sends back and when, and the
schedules the runtime refuses to run this way (one process; the runs against the reference are in
tests/test_runtime_rules.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PipelineRuntimeError, PlanningError
from lightning_pipe.runtime.borrowing import (
    Lending,
    check_borrowing,
    last_gradients,
    load_weights,
    returned_gradients,
    weights_message,
)
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, hand_action, hand_schedule


@pytest.mark.parametrize(
    ("family", "workers", "expected"),
    [
        # each worker computes both stages for its micro-batches and owns one
        ("fsdp", 2, [({1: 1}, {0: [1]}), ({0: 0}, {1: [0]})]),
        # workers 0 and 3 own stages 0 and 1; worker 1 computes stage 1, worker 2 stage 0
        ("fslpp", 4, [({}, {0: [2]}), ({1: 3}, {}), ({0: 0}, {}), ({}, {1: [1]})]),
        ("pp", 2, [({}, {}), ({}, {})]),  # every worker computes only what it owns
        ("ddp", 2, [({}, {}), ({}, {})]),  # every worker owns every stage
    ],
)
def test_lenders_and_borrowers_by_hand(family: str, workers: int, expected: list) -> None:
    """Guards against lending a stage to a worker that owns it, or not to one that computes it."""
    schedule = make_schedule(family, 2, 2, 1)
    assert schedule.workers == workers
    got = [Lending.of(schedule, worker) for worker in range(workers)]
    assert [(lending.lenders, lending.borrowers) for lending in got] == expected


def test_a_replicated_stage_is_lent_by_its_first_owner() -> None:
    """Stage 0 owned by workers 0 and 1, computed by worker 2 too: worker 0 lends it (and adds the
    borrowed gradient before the owners reduce), worker 1 does not."""
    schedule = hand_schedule(["0F0 0B0 0UPDATE", "0F1 0B1 0UPDATE", "0F2 0B2"], ((0, 1),), 1, 3, 1)
    assert Lending.of(schedule, 0) == Lending({}, {0: [2]})
    assert Lending.of(schedule, 1) == Lending({}, {})
    assert Lending.of(schedule, 2) == Lending({0: 0}, {})


def test_borrowing_is_refused_without_flushes() -> None:
    """A call of a non-flushing schedule may compute with versions other than the lender's live one:
    refused, naming the worker, the stage and its owners; the flushing form of the same orders runs."""
    orders = ["0F0 1F0 1B0 0B0 0UPDATE", "0F1 1F1 1B1 0B1 1UPDATE"]
    flushing = hand_schedule(orders, ((0,), (1,)), 2, 2, 1)
    check_borrowing(flushing)
    with pytest.raises(PlanningError, match=r"worker 0 computes stage 1, whose weights live on worker\(s\) \[1\]"):
        check_borrowing(flushing.with_orders(flushing.orders, flush=False))


def test_gradients_go_back_after_the_last_backward_of_each_step() -> None:
    """Positions of the last B or W of each (stage, step) of the borrowed stages only: a split
    backward's W, not its I; a later step's own position. Guards against sending a partial gradient."""
    tokens = ["1F0v0", "1F1v0", "1B0v0", "1I1v0", "0F0v0", "1W1v0", "0B0v0", "1F0@1v1", "1B0@1v1"]
    actions = [hand_action(token) for token in tokens]
    assert last_gradients(actions, {1}) == {5: (1, 0), 8: (1, 1)}
    assert last_gradients(actions, {0, 1}) == {5: (1, 0), 6: (0, 0), 8: (1, 1)}
    assert last_gradients(actions, set()) == {}


def _stage(seed: int) -> StageWeights:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    module[2].bias.requires_grad_(False)
    return StageWeights(module, OPTIMIZERS["sgd"], snapshots=False)


def test_a_borrower_computes_with_the_lenders_weights_and_buffers() -> None:
    """The lender's parameters and batch-norm statistics land in the borrower's copy, at the version
    the call uses; a copy built differently is refused. Guards against computing with the borrower's
    own initial weights."""
    lender, borrower = _stage(0), _stage(1)
    lender.module(torch.randn(5, 3))  # moves the running statistics
    load_weights(borrower, weights_message(lender), version=3)
    assert borrower.version == 3
    for got, want in zip(borrower.module.state_dict().values(), lender.module.state_dict().values(), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(PipelineRuntimeError, match="every worker must build the same stage modules"):
        load_weights(StageWeights(nn.Linear(3, 4), OPTIMIZERS["sgd"], snapshots=False), weights_message(lender), 0)


def test_a_borrower_returns_its_trainable_gradients_and_forgets_them() -> None:
    """One gradient per trainable weight (the frozen bias left out), None where no micro-batch reached
    a weight, the step's buffer emptied; the lender's add() takes them as they are."""
    borrower, lender = _stage(0), _stage(0)
    x = torch.randn(5, 3)
    leaves = borrower.leaves(0)
    borrower.backward(0, leaves, [borrower.forward(leaves, x).sum()], None, [])
    sent = returned_gradients(borrower, 0)
    assert 0 not in borrower.gradients
    assert len(sent) == len(borrower.trainable) == len(borrower.params) - 1
    assert all(g is not None for g in sent)
    lender.add(0, sent)
    assert all(torch.equal(a, b) for a, b in zip(lender.gradients[0][:-1], sent, strict=True))
    assert returned_gradients(borrower, 1) == [None] * len(borrower.trainable)  # nothing computed in step 1

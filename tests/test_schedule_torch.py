"""Interoperability with torch.distributed.pipelining: same orders, and its schedules validate here."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from lightning_pipe.schedule import Schedule, StageCosts, make_schedule, simulate, validate
from lightning_pipe.schedule.versions import assign_versions


def _torch_orders(name: str, workers: int, microbatches: int, per_rank: int) -> list[list[str]] | None:
    try:
        ops = get_schedule_ops(name, workers, microbatches, num_stages_per_rank=per_rank)
    except (ValueError, AssertionError, RuntimeError):
        return None  # a size torch.distributed.pipelining does not support
    return [[str(a) for a in rank if a is not None] for rank in ops]


@pytest.mark.parametrize(
    ("torch_name", "ours", "per_rank"),
    [
        ("GPipe", "gpipe", 1),
        ("Interleaved1F1B", "interleaved", 2),
        ("Interleaved1F1B", "interleaved", 3),
        ("LoopedBFS", "looped_bfs", 2),
        ("LoopedBFS", "looped_bfs", 3),
    ],
)
def test_our_orders_equal_torch_where_it_has_the_family(torch_name: str, ours: str, per_rank: int) -> None:
    compared = 0
    for workers in (1, 2, 3, 4, 5):
        for microbatches in (1, 2, 3, 4, 6, 8, 9):
            theirs = _torch_orders(torch_name, workers, microbatches, per_rank)
            if theirs is None:
                continue
            mine = make_schedule(ours, workers * per_rank, microbatches, virtual_stages=per_rank)
            assert mine.to_torch() == Schedule.from_torch(theirs).to_torch(), (workers, microbatches)
            compared += 1
    assert compared >= 20


@pytest.mark.parametrize("torch_name", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV", "Interleaved1F1B"])
def test_torch_schedules_import_validate_and_simulate(torch_name: str) -> None:
    for workers, microbatches in ((2, 4), (4, 8)):
        orders = _torch_orders(torch_name, workers, microbatches, 2)
        assert orders is not None
        schedule = assign_versions(Schedule.from_torch(orders, family=torch_name), "sync")
        validate(schedule)
        sim = simulate(schedule, StageCosts.uniform(schedule.stages, 1.0, 2.0))
        assert sim.makespan >= microbatches * 2 * 3.0  # each worker does 2 stages of every micro-batch
        assert schedule.workers == workers

"""The ranks and process groups of a worker's pipeline, and of data parallelism over whole pipelines.

Data parallelism over pipelines runs copies of one pipeline, each on its own ranks and mini-batches;
a stage held by several ranks (its replicas inside a pipeline, as in PipeDream's 1F1B-RR, Narayanan
et al. 2019 §3.2, and its copies in every pipeline) reduces its gradients in a process group of its
own. ``torch.distributed`` needs every rank to create every group, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Schedule

__all__ = ["pipeline_ranks", "replica_groups"]


def pipeline_ranks(pipelines: Sequence[Sequence[int]] | None, workers: int) -> list[list[int]]:
    """The ranks of each pipeline, checked: ``workers`` each, together every rank once."""
    world = dist.get_world_size()
    if pipelines is None:
        pipelines = [range(world)]
    result = [list(ranks) for ranks in pipelines]
    every = sorted(rank for ranks in result for rank in ranks)
    if every != list(range(world)):
        raise PlanningError(f"pipelines {result} must hold every rank 0..{world - 1} exactly once")
    if any(len(ranks) != workers for ranks in result):
        raise PlanningError(
            f"the schedule has {workers} workers but the pipelines have {[len(r) for r in result]} ranks: start "
            f"{workers} processes per pipeline (e.g. torchrun --nproc-per-node {workers * len(result)})"
        )
    return result


def replica_groups(schedule: Schedule, pipelines: list[list[int]], rank: int) -> dict[int, dist.ProcessGroup]:
    """A process group per stage held by several ranks (its replicas in every pipeline), for the
    stages ``rank`` holds; every rank creates every group, in stage order."""
    groups = {}
    for stage, owners in enumerate(schedule.owners):
        holders = sorted(ranks[w] for ranks in pipelines for w in owners)
        if len(holders) > 1 and not schedule.rings:  # a ring reduces point to point (.gradient_rings)
            group = dist.new_group(holders)
            if rank in holders:
                groups[stage] = group
    return groups

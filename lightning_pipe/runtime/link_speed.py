"""The speed of the links between a job's ranks, measured, for planning when none is given.

A data-parallel copy of a stage (PipeDream's replication, Rahimi's ``ddp``) pays an all-reduce of its
gradients every step, and a pipeline pays its activations; priced as free, the search behind
``schedule="auto"`` would always replicate. :func:`allreduce_bandwidth` times what the replicas do,
an all-reduce over the process group, and gives the bandwidth
:class:`~lightning_pipe.cost.network.Network` prices a ring all-reduce with: ``2 (r - 1) / r`` bytes
sent per byte reduced among ``r`` ranks (Patarasuk & Yuan 2009), so a reduction of ``n`` bytes that
took ``t`` seconds ran at ``2 (r - 1) / r · n / t`` bytes per second. Activations between stages of
one host travel through shared memory instead (:mod:`.shared_memory`), faster than this: they are
priced pessimistically.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.errors import check_whole

__all__ = ["MEASURED_BYTES", "allreduce_bandwidth"]

MEASURED_BYTES = 4 * 2**20
"""Bytes reduced per timed all-reduce: large enough that the latency is a small part of it."""


def allreduce_bandwidth(
    device: torch.device, group: Any = None, nbytes: int = MEASURED_BYTES, repeats: int = 3
) -> float:
    """Bytes per second of a ring all-reduce among ``group``'s ranks (the default group: every rank),
    from the best of ``repeats`` timed all-reduces of ``nbytes`` of float32 on ``device`` after one
    untimed one; ``inf`` for a single rank. A collective: every rank of ``group`` calls it."""
    check_whole("nbytes", nbytes, 4, "bytes")
    check_whole("repeats", repeats, 1)
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return math.inf
    buffer = torch.zeros(nbytes // 4, device=device)
    best = math.inf
    for attempt in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:  # the first sets up the connections
            best = min(best, time.perf_counter() - start)
    seconds = torch.tensor([best], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # every rank prices with the same figure
    return 2 * (ranks - 1) / ranks * (buffer.numel() * 4) / max(float(seconds.item()), 1e-9)

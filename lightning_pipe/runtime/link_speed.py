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

:func:`allreduce_overlap` measures how much of such an all-reduce runs beside the ranks' compute
(``StageCosts.reduce_overlap``): a GPU's collectives run on a stream of their own, while on CPU
processes that fill a machine's cores the collective's threads take the processors the compute runs
on (2 gloo processes on 2 cores: a simulation with its all-reduces beside the compute predicted
the step of Rahimi's ``ddp`` on torchvision's ResNet-18 33% short, ``bench/auto_plan.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.cost.flop_rate import matmul_seconds, matmul_size, synchronize
from lightning_pipe.errors import check_whole

__all__ = ["MEASURED_BYTES", "allreduce_bandwidth", "allreduce_overlap", "overlap_share"]

MEASURED_BYTES = 16 * 2**20
"""Bytes reduced per timed all-reduce: a stage's gradients, about, and large enough that the latency
is a small part of it."""


def allreduce_bandwidth(
    device: torch.device, group: Any = None, nbytes: int = MEASURED_BYTES, repeats: int = 5
) -> float:
    """Bytes per second of a ring all-reduce among ``group``'s ranks (the default group: every rank),
    from the median of ``repeats`` timed all-reduces of ``nbytes`` of float32 on ``device`` after one
    untimed one, the slowest rank's; ``inf`` for a single rank. A collective: every rank of ``group``
    calls it. The median, not the best: on 2 gloo processes of one host the same 4 MiB all-reduce ran
    at 0.6-2.4 GiB/s from one measurement to the next (the best of 3), and a replica's step pays the
    all-reduces as they come."""
    check_whole("nbytes", nbytes, 4, "bytes")
    check_whole("repeats", repeats, 1)
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return math.inf
    buffer = torch.zeros(nbytes // 4, device=device)
    seconds = []
    for attempt in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        synchronize(device)
        if attempt:  # the first sets up the connections
            seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # every rank prices with the same figure
    return 2 * (ranks - 1) / ranks * (buffer.numel() * 4) / max(float(slowest.item()), 1e-9)


def allreduce_overlap(device: torch.device, group: Any = None, nbytes: int = MEASURED_BYTES, repeats: int = 6) -> float:
    """The share of an all-reduce among ``group``'s ranks that runs beside their compute, from 0 to 1
    (``StageCosts.reduce_overlap``; 1 for a single rank). Every rank times, each after a barrier, the
    all-reduce of ``nbytes`` of float32 alone (``R``), a loop of square matmuls on ``device`` lasting
    about twice as long alone (``W``), and the two at once, the all-reduce started first and waited
    for after the loop (``T``), in turn ``repeats`` times (so that the machine's drift moves all three
    alike), after one untimed run of each. With the medians, the share is ``(W + R - T) / R``,
    clipped to 0..1, the smallest over the ranks (every rank prices with the same figure). A
    collective: every rank of ``group`` calls it."""
    check_whole("nbytes", nbytes, 4, "bytes")
    check_whole("repeats", repeats, 1)
    if dist.get_world_size(group) == 1:
        return 1.0
    buffer = torch.zeros(nbytes // 4, device=device)
    size = matmul_size(device) // 2
    left, right = (torch.randn(size, size, device=device) for _ in range(2))

    def timed(work: Callable[[], object]) -> float:
        synchronize(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        work()
        synchronize(device)
        return time.perf_counter() - start

    def reduce() -> None:
        dist.all_reduce(buffer, group=group)

    def compute() -> None:
        for _ in range(products):
            torch.mm(left, right)

    def both() -> None:
        reducing = dist.all_reduce(buffer, group=group, async_op=True)
        compute()
        reducing.wait()

    product = max(statistics.median(matmul_seconds(device, size, torch.float32, 3)), 1e-9)
    products = max(1, math.ceil(2 * timed(reduce) / product))
    timed(compute)
    timed(both)
    runs = [(timed(reduce), timed(compute), timed(both)) for _ in range(repeats)]
    alone, working, together = (statistics.median(column) for column in zip(*runs, strict=True))
    share = torch.tensor([overlap_share(alone, working, together)], device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN, group=group)
    return float(share.item())


def overlap_share(alone: float, working: float, together: float) -> float:
    """The share of an all-reduce of ``alone`` seconds that ran beside ``working`` seconds of compute,
    the two taking ``together`` seconds at once: ``(working + alone - together) / alone``, clipped to
    0..1 (0: the sum of the two, 1: no longer than the compute alone; noise can put it outside)."""
    return min(max((working + alone - together) / max(alone, 1e-12), 0.0), 1.0)

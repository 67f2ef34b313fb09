"""How much slower a worker computes while every worker computes: the ``contention`` of the prediction.

Workers that share a machine share its processors, memory bandwidth and caches: an action takes
longer while the others compute too (``StageCosts.contention``, ``PlanOptions.contention``;
docs/simulation.md). :func:`measure_contention` measures it instead of guessing: every rank of a
process group runs the same loop of square matmuls on its device (half the side of
:func:`~lightning_pipe.cost.flop_rate.matmul_size`: 512 on the CPU, 2048 on an accelerator), first
alone, one rank at a time while the others wait in a barrier, then all at once. A rank's slowdown is
the median of its products' seconds all at once over the median alone (medians: the ranks' loops
start and end a barrier's release apart, and a burst of other work slows some products, not the
median). The contention is the median of the ranks' slowdowns, the same on every rank, and at least
1 (a ratio below 1 is noise: no rank computes faster for the others computing). Devices that share
nothing (GPUs, each its own process) come out near 1.

The barriers should block, not spin: use a gloo group (the waits of an NCCL barrier poll).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from lightning_pipe.cost.flop_rate import matmul_seconds, matmul_size
from lightning_pipe.errors import PlanningError

__all__ = ["measure_contention"]

WARMUP = 3
"""Products each rank runs before the measurement (all ranks at once): allocations, threads and clocks settle."""


def measure_contention(
    group: dist.ProcessGroup | None,
    device: str | torch.device,
    seconds: float = 0.25,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The contention of ``group``'s ranks computing on their ``device`` (see the module docstring):
    how many times slower a rank's matmuls run while every rank computes than alone. A collective:
    every rank of ``group`` (``None``: the default group) calls it; each gets the same factor.

    Args:
        group: the ranks that share what is measured (those of one machine).
        device: this rank's device.
        seconds: about how long the measurement takes, divided evenly among the ranks' turns alone
            and the turn all at once (each turn runs at least 3 products).
        dtype: of the matmuls (the model's).

    Raises:
        PlanningError: ``seconds`` is not a finite number > 0, or ``device`` is not a device or is the
            meta device.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
        raise PlanningError(f"seconds must be a finite number > 0, got {seconds!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlanningError(f"unknown device {device!r}: use e.g. 'cpu' or 'cuda:0' ({exc})") from exc
    if target.type == "meta":
        raise PlanningError("the meta device computes nothing: measure contention on the device the ranks train on")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = matmul_size(target) // 2
    turn = seconds / (world + 1)
    matmul_seconds(target, size, dtype, WARMUP)
    alone = math.nan
    for which in range(world):
        dist.barrier(group=group)
        if which == rank:
            alone = statistics.median(matmul_seconds(target, size, dtype, 3, turn))
    dist.barrier(group=group)
    together = statistics.median(matmul_seconds(target, size, dtype, 3, turn))
    slowdowns: list[float] = [math.nan] * world
    dist.all_gather_object(slowdowns, together / alone, group=group)
    return max(statistics.median(slowdowns), 1.0)

"""Brute-force oracle: every contiguous split and every replica assignment, evaluated one by one.

Used by the tests to prove the fast searches optimal, and available as the ``exact`` partitioner
for small chains. It shares nothing with the fast search but :func:`~lightning_pipe.partition.plan.evaluate`,
the single definition of a plan's bottleneck and memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.plan import Plan
from lightning_pipe.partition.request import PlanRequest
from lightning_pipe.util.units import format_bytes

__all__ = ["MAX_CANDIDATES", "exact"]

MAX_CANDIDATES = 200_000


def _splits(layers: int, stages: int) -> Iterator[list[list[int]]]:
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


def _replicas(stages: int, devices: int, replicate: bool) -> Iterator[tuple[int, ...]]:
    if not replicate:
        yield (1,) * stages
        return
    for counts in itertools.product(range(1, devices - stages + 2), repeat=stages):
        if sum(counts) <= devices:
            yield counts


def _candidates(layers: int, devices: int, replicate: bool) -> int:
    total = 0
    for stages in range(1, min(layers, devices) + 1):
        replica_choices = math.comb(devices, stages) if replicate else 1  # Σ r <= devices, r >= 1
        total += math.comb(layers - 1, stages - 1) * replica_choices
    return total


def exact(request: PlanRequest) -> Plan:
    """The best contiguous plan by exhaustive search (bottleneck, then peak memory)."""
    layers, devices, replicate = len(request.costs), request.devices, not request.straight
    if not replicate:
        request.require_layers_per_device("exact")
    count = _candidates(layers, devices, replicate)
    if count > MAX_CANDIDATES:
        raise PlanningError(
            f"exact: {count} candidate plans for {layers} layers on {devices} devices, more than the "
            f"{MAX_CANDIDATES} it enumerates; use the pipedream partitioner (also optimal) for this size"
        )
    best: Plan | None = None
    for stages in range(1, min(layers, devices) + 1):
        for groups in _splits(layers, stages):
            for replicas in _replicas(stages, devices, replicate):
                plan = request.plan_unchecked("exact", groups, list(replicas))
                if request.memory_limit is not None and plan.peak_memory_bytes > request.memory_limit:
                    continue
                if best is None or (plan.bottleneck_seconds, plan.peak_memory_bytes) < (
                    best.bottleneck_seconds,
                    best.peak_memory_bytes,
                ):
                    best = plan
    if best is None:
        raise PlanningError(
            f"exact: no contiguous plan on {devices} device(s) fits {format_bytes(request.memory_limit)} per device"
        )
    return best

"""Communication costs between stages and among replicas of a stage.

PipeDream (Narayanan et al. 2019, §3.1) charges a cut after
layer ``i`` ``2·C_i``: the activation goes forward and its gradient comes back, ``C_i`` being the
transfer time of the bytes crossing the cut. A stage replicated ``r`` times synchronises its weights
with an all-reduce of its parameter bytes; we use the ring all-reduce volume ``2(r-1)/r`` of the
bytes (Patarasuk & Yuan 2009), the bandwidth-optimal algorithm NCCL and gloo implement.

Both costs are linear in the bytes, which is what lets the planner invert them (bytes allowed for a
given time) in its binary search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError

__all__ = ["Network"]


@dataclass(frozen=True)
class Network:
    """A homogeneous network: every link has ``bandwidth`` bytes per second (``inf``: free)."""

    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if math.isnan(self.bandwidth) or self.bandwidth <= 0:
            raise PlanningError(f"bandwidth must be > 0 bytes/s (or inf), got {self.bandwidth!r}")

    @property
    def free(self) -> bool:
        """True when communication costs nothing."""
        return math.isinf(self.bandwidth)

    def transfer_seconds(self, nbytes: float) -> float:
        """Time to send ``nbytes`` once over one link."""
        return 0.0 if self.free else nbytes / self.bandwidth

    def cut_seconds(self, nbytes: float) -> float:
        """PipeDream's ``2·C_i``: activation forward plus its gradient backward."""
        return 2.0 * self.transfer_seconds(nbytes)

    def allreduce_factor(self, replicas: int) -> float:
        """Seconds per parameter byte of a ring all-reduce among ``replicas`` workers."""
        if replicas <= 1 or self.free:
            return 0.0
        return 2.0 * (replicas - 1) / (replicas * self.bandwidth)

    def allreduce_seconds(self, nbytes: float, replicas: int) -> float:
        """Weight-synchronisation time ``W^m`` of a stage with ``nbytes`` of parameters."""
        return nbytes * self.allreduce_factor(replicas)

"""What each worker of a pipeline holds: the stages it computes, and their activations at its peak.

A partitioner prices each stage alone (:func:`~lightning_pipe.partition.evaluate`: its weights,
gradients and optimizer state, and its activations in flight by the memory model). A worker that
computes several stages — an interleaved or looped pipeline's virtual stages, every stage of a
replica in Rahimi's ``ddp`` — holds their weights together, and the activations its actions keep alive
at once, which peak lower than the stages' own peaks added (they come at other times:
:func:`~lightning_pipe.schedule.in_flight.worker_peaks`). The memory limit is per device, so it is
checked here, per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition.plan import Plan
from lightning_pipe.schedule.in_flight import worker_peaks
from lightning_pipe.schedule.ir import COMPUTE, Schedule

__all__ = ["WorkerMemory"]


@dataclass(frozen=True)
class WorkerMemory:
    """What each worker of a schedule holds: the stages it computes (``owned``), each with
    ``saved`` activation bytes per micro-batch, and the actions that keep them (``schedule``)."""

    schedule: Schedule
    owned: list[set[int]]
    saved: tuple[float, ...]

    @classmethod
    def of(cls, schedule: Schedule, costs: ChainCosts, bounds: Sequence[tuple[int, int]]) -> WorkerMemory:
        owned = [{a.stage for a in order if a.kind in COMPUTE} for order in schedule.orders]
        return cls(schedule, owned, tuple(costs.saved_between(first, last) for first, last in bounds))

    def bytes_under(self, plan: Plan, recompute: Sequence[bool]) -> tuple[float, ...]:
        """Each worker's bytes under ``plan``: its stages' weights, gradients and state, the
        recomputing stages' activations as the plan has them, and the others' as its actions hold
        them at their peak."""
        kept = [0.0 if r else saved for saved, r in zip(self.saved, recompute, strict=True)]
        peaks = worker_peaks(self.schedule, kept)
        return tuple(
            peak
            + sum(
                plan.stages[s].memory_bytes - (0.0 if recompute[s] else plan.stages[s].activation_bytes) for s in mine
            )
            for mine, peak in zip(self.owned, peaks, strict=True)
        )

"""What each worker of a pipeline holds: the stages it computes, and their activations at its peak.

A partitioner prices each stage alone (:func:`~lightning_pipe.partition.evaluate`: its weights,
gradients and optimizer state, and its activations in flight by the memory model). A worker that
computes several stages — an interleaved or looped pipeline's virtual stages, every stage of a
replica in Rahimi's ``ddp`` — holds their weights together, and the activations its actions keep alive
at once, which peak lower than the stages' own peaks added (they come at other times). A stage's
gradient and what its backward holds for a moment peak at their own times too, one backward at a time
on a worker (:func:`~lightning_pipe.schedule.in_flight.worker_holdings`). Parameters several of a
worker's stages use (tied weights, :class:`~lightning_pipe.cost.records.SharedParameters`) are held
there once under a flushing schedule, with one optimizer state, each stage keeping its own part of
their gradient; a non-flushing one keeps a copy per stage (:mod:`~lightning_pipe.runtime.ties`). The
memory limit is per device, so it is checked here, per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition.plan import Plan, Stage
from lightning_pipe.schedule.in_flight import Holding, weight_versions, worker_holdings
from lightning_pipe.schedule.ir import COMPUTE, Schedule

__all__ = ["WorkerMemory"]


@dataclass(frozen=True)
class WorkerMemory:
    """What each worker of a schedule holds: the stages it computes (``owned``), each with
    ``saved`` activation bytes per micro-batch, the actions that keep them (``schedule``), and the
    weight versions each stage its worker owns keeps (``versions``,
    :func:`~lightning_pipe.schedule.in_flight.weight_versions`; the others as the plan counts them),
    and the bytes of shared parameters each worker holds once but its stages count again (``shared``)."""

    schedule: Schedule
    owned: list[set[int]]
    saved: tuple[float, ...]
    versions: dict[int, int]
    entering: tuple[float, ...]
    shared: tuple[float, ...]

    @classmethod
    def of(cls, schedule: Schedule, costs: ChainCosts, bounds: Sequence[tuple[int, int]]) -> WorkerMemory:
        owned = [{a.stage for a in order if a.kind in COMPUTE} for order in schedule.orders]
        saved = tuple(costs.held_between(first, last) for first, last in bounds)
        entering = tuple(costs.boundary_bytes[first - 1] if first > 0 else 0.0 for first, _ in bounds)
        stage_of = {layer: s for s, (first, last) in enumerate(bounds) for layer in range(first, last + 1)}
        shared = [0.0] * len(owned)
        for group in costs.shared if schedule.flush else ():  # non-flushing: each stage its own copy
            users = {stage_of[layer] for layer in group.layers}
            for worker, mine in enumerate(owned):
                shared[worker] += max(len(users & mine) - 1, 0) * group.param_bytes
        return cls(schedule, owned, saved, weight_versions(schedule), entering, tuple(shared))

    def bytes_under(self, plan: Plan, recompute: Sequence[bool]) -> tuple[float, ...]:
        """Each worker's bytes under ``plan``: its stages' weights and optimizer state (a parameter its
        stages share, once), the recomputing stages' activations as the plan has them, and the others'
        activations, the gradients and what a backward holds for a moment as its actions hold them at
        their peak."""
        holdings = self.holdings(plan, recompute)
        peaks = worker_holdings(self.schedule, holdings)
        copies = plan.memory.extra_copies
        once = 1 + copies - (1 if copies >= 1 else 0)  # a weight and its optimizer state; each stage its gradient
        return tuple(
            peak + sum(self.steady(s, plan.stages[s], holdings[s]) for s in mine) - once * shared
            for mine, peak, shared in zip(self.owned, peaks, self.shared, strict=True)
        )

    def holdings(self, plan: Plan, recompute: Sequence[bool]) -> list[Holding]:
        """What each stage holds as its actions run (:class:`~lightning_pipe.schedule.in_flight.Holding`):
        a recomputing stage keeps its input per micro-batch in flight and makes one micro-batch's
        activations again while its backward runs (GPipe's re-materialisation, Huang et al. 2019 §2.3)."""
        gradient = plan.memory.extra_copies >= 1  # the plan's copies count a gradient
        holdings = []
        for stage, saved, into, again in zip(plan.stages, self.saved, self.entering, recompute, strict=True):
            besides = stage.kept_bytes + (saved if again else 0.0)
            holdings.append(
                Holding(
                    saved=into if again else saved,
                    gradient=stage.param_bytes if gradient else 0.0,
                    backward=stage.backward_bytes + besides,
                    accumulating=stage.transient_bytes - stage.backward_bytes,
                    first=(stage.first_backward_bytes if gradient else stage.backward_bytes) + besides,
                )
            )
        return holdings

    def steady(self, index: int, stage: Stage, holding: Holding) -> float:
        """What ``stage`` (number ``index``) holds whatever its actions: the plan's bytes for it less
        what ``holding`` counts as the actions run (its activations, the gradient, what a backward holds
        for a moment), its weight versions as its worker's actions keep them."""
        moving = holding.gradient + stage.transient_bytes + stage.kept_bytes + stage.activation_bytes
        if index in self.versions:
            moving += stage.weight_bytes - self.versions[index] * stage.param_bytes
        return stage.memory_bytes - moving

"""What a simulation predicts: the timeline, the figures derived from it, and the messages sent.

:class:`Simulation` holds the makespan, per-step completion and steady-state time per step
(:func:`steady_step`), throughput, per-worker busy and idle time and bubble fraction, NCA per stage
(Beaumont et al. §3.2), peak activations (count and bytes) and weight versions held per worker, bytes
moved per worker, the timeline itself (:class:`Interval`, also what the runtime measures) and every
message, which :meth:`Simulation.sent_per_time_step` counts per time step as Fournier & Oyallon 2024
(Table 1) count CDP's communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Action, Schedule
from lightning_pipe.schedule.traffic import Message

__all__ = ["Interval", "Simulation", "steady_step"]


@dataclass(frozen=True)
class Interval:
    """One executed action; ``waited``: seconds of it spent waiting for messages, ``call``: which of
    the executor's runs (a training step's call or a drain, counted from 0) it ran in (measured
    timelines; a simulation's are one run)."""

    worker: int
    action: Action
    start: float
    end: float
    waited: float = 0.0
    call: int = 0


@dataclass
class Simulation:
    """What :func:`~lightning_pipe.schedule.simulate.simulate` predicts (times in the unit of the costs, sizes
    in bytes)."""

    schedule: Schedule
    makespan: float
    step_end: list[float]
    steady_step: float
    throughput: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    nca: list[int]
    peak_activations: list[int]
    peak_activation_bytes: list[float]
    weight_versions: list[int]
    peak_weight_bytes: list[float]
    received_bytes: dict[str, list[float]]
    sent_bytes: dict[str, list[float]]
    transfers: dict[str, list[int]]
    timeline: list[Interval] = field(repr=False)
    memory_timeline: list[list[tuple[float, float]]] = field(repr=False)
    messages: list[Message] = field(repr=False)

    def sent_per_time_step(self, time_step: float, category: str | None = None) -> list[list[int]]:
        """Per worker, the messages (of ``category``, or all) it sent in each time step
        ``[k time_step, (k + 1) time_step)`` of the run: with every action one time step, the
        paper's time steps (Fournier & Oyallon 2024, Table 1: "max com. steps between 2 time
        steps")."""
        if time_step <= 0:
            raise PlanningError(f"a time step must be positive, got {time_step}")
        steps = max(1, math.ceil(self.makespan / time_step))
        counts = [[0] * steps for _ in range(self.schedule.workers)]
        for message in self.messages:
            if category is None or message.category == category:
                counts[message.source][min(int(message.sent // time_step), steps - 1)] += 1
        return counts

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.schedule.family,
            "rule": self.schedule.rule,
            "stages": self.schedule.stages,
            "microbatches": self.schedule.microbatches,
            "steps": self.schedule.steps,
            "workers": self.schedule.workers,
            "makespan": self.makespan,
            "step_end": self.step_end,
            "steady_step": self.steady_step,
            "throughput": self.throughput,
            "bubble_fraction": self.bubble_fraction,
            "busy": self.busy,
            "idle": self.idle,
            "nca": self.nca,
            "peak_activations": {"count": self.peak_activations, "bytes": self.peak_activation_bytes},
            "weight_versions": self.weight_versions,
            "peak_weight_bytes": self.peak_weight_bytes,
            "received_bytes": self.received_bytes,
            "sent_bytes": self.sent_bytes,
            "transfers": self.transfers,
        }


def steady_step(step_end: list[float]) -> float:
    """Time per step once the pipeline is full: the mean spacing of the later half of the steps, the
    last one left out from four steps on (it ends in the drain, where a non-flushing schedule has no
    later step to overlap and finishes its deferred updates at once)."""
    if len(step_end) == 1:
        return step_end[0]
    last = len(step_end) - 1 if len(step_end) >= 4 else len(step_end)
    half = len(step_end) // 2
    return (step_end[last - 1] - step_end[half - 1]) / (last - half)

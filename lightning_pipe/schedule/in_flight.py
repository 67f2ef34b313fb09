"""Activations in flight, counted from a schedule's action orders alone.

A stage keeps what autograd saves from a micro-batch's forward until its last backward half on that
stage (Beaumont et al. 2021, §3.2: the NCA). A worker runs its actions one after the other, so what
it holds at any moment follows from its order: a forward adds its micro-batch's activations, the
last of the micro-batch's backward halves there frees them once it ends. No timing enters, so the
counts are those of the replay (:func:`~lightning_pipe.schedule.peak_memory.activation_peaks`, which
sweeps the same events in time) and are known before any profile: the memory model plans with them
(:func:`~lightning_pipe.planning.memory_model`).

Closed forms cover the families whose workers each hold one stage (GPipe ``m``, 1F1B ``min(k, m)``);
the others do not fit them: a breadth-first looped pipeline keeps every micro-batch on every stage
(``m``, where 1F1B's form gives ``min(k, m)``), an interleaved worker's virtual stages keep more than
1F1B's form on some workers and less on others, and a replicated worker (Rahimi's ``ddp``) runs each
micro-batch through before the next (one per stage).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedule.ir import Kind, Schedule

__all__ = ["stage_in_flight", "worker_peaks"]

_FREES = (Kind.B, Kind.W)


def _sweep(schedule: Schedule, saved: Sequence[float]) -> tuple[list[int], list[float]]:
    """Per stage, the most micro-batches one worker holds at once; per worker, the most bytes
    (``saved[s]`` per micro-batch of stage ``s``)."""
    stages = [0] * schedule.stages
    peaks = [0.0] * schedule.workers
    for worker, order in enumerate(schedule.orders):
        last = {(a.stage, a.microbatch, a.step): i for i, a in enumerate(order) if a.kind in _FREES}
        live = [0] * schedule.stages
        held = 0.0
        for i, action in enumerate(order):
            if action.kind is Kind.F:
                live[action.stage] += 1
                held += saved[action.stage]
                stages[action.stage] = max(stages[action.stage], live[action.stage])
                peaks[worker] = max(peaks[worker], held)
            elif action.kind in _FREES and last.get((action.stage, action.microbatch, action.step)) == i:
                live[action.stage] -= 1
                held -= saved[action.stage]
    return stages, peaks


def stage_in_flight(schedule: Schedule) -> list[int]:
    """Each stage's NCA: the most micro-batches whose activations one worker keeps for it at once."""
    return _sweep(schedule, [0.0] * schedule.stages)[0]


def worker_peaks(schedule: Schedule, saved: Sequence[float]) -> list[float]:
    """Each worker's most activation bytes at once, with ``saved[s]`` bytes per micro-batch of stage
    ``s``: at most the sum of its stages' own peaks, which need not come together."""
    if len(saved) != schedule.stages:
        raise ValueError(f"saved lists {len(saved)} stages, the schedule has {schedule.stages}")
    return _sweep(schedule, saved)[1]

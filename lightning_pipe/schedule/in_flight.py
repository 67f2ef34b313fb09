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

A worker's peak is not its activations' alone either (:func:`worker_holdings`): a stage's gradient
exists from the first backward of a step that makes it until the stage's update frees it (the runtime
keeps no gradient between steps, :meth:`~lightning_pipe.runtime.weights.StageWeights.update`), so under
GPipe the activations of every micro-batch and the gradient are never held together; and while a
backward runs it holds what its largest layer's backward computes, and the new gradient it makes
before adding it into one made by an earlier micro-batch, one backward at a time on a worker however
many stages it computes. On one CPU process every single-device program of a torchvision ResNet-50
allocated 0.96-1.01x what this counts (``python bench/gpu_check.py --cpu-memory``, ``docs/measurements.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.schedule.ir import Kind, Schedule

__all__ = ["Holding", "stage_in_flight", "weight_versions", "worker_holdings"]

_FREES = (Kind.B, Kind.W)
_BACKWARDS = (Kind.B, Kind.I, Kind.W)
_GRADIENTS = (Kind.B, Kind.W)  # the actions that make a stage's weights' gradient


@dataclass(frozen=True)
class Holding:
    """What a stage holds on the worker computing it beyond its weights and optimizer state: ``saved``
    bytes per micro-batch in flight, its weights' ``gradient`` from the first backward of a step until
    its update; while the backward making the step's gradient runs, ``first`` bytes beside the whole
    gradient (:attr:`~lightning_pipe.partition.plan.Stage.first_backward_bytes`); while another of
    its backwards runs, ``backward`` bytes (its largest layer's
    :attr:`~lightning_pipe.cost.records.LayerCost.backward_bytes`) and, where it adds to the step's
    gradient, ``accumulating`` bytes more (the new gradient before it is added)."""

    saved: float
    gradient: float = 0.0
    backward: float = 0.0
    accumulating: float = 0.0
    first: float = 0.0


def stage_in_flight(schedule: Schedule) -> list[int]:
    """Each stage's NCA: the most micro-batches whose activations one worker keeps for it at once."""
    stages = [0] * schedule.stages
    for order in schedule.orders:
        last = {(a.stage, a.microbatch, a.step): i for i, a in enumerate(order) if a.kind in _FREES}
        live = [0] * schedule.stages
        for i, action in enumerate(order):
            if action.kind is Kind.F:
                live[action.stage] += 1
                stages[action.stage] = max(stages[action.stage], live[action.stage])
            elif action.kind in _FREES and last.get((action.stage, action.microbatch, action.step)) == i:
                live[action.stage] -= 1
    return stages


def worker_holdings(schedule: Schedule, holdings: Sequence[Holding]) -> list[float]:
    """Each worker's most bytes at once of what its stages hold (``holdings[s]`` for stage ``s``,
    :class:`Holding`) as it runs its actions in order: a forward adds its micro-batch's activations, a
    backward holds its transient bytes while it runs and makes its stage's gradient, the whole of it
    counted from then on (or adds to it), the last backward half of a micro-batch frees its
    activations, an update frees the gradient."""
    if len(holdings) != schedule.stages:
        raise ValueError(f"holdings lists {len(holdings)} stages, the schedule has {schedule.stages}")
    peaks = []
    for order in schedule.orders:
        last = {(a.stage, a.microbatch, a.step): i for i, a in enumerate(order) if a.kind in _FREES}
        made: set[int] = set()  # the stages whose gradient of the running step exists
        held = gradients = peak = 0.0
        for i, action in enumerate(order):
            stage = holdings[action.stage]
            if action.kind is Kind.F:
                held += stage.saved
                peak = max(peak, held + gradients)
            elif action.kind in _BACKWARDS:
                transient = stage.backward
                if action.kind in _GRADIENTS and action.stage in made:
                    transient += stage.accumulating
                elif action.kind in _GRADIENTS:
                    made.add(action.stage)
                    gradients += stage.gradient
                    transient = stage.first
                peak = max(peak, held + gradients + transient)
                if action.kind in _FREES and last.get((action.stage, action.microbatch, action.step)) == i:
                    held -= stage.saved
            elif action.kind is Kind.UPDATE and action.stage in made:
                made.discard(action.stage)
                gradients -= stage.gradient
        peaks.append(peak)
    return peaks


def weight_versions(schedule: Schedule) -> dict[int, int]:
    """The most versions of each stage's weights its worker holds at once, for each stage computed
    and owned by one worker, which keeps it whole (not relayed): version ``v`` lives from the update
    that makes it (version 0: from the start) until version ``v + 1`` is made and the last action
    using ``v`` has run (PipeDream's weight stashing, Narayanan et al. 2019 §3.3; 2BW's two,
    Narayanan et al. 2021 §3.1). The runtime keeps a retired version's storage as the spare the
    next update writes into (:class:`~lightning_pipe.runtime.weights.StageWeights`), so a stage holds
    this many copies from its first stash on."""
    counts: dict[int, int] = {}
    for worker, order in enumerate(schedule.orders):
        computed = {a.stage for a in order if a.kind in (Kind.F, *_BACKWARDS)}
        for stage in computed:
            if schedule.owners[stage] != (worker,) or (schedule.relays and schedule.relays[stage]):
                continue
            made, used = {0: 0}, {}
            for i, action in enumerate(order):
                if action.stage != stage:
                    continue
                if action.kind is Kind.UPDATE:
                    made[action.step + 1] = i
                elif action.version is not None:
                    used[action.version] = i
            end = len(order)
            spans = [(born, max(made.get(v + 1, end), used.get(v, born))) for v, born in made.items()]
            counts[stage] = max(sum(1 for born, dies in spans if born <= i < dies) for i in range(end)) if end else 1
    return counts

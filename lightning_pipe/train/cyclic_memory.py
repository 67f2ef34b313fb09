"""Activation memory per worker of data parallelism (DP) against Cyclic Data Parallelism (CDP),
measured with the runtime and predicted by the simulator (Fournier & Oyallon 2024, §4.1-4.2,
Table 1, Fig. 4).

A model is cut into ``P = N`` stages (the paper's setting: as many stages as micro-batches) and
trained for a few steps in one of two settings:

- ``one device``: DP runs the ``N`` micro-batches of a step together (every forward, then every
  backward: :func:`~lightning_pipe.schedule.master.ddp` on one worker, forwards first), CDP in the
  cyclic order (``cdp``, ``form="single"``);
- ``processes``: ``N`` processes, each a replica with its own micro-batch; DP all at once
  (:func:`~lightning_pipe.schedule.master.ddp`), CDP each started 1/N of a pass after the previous
  (``cdp``, ``form="dp"``).

The runtime counts the bytes autograd saves for the micro-batches in flight after every action
(``PipelineExecutor(track_memory=True)``); the activation memory per worker is the sum over the
workers at each moment divided by ``N``, and its peak is compared. The simulator replays the same
schedules with the profiled stage costs, and again with the costs the runs measured, and predicts
the same figure. Parameters, gradients and
optimizer state are left out, as in the paper's Fig. 4.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.saved_bytes import saved_bytes
from lightning_pipe.planning import PlanOptions, StagePlan, plan_stages
from lightning_pipe.runtime import PipelineExecutor, run_local
from lightning_pipe.runtime.calibration import Totals, measured_seconds, stage_costs
from lightning_pipe.schedule import StageCosts, simulate
from lightning_pipe.schedule.cyclic import Durations
from lightning_pipe.schedule.ir import Schedule
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.contract import Call, pipeline_model
from lightning_pipe.util.nested import map_tensors, tensors

__all__ = ["SETTINGS", "Measurement", "Split", "measure", "per_worker_peak", "plan_split", "schedule_of"]

SETTINGS = ("one device", "processes")
Builder = Callable[[], nn.Module]


@dataclass(frozen=True)
class Split:
    """The stages of a model: each stage's layer range, the profiled costs of the stages, and each
    stage's saved bytes when its input is the previous stage's output on the same device (a tensor
    both save is held once: :func:`stage_saved_bytes`)."""

    bounds: tuple[tuple[int, int], ...]
    costs: StageCosts
    saved_on_one_device: tuple[float, ...]

    @property
    def durations(self) -> Durations:
        """Each stage's profiled forward and backward seconds."""
        return tuple(self.costs.forward), tuple(self.costs.backward)

    def costs_in(self, setting: str) -> StageCosts:
        """The stage costs as ``setting`` holds the activations."""
        return (
            replace(self.costs, saved_bytes=list(self.saved_on_one_device)) if setting == "one device" else self.costs
        )


@dataclass(frozen=True)
class Measurement:
    """Peak activation memory per worker (bytes) of DP and CDP in one setting: ``measured``,
    ``predicted`` by the simulator from the profiled stage costs, and ``calibrated``: predicted from
    the costs each run measured (each action's mean seconds from its start to the next action's,
    waits left out), which hold what the profile misses (the workers sharing cores, the executor's
    own time between actions)."""

    setting: str
    workers: int
    measured: dict[str, float]
    predicted: dict[str, float]
    calibrated: dict[str, float]

    @property
    def ideal(self) -> float:
        """The paper's ``(N + 1) / 2N``: CDP keeps about ``(N + 1) / 2`` micro-batches where DP keeps ``N``."""
        return (self.workers + 1) / (2 * self.workers)

    def ratio(self, which: str) -> float:
        """CDP's peak over DP's, ``measured``, ``predicted`` or ``calibrated``."""
        values = {"measured": self.measured, "predicted": self.predicted, "calibrated": self.calibrated}[which]
        return values["cdp"] / values["dp"]


def _layers(build: Builder, sample: torch.Tensor, stages: int) -> tuple[list[nn.Module], Any, list[str]]:
    """The model's layers captured for ``stages`` stages (the same on every process: the capture is
    deterministic), the first layer's input for ``sample`` and the layers' names."""
    torch.manual_seed(0)
    model = build().train()
    call = Call((sample,), {})
    captured = pipeline_model(model, call, stages)
    return captured.layers, captured.inputs(call), captured.names


def plan_split(build: Builder, microbatch: torch.Tensor, stages: int, repeats: int = 2) -> Split:
    """Profile the model on one micro-batch and split it into ``stages`` stages of balanced time; each
    stage's saved bytes as the runtime counts them (:func:`stage_saved_bytes`)."""
    layers, inputs, names = _layers(build, microbatch, stages)
    plan = plan_stages(
        layers, inputs, stages, PlanOptions(repeats=repeats), MemoryModel("1f1b", 1), torch.device("cpu"), names=names
    )
    assert plan.plan is not None
    costs = StageCosts.from_plan(plan.plan.to_dict())
    modules = plan.modules(layers)
    apart = stage_saved_bytes(modules, inputs, one_device=False)
    together = stage_saved_bytes(modules, inputs, one_device=True)
    return Split(plan.bounds, replace(costs, saved_bytes=apart), tuple(together))


def stage_saved_bytes(stages: Sequence[nn.Module], inputs: Any, one_device: bool) -> list[float]:
    """What each stage saves for its backward on ``inputs`` (one micro-batch), each stage as one unit,
    as the runtime counts it: a tensor two of its layers save counts once (the profile counts it per
    layer), the data (the first stage's inputs, and views of them further on) not at all. Each stage
    is fed the previous stage's output; on ``one_device`` a tensor the previous stage saved too (its
    output, when its last layer keeps it) is held once, by the previous stage, whose backward comes
    later; on several devices the input is a received copy."""
    saved = []
    current = inputs
    held: set[int] = set()
    data = list(tensors(inputs))
    for stage in stages:
        model_state = [*stage.parameters(), *stage.buffers(), *data]
        try:
            with saved_bytes(model_state) as counted:
                output = stage(current)
        except RuntimeError:  # its first layer works in place on its input: fed a copy, as the runtime does
            with saved_bytes(model_state) as counted:
                output = stage(map_tensors(torch.Tensor.clone, current))
        mine = {key: nbytes for key, nbytes in counted.storages.items() if not (one_device and key in held)}
        saved.append(float(sum(mine.values())))
        held = set(counted.storages)
        current = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), output)
    return saved


def schedule_of(
    setting: str, kind: str, stages: int, workers: int, durations: Durations | None = None
) -> Callable[[int], Schedule]:
    """``steps -> schedule`` of DP (``kind="dp"``) or CDP (``"cdp"``, rule CDP-v2) in ``setting``,
    with ``workers`` micro-batches per step; ``durations`` (each stage's forward and backward
    seconds) start CDP's replicas 1/N of a pass apart in ``processes`` (without them: two time steps)."""
    if setting not in SETTINGS or kind not in ("dp", "cdp"):
        raise ValueError(f"setting must be one of {SETTINGS} and kind 'dp' or 'cdp'; got {setting!r}, {kind!r}")
    if kind == "cdp":
        if setting == "processes":
            options = ScheduleOptions("cdp", form="dp", rule="cdp_v2")
            return options.make(stages, workers, stage_durations=durations)
        options = ScheduleOptions("cdp", form="single", rule="cdp_v2")
    elif setting == "one device":
        options = ScheduleOptions("ddp", workers=1, priority="forward_first")
    else:
        options = ScheduleOptions("ddp", workers=workers)
    return options.make(stages, workers)


def per_worker_peak(curves: Sequence[Sequence[tuple[float, float]]], workers: int) -> float:
    """The peak over time of the workers' summed memory, divided by ``workers``; each curve is
    ``(time, bytes from then on)``. Changes at the same moment count together."""
    events = sorted((time, worker, level) for worker, curve in enumerate(curves) for time, level in curve)
    levels = [0.0] * len(curves)
    peak = 0.0
    for _, changes in itertools.groupby(events, key=lambda event: event[0]):
        for _, worker, level in changes:
            levels[worker] = level
        peak = max(peak, sum(levels))
    return peak / workers


def _measure_worker(
    rank: int,
    build: Builder,
    batch: torch.Tensor,
    classes: int,
    bounds: tuple,
    setting: str,
    microbatches: int,
    steps: int,
    durations: Durations,
) -> dict[str, tuple[list[tuple[float, int]], Totals]]:
    """Worker of :func:`run_local`: train DP then CDP for ``steps`` steps on the same data; the
    saved-activation bytes after every action of each, and its actions' seconds, each to the next
    action's start (:func:`~lightning_pipe.runtime.calibration.measured_seconds` with ``to_next``)."""
    layers, _, _ = _layers(build, batch[: batch.shape[0] // microbatches], len(bounds))
    curves = {}
    for kind in ("dp", "cdp"):
        make = schedule_of(setting, kind, len(bounds), microbatches, durations)
        stages = StagePlan(bounds).modules(layers)
        executor = PipelineExecutor(
            make,
            stages,
            nn.functional.cross_entropy,
            lambda params: torch.optim.SGD(params, lr=1e-3),
            track_memory=True,
        )
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            targets = torch.randint(classes, (batch.shape[0],), generator=generator)
            executor.step((batch,), targets)
        executor.drain()
        executor.close()
        curves[kind] = (list(executor.memory_timeline), measured_seconds(executor.timeline, 1, to_next=True))
    return curves


def measure(
    build: Builder,
    microbatch: torch.Tensor,
    classes: int,
    setting: str,
    workers: int,
    split: Split,
    steps: int = 3,
    timeout: float = 1800,
) -> Measurement:
    """DP against CDP in ``setting`` with ``workers`` micro-batches of ``microbatch``'s shape (one per
    process in ``processes``), ``split``'s stages: measured over ``steps`` steps and predicted."""
    batch = microbatch.repeat(workers, *([1] * (microbatch.dim() - 1)))
    processes = workers if setting == "processes" else 1
    args = (build, batch, classes, split.bounds, setting, workers, steps, split.durations)
    results = run_local(_measure_worker, processes, *args, timeout=timeout)
    measured, predicted, calibrated = {}, {}, {}
    for kind in ("dp", "cdp"):
        measured[kind] = per_worker_peak([result[kind][0] for result in results], workers)
        schedule = schedule_of(setting, kind, len(split.bounds), workers, split.durations)(steps)
        profiled = split.costs_in(setting)
        predicted[kind] = per_worker_peak(simulate(schedule, profiled).memory_timeline, workers)
        ran = replace(
            stage_costs([result[kind][1] for result in results], len(split.bounds)), saved_bytes=profiled.saved_bytes
        )
        calibrated[kind] = per_worker_peak(simulate(schedule, ran).memory_timeline, workers)
    return Measurement(setting, workers, measured, predicted, calibrated)

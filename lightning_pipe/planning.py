"""Planning at set-up: profile the layers, split them into stages, predict the schedule.

What the ``lightning-pipe plan`` and ``simulate`` commands do from the command line, the strategy does
on its first batch: the layers are profiled on the training device with a real micro-batch (or a
saved profile is loaded, or the split is given), partitioned into straight stages by the chosen
partitioner under the memory limit, and the schedule is simulated with the measured costs.

It joins capture, costs, partitioners and schedules, so it sits above them and below the runtime
and the strategy (docs/design.md, "The packages"): the strategy plans with it at its first batch,
and so do the benchmarks and the command line's experiments, without a Trainer.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_pipe.capture import CapturedForward
from lightning_pipe.capture.describe import describe
from lightning_pipe.cost.machine_load import LOADED
from lightning_pipe.cost.memory import EXTRA_COPIES, MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profile_cache import cached_profile, kept_here, profile_key
from lightning_pipe.cost.profile_file import load_profile
from lightning_pipe.cost.profiler import given_names, profile_layers
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.partition import PARTITIONERS, Plan, PlanRequest, partition
from lightning_pipe.partition.plan_file import load_plan
from lightning_pipe.partition.request import check_tolerance
from lightning_pipe.schedule import NON_FLUSHING_FAMILIES, StageCosts, memory_schedule, simulate
from lightning_pipe.schedule.in_flight import stage_in_flight
from lightning_pipe.schedule.ir import Schedule
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.schedule.simulation import Simulation
from lightning_pipe.schedule.stage_costs import check_contention, check_reduce_overlap
from lightning_pipe.tables import placement_table, plan_table, simulation_table
from lightning_pipe.util.units import format_bytes
from lightning_pipe.worker_memory import WorkerMemory

__all__ = [
    "PREDICTED_STEPS",
    "SETUP_PHASES",
    "PlanOptions",
    "StagePlan",
    "every_worker_a_stage",
    "in_flight_counts",
    "memory_model",
    "optimizer_copies",
    "plan_stages",
    "predict",
    "profile_costs",
    "schedule_of",
    "setup_line",
    "setup_report",
    "timed",
    "within_workers",
]

DEFAULT_TOLERANCE = 0.02
"""Near-ties of measured splits (``PlanOptions.tolerance``): within 2% of the fastest split."""
PREDICTED_STEPS = 4
"""Steps the prediction simulates: :func:`~lightning_pipe.schedule.simulation.steady_step` leaves the
last step (the drain) out from four steps on; from three, a non-flushing family's step was predicted
shorter than its slowest stage's compute (2BW, m = 2, stages of 18 and 15 ms: 15.75 ms)."""
SHARES = 4
"""Per-stage limits :func:`within_workers` plans again with, where a worker computing several stages
goes over the memory limit with them together: evenly spaced from near the whole limit down to the
limit over the most stages a worker computes."""
SETUP_PHASES = ("capture", "verify", "profile", "plan")
"""The phases of a pipeline's set-up timed apart (``PipelineStrategy.setup_seconds``, ``bench/setup_time.py``)."""


@contextmanager
def timed(seconds: dict[str, float] | None, phase: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block (``time.perf_counter``) to ``seconds[phase]``; nothing
    is timed without ``seconds``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def setup_line(seconds: dict[str, float]) -> str:
    """``Pipeline set-up 3.2 s: capture 0.6 s, verify 0.2 s, ...``: ``seconds['total']`` and each
    other phase in it, in order."""
    parts = ", ".join(f"{phase} {value:.1f} s" for phase, value in seconds.items() if phase != "total")
    return f"Pipeline set-up {seconds['total']:.1f} s: {parts}"


@dataclass(frozen=True)
class PlanOptions:
    """How the layers are split into stages.

    Attributes:
        partitioner: a key of :data:`~lightning_pipe.partition.PARTITIONERS`.
        memory_limit: bytes per device (``None``: no limit).
        bandwidth: bytes per second between devices (``inf``: communication is free).
        contention: how many times slower an action runs while every device computes, for the
            prediction (``StageCosts.contention``; 1: devices share nothing, e.g. GPUs).
        reduce_overlap: the share of replicas' all-reduce of gradients that runs beside the compute,
            for the prediction (``StageCosts.reduce_overlap``; 1: all of it, e.g. GPUs).
        profile: a saved profile (JSON or PipeDream ``graph.txt``) to use instead of profiling.
        plan: a plan from ``lightning-pipe plan --json`` to use as is.
        balance: layers per stage (e.g. ``[3, 2]``), instead of planning.
        stage_replicas: workers per stage with ``balance`` for ``1f1b_rr`` (PipeDream's replicated
            stages); planned by the partitioner otherwise.
        repeats: timed runs per layer when profiling.
        tolerance: splits within this fraction of the fastest one's bottleneck are ties, decided by
            the least memory, then the fewest FLOPs in the largest stage (``PlanRequest.tolerance``),
            so that the jitter of the profile's times moves the split less often
            (``bench/plan_stability.py``).
        cache: where measured profiles are kept from run to run (:mod:`~lightning_pipe.cost.profile_cache`), so that
            the same model on the same machine is planned from the same profile; ``None``: not kept.
    """

    partitioner: str = "time"
    memory_limit: float | None = None
    bandwidth: float = float("inf")
    contention: float = 1.0
    reduce_overlap: float = 1.0
    profile: str | None = None
    plan: str | None = None
    balance: Sequence[int] | None = None
    stage_replicas: Sequence[int] | None = None
    repeats: int = 3
    tolerance: float = DEFAULT_TOLERANCE
    cache: Path | None = None

    def __post_init__(self) -> None:
        """Refuse what no model could be planned with (a file is read here to check it; whether it
        describes the model is checked when planning)."""
        if self.partitioner not in PARTITIONERS:
            raise PlanningError(f"unknown partitioner {self.partitioner!r}; choose one of {', '.join(PARTITIONERS)}")
        if sum(x is not None for x in (self.plan, self.balance)) > 1:
            raise PlanningError("give at most one of plan= and balance=")
        check_contention(self.contention)
        check_reduce_overlap(self.reduce_overlap)
        check_tolerance(self.tolerance, "plan_tolerance")
        _check_counts("balance", self.balance, "layers")
        _check_counts("stage_replicas", self.stage_replicas, "workers")
        for name, load in (("profile", load_profile), ("plan", load_plan)):
            path = getattr(self, name)
            if path is not None and not isinstance(path, str | os.PathLike):
                raise PlanningError(f"{name} must be the path of a {name} file, or None; got {path!r}")
            if path is not None:
                load(path)
        if self.cache is not None and self.cache.exists() and not self.cache.is_dir():
            raise PlanningError(
                f"the profile cache {self.cache} is a file, not a directory: give profile_cache a directory, or "
                "False to measure every run (the default directory is $LIGHTNING_PIPE_CACHE when set)"
            )


@dataclass(frozen=True)
class StagePlan:
    """Layer ranges per stage, with the plan and profile they came from (when planned) and the names
    of the layers they split (when known)."""

    bounds: tuple[tuple[int, int], ...]
    plan: Plan | None = None
    costs: ChainCosts | None = None
    replicas: tuple[int, ...] | None = None
    names: tuple[str, ...] | None = None

    def modules(self, layers: Sequence[nn.Module]) -> list[nn.Sequential]:
        """The stage modules: each an ``nn.Sequential`` of the model's own layers (shared, not copied)."""
        return [nn.Sequential(*layers[first : last + 1]) for first, last in self.bounds]

    def to_dict(self) -> dict[str, object]:
        """The plan as ``lightning-pipe plan --json`` writes it (with the profile's name), or the
        stages' layer ranges when they were given, and the model's layers (their count and names,
        which a run given the file compares with its own: :mod:`lightning_pipe.partition.plan_file`);
        ``PipelineStrategy(plan=path)`` reads either."""
        model = {} if self.names is None else {"layers": len(self.names), "layer_names": list(self.names)}
        if self.plan is not None:
            return {"profile": self.costs.name if self.costs is not None else None, **model, **self.plan.to_dict()}
        replicas = self.replicas or (1,) * len(self.bounds)
        spans = [{"layers": [a, b], "replicas": r} for (a, b), r in zip(self.bounds, replicas, strict=True)]
        return {**model, "stages": spans}


def _check_counts(name: str, value: object, unit: str) -> None:
    """Refuse a ``balance`` or ``stage_replicas`` that is not ``None`` or a list of whole numbers >= 1."""
    if value is None:
        return
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise PlanningError(f"{name} must list the {unit} of each stage, e.g. [3, 2], or be None; got {value!r}")
    for count in value:
        check_whole(f"every {name} entry", count, 1, unit)


def memory_model(
    family: str, microbatches: int, extra_copies: float, recompute: bool = False, counts: Sequence[int] | None = None
) -> MemoryModel:
    """The memory model a run of ``family`` with ``microbatches`` per step is planned with: the
    family's in-flight activations (its schedule's ``counts``, :func:`in_flight_counts`; the closed
    form of :func:`~lightning_pipe.schedule.memory_schedule` without them) and weight versions, the
    flushing families' early cool-down gradients, the gradient a stage adds into its last one, and
    ``recompute``'s inputs in flight."""
    return MemoryModel(
        memory_schedule(family),
        microbatches,
        extra_copies,
        split_backward=family not in NON_FLUSHING_FAMILIES,
        accumulation=True,
        recompute=recompute,
        counts=None if counts is None else tuple(counts),
    )


def in_flight_counts(options: ScheduleOptions, stages: int, microbatches: int) -> tuple[int, ...] | None:
    """Each stage's activations in flight under ``options``' schedule on ``stages`` straight stages
    with ``microbatches`` per step, counted from its actions
    (:func:`~lightning_pipe.schedule.in_flight.stage_in_flight`); ``None`` for ``1f1b_rr``, whose
    replicas the split decides (PipeDream's closed form prices them)."""
    if options.family == "1f1b_rr":
        return None
    return tuple(stage_in_flight(options.make(stages, microbatches)(PREDICTED_STEPS)))


def optimizer_copies(optimizer: torch.optim.Optimizer | None) -> int:
    """Parameter-sized copies the optimizer keeps besides the weights (ZeRO's accounting)."""
    if optimizer is None:
        return EXTRA_COPIES["sgd"]
    name = type(optimizer).__name__.lower()
    if name.startswith("adam") or name in ("lamb", "nadam", "radam"):
        return EXTRA_COPIES["adam"]
    momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
    return EXTRA_COPIES["momentum" if momentum else "sgd"]


def _bounds_from_balance(balance: Sequence[int], layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    if len(balance) != stages or any(not isinstance(n, int) or n < 1 for n in balance) or sum(balance) != layers:
        raise PlanningError(
            f"balance={list(balance)} must give {stages} positive layer counts summing to the {layers} layers"
        )
    starts = [sum(balance[:i]) for i in range(stages)]
    return tuple((start, start + n - 1) for start, n in zip(starts, balance, strict=True))


def _run_whole_said(whole: Mapping[str, str]) -> str:
    """The modules run whole (path -> why) as the refusal of more stages than layers says them."""
    if not whole:
        return ""
    listed = "; ".join(f"{path}: {why}" for path, why in whole.items())
    return (
        f"{', '.join(whole)} run{'s' if len(whole) == 1 else ''} whole, inside one layer, because "
        f"{'its' if len(whole) == 1 else 'their'} forward cannot be traced ({listed}). A module whose forward runs "
        "other operations in training than in evaluation (torchvision's GoogLeNet and Inception-v3 with "
        "aux_logits=True compute their auxiliary heads in training only) runs whole: build it to run the same "
        "operations in both (aux_logits=False), or define configure_pipeline(self) returning the ordered layers. "
    )


def plan_stages(
    layers: Sequence[nn.Module],
    sample: Any,
    workers: int,
    options: PlanOptions,
    memory: MemoryModel,
    device: torch.device,
    replicate: bool = False,
    names: Sequence[str] | None = None,
    seconds: dict[str, float] | None = None,
    runs_on: torch.device | None = None,
    whole: Mapping[str, str] | None = None,
) -> StagePlan:
    """Split ``layers`` (named ``names``) into straight stages, one per worker, or — with
    ``replicate`` (``1f1b_rr``) — into stages replicated over ``workers`` workers (see the module
    docstring). The time spent profiling is added to ``seconds['profile']`` (:func:`timed`).
    ``whole``: the modules run whole inside a layer, with why (their forward could not be traced),
    which a refusal of more stages than layers names."""
    if workers > len(layers) and not replicate:
        shown = f" ({', '.join(names)})" if names is not None else ""
        raise PlanningError(
            f"{workers} stages but the model has {len(layers)} layer{'s' if len(layers) != 1 else ''}{shown}: a stage "
            f"holds at least one layer. {_run_whole_said(whole or {})}Train it on at most {len(layers)} "
            f"device{'s' if len(layers) != 1 else ''} (devices=1 needs no pipeline: strategy='auto'), or pipeline a "
            "model with more layers (a forward that calls more modules)"
        )
    known = None if names is None else tuple(names)
    if options.balance is not None:
        replicas = _replicas_given(options, workers) if replicate else None
        stages = len(options.balance) if replicate else workers
        return StagePlan(_bounds_from_balance(options.balance, len(layers), stages), replicas=replicas, names=known)
    if options.plan is not None:
        return _plan_file(options.plan, len(layers), known, workers, replicate)
    costs = profile_costs(layers, sample, options, device, names, seconds, runs_on)
    request = PlanRequest(
        costs,
        devices=workers,
        memory_limit=options.memory_limit,
        memory=memory,
        network=Network(options.bandwidth),
        straight=not replicate,
        tolerance=options.tolerance,
    )
    plan = partition(request, options.partitioner)
    if not plan.contiguous:
        raise PlanningError(
            f"the {options.partitioner} partitioner gave stages of non-adjacent layers, which the strategy does not "
            "place yet: use a contiguous partitioner (time, flops, params, pipedream, memory, exact, uniform)"
        )
    if replicate and plan.devices_used != workers:
        raise PlanningError(
            f"the {options.partitioner} plan uses {plan.devices_used} of the {workers} workers: 1f1b_rr needs every "
            "worker placed (use the pipedream partitioner, or give balance= and stage_replicas=)"
        )
    if not replicate and len(plan.stages) < workers:
        plan = every_worker_a_stage(request, plan, costs.column("seconds"))
    bounds = tuple((s.layers[0], s.layers[-1]) for s in plan.stages)
    return StagePlan(bounds, plan, costs, tuple(s.replicas for s in plan.stages) if replicate else None, known)


def within_workers(
    plan_once: Callable[[PlanOptions], StagePlan], options: PlanOptions, schedule: ScheduleOptions, microbatches: int
) -> StagePlan:
    """``plan_once(options)``, its memory limit kept per worker, not only per stage
    (:class:`~lightning_pipe.worker_memory.WorkerMemory`): where the workers compute several
    stages (interleaved and looped pipelines, Rahimi's replicated families) and one goes over the limit
    with its stages together, the stages are planned again, each within a smaller share of the limit
    (:data:`SHARES` of them, from near the whole limit down to the limit over a worker's stages), and
    the first plan whose workers fit is kept: the least constrained, so the fastest as a rule; a plan
    over the limit at every share is refused, naming what each worker needs."""
    stage_plan = plan_once(options)
    limit = options.memory_limit
    if limit is None or stage_plan.plan is None:
        return stage_plan
    held = _held(stage_plan, schedule, microbatches)
    needs = _needs(held, stage_plan)
    if max(needs) <= limit * (1 + 1e-9):
        return stage_plan
    most = max(len(mine) for mine in held.owned)
    for share in range(1, SHARES + 1) if most > 1 else ():
        try:
            shared = plan_once(replace(options, memory_limit=limit * (1 - (1 - 1 / most) * share / SHARES)))
        except PlanningError:
            continue
        if max(_needs(_held(shared, schedule, microbatches), shared)) <= limit * (1 + 1e-9):
            return shared
    worst = max(range(len(needs)), key=needs.__getitem__)
    count = len(held.owned[worst])
    raise PlanningError(
        f"worker {worst} computes {count} stage{'s' if count > 1 else ''} of {schedule.family} and needs "
        f"{format_bytes(needs[worst])} for them together, over memory_limit={format_bytes(limit)} "
        f"(each worker: {', '.join(format_bytes(n) for n in needs)}): raise the limit to at least "
        f"{format_bytes(max(needs))}, recompute activations (recompute=True), run more devices, or let "
        "schedule='auto' choose a configuration that fits"
    )


def _needs(held: WorkerMemory, stage_plan: StagePlan) -> list[float]:
    """Each worker's bytes under ``stage_plan``, no stage recomputing."""
    assert stage_plan.plan is not None
    return held.bytes_under(stage_plan.plan, [False] * len(stage_plan.bounds))


def _held(stage_plan: StagePlan, schedule: ScheduleOptions, microbatches: int) -> WorkerMemory:
    assert stage_plan.costs is not None
    steps = schedule_of(stage_plan, schedule, microbatches)(PREDICTED_STEPS)
    return WorkerMemory.of(steps, stage_plan.costs, stage_plan.bounds)


def every_worker_a_stage(request: PlanRequest, plan: Plan, seconds: Sequence[float]) -> Plan:
    """``plan`` split into one stage per worker. A partitioner uses at most the devices it is given,
    and fewer when one layer's time bounds every split (a large first layer); every rank of the
    pipeline holds a stage, so the longest stage with two layers or more is cut in two where the
    longer half is shortest, until there are as many as workers: no stage's compute grows."""
    spans = [(stage.layers[0], stage.layers[-1]) for stage in plan.stages]
    while len(spans) < request.devices:
        index = max(
            (i for i, (first, last) in enumerate(spans) if last > first),
            key=lambda i: sum(seconds[spans[i][0] : spans[i][1] + 1]),
        )
        first, last = spans[index]
        cut = min(
            range(first, last),
            key=lambda c: max(sum(seconds[first : c + 1]), sum(seconds[c + 1 : last + 1])),
        )
        spans[index : index + 1] = [(first, cut), (cut + 1, last)]
    note = f"{len(plan.stages)} stages were as fast; split to one per worker"
    return request.plan_spans(plan.partitioner, [(first, last, 1) for first, last in spans], [*plan.notes, note])


def profile_costs(
    layers: Sequence[nn.Module],
    sample: Any,
    options: PlanOptions,
    device: torch.device,
    names: Sequence[str] | None = None,
    seconds: dict[str, float] | None = None,
    runs_on: torch.device | None = None,
) -> ChainCosts:
    """The profile a plan is made from: ``options.profile``'s file (checked against the layers), or
    the layers profiled on ``device`` with ``sample``, one micro-batch (kept from run to run in
    ``options.cache``); the time profiling takes is added to ``seconds['profile']``. A model on the
    meta device is timed from its FLOPs at the measured rate of ``runs_on``, the device that will
    train it (default: the current accelerator, else the CPU)."""
    if options.profile is not None:
        costs = load_profile(options.profile)
        _check_same_model(options.profile, "profile", len(costs), given_names(costs), len(layers), names)
        return costs
    with timed(seconds, "profile"):
        return _profile(layers, sample, device, options, names, runs_on)


def _profile(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    options: PlanOptions,
    names: Sequence[str] | None,
    runs_on: torch.device | None = None,
) -> ChainCosts:
    """The layers' profile: measured, or the one measured before for the same layers, micro-batch and
    device (``options.cache``; a meta-device model's profile is computed from its FLOPs at the
    current accelerator's measured rate, else the CPU's: not kept)."""

    def measure() -> ChainCosts:
        return profile_layers(
            list(layers), sample, device=device, repeats=options.repeats, layer_names=names, rate_device=runs_on
        )

    if options.cache is None or device.type == "meta":
        return measure()
    key = profile_key(layers, names, sample, device, options.repeats)
    costs, path, reused = cached_profile(options.cache, key, measure, len(layers))
    if reused and not kept_here(path):  # an earlier run's, not this run's own
        load = costs.meta.get("load")
        loaded = (
            f" It was measured while other processes kept {load:.0%} of the processors busy, and the machine is no "
            "quieter now: it is measured anew once it is."
            if isinstance(load, int | float) and load >= LOADED
            else ""
        )
        rank_zero_info(
            f"Profile of these {len(layers)} layers on this device reused from {path}: planned as the run that "
            f"measured it (profile_cache=False, or deleting the file, measures anew).{loaded}"
        )
    return costs


def _replicas_given(options: PlanOptions, workers: int) -> tuple[int, ...]:
    replicas = options.stage_replicas
    assert options.balance is not None
    count = len(options.balance)
    if replicas is None or len(replicas) != count or sum(replicas) != workers or min(replicas) < 1:
        example = [workers - count + 1] + [1] * (count - 1)
        raise PlanningError(
            f"1f1b_rr with balance={list(options.balance)} needs stage_replicas: one worker count >= 1 per stage, "
            f"summing to the {workers} workers (e.g. {example})"
        )
    return tuple(replicas)


def _plan_file(path: str, layers: int, names: tuple[str, ...] | None, workers: int, replicate: bool) -> StagePlan:
    plan = load_plan(path)
    _check_same_model(path, "plan", plan.layers, plan.names, layers, names)
    spans = plan.stages
    expected = sum(plan.replicas) if replicate else len(spans)
    if (
        expected != workers
        or not plan.contiguous
        or any(len(span) != 2 for span in spans)
        or (not replicate and set(plan.replicas) != {1})
    ):
        raise PlanningError(
            f"{path} holds {len(spans)} stages on {sum(plan.replicas)} devices (contiguous ones needed); this run has "
            f"{workers} workers" + ("" if replicate else ", one stage each") + f". {_ANEW['plan']}"
        )
    if spans[0][0] != 0 or spans[-1][1] != layers - 1 or any(a[1] + 1 != b[0] for a, b in itertools.pairwise(spans)):
        raise PlanningError(
            f"{path} does not split the {layers} layers of this model into consecutive stages. {_ANEW['plan']}"
        )
    return StagePlan(tuple((a, b) for a, b in spans), replicas=plan.replicas if replicate else None, names=names)


_ANEW = {
    "plan": "Plan this model anew (leave plan= out; Hydra: pipeline.plan=null), or give the plan.json of a run of "
    "this model",
    "profile": "Profile this model anew (leave profile= out; Hydra: pipeline.profile=null), or give a profile of this "
    "model (lightning-pipe plan --model ... --save-profile FILE)",
}


def _check_same_model(
    path: str, kind: str, count: int, described: Sequence[str] | None, layers: int, names: Sequence[str] | None
) -> None:
    """Refuse a ``kind`` file (``plan`` or ``profile``) made for another model: it describes ``count``
    layers named ``described`` where this model has ``layers`` named ``names`` (names compared where
    both are known)."""
    if count == layers and (described is None or names is None or list(described) == list(names)):
        return
    where = ""
    if count == layers:
        assert described is not None and names is not None
        i = next(i for i, (there, here) in enumerate(zip(described, names, strict=True)) if there != here)
        where = f"; layer {i} is {described[i]} there, {names[i]} here"
    raise PlanningError(
        f"{path} is a {kind} of another model: it describes {_layers(count, described)}, this model has "
        f"{_layers(layers, names)}{where}. {_ANEW[kind]}"
    )


def _layers(count: int, names: Sequence[str] | None) -> str:
    """``6 layers (net.flatten .. net.head)``, or ``6 layers`` without names."""
    shown = "" if not names else f" ({names[0]})" if count == 1 else f" ({names[0]} .. {names[-1]})"
    return f"{count} layer{'s' if count != 1 else ''}{shown}"


def schedule_of(stage_plan: StagePlan, schedule: ScheduleOptions, microbatches: int) -> Callable[[int], Schedule]:
    """``steps -> schedule`` for the plan's stages (and their replicas, for ``1f1b_rr``; their profiled
    durations, which space CDP's dp-form replicas 1/N of a pass apart)."""
    extra: dict[str, object] = {}
    if stage_plan.replicas is not None:
        extra["stage_replicas"] = list(stage_plan.replicas)
    if schedule.family == "cdp" and schedule.form == "dp" and stage_plan.plan is not None:
        stages = stage_plan.plan.stages
        extra["stage_durations"] = ([s.forward_seconds for s in stages], [s.backward_seconds for s in stages])
    return schedule.make(len(stage_plan.bounds), microbatches, **extra)


def predict(
    stage_plan: StagePlan,
    schedule: ScheduleOptions,
    microbatches: int,
    contention: float = 1.0,
    recompute: bool | Sequence[bool] = False,
    action_seconds: float = 0.0,
    update: Sequence[float] | None = None,
    scale: float = 1.0,
    bandwidth: float | None = None,
    reduce_overlap: float = 1.0,
) -> Simulation | None:
    """The schedule simulated with the plan's measured costs (``None`` without a profile), on devices
    sharing one machine by ``contention``; a stage recomputing (``recompute``: all, or per stage) runs its
    forward again in its backward (Huang et al. 2019, §2.3), every forward and backward costs
    ``scale`` × its profile + ``action_seconds`` (what a run measured beyond the profile:
    :class:`~lightning_pipe.cost.calibrated.Calibration`), and each stage's update ``update`` seconds
    (:class:`~lightning_pipe.cost.update_rate.UpdatePrices`; none: free); messages travel at the plan's
    bandwidth, or at ``bandwidth`` when given, and ``reduce_overlap`` of a replicas' all-reduce runs
    beside the compute (``StageCosts.reduce_overlap``)."""
    if stage_plan.plan is None:
        return None
    costs = StageCosts.from_plan(stage_plan.plan.to_dict(), replicated=stage_plan.replicas is not None)
    again = [recompute] * len(costs.forward) if isinstance(recompute, bool) else list(recompute)
    forward = [scale * f + action_seconds for f in costs.forward]
    backward = [
        scale * b + action_seconds + (f if r else 0.0) for f, b, r in zip(forward, costs.backward, again, strict=True)
    ]
    updates = None if update is None else list(update)
    links = costs.bandwidth if bandwidth is None else bandwidth
    costs = replace(
        costs,
        forward=forward,
        backward=backward,
        contention=contention,
        update=updates,
        bandwidth=links,
        reduce_overlap=reduce_overlap,
    )
    return simulate(schedule_of(stage_plan, schedule, microbatches)(PREDICTED_STEPS), costs, early_gradients=True)


def setup_report(
    stage_plan: StagePlan,
    prediction: Simulation | None,
    captured: CapturedForward | None = None,
    schedule: Schedule | None = None,
) -> str:
    """The set-up report rank 0 prints once the plan is made (the end-of-fit one is
    :mod:`~lightning_pipe.strategy.fit_report`'s): the captured layers and cuts (when ``forward`` was
    captured), the plan table, the placement of ``schedule`` and the prediction, as ``lightning-pipe
    plan`` and ``simulate`` print them."""
    lines = [describe(captured, stage_plan.bounds)] if captured is not None else []
    placement = [placement_table(schedule)] if schedule is not None else []
    if stage_plan.plan is None or stage_plan.costs is None:
        spans = ", ".join(f"{a}..{b}" for a, b in stage_plan.bounds)
        return "\n".join([*lines, f"Pipeline stages (layers, as given): {spans}", *placement])
    lines += [plan_table(stage_plan.costs, stage_plan.plan), *placement]
    if prediction is not None:
        lines += ["===== Predicted schedule (measured costs, seconds) =====", simulation_table(prediction)]
    return "\n".join(lines)

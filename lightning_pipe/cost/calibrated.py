"""What a run measured beyond the layer profile, and keeping it for the next run's prediction.

A profile taken layer by layer, one process at a time, misses what the pipeline adds to each action
(the executor's own time, its messages, the other processes computing at the same time) and to each
step (Lightning's loop, the strategy's log relay). A run measures both: its actions' seconds against
the profile's give ``scale`` and ``fixed`` (:func:`calibration`), its steps against the simulation of
its measured actions give ``per_step`` (:class:`Calibration`, :func:`separated`). ``schedule="auto"`` re-ranks its
candidates with them after its first steps (:mod:`lightning_pipe.strategy.calibrating`); and every
run keeps them beside its profile (:func:`keep_calibration`), so that the next run of the same model
on the same machine predicts its step with them from the start (:func:`kept_calibration`): on 2 CPU
processes the profile alone predicted the steps of a 6-block transformer 12-30% short, all of it
what the runtime adds (``bench/auto_plan.py``, ``docs/measurements.md``).

A calibration is kept under a key of the layers, their parameters, the device and the versions of torch and
this package (:func:`~lightning_pipe.cost.profile_cache.profile_key` without a micro-batch): what a run adds
does not depend on the micro-batch's rows the way the profile does, and the next run may split it into
another count. A fit of another cut of the model into layers, with nothing kept under its own key, is priced
with what the model's other cuts kept (:func:`other_cuts`). Calibrations are kept per schedule family,
micro-batch size and pinning (:class:`RunShape`), and a prediction takes the closest shape kept: the same
family and size, else the same size (the same profile) measured on the same kind of family
(:func:`family_kind`: replicating stages or not, one stage per worker or several, each backward one action
or two), else the same size and replication, else the same family, else the same kind, else the same
replication, else the same size, else the last kept; at each, the same pinning first. The last
:data:`KEPT_PER_SHAPE` fits of a shape are kept, and a prediction takes the lower median of each of their
figures (:func:`typical`): one fit run through a slow stretch of the machine no longer prices every later
fit of its shape (on 2 CPU processes a CIFAR ResNet-18's 2BW and CDP fits that ran 1.4-1.7x their usual step
kept rates of 1.70x and 1.75x the profile, where the same configurations measured 1.17x and 1.20x in the
next round, and the chain's set-up predictions priced with them missed by 13-40% on five rows:
``bench/auto_plan.py``, ``docs/measurements.md``). Those fits ran at the machine's rate of their time:
the rate priced with follows half the drift measured since by later fits of the same kind, each against
its own shape's fits up to then (:func:`machine_drift`; replayed over 1,975 fits of a shape kept before,
1,680 came within 10% of their own rate, against 1,580 priced as kept: ``bench/calibration_transfer.py``).
What a run adds depends on all of these:
replicas that all-reduce their gradients every step (Rahimi's ``ddp``) spend in their actions the
waits for the slowest replica, a pipeline does not (on 2 CPU processes an MLP's ``ddp`` run measured
its actions 2.5x its profile, its 1F1B runs 0.6-1.3x; its 2BW steps, predicted from the
calibration of its ``ddp`` run at the same size, came out 53-83% long); a worker holding several
stages, or splitting each backward, runs more and smaller actions for the same work, each paying the
runtime's own time (an MLP's in-run actions measured 3.0-3.8x its profile under interleaved 1F1B at 32
rows a micro-batch, 2.1-2.5x under 1F1B and 2BW; its 2BW steps, priced from the interleaved run's
calibration, came out 56% long: ``bench/auto_plan.py``, and ``bench/calibration_transfer.py`` replays
the rules on the calibrations its fits kept); the profile of a smaller
micro-batch is another measurement, off the run by another factor (torchvision's ResNet-18 at 4 rows a
micro-batch, predicted from a calibration measured at 16, came out 20-35% off:
``bench/auto_plan.py``); and threads pinned to cores run at another rate (the same ResNet-18's rows,
each predicted from the calibration of the same configuration with the other pinning, came out up to
32% short unpinned and up to 22% long pinned).
Each holds the configuration it was measured on and when.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import SPLIT_BACKWARD_FAMILIES
from lightning_pipe.schedule.options import LOOPED_FAMILIES, PLACED_FAMILIES
from lightning_pipe.util.files import kept_document, kept_runs, replace_json
from lightning_pipe.util.units import format_seconds

__all__ = [
    "DRIFT_FITS",
    "DRIFT_SHARE",
    "KEPT_PER_SHAPE",
    "REPLICATING_FAMILIES",
    "Calibration",
    "KeptFits",
    "Kind",
    "Priced",
    "RunShape",
    "calibration",
    "calibration_path",
    "closest_fits",
    "closest_kept",
    "family_kind",
    "keep_calibration",
    "kept_calibration",
    "kept_fits",
    "machine_drift",
    "other_cuts",
    "separated",
    "typical",
]


_FIGURES = ("scale", "fixed", "per_step")
"""A calibration's measured figures."""

KEPT_PER_SHAPE = 5
"""The fits of one shape (:class:`RunShape`) whose calibrations are kept: their median (:func:`typical`)
leaves out up to two measured through a slow stretch of the machine, and follows a lasting change of
its speed within three fits."""

DRIFT_FITS = 3
"""The latest fits whose rates tell how the machine drifted (:func:`machine_drift`: their median)."""

DRIFT_SHARE = 0.5
"""The share of the measured drift a prediction follows (its exponent): the drift is read from fits as
noisy as the one priced, so half of it. Replayed over 1,975 fits of shapes kept before
(``bench/calibration_transfer.py``, 2026-11-30), a rate corrected by none of it came within 10% of the
fit's own on 1,580, by half on 1,680, by all of it on 1,635."""

Kind = Callable[[object], tuple[bool, ...]]
"""What tells schedule families apart for a calibration's lookup (:func:`family_kind`)."""

REPLICATING_FAMILIES: tuple[str, ...] = (*PLACED_FAMILIES, "1f1b_rr")
"""The families whose workers compute replicas of the same stages and sum their gradients every step
(Rahimi's placed families and PipeDream's 1F1B-RR): their actions take in the waits for the slowest
replica, a pipeline's do not, so a calibration of one kind prices the other poorly."""


class Priced(Protocol):
    """A configuration's simulated step (``step_seconds``), its busiest worker's seconds of actions
    per step (``busiest_seconds``), and whether its steps end with the pipeline empty (``flushes``)."""

    @property
    def step_seconds(self) -> float: ...

    @property
    def busiest_seconds(self) -> float: ...

    @property
    def flushes(self) -> bool: ...


def calibration(profiled: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """``(scale, fixed)`` fitting ``measured ≈ scale × profiled + fixed`` by least squares over the
    actions' seconds (each stage's forward and backward), with ``fixed >= 0``: the profile's rate
    error (a busy machine, contention) and the runtime's fixed cost per action. Where the profiled
    values do not vary, or the fit would need a negative fixed cost, the fit goes through zero."""
    if len(profiled) != len(measured) or not profiled:
        raise PlanningError(f"calibration needs as many measured values as profiled ones, at least one: {profiled!r}")
    n = len(profiled)
    mean_x, mean_y = math.fsum(profiled) / n, math.fsum(measured) / n
    spread = math.fsum((x - mean_x) ** 2 for x in profiled)
    if spread > 1e-12 * max(mean_x**2, 1e-300) * n:
        scale = math.fsum((x - mean_x) * (y - mean_y) for x, y in zip(profiled, measured, strict=True)) / spread
        fixed = mean_y - scale * mean_x
        if scale > 0 and fixed >= 0:
            return scale, fixed
    squares = math.fsum(x * x for x in profiled)
    if squares <= 0:
        return 1.0, max(mean_y, 0.0)
    return max(math.fsum(x * y for x, y in zip(profiled, measured, strict=True)) / squares, 1e-12), 0.0


def separated(profiled: Sequence[float], compute: Sequence[float], until_next: Sequence[float]) -> tuple[float, float]:
    """``(scale, fixed)`` of a run's actions measured two ways: ``scale`` is the rate of their
    ``compute`` (waits excluded) against their ``profiled`` seconds, through zero (what contention
    and a colder cache add grows with the work); ``fixed`` the mean time the executor spends per
    action beyond its compute, until the next action starts (``until_next``; its messages, its own
    bookkeeping), which does not. Each list holds every stage's forward, then backward. Measured
    apart, neither absorbs the other, as a line fitted through few actions of similar length can
    (on torchvision's ResNet-18 such a fit at two micro-batches predicted four 20-40% long)."""
    if not len(profiled) == len(compute) == len(until_next) or not profiled:
        raise PlanningError(
            f"calibration needs as many measured values as profiled ones, at least one: {profiled!r}, {compute!r}"
        )
    total = math.fsum(profiled)
    scale = math.fsum(compute) / total if total > 0 else 1.0
    beyond = math.fsum(after - alone for after, alone in zip(until_next, compute, strict=True)) / len(compute)
    return max(scale, 1e-12), max(beyond, 0.0)


@dataclass(frozen=True)
class Calibration:
    """What a run measured beyond the profile: each action is ``scale`` × its profiled seconds +
    ``fixed`` (:func:`calibration`, the executor's own time between actions included), and each worker
    spends ``per_step`` each training step outside its actions (Lightning's loop, the strategy's log
    relay: what a simulation of the actions leaves out), whatever the configuration.

    Where that time goes depends on the schedule: a flushing one's step ends with the pipeline
    empty, so every worker's ``per_step`` adds to the step; a non-flushing one's workers spend it
    while the others still compute the micro-batches in flight, so a step takes the simulated one or
    the busiest worker's actions and ``per_step``, whichever is longer (on 2 CPU processes an MLP's
    2BW steps measured 0.68x 1F1B's, where adding ``per_step`` to both predicted them equal).

    ``measured_on`` names the configuration and the date the calibration was measured on, when kept;
    ``replicating`` says whether it was measured on a family of :data:`REPLICATING_FAMILIES`: its
    actions then ran beside their replicas' all-reduces and carry what those took from them, so a
    prediction priced with it runs the all-reduces beside the compute (``StageCosts.reduce_overlap``
    = 1), where one priced with a pipeline's takes the share measured among the ranks."""

    scale: float
    fixed: float
    per_step: float
    measured_on: str = ""
    replicating: bool = False

    def __post_init__(self) -> None:
        for name in _FIGURES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise PlanningError(f"calibration {name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def fitted(
        cls,
        scale: float,
        fixed: float,
        running: Priced,
        measured: float,
        measured_on: str = "",
        replicating: bool = False,
    ) -> Calibration:
        """The calibration whose ``per_step`` makes ``running``'s predicted step the ``measured`` one
        (none, where the simulated step is longer already)."""
        beside = running.step_seconds if running.flushes else running.busiest_seconds
        return cls(scale, fixed, max(measured - beside, 0.0), measured_on, replicating)

    @staticmethod
    def reduce_overlap(calibration: Calibration | None, measured: float) -> float:
        """The share of an all-reduce beside the compute to price with ``calibration``: all of it
        when it was measured on a replicating family (its actions carry what the all-reduces took),
        else (or with none) the ``measured`` share."""
        return 1.0 if calibration is not None and calibration.replicating else measured

    def seconds(self, candidate: Priced) -> float:
        """``candidate``'s predicted seconds per training step: its ``step_seconds`` (priced with
        the calibrated costs) with the work beyond its actions."""
        if candidate.flushes:
            return candidate.step_seconds + self.per_step
        return max(candidate.step_seconds, candidate.busiest_seconds + self.per_step)

    def __str__(self) -> str:
        said = (
            f"in-run actions = {self.scale:.2f} x the profile + {format_seconds(self.fixed)}, each step "
            f"{format_seconds(self.per_step)} beyond them"
        )
        return f"{said} (measured on {self.measured_on})" if self.measured_on else said


CALIBRATION_PREFIX = "calibration-"


def calibration_path(directory: Path, key: str) -> Path:
    """The file a calibration of the model keyed ``key`` is kept in."""
    return directory / f"{CALIBRATION_PREFIX}{key}.json"


def family_kind(family: object) -> tuple[bool, bool, bool]:
    """What a run of ``family`` adds to its actions depends on: whether its workers hold replicas of the
    same stages (:data:`REPLICATING_FAMILIES`), whether each holds several stages
    (:data:`~lightning_pipe.schedule.options.LOOPED_FAMILIES`), and whether each backward runs as two
    actions (:data:`~lightning_pipe.schedule.SPLIT_BACKWARD_FAMILIES`): the last two make more, smaller
    actions of the same work, each paying the runtime's own time."""
    return family in REPLICATING_FAMILIES, family in LOOPED_FAMILIES, family in SPLIT_BACKWARD_FAMILIES


@dataclass(frozen=True)
class RunShape:
    """What a calibration was measured running, or is asked for: the schedule family, the rows of
    each micro-batch, and whether each process's threads were pinned to cores of their own (``None``:
    not known yet, as under ``pin_cpus="auto"`` before its trial). Pinning moves the rate of the
    actions: on 2 CPU processes a torchvision ResNet-18's steps ran up to 31% apart pinned and
    unpinned, the same configuration otherwise (2BW on 2 micro-batches: 137.1 and 104.5 ms)."""

    family: str
    rows: int
    pinned: bool | None = False

    def matches(self, entry: dict[str, object]) -> bool:
        """Whether a kept ``entry`` was measured running this very shape."""
        return _shape_of(entry) == (self.family, self.rows, self.pinned)

    def closeness(self, entry: dict[str, object], kind: Kind = family_kind) -> tuple[bool, ...]:
        """How close a kept ``entry`` comes: the same family and rows, then the same rows (the same
        profile) and kind, then the same rows and replication (the kind's first trait), then the same
        family, then the same kind, then the same replication, then the same rows; among those, the
        same pinning. ``kind`` tells families apart."""
        rows, family = entry.get("rows") == self.rows, entry.get("family") == self.family
        theirs, ours = kind(entry.get("family")), kind(self.family)
        alike, replicated = theirs == ours, theirs[0] == ours[0]
        pinned = self.pinned is not None and entry.get("pinned") == self.pinned
        return rows and family, rows and alike, rows and replicated, family, alike, replicated, rows, pinned


def closest_kept(
    entries: Sequence[dict[str, object]], shape: RunShape | None, kind: Kind = family_kind
) -> dict[str, object] | None:
    """The kept ``entries`` (in the order kept) closest to ``shape`` (:meth:`RunShape.closeness` with
    ``kind``; among equals, and for no ``shape``, the last kept); ``None`` where there is none."""
    if not entries:
        return None
    return max(enumerate(entries), key=lambda item: (shape.closeness(item[1], kind) if shape else (), item[0]))[1]


def _shape_of(entry: dict[str, object]) -> tuple[object, object, object]:
    """The family, rows and pinning a kept ``entry`` was measured running."""
    return entry.get("family"), entry.get("rows"), entry.get("pinned")


def closest_fits(
    entries: Sequence[dict[str, object]], shape: RunShape | None, kind: Kind = family_kind
) -> list[dict[str, object]]:
    """The kept ``entries`` measured running the shape closest to ``shape`` (:func:`closest_kept`
    with ``kind``), in the order kept; none where nothing is kept."""
    found = closest_kept(entries, shape, kind)
    return [] if found is None else [entry for entry in entries if _shape_of(entry) == _shape_of(found)]


def typical(entries: Sequence[dict[str, object]]) -> Calibration:
    """The calibration of kept ``entries`` of one shape (at least one): each figure (``scale``,
    ``fixed``, ``per_step``) the lower median of theirs (:func:`statistics.median_low`: of two, the
    smaller; a machine's slow stretches only lengthen what a fit measures), measured on the last's
    configuration."""
    if not entries:
        raise PlanningError("a typical calibration needs one kept entry at least")
    last = entries[-1]
    figures = {name: statistics.median_low(entry[name] for entry in entries) for name in _FIGURES}  # checked below
    said = str(last["measured_on"])
    if len(entries) > 1:
        said = f"{said}; each figure the median of this configuration's last {len(entries)} fits"
    return Calibration(**figures, measured_on=said, replicating=last.get("family") in REPLICATING_FAMILIES)


@dataclass(frozen=True)
class KeptFits:
    """What earlier fits of a model kept (:func:`kept_fits`), read once: the ``entries`` in the order
    kept, and what the set-up report adds to a calibration priced from them (``said``: that they were
    kept for another cut of the model into layers)."""

    entries: tuple[dict[str, object], ...] = ()
    said: str = ""

    def closest(self, shape: RunShape | None, drift_share: float = DRIFT_SHARE) -> Calibration | None:
        """The :func:`typical` calibration of the :func:`closest_fits` to ``shape`` (the last kept's
        shape for ``None``), its rate following ``drift_share`` of the :func:`machine_drift` of
        ``shape``'s kind since the last of those fits (0: none of it); ``None`` where nothing is kept
        or what is kept is no calibration."""
        try:
            fits = closest_fits(self.entries, shape)
            if not fits:
                return None
            found = typical(fits)
            family = shape.family if shape is not None else fits[-1].get("family")
        except (KeyError, TypeError, PlanningError):  # a figure or a name missing, or not a number
            return None
        said = found.measured_on + self.said
        since = next(index for index, entry in enumerate(self.entries) if entry is fits[-1])
        drift = machine_drift(self.entries, since, family_kind(family)) if drift_share else 1.0
        if drift == 1.0:
            return replace(found, measured_on=said)
        factor = drift**drift_share
        said += f"; its rate x {factor:.2f} for the machine's drift since (later fits measured x {drift:.2f})"
        return replace(found, scale=found.scale * factor, measured_on=said)


def machine_drift(entries: Sequence[dict[str, object]], since: int, kind: tuple[bool, ...]) -> float:
    """How much slower (above 1) or faster than at kept entry ``since`` the machine runs a family of
    ``kind`` (:func:`family_kind`) now: the median, over the last :data:`DRIFT_FITS` fits kept after
    ``since`` of that kind whose shape had fits kept up to ``since``, of each one's ``scale`` over the
    :func:`typical` scale of those; 1 where there is none. The fits a prediction is priced with ran at
    the machine's rate of their time, and on 2 shared CPU cores that rate moved between fits minutes
    apart as much as it differs between families of one kind (``bench/calibration_transfer.py``)."""
    ratios: list[float] = []
    for later in reversed(entries[since + 1 :]):
        if family_kind(later.get("family")) != kind:
            continue
        before = [entry for entry in entries[: since + 1] if _shape_of(entry) == _shape_of(later)]
        try:
            then, now = typical(before[-KEPT_PER_SHAPE:]).scale, float(later["scale"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError, PlanningError):  # none before, or not a calibration
            continue
        if then > 0 and math.isfinite(now) and now > 0:
            ratios.append(now / then)
            if len(ratios) == DRIFT_FITS:
                break
    return statistics.median(ratios) if ratios else 1.0


def kept_fits(directory: Path, key: str, model: str | None = None) -> KeptFits:
    """The fits kept for ``key`` in ``directory``; where none is, those kept for the other cuts of
    ``model`` into layers (:func:`~lightning_pipe.cost.profile_cache.model_key`; :func:`other_cuts`)."""
    entries = kept_runs(kept_document(calibration_path(directory, key)))
    if not entries and model is not None:
        return KeptFits(tuple(other_cuts(directory, model)), "; kept by a fit of another cut of this model into layers")
    return KeptFits(tuple(entries))


def kept_calibration(
    directory: Path | None, key: str, shape: RunShape | None = None, model: str | None = None
) -> Calibration | None:
    """The calibration kept for ``key`` (else for ``model``'s other cuts) in ``directory`` closest to
    ``shape`` (:func:`kept_fits`, :meth:`KeptFits.closest`); ``None``: none kept, none readable, or no
    directory (a run without a profile cache keeps nothing)."""
    return None if directory is None else kept_fits(directory, key, model).closest(shape)


def other_cuts(directory: Path, model: str) -> list[dict[str, object]]:
    """The calibrations kept in ``directory`` for every cut of ``model`` into layers, in the order
    written. A capture cuts a model finer to have layers for more stages (interleaved schedules hold
    two a worker), which is another profile and another key: its first fit, with none kept under
    that key, is priced with what the model's fits at another cut measured, not with the profile alone
    (on 2 CPU processes the grid's first interleaved configuration of torchvision's ResNet-18, the
    transformer and GPT-2, cut finer and predicted from the profile alone in one of its two rounds,
    came out 14%, 9% and 7% short: ``bench/auto_plan.py``, ``docs/measurements.md``)."""
    found: list[dict[str, object]] = []
    for path in sorted(directory.glob(f"{CALIBRATION_PREFIX}*.json")):
        kept = kept_document(path)
        if kept.get("model") == model:
            found += kept_runs(kept)
    return sorted(found, key=lambda entry: str(entry.get("written", "")))


def keep_calibration(
    directory: Path | None, key: str, shape: RunShape, found: Calibration, model: str | None = None
) -> Path | None:
    """Keep ``found``, measured running ``shape``, for ``key`` (a cut of ``model`` into layers:
    :func:`other_cuts`) in ``directory`` as the last kept
    (with the last :data:`KEPT_PER_SHAPE` - 1 kept for the same shape: the oldest beyond them is
    dropped; the file is replaced atomically); the file, or ``None`` where it could not be written (the
    run goes on without keeping it)."""
    if directory is None:
        return None
    path = calibration_path(directory, key)
    entries = kept_runs(kept_document(path))  # an unreadable file is replaced
    alike = [index for index, entry in enumerate(entries) if shape.matches(entry)]
    dropped = set(alike[: max(len(alike) - (KEPT_PER_SHAPE - 1), 0)])
    entries = [entry for index, entry in enumerate(entries) if index not in dropped]
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    measured = {k: v for k, v in asdict(found).items() if k != "replicating"}  # the family says it
    entries.append({**asdict(shape), **measured, "written": written})
    if not replace_json(path, {"runs": entries} if model is None else {"model": model, "runs": entries}):
        return None
    return path

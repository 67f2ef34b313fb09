"""The configurations a run tries, and for how long (``schedule="auto"`` and ``pin_cpus="auto"``;
:mod:`.calibrating` runs them).

The calibrated predictions of one family priced from another's run are off by more than the
differences between the best configurations (on 2 CPU processes a replicated model's actions ran
1.8x its profile, a pipeline's far less: ``bench/auto_plan.py``), so the decision is measured. After
calibration, up to :data:`TRIALS` other configurations are tried one after the other
(:func:`trial_candidates`: the best priced of each family predicted faster, or no more than
:data:`TRIAL_MARGIN` slower, than the fastest measured; after each, every candidate is priced again
with what the trial closest to it measured, :func:`closest_calibration`), each for as many steps as
fill :data:`TRIAL_SECONDS` (:func:`trial_steps`) after :data:`WARM_UP` steps that build and warm it.
The two fastest, when within :data:`CONFIRM_WITHIN` of each other, are measured again in the other
order (:meth:`Trials.again`), and the fastest as measured wins (:meth:`Trials.best`). Pinning is
measured the same way, each side for a quarter second (:class:`PinTrial`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_pipe.auto import DELAYED_FAMILIES, Candidate
from lightning_pipe.cost.calibrated import Calibration, closest_kept, family_kind
from lightning_pipe.errors import PlanningError
from lightning_pipe.planning import StagePlan
from lightning_pipe.strategy.choosing import AUTO, Chosen
from lightning_pipe.strategy.step_prices import run_shape

__all__ = [
    "CONFIRM_WITHIN",
    "MAX_TRIAL_STEPS",
    "PIN_STEPS",
    "SETTLED_BY",
    "SWITCH_GAIN",
    "TRIALS",
    "TRIAL_MARGIN",
    "TRIAL_SECONDS",
    "TRIAL_STEPS",
    "WARM_UP",
    "PinTrial",
    "Trial",
    "Trials",
    "closest_calibration",
    "configuration",
    "trial_candidates",
    "trial_kind",
    "trial_steps",
]

WARM_UP = 3
"""Steps left out of the in-run costs, and of a trial's: a fit's first steps, and the steps after a
rebuild, run slower than the settled ones (the trials' medians against the same configurations'
settled steps: ``bench/auto_plan.py``)."""
SWITCH_GAIN = 0.05
"""How much faster (predicted) another configuration of the running family must be to be tried."""
PIN_STEPS = 5
"""Steps run pinned in the pinning trial at least (the first left out; the last's time is not known yet)."""
TRIAL_MARGIN = 0.15
"""A configuration predicted at most this much slower than the one running is tried: the calibrated
predictions of another family were off by up to 25% (``bench/auto_plan.py``), the measurement is not."""
TRIAL_STEPS = 4
"""Steps a configuration is tried for at least (after the :data:`WARM_UP` steps that build and warm it)."""
TRIAL_SECONDS = 0.25
"""Seconds a trial, and each side of the pinning trial, lasts at least (:func:`trial_steps`)."""
MAX_TRIAL_STEPS = 64
"""Steps a configuration is tried for at most: steps of 4 ms and longer fill :data:`TRIAL_SECONDS`
(with 16 at most, ``bench/auto_plan.py``'s MLP, steps of 3-7 ms on 2 CPU processes, was tried for
50-110 ms; its steps spread 15-20% about their median, and the medians of 25 steps of one fixed
configuration ranged over 6.8-7.3 ms in one fit of 300 steps, 2026-11-29)."""
TRIALS = 3
"""Other configurations tried at most, one per family: the calibrated predictions of the families
were off from each other by more than the differences between them (``bench/auto_plan.py``)."""
SETTLED_BY = WARM_UP + 2 * (MAX_TRIAL_STEPS + 1) + 1 + (TRIALS + 2) * (WARM_UP + MAX_TRIAL_STEPS + 1)
"""The most steps a fit takes to settle on its configuration (``settled_step`` at most): the pinning
trial at its longest (its unpinned steps' intervals after the warm-up, then its pinned steps), the
calibration at the step after it, and every trial (the warm-up, then its steps' intervals), the closest
two measured again."""
CONFIRM_WITHIN = 0.10
"""The two fastest trials closer than this are measured once more each, in the other order, and
decided by the mean of their two medians: a trial measured early and one measured late differ by the
machine's drift as well (on 2 shared CPU cores GPT-2's pick, ``ddp`` on 2 micro-batches, measured
150 ms in its trial and ran 179 ms settled, where the best configuration of the grid ran 147 ms:
``bench/auto_plan.py``)."""


@dataclass(frozen=True)
class Trial:
    """A configuration tried after calibration (the one running then first): its plan and options,
    its label, and once measured its median step and what its steps measured beyond the profile
    (``calibration``; rank 0's, ``None`` where not priced)."""

    stage_plan: StagePlan
    chosen: Chosen
    label: str
    seconds: float | None = None
    calibration: Calibration | None = None


def configuration(trial: Trial) -> tuple[object, ...]:
    """What a trial runs: its split, replicas, schedule and recomputing stages."""
    return trial.stage_plan.bounds, trial.stage_plan.replicas, trial.chosen


@dataclass
class Trials:
    """The trials of a run: those measured (the one running first, then each tried; a configuration
    measured again appears again) and those to try; ``confirmed`` once the closest two were measured
    again (:meth:`again`)."""

    measured: list[Trial]
    waiting: list[Trial]
    confirmed: bool = False
    steps: int = TRIAL_STEPS

    def _means(self) -> dict[tuple[object, ...], tuple[float, Trial]]:
        """Each configuration's mean over its measured medians, with its first trial."""
        found: dict[tuple[object, ...], list[Trial]] = {}
        for trial in self.measured:
            found.setdefault(configuration(trial), []).append(trial)
        return {
            key: (statistics.fmean(t.seconds if t.seconds is not None else math.inf for t in trials), trials[0])
            for key, trials in found.items()
        }

    def best(self) -> Trial:
        """The configuration with the shortest step: its medians' mean, where it was measured twice."""
        return min(self._means().values(), key=lambda pair: pair[0])[1]

    def seconds_of(self, trial: Trial) -> float:
        """``trial``'s configuration's mean median step."""
        return self._means()[configuration(trial)][0]

    def calibration_of(self, trial: Trial) -> Calibration | None:
        """What ``trial``'s configuration measured beyond the profile when it last ran."""
        found = [t.calibration for t in self.measured if configuration(t) == configuration(trial)]
        return next((c for c in reversed(found) if c is not None), None)

    def again(self) -> list[Trial]:
        """Once, after the first pass: the two fastest configurations when they are within
        :data:`CONFIRM_WITHIN` of each other, to be measured again in the other order (the one
        measured last first: it may be running already); none otherwise."""
        if self.confirmed:
            return []
        self.confirmed = True
        ranked = sorted(self._means().items(), key=lambda item: item[1][0])
        if len(ranked) < 2 or ranked[1][1][0] > ranked[0][1][0] * (1 + CONFIRM_WITHIN):
            return []
        order = {configuration(t): i for i, t in enumerate(self.measured)}  # the last measurement of each
        pair = sorted((key for key, _ in ranked[:2]), key=order.__getitem__, reverse=True)
        firsts = {key: trial for key, (_, trial) in ranked[:2]}
        return [dataclasses.replace(firsts[key], seconds=None) for key in pair]


def trial_kind(family: object) -> tuple[bool, ...]:
    """What a trial's calibration prices reliably: the families of its kind (:func:`family_kind`)
    that flush as it does, or not: where the time beyond the actions goes depends on it (an MLP's 2BW
    steps measured 0.68x its 1F1B's, which one calibration priced alike: :class:`Calibration`)."""
    return (*family_kind(family), family not in DELAYED_FAMILIES)


def trial_candidates(
    ranked: Sequence[Candidate],
    fastest: float,
    seconds: Callable[[Candidate], float],
    measured: Sequence[tuple[str, int]],
    places: int,
) -> list[Candidate]:
    """The configurations to try next, best first by ``seconds`` (each one's calibrated prediction;
    ``ranked`` sorted by it), against ``fastest`` (the shortest step measured so far), after the
    configurations ``measured`` (family and micro-batch count each, the one running first):

    - one per family, ``places`` at most;
    - of a family that ran, or of a kind (:func:`trial_kind`) that ran on as many micro-batches, only
      when predicted :data:`SWITCH_GAIN` faster: a run of its kind priced it (an MLP's 1F1B-RR priced
      from its ``ddp`` run came out 5% long, its pipelines priced from that run about 90% long);
    - any other when predicted no more than :data:`TRIAL_MARGIN` slower: a calibration measured on
      another kind prices it up to 25% off (``bench/auto_plan.py``);
    - where none of the families that flush, or of those that do not, ran or made the margin, the
      best of that kind takes the last place: the two kinds' predictions differ most in what they
      leave out (the time beyond the actions overlaps the others' compute only without a flush; an
      MLP's best family was once left out, 0.91 of the best: ``bench/auto_plan.py``)."""
    families = {family for family, _ in measured}
    alike = {(trial_kind(family), m) for family, m in measured}
    chosen: list[Candidate] = []
    for candidate in ranked:
        if len(chosen) >= places or seconds(candidate) > fastest * (1 + TRIAL_MARGIN):
            break
        known = candidate.family in families or (trial_kind(candidate.family), candidate.microbatches) in alike
        faster = seconds(candidate) <= fastest * (1 - SWITCH_GAIN)
        if (faster or not known) and candidate.family not in families | {c.family for c in chosen}:
            chosen.append(candidate)
    kinds = {family not in DELAYED_FAMILIES for family in families} | {c.flushes for c in chosen}
    other = next((c for c in ranked if c.flushes not in kinds), None)
    if other is not None and places > 0:
        chosen = [*chosen[: places - 1], other]
    return chosen


def closest_calibration(measured: Sequence[Trial], family: str, microbatches: int, batch_rows: int) -> Calibration:
    """The calibration of the ``measured`` trial closest to ``family`` on ``microbatches`` of
    ``batch_rows`` by the rule kept calibrations are looked up by (:func:`closest_kept`, with
    :func:`trial_kind`; the last measured among equals), trials without one passed over.

    Raises:
        PlanningError: none of them has a calibration."""
    known = [t for t in measured if t.calibration is not None]
    if not known:
        raise PlanningError("no trial measured a calibration to price the configurations with")
    shapes = [run_shape(t.chosen.schedule.family, batch_rows, t.chosen.schedule.microbatches or 1, None) for t in known]
    entries: list[dict[str, object]] = [{"family": shape.family, "rows": shape.rows} for shape in shapes]
    found = closest_kept(entries, run_shape(family, batch_rows, microbatches, None), trial_kind)
    calibration = next(t.calibration for t, entry in zip(known, entries, strict=True) if entry is found)
    assert calibration is not None
    return calibration


def trial_steps(step_seconds: float) -> int:
    """Steps each configuration is tried for at a pace of ``step_seconds``: :data:`TRIAL_STEPS`, or as
    many as fill :data:`TRIAL_SECONDS`, :data:`MAX_TRIAL_STEPS` at most. A median of four steps of a
    few ms moves with the machine's jitter (an MLP's 2BW on 2 micro-batches measured 4.4 ms in one
    trial, 6.3 ms in another: ``bench/auto_plan.py``); such steps cost little beside a rebuild."""
    if not step_seconds > 0:
        return TRIAL_STEPS
    return max(TRIAL_STEPS, min(MAX_TRIAL_STEPS, math.ceil(TRIAL_SECONDS / step_seconds)))


@dataclass
class PinTrial:
    """``pin_cpus="auto"``: steps run unpinned, their median, the first pinned, how many pinned, the decision."""

    unpinned_steps: int | None = None
    start: int | None = None
    unpinned: float | None = None
    steps: int = PIN_STEPS
    pinned: bool | None = None

    @classmethod
    def of(cls, pin_cpus: object, device: torch.device) -> PinTrial | None:
        """A trial for ``pin_cpus="auto"`` on a CPU device of a system that places threads (Linux)."""
        if pin_cpus != AUTO or device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
            return None
        return cls()

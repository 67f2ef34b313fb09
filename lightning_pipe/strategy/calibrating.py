"""What the first steps of a run measure, and the switch it may lead to (``schedule="auto"`` and
``pin_cpus="auto"``; :mod:`.choosing` made the first choice).

**Pinning** (``pin_cpus="auto"``, CPU training on Linux): whether each process's threads run
faster on cores of their own depends on the model and the schedule (on 2 cores it made 2BW and CDP
1.14-1.18x faster, and torchvision's ResNet-18 0.74x as fast), and no profile taken one process at a
time shows it. So it is measured: from step 3 on, as many steps as fill :data:`TRIAL_SECONDS` at the
pace of steps 3-7 (:func:`trial_steps`: 4-16) run unpinned, then as many pinned at theirs, one more
left out while the threads move (:data:`PIN_STEPS` at least), and the placement whose median step was
shorter is kept.

**Calibration.** A profile taken layer by layer misses what the run adds to each micro-batch (the
executor's own time, messages, the other processes computing at the same time), and a kept profile
may have been taken on a busier machine. After :data:`CALIBRATE_AFTER` steps (the first three left out
as warm-up), or after the pinning trial, the stage costs the run measured
(:meth:`~lightning_pipe.runtime.PipelineExecutor.measured_costs`) give ``scale × profile + fixed``
per forward and backward (the rate of their compute against the profile's, and the executor's own
time per action: :func:`~lightning_pipe.cost.calibrated.separated`), the step's time beyond its
simulated actions is measured, and every candidate is priced again. The predictions transfer imperfectly from one
family to another (on 2 CPU processes a replicated model's actions ran 1.8x its profile, a
pipeline's far less: ``bench/auto_plan.py``), so the decision is measured: up to :data:`TRIALS`
other configurations, the best priced of each family predicted faster or no more than
:data:`TRIAL_MARGIN` slower than the one running (:func:`trial_candidates`), are tried one after the
other for :func:`trial_steps` steps each (after :data:`WARM_UP` steps that build and warm the
pipeline); after each, the places left are filled again, every candidate priced with what the
trial closest to it measured (:func:`closest_calibration`). The run goes on with the one whose
median step was shortest, the one that ran first included; where the two fastest came within
:data:`CONFIRM_WITHIN` of each other, both are measured once more in the other order (the
machine's drift then weighs on both alike) and the mean of each one's two medians decides. The
configuration the run goes on with is then predicted (``planned_step_seconds``) with what its own
trial's steps measured beyond the profile, not with the calibration of the one that ran first: on 2
CPU processes an MLP's calibration taken running one family priced the steps of the configuration it
went on with 43-92% long (``bench/auto_plan.py --pairs``). A switch finishes the steps in flight (a
drain), gathers the model's weights and every parameter's optimizer state by name, rebuilds the
pipeline on the new split and schedule, and gives each rank back its stages' weights and states, as
a resume on another split does. A synchronous run that switches, and back, ends with plain
Lightning's parameters (``tests/test_strategy_auto.py``).

:class:`PipelineCalibration` holds these as methods of :class:`~lightning_pipe.strategy.PipelineStrategy`
(one of the parts the strategy's class is assembled from, each a module of its own).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.auto import DELAYED_FAMILIES, Candidate, ranking_table, search
from lightning_pipe.cost.calibrated import (
    REPLICATING_FAMILIES,
    Calibration,
    calibration,
    closest_kept,
    family_kind,
    separated,
)
from lightning_pipe.cost.profile_cache import forget_profile, profile_disagrees
from lightning_pipe.errors import PlanningError
from lightning_pipe.planning import StagePlan
from lightning_pipe.runtime.affinity import pin_threads, place_threads
from lightning_pipe.schedule import StageCosts
from lightning_pipe.strategy.after_fit import fill
from lightning_pipe.strategy.choosing import AUTO, SHOWN, Chosen
from lightning_pipe.strategy.step_prices import actions, measured_calibration, run_shape
from lightning_pipe.util.units import format_seconds

__all__ = [
    "CALIBRATE_AFTER",
    "CONFIRM_WITHIN",
    "KEPT_AFTER",
    "MAX_TRIAL_STEPS",
    "OWN_TIME_SHARE",
    "PIN_STEPS",
    "SETTLED_BY",
    "SWITCH_GAIN",
    "TRIALS",
    "TRIAL_MARGIN",
    "TRIAL_SECONDS",
    "TRIAL_STEPS",
    "PinTrial",
    "PipelineCalibration",
    "Trial",
    "Trials",
    "closest_calibration",
    "stale_profile_rate",
    "trial_candidates",
    "trial_kind",
    "trial_steps",
]

CALIBRATE_AFTER = 8
"""Steps run before the in-run costs re-rank the candidates (steps 3-7 measured)."""
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
MAX_TRIAL_STEPS = 16
"""Steps a configuration is tried for at most."""
KEPT_AFTER = 4
"""Settled steps (after :data:`WARM_UP`) a fit needs to keep its calibration for the next fit."""
TRIALS = 3
"""Other configurations tried at most, one per family: the calibrated predictions of the families
were off from each other by more than the differences between them (``bench/auto_plan.py``)."""
SETTLED_BY = WARM_UP + 2 * MAX_TRIAL_STEPS + 2 + (TRIALS + 2) * (WARM_UP + MAX_TRIAL_STEPS + 1)
"""The most steps a fit takes to settle on its configuration: the pinning trial at its longest, every
trial, and the closest two measured again."""
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


def _configuration(trial: Trial) -> tuple[object, ...]:
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
            found.setdefault(_configuration(trial), []).append(trial)
        return {
            key: (statistics.fmean(t.seconds if t.seconds is not None else math.inf for t in trials), trials[0])
            for key, trials in found.items()
        }

    def best(self) -> Trial:
        """The configuration with the shortest step: its medians' mean, where it was measured twice."""
        return min(self._means().values(), key=lambda pair: pair[0])[1]

    def seconds_of(self, trial: Trial) -> float:
        """``trial``'s configuration's mean median step."""
        return self._means()[_configuration(trial)][0]

    def calibration_of(self, trial: Trial) -> Calibration | None:
        """What ``trial``'s configuration measured beyond the profile when it last ran."""
        found = [t.calibration for t in self.measured if _configuration(t) == _configuration(trial)]
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
        order = {_configuration(t): i for i, t in enumerate(self.measured)}  # the last measurement of each
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


OWN_TIME_SHARE = 0.5
"""The share of the actions' time beyond which the runtime's own hides their rate (:func:`stale_profile_rate`)."""


def stale_profile_rate(profiled: Sequence[float], measured: Sequence[float]) -> float | None:
    """The rate of a run's actions against a kept profile (each stage's forward, then backward, the
    contention taken out of ``measured``) where it is more than 15% off (:func:`profile_disagrees`).
    The runtime's own time per action is fitted apart (:func:`calibration`): profiling again would
    not change it; where it is more than :data:`OWN_TIME_SHARE` of the actions' time, the rate is not
    told apart from it and nothing is said (a line through an MLP's four ~1 ms actions read its run
    at 0.06-0.45x the profile in each of 8 fits: ``bench/auto_plan.py --models mlp``)."""
    rate, fixed = calibration(profiled, measured)
    if fixed * len(measured) > OWN_TIME_SHARE * math.fsum(measured):
        return None
    return rate if profile_disagrees(profiled, [rate * seconds for seconds in profiled]) else None


def _intervals(starts: Sequence[float]) -> list[float]:
    """The seconds of each step whose start and next start are known."""
    return [b - a for a, b in itertools.pairwise(starts)]


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


class PipelineCalibration:
    """What the first steps measure, and the switch (methods of :class:`~lightning_pipe.strategy.PipelineStrategy`)."""

    def _recalibrate(self) -> None:
        """After the pinning trial (``pin_cpus="auto"``) and :data:`CALIBRATE_AFTER` steps (once per
        fit): re-rank with the in-run costs and try other configurations when they are predicted
        faster, or within the predictions' error (:meth:`_to_try`); after :data:`WARM_UP` +
        :func:`trial_steps` steps of each, go on with the fastest as measured (:meth:`_judge_trial`).
        Every decision is a collective, taken at the same step on every rank (:meth:`_meet`)."""
        executor = self.executor
        if executor is None:
            return
        if self.trials is not None and self.trials.measured[-1].seconds is None:
            self._judge_trial(self.trials)
            return
        if executor.next_step < CALIBRATE_AFTER:
            return
        trial = self._pin_trial
        if trial is not None and trial.pinned is None:
            self._try_pinning(trial, executor.next_step)
            return
        if self._calibrated:
            return
        self._calibrated = True
        since = trial.start + 1 if trial is not None and trial.pinned and trial.start is not None else WARM_UP
        self._meet()
        # the actions alone (for the kept profile's check), and with the executor's own time until the next
        compute, in_run = executor.measured_costs_both(since_step=since)
        tried: list[Trial] = []
        if self.global_rank == 0:
            self._check_kept_profile(compute)
            tried = self._to_try(compute, in_run, since)
        tried = self.broadcast(tried)
        if not tried:
            return
        measured = self.broadcast(statistics.median(_intervals(self._step_starts)[since:]))
        running = Chosen(self.schedule_options, tuple(self._recompute_flags()))
        assert self.stage_plan is not None
        first = Trial(self.stage_plan, running, self._label(), measured, self.calibration)  # rank 0's, as measured
        self.trials = Trials([first, tried[0]], tried[1:], steps=trial_steps(measured))
        self._switch(tried[0].stage_plan, tried[0].chosen)

    def _to_try(self, compute: StageCosts, in_run: StageCosts, since: int) -> list[Trial]:
        """Rank 0: the configurations to try (:func:`trial_candidates`), the candidates priced again
        with what steps ``since`` on measured (said either way)."""
        assert self.stage_plan is not None and self.stage_plan.plan is not None and self._searched is not None
        scale, fixed = separated(self._profiled(self.stage_plan), actions(compute), actions(in_run))
        basis, arguments = self._searched
        in_run = Calibration(scale, fixed, 0.0, replicating=self.schedule_options.family in REPLICATING_FAMILIES)
        ranked = search(basis.chain, self.workers, calibrations=lambda family, m: in_run, **arguments)
        running = next((c for c in ranked if self._runs(c)), None)
        if running is None:
            rank_zero_info(f"Calibration after {CALIBRATE_AFTER} steps: the running configuration is not priced")
            return []
        median = statistics.median(_intervals(self._step_starts)[since:])
        found = Calibration.fitted(scale, fixed, running, median, replicating=in_run.replicating)
        self.calibration, self.candidates = found, sorted(ranked, key=found.seconds)
        predicted = self.calibrated_step_seconds = found.seconds(running)
        chosen = trial_candidates(
            self.candidates, predicted, found.seconds, [(running.family, running.microbatches)], TRIALS
        )
        if not chosen:
            rank_zero_info(f"Calibration after {CALIBRATE_AFTER} steps: {found}; keeping {running.label}")
            return []
        said = ", ".join(f"{c.label} (predicted {found.seconds(c) / predicted - 1:+.0%})" for c in chosen)
        rank_zero_info(
            f"Calibration after {CALIBRATE_AFTER} steps: {found}; trying {said} against {running.label} (running) "
            f"for {trial_steps(median)} steps each, then keeping the fastest as measured\n"
            f"{ranking_table(self.candidates, SHOWN, found.seconds)}"
        )
        return [Trial(c.stage_plan, Chosen.of(c, self.schedule_options), c.label) for c in chosen]

    def _to_try_next(self, trials: Trials) -> list[Trial]:
        """Rank 0, after a trial: what to try in the places left, each candidate priced again with the
        calibration of the trial closest to it (:func:`closest_calibration`); said where it changed."""
        assert self._searched is not None
        basis, arguments = self._searched
        measured = trials.measured
        places = TRIALS - (len(measured) - 1)
        if places <= 0:  # every place taken: nothing to price
            return []

        @functools.cache  # one lookup per family and count, for the search and the ranking alike
        def closest(family: str, microbatches: int) -> Calibration:
            return closest_calibration(measured, family, microbatches, self.step_prices.batch_rows)

        def seconds(candidate: Candidate) -> float:
            return closest(candidate.family, candidate.microbatches).seconds(candidate)

        ranked = sorted(search(basis.chain, self.workers, calibrations=closest, **arguments), key=seconds)
        fastest = min(trials.seconds_of(t) for t in measured)
        ran = [(t.chosen.schedule.family, t.chosen.schedule.microbatches or 1) for t in measured]
        chosen = trial_candidates(ranked, fastest, seconds, ran, places)
        following = [Trial(c.stage_plan, Chosen.of(c, self.schedule_options), c.label) for c in chosen]
        if [t.label for t in following] != [t.label for t in trials.waiting]:
            said = ", ".join(f"{c.label} (predicted {seconds(c) / fastest - 1:+.0%})" for c in chosen) or "none"
            rank_zero_info(
                f"Priced again with what {measured[-1].label} measured ({measured[-1].calibration}): trying {said} "
                f"against the fastest so far ({format_seconds(fastest)})"
            )
        return following

    def _keep_calibration(self) -> None:
        """At the end of a fit (every rank: a collective): what the running configuration's settled
        steps measured beyond the profile, kept for the next fit of this model on this machine
        (:mod:`.step_prices`); none where fewer than :data:`KEPT_AFTER` steps settled, or the stages
        were not profiled."""
        found = self._measured_calibration()
        if found is None or self.step_prices.directory is None:
            return
        if self._searched is not None:  # schedule="auto" planned with the chain-timed profile: kept against the layers'
            found = self._searched[0].to_layers(found, self.microbatches)
        self.step_prices.keep(self.options.family, self.microbatches, bool(self._pinned()), found)

    def _measured_calibration(self) -> Calibration | None:
        """Every rank (a collective): what the running configuration's steps since its warm-up
        measured beyond the profile of its plan (:func:`~.step_prices.measured_calibration`), on rank 0;
        ``None`` elsewhere, and where fewer than :data:`KEPT_AFTER` steps ran or the stages were not
        profiled."""
        executor, plan = self.executor, self.stage_plan
        intervals = _intervals(self._step_starts)[WARM_UP:]
        if executor is None or plan is None or plan.plan is None or len(intervals) < KEPT_AFTER:
            return None
        compute, until_next = executor.measured_costs_both(since_step=WARM_UP)
        if self.global_rank != 0:
            return None
        on = f"{self._label()}, {time.strftime('%Y-%m-%d')}"
        profiled = self._profiled(plan)
        return measured_calibration(
            self.step_prices,
            plan,
            self.options,
            self.microbatches,
            self.recompute,
            profiled,
            compute,
            until_next,
            intervals,
            on,
        )

    def _judge_trial(self, trials: Trials) -> None:
        """Every rank, after :data:`WARM_UP` + ``trials.steps`` steps of the configuration tried:
        record its median step (rank 0's) and what it measured beyond the profile, then try the next
        one, or go on with the fastest measured, predicted with what its own steps measured."""
        intervals = _intervals(self._step_starts)[WARM_UP:]
        if len(intervals) < trials.steps:
            return
        self._meet()
        trying = trials.measured[-1]
        seconds = self.broadcast(statistics.median(intervals))
        trials.measured[-1] = dataclasses.replace(trying, seconds=seconds, calibration=self._measured_calibration())
        if not trials.confirmed:
            trials.waiting = self.broadcast(self._to_try_next(trials) if self.global_rank == 0 else [])
        if not trials.waiting:
            trials.waiting = trials.again()  # the same on every rank: rank 0's medians, broadcast
            if trials.waiting:
                said = " and ".join(t.label for t in trials.waiting)
                rank_zero_info(
                    f"Tried for {trials.steps} steps each (medians): {self._tried(trials)}; {said} are within "
                    f"{CONFIRM_WITHIN:.0%} of each other: measuring them again, in the other order"
                )
        if trials.waiting:
            following = trials.waiting.pop(0)
            trials.measured.append(following)
            if _configuration(following) == _configuration(trying):  # running already: measure on
                self._restart_steps()
            else:
                self._switch(following.stage_plan, following.chosen)
            return
        best = trials.best()
        twice = sum(_configuration(t) == _configuration(best) for t in trials.measured) > 1
        rank_zero_info(
            f"Tried for {trials.steps} steps each (medians): {self._tried(trials)}; going on with {best.label}"
            + (f" ({format_seconds(trials.seconds_of(best))}, the mean of its two)" if twice else "")
        )
        if _configuration(best) != _configuration(trials.measured[-1]):
            self._switch(best.stage_plan, best.chosen, trials.calibration_of(best))
        else:
            self._predict_running(trials.calibration_of(best))

    @staticmethod
    def _tried(trials: Trials) -> str:
        return ", ".join(f"{t.label} {format_seconds(t.seconds or math.nan)}" for t in trials.measured)

    def _meet(self) -> None:
        """Bring the ranks together between steps for a decision: a non-flushing schedule's steps in
        flight are finished first. Otherwise a rank could wait inside its step for a collective that
        another rank makes only in its next call — a tied parameter's gradient sum (GPT-2's embedding
        and head) — while that one waits here for the decision: a deadlock. The executor drains before
        the logs of the last call are collected (which waits for every rank to have finished it)."""
        assert self.executor is not None
        if self.executor.calls:
            self.executor.drain()

    def _place_threads(self) -> None:
        """Every rank, at set-up: ``pin_cpus=True`` pins the threads now, ``"auto"`` makes its trial;
        either way the cores they had are kept, which :meth:`_restore_placement` puts them back on."""
        if self.pin_cpus is not False and hasattr(os, "sched_getaffinity"):
            self._cores_before = set(os.sched_getaffinity(0))
        if self.pin_cpus is True:
            pin_threads(self.local_rank, self.num_processes)
        self._pin_trial = PinTrial.of(self.pin_cpus, self.root_device)

    def _restore_placement(self) -> None:
        """At teardown: every thread back on the cores it had before :meth:`_place_threads`."""
        if self._cores_before is not None:
            place_threads(self._cores_before)
            self._cores_before = None

    def _pinned(self) -> bool | None:
        """Whether each process's threads run pinned to cores of their own: ``None`` while
        ``pin_cpus="auto"`` has not decided yet."""
        trial = self._pin_trial
        return self.pin_cpus is True or (trial.pinned if trial is not None else False)

    def _label(self) -> str:
        """The running configuration as the ranking names it."""
        assert self.stage_plan is not None
        running = next((c for c in self.candidates if self._runs(c)), None)
        return running.label if running is not None else f"{self.schedule_options.family} m={self.microbatches}"

    def _recompute_flags(self) -> list[bool]:
        """Whether each stage of the running plan recomputes."""
        assert self.stage_plan is not None
        count = len(self.stage_plan.bounds)
        return list(self.recompute) if isinstance(self.recompute, list) else [bool(self.recompute)] * count

    def _check_kept_profile(self, compute: StageCosts) -> None:
        """Rank 0: mark the kept profiles stale (:func:`~lightning_pipe.cost.profile_cache.forget_profile`)
        when the rate of this run's actions, with the contention it measured taken out, is more than
        15% off the profile's (:func:`~lightning_pipe.cost.profile_cache.profile_disagrees`): a profile
        taken on a busier or other machine (:func:`stale_profile_rate`)."""
        assert self.stage_plan is not None and self._searched is not None
        factor = self._searched[0].factor(self.microbatches)
        profiled = [seconds / factor for seconds in self._profiled(self.stage_plan)]  # the kept profile's
        contention = self.plan_options.contention
        measured = [seconds / contention for seconds in [*compute.forward, *compute.backward]]
        rate = stale_profile_rate(profiled, measured)
        if rate is None:
            return
        small = self._searched[1]["small"]
        reason = f"a run measured its layers {rate:.2f}x as long as this profile"
        marked = [forget_profile(costs, reason) for costs in (self._searched[0].chain, small and small[0]) if costs]
        for path in filter(None, marked):
            rank_zero_info(f"Kept profile {path}: {reason}; the next run measures it anew")

    def _profiled(self, stage_plan: StagePlan) -> list[float]:
        """Each stage's profiled forward seconds, then backward (with the forward again where it
        recomputes), as the run's costs list them."""
        assert stage_plan.plan is not None
        stages = stage_plan.plan.stages
        again = zip(stages, self._recompute_flags(), strict=True)
        return [s.forward_seconds for s in stages] + [
            s.backward_seconds + (s.forward_seconds if r else 0.0) for s, r in again
        ]

    def _runs(self, candidate: Candidate) -> bool:
        """Whether ``candidate`` is the configuration running."""
        assert self.stage_plan is not None
        return (
            candidate.schedule == self.options
            and candidate.bounds == self.stage_plan.bounds
            and candidate.stage_plan.replicas == self.stage_plan.replicas
            and list(candidate.recompute) == self._recompute_flags()
        )

    def _switch(self, stage_plan: StagePlan, chosen: Chosen, calibration: Calibration | None = None) -> None:
        """Every rank: finish the steps in flight, gather the weights and optimizer states by name,
        close the pipeline and run ``chosen`` on ``stage_plan`` from the next batch, each rank taking
        back its stages' weights and states as a resume on another split does; rank 0 predicts its step
        with ``calibration`` (what its own steps measured, when it ran before), else the run's
        (``planned_step_seconds``)."""
        assert self.executor is not None and self._chain is not None
        full = self.broadcast(self.full_state_dict())  # drains first
        state = self.broadcast(self.optimizer_state(self.optimizers[0], whole=True))  # whatever the checkpoints are
        self.executor.close()
        self.executor = None
        module = self.lightning_module
        fill([module, *self._chain.layers], module, full, self.optimizers)
        self.load_optimizer_state_dict({"optimizer_states": [state]})
        self._run_chosen(chosen)
        self.stage_plan = stage_plan
        self._restart_steps()
        self._predict_running(calibration)

    def _predict_running(self, calibration: Calibration | None) -> None:
        """Rank 0: the running configuration's simulation and step (``planned_step_seconds``), priced
        with ``calibration``, else the run's."""
        if self.global_rank == 0 and self.stage_plan is not None:
            found, prices = calibration or self.calibration, self.step_prices
            calibrated = prices if found is None else dataclasses.replace(prices, kept=found)
            self._prediction, self.planned_step_seconds = calibrated.predict(
                self.stage_plan, self.options, self.microbatches, self.plan_options.contention, self.recompute
            )

    def _restart_steps(self) -> None:
        """Time the steps from here on as those of a configuration just started (its warm-up first)."""
        self.settled_step += len(self._step_starts)
        self._step_seconds, self._step_starts = [], []

    def _try_pinning(self, trial: PinTrial, step: int) -> None:
        """The pinning trial (every rank; rank 0's step times decide): pin after ``trial.unpinned_steps``
        unpinned steps (from :data:`WARM_UP`), and after ``trial.steps`` pinned ones keep the faster
        placement; both as many as fill :data:`TRIAL_SECONDS` (:func:`trial_steps`)."""
        intervals = _intervals(self._step_starts)
        if trial.start is None:
            steps = trial.unpinned_steps  # None at the first call: the pace then gives it
            if steps is not None and len(intervals) - WARM_UP < steps:  # the same count on every rank
                return
            self._meet()
            median = self.broadcast(statistics.median(intervals[WARM_UP:]))
            if steps is None:
                trial.unpinned_steps = trial_steps(median)
                if len(intervals) - WARM_UP < trial.unpinned_steps:
                    return
            trial.unpinned = median
            trial.steps = max(PIN_STEPS, trial_steps(trial.unpinned) + 1)  # the same on every rank
            pin_threads(self.local_rank, self.num_processes)
            trial.start = step
            return
        if step < trial.start + trial.steps:
            return
        self._meet()
        pinned = self.broadcast(statistics.median(intervals[trial.start + 1 :]))
        assert trial.unpinned is not None
        trial.pinned = pinned < trial.unpinned
        if not trial.pinned:
            assert self._cores_before is not None  # kept wherever a trial is made
            place_threads(self._cores_before)
        rank_zero_info(
            f"pin_cpus='auto': steps took {format_seconds(pinned)} pinned, {format_seconds(trial.unpinned)} "
            f"unpinned (medians): {'pinned' if trial.pinned else 'unpinned'} from here on"
        )

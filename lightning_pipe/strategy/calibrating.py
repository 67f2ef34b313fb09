"""What the first steps of a run measure, and the switch it may lead to (``schedule="auto"`` and
``pin_cpus="auto"``; :mod:`.choosing` made the first choice).

**Pinning** (``pin_cpus="auto"``, CPU training on Linux): whether each process's threads run
faster on cores of their own depends on the model and the schedule (on 2 cores it made 2BW and CDP
1.14-1.18x faster, and torchvision's ResNet-18 0.74x as fast), and no profile taken one process at a
time shows it. So it is measured: from step 3 on, as many steps as fill
:data:`~.trials.TRIAL_SECONDS` at the pace of steps 3-7 (:func:`~.trials.trial_steps`) run unpinned,
then as many pinned, one more left out while the threads move, and the placement whose median step
was shorter is kept (:class:`~.trials.PinTrial`).

**Calibration.** A profile taken layer by layer misses what the run adds to each micro-batch (the
executor's own time, messages, the other processes computing at the same time), and a kept profile
may have been taken on a busier machine. After :data:`CALIBRATE_AFTER` steps (the first three left out
as warm-up), or after the pinning trial, the stage costs the run measured
(:meth:`~lightning_pipe.runtime.PipelineExecutor.measured_costs`) give ``scale × profile + fixed``
per forward and backward (the rate of their compute against the profile's, and the executor's own
time per action: :func:`~lightning_pipe.cost.calibrated.separated`), the step's time beyond its
simulated actions is measured, and every candidate is priced again. The others worth it are then
tried (:mod:`.trials`: which, for how long, and which won), and the run goes on with the fastest as
measured. Its step is then predicted (``planned_step_seconds``) with what its own trial measured
beyond the profile: an MLP's calibration taken on another family priced it 43-92% long
(``bench/auto_plan.py --pairs``). A switch finishes the steps in flight (a drain), gathers the
model's weights and every parameter's optimizer state by name, rebuilds the pipeline on the new split
and schedule, and gives each rank back its stages' weights and states, as a resume on another split
does. A synchronous run that switches, and back, ends with plain Lightning's parameters
(``tests/test_strategy_auto.py``).

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
from collections.abc import Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.auto import Candidate, ranking_table, search
from lightning_pipe.cost.calibrated import REPLICATING_FAMILIES, Calibration, calibration, separated
from lightning_pipe.cost.loop_time import keep_loop_seconds, loop_seconds
from lightning_pipe.cost.machine_rate import keep_rate
from lightning_pipe.cost.profile_cache import forget_profile, profile_disagrees
from lightning_pipe.planning import StagePlan
from lightning_pipe.runtime.affinity import pin_threads, place_threads
from lightning_pipe.schedule import StageCosts
from lightning_pipe.strategy.after_fit import fill
from lightning_pipe.strategy.choosing import SHOWN, Chosen
from lightning_pipe.strategy.step_prices import actions, measured_calibration
from lightning_pipe.strategy.trials import (
    CONFIRM_WITHIN,
    PIN_STEPS,
    TRIALS,
    WARM_UP,
    PinTrial,
    Trial,
    Trials,
    closest_calibration,
    configuration,
    trial_candidates,
    trial_steps,
)
from lightning_pipe.util.units import format_seconds

__all__ = ["CALIBRATE_AFTER", "KEPT_AFTER", "OWN_TIME_SHARE", "PipelineCalibration", "stale_profile_rate"]

CALIBRATE_AFTER = 8
"""Steps run before the in-run costs re-rank the candidates (steps 3-7 measured)."""
KEPT_AFTER = 4
"""Settled steps (after :data:`WARM_UP`) a fit needs to keep its calibration for the next fit."""
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
        timed = len(self._step_starts)  # this fit's steps: a resumed run's executor counts on from its checkpoint's
        if timed < CALIBRATE_AFTER:
            return
        trial = self._pin_trial
        if trial is not None and trial.pinned is None:
            self._try_pinning(trial, timed)
            return
        if self._calibrated:
            return
        self._calibrated = True
        since = trial.start + 1 if trial is not None and trial.pinned and trial.start is not None else WARM_UP
        self._meet()
        # the actions alone (for the kept profile's check), and with the executor's own time until the next
        first = executor.next_step - timed  # the executor's count at this fit's first step
        compute, in_run = executor.measured_costs_both(since_step=first + since)
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
        (:mod:`.step_prices`), and the training loop's own time per step and the actions' rate, for the
        first fit of any other model (:mod:`~lightning_pipe.cost.loop_time`,
        :mod:`~lightning_pipe.cost.machine_rate`); none where fewer than :data:`KEPT_AFTER` steps
        settled, or (the calibration and the rate) the stages were not profiled."""
        self._keep_loop_seconds()
        found = self._measured_calibration()
        prices = self.step_prices
        if found is None or prices.directory is None:
            return
        if self._searched is not None:  # schedule="auto" planned with the chain-timed profile: kept against the layers'
            found = self._searched[0].to_layers(found, self.microbatches)
        family, pinned = self.options.family, bool(self._pinned())
        prices.keep(family, self.microbatches, pinned, found)
        if prices.model is not None:
            processes, m = self.world_size, self.microbatches
            keep_rate(prices.directory, self.root_device, processes, family, m, pinned, found, prices.model)

    def _keep_loop_seconds(self) -> None:
        """Every rank (a collective): the loop's own time per settled step, the smallest rank's (one
        that ends its call first waits for the others there), kept by rank 0 beside the profiles."""
        if len(self._step_starts) < WARM_UP + KEPT_AFTER + 1:
            return
        own = loop_seconds(self._step_starts[WARM_UP:], self._step_seconds[WARM_UP:])
        measured = [seconds for seconds in self._gather(own) if seconds is not None]
        directory = self.step_prices.directory
        if self.global_rank == 0 and directory is not None and measured:
            keep_loop_seconds(directory, self.root_device, self.world_size, min(measured))

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
            if configuration(following) == configuration(trying):  # running already: measure on
                self._restart_steps()
            else:
                self._switch(following.stage_plan, following.chosen)
            return
        best = trials.best()
        twice = sum(configuration(t) == configuration(best) for t in trials.measured) > 1
        rank_zero_info(
            f"Tried for {trials.steps} steps each (medians): {self._tried(trials)}; going on with {best.label}"
            + (f" ({format_seconds(trials.seconds_of(best))}, the mean of its two)" if twice else "")
        )
        if configuration(best) != configuration(trials.measured[-1]):
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

    @property
    def settled(self) -> bool:
        """Whether the configuration running is the one the fit goes on with: no pinning trial
        (``pin_cpus="auto"``), calibration or trial (``schedule="auto"``) to come. The same on every
        rank at every step (the decisions are rank 0's, broadcast); ``settled_step`` steps ran before
        the configuration was built (a timing callback starts :data:`WARM_UP` steps later)."""
        pin, trials = self._pin_trial, self.trials
        if (pin is not None and pin.pinned is None) or not self._calibrated:
            return False
        return trials is None or (not trials.waiting and trials.measured[-1].seconds is not None)

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
        full = self.broadcast(self.full_tensors())  # drains first; buffers no state dict holds too
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

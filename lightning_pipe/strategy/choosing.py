"""``schedule="auto"`` (and ``microbatches="auto"``, ``recompute="auto"``): the strategy chooses its
pipeline on the first batch with :func:`lightning_pipe.auto.search` and runs the winner.

Rank 0 profiles the layers as for any plan (one micro-batch; the kept profile when there is one),
prices every configuration the options leave open — split × family (with its update rule) ×
micro-batches × per-stage recomputation × replication — under the memory limit, prints the best
five and why the winner won, and every rank then runs the winner as if it had been given: its
family, micro-batches and rule become the strategy's schedule options, its stages the plan. What is
fixed stays fixed: a family given with ``microbatches="auto"`` searches the micro-batch counts and
splits of that family only, and the update rule is never changed silently (``rule=None`` or
``"sync"``: the flushing families; ``"delayed"``: every family with its own rule; one delayed rule:
the flushing families and those running it). Gradient accumulation over batches and float16 keep
the search to the flushing families, as they would refuse the others.

**Pinning** (``pin_cpus="auto"``, CPU training on Linux): whether each process's threads run
faster on cores of their own depends on the model and the schedule (on 2 cores it made 2BW and CDP
1.14-1.18x faster, and torchvision's ResNet-18 0.74x as fast), and no profile taken one process at a
time shows it. So it is measured: steps 2-5 run unpinned, then :data:`PIN_STEPS` steps pinned (the
first left out while the threads move), and the placement whose median step was shorter is kept.

**Calibration.** A profile taken layer by layer misses what the run adds to each micro-batch (the
executor's own time, messages, the other processes computing at the same time), and a kept profile
may have been taken on a busier machine. After :data:`CALIBRATE_AFTER` steps (the first two left out
as warm-up), or after the pinning trial, the stage costs the run measured
(:meth:`~lightning_pipe.runtime.PipelineExecutor.measured_costs`) are fitted as
``scale × profile + fixed`` per forward and backward (:func:`calibration`), every
candidate is priced again with the profile scaled and the fixed cost added, and when another is
predicted at least :data:`SWITCH_GAIN` faster than the one running, the strategy switches to it
there: the steps in flight are finished (a drain), the model's weights and every parameter's
optimizer state are gathered by name, the pipeline is rebuilt on the new split and schedule, and each
rank takes back its stages' weights and states, as a resume on another split does. A synchronous run
that switches ends with the parameters of the run that did not (``tests/test_strategy_auto.py``).

:class:`PipelineChoosing` holds these as methods of :class:`~lightning_pipe.strategy.PipelineStrategy`
(one of the parts the strategy's class is assembled from, each a module of its own).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.auto import (
    ANY_RULE,
    DELAYED_FAMILIES,
    FLUSHING_FAMILIES,
    Candidate,
    ranking_table,
    search,
    searched_families,
)
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profile_cache import forget_profile, profile_disagrees
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.planning import StagePlan, optimizer_copies, predict, profile_costs
from lightning_pipe.runtime.affinity import pin_threads, place_threads
from lightning_pipe.runtime.batches import rows_of, split_batch
from lightning_pipe.runtime.contention import measure_contention
from lightning_pipe.runtime.link_speed import allreduce_bandwidth
from lightning_pipe.schedule import StageCosts, rules_of
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.after_fit import fill
from lightning_pipe.util.nested import flatten, unflatten
from lightning_pipe.util.units import format_bandwidth, format_seconds

if TYPE_CHECKING:
    from lightning_pipe.strategy.contract import Call, PipelineModel

__all__ = [
    "AUTO",
    "CALIBRATE_AFTER",
    "DEFAULT_MICROBATCHES",
    "PIN_STEPS",
    "SWITCH_GAIN",
    "AutoOptions",
    "Calibration",
    "Chosen",
    "PinTrial",
    "PipelineChoosing",
    "calibration",
]

AUTO = "auto"
DEFAULT_MICROBATCHES: tuple[int, ...] = (2, 4, 8)
"""The micro-batch counts searched unless given (those above the batch's rows are left out)."""
SHOWN = 5
"""Candidates printed at set-up."""
CALIBRATE_AFTER = 6
"""Steps run before the in-run costs re-rank the candidates (steps 2-5 measured)."""
WARM_UP = 2
"""Steps left out of the in-run costs."""
SWITCH_GAIN = 0.05
"""How much faster (predicted) another configuration must be for the strategy to switch to it."""
PIN_STEPS = 5
"""Steps run pinned in the pinning trial (the first left out; the last's time is not known yet)."""


@dataclass(frozen=True)
class Calibration:
    """What the first steps measured beyond the profile: each action is ``scale`` × its profiled
    seconds + ``fixed`` (:func:`calibration`, the executor's own time between actions included), and
    each training step takes ``per_step`` beyond its simulated actions (Lightning's loop, the
    strategy's log relay: what a simulation of the actions leaves out), whatever the configuration."""

    scale: float
    fixed: float
    per_step: float

    def seconds(self, candidate: Candidate) -> float:
        """``candidate``'s predicted seconds per training step: its ``step_seconds`` (priced with
        the calibrated costs) and the work beyond its actions."""
        return candidate.step_seconds + self.per_step

    def __str__(self) -> str:
        return (
            f"in-run actions = {self.scale:.2f} x the profile + {format_seconds(self.fixed)}, each step "
            f"{format_seconds(self.per_step)} beyond them"
        )


@dataclass
class PinTrial:
    """``pin_cpus="auto"``: the unpinned steps' median, the first pinned step, the decision."""

    cores: set[int]
    start: int | None = None
    unpinned: float | None = None
    pinned: bool | None = None

    @classmethod
    def of(cls, pin_cpus: object, device: torch.device) -> PinTrial | None:
        """A trial for ``pin_cpus="auto"`` on a CPU device of a system that places threads (Linux)."""
        if pin_cpus != AUTO or device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
            return None
        return cls(set(os.sched_getaffinity(0)))


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


@dataclass(frozen=True)
class AutoOptions:
    """What the search may choose: ``families`` (``None``: every one ``rule`` allows), the
    micro-batch counts, and ``recompute`` (``None``: per stage, as each needs to fit)."""

    families: tuple[str, ...] | None
    rule: str | None
    microbatches: tuple[int, ...]
    recompute: bool | None

    @classmethod
    def of(
        cls, schedule: str, microbatches: object, rule: str | None, recompute: object
    ) -> tuple[AutoOptions | None, ScheduleOptions]:
        """The search the strategy's arguments ask for (``None``: none, every value given) and the
        schedule options the strategy starts with: the family given, or ``1f1b`` until the search
        has chosen (one stage per worker, as every family searched but ``interleaved``)."""
        counts = _counts(microbatches)
        if not (isinstance(recompute, bool) or recompute is None or recompute == AUTO):
            raise PlanningError(
                f"recompute must be True, False or 'auto' (each stage recomputes as it needs to fit); got {recompute!r}"
            )
        searching = schedule == AUTO or counts is not None or recompute == AUTO
        fixed = microbatches if isinstance(microbatches, int) and not isinstance(microbatches, bool) else None
        if rule == ANY_RULE and schedule != AUTO:
            raise PlanningError(
                f"rule={ANY_RULE!r} lets schedule='auto' choose any family with its own rule; with schedule="
                f"{schedule!r} give one of its rules, or None (its own)"
            )
        if not searching:
            return None, ScheduleOptions(family=schedule, microbatches=fixed, rule=rule)
        searched = FLUSHING_FAMILIES + DELAYED_FAMILIES
        if schedule != AUTO and schedule not in searched:
            raise PlanningError(
                f"microbatches='auto' and recompute='auto' choose among the splits of {', '.join(searched)}; "
                f"{schedule!r} is not searched: give its micro-batches and recompute=True/False, or schedule='auto'"
            )
        if schedule == AUTO and rule is not None:
            searched_rule: str | None = rule
            start = ScheduleOptions(family="1f1b", microbatches=fixed)
        else:
            searched_rule = rule if schedule == AUTO else (rule or rules_of(schedule)[0])
            start = ScheduleOptions(family="1f1b" if schedule == AUTO else schedule, microbatches=fixed, rule=rule)
        auto = cls(
            families=None if schedule == AUTO else (schedule,),
            rule=searched_rule,
            microbatches=(fixed,) if fixed is not None else counts or DEFAULT_MICROBATCHES,
            recompute=None if recompute == AUTO or (recompute is None and schedule == AUTO) else bool(recompute),
        )
        searched_families(auto.rule, auto.families)  # a rule that is none, or refuses the family given: now
        return auto, start

    def flushing_only(self, reason: str) -> AutoOptions:
        """The search kept to the flushing families (sync), because of ``reason``; refused when the
        family given is a delayed one."""
        if self.families is not None and not set(self.families) & set(FLUSHING_FAMILIES):
            raise PlanningError(f"{', '.join(self.families)} cannot run with {reason}")
        if self.rule in (None, "sync"):
            return self
        rank_zero_info(f"schedule='auto': {reason} runs only the flushing schedules, which the search keeps to")
        return dataclasses.replace(self, rule=None)


def _counts(microbatches: object) -> tuple[int, ...] | None:
    """The micro-batch counts ``microbatches`` asks the search to try (``None``: not searched)."""
    if microbatches == AUTO:
        return DEFAULT_MICROBATCHES
    if isinstance(microbatches, Sequence) and not isinstance(microbatches, str):
        if not microbatches:
            raise PlanningError("microbatches=[] gives the search nothing to try: list counts such as [2, 4, 8]")
        for count in microbatches:
            check_whole("every microbatches entry", count, 1)
        return tuple(dict.fromkeys(int(count) for count in microbatches))
    if isinstance(microbatches, str):
        raise PlanningError(f"microbatches must be a whole number, a list of them or 'auto'; got {microbatches!r}")
    return None


@dataclass(frozen=True)
class Chosen:
    """The search's winner as the strategy runs it: its schedule options and recomputing stages."""

    schedule: ScheduleOptions
    recompute: tuple[bool, ...]

    @classmethod
    def of(cls, winner: Candidate, start: ScheduleOptions) -> Chosen:
        """``winner`` on the options the strategy started with (slack, ... kept)."""
        schedule = dataclasses.replace(
            start, family=winner.family, microbatches=winner.microbatches, rule=winner.schedule.rule
        )
        return cls(schedule, winner.recompute)


class PipelineChoosing:
    """Choosing the pipeline on the first batch (methods of :class:`~lightning_pipe.strategy.PipelineStrategy`)."""

    def _choose(
        self, model: PipelineModel, first: Call, optimizer: Any, batch_rows: int, meta: bool
    ) -> tuple[StagePlan, Chosen]:
        """Rank 0: profile, search, print the ranking; the winner's stage plan and options."""
        assert self._auto is not None
        options = self._within_limit(self.plan_options)
        sample = model.inputs(first)
        device = torch.device("meta") if meta else self.root_device
        costs = profile_costs(model.layers, sample, options, device, model.names, self.setup_seconds, self.root_device)
        counts = [m for m in self._auto.microbatches if m <= batch_rows]
        if not counts:
            raise PlanningError(
                f"the batch has {batch_rows} rows, fewer than any micro-batch count searched "
                f"({list(self._auto.microbatches)}): use larger batches or smaller counts (microbatches=[...])"
            )
        parts = batch_rows / rows_of(sample)
        small = None
        finer = round(max(counts) / parts)  # the smallest micro-batch searched is profiled too (no file given)
        if finer > 1 and options.profile is None and rows_of(sample) >= finer:
            fewer = _first_part(sample, finer)
            few = profile_costs(model.layers, fewer, options, device, model.names, self.setup_seconds, self.root_device)
            small = (few, batch_rows / rows_of(fewer))
        start = time.perf_counter()
        arguments = {
            "small": small,
            "memory_limit": options.memory_limit,
            "rule": self._auto.rule,
            "families": self._auto.families,
            "microbatches": counts,
            "recompute": self._auto.recompute,
            "partitioner": options.partitioner,
            "profile_microbatches": parts,
            "extra_copies": optimizer_copies(optimizer),
            "network": Network(options.bandwidth),
            "names": model.names,
        }
        self._searched = costs, arguments
        ranked = search(costs, self.workers, contention=options.contention, **self._searched[1])
        self.candidates = ranked
        rank_zero_info(
            f"Choosing the pipeline: {len(ranked)} configurations fit, priced in {time.perf_counter() - start:.2f} s; "
            f"the best {min(SHOWN, len(ranked))}:\n{ranking_table(ranked, SHOWN)}"
        )
        return ranked[0].stage_plan, Chosen.of(ranked[0], self.schedule_options)

    def _measure_machine(self) -> None:
        """Every rank, for what was not given: the all-reduce bandwidth among the ranks
        (:func:`~lightning_pipe.runtime.link_speed.allreduce_bandwidth`) and how much slower the ranks
        compute all at once than alone (:func:`~lightning_pipe.runtime.contention.measure_contention`)
        become the ones planned with."""
        measured: dict[str, float] = {}
        if self._links_measured:
            measured["bandwidth"] = allreduce_bandwidth(self.root_device)
        if self._contention_measured:
            measured["contention"] = measure_contention(self._objects, self.root_device)
        if not measured:
            return
        self.plan_options = dataclasses.replace(self.plan_options, **measured)
        said = [f"links {format_bandwidth(measured['bandwidth'])} (an all-reduce)"] if "bandwidth" in measured else []
        said += [f"contention {measured['contention']:.2f}"] if "contention" in measured else []
        rank_zero_info(f"Measured among the ranks: {', '.join(said)}")

    def _run_chosen(self, chosen: Chosen) -> None:
        """Every rank: the winner's options become the strategy's (the topology follows them)."""
        self.schedule_options = chosen.schedule
        flags = chosen.recompute
        self.recompute = flags[0] if len(set(flags)) == 1 else list(flags)
        self._topology = self._shape()

    def _recalibrate(self) -> None:
        """After the pinning trial (``pin_cpus="auto"``) and :data:`CALIBRATE_AFTER` steps (once per
        fit): re-rank with the in-run costs and switch when another configuration is predicted
        :data:`SWITCH_GAIN` faster (a collective)."""
        executor = self.executor
        if executor is None or executor.next_step < CALIBRATE_AFTER:
            return
        trial = self._pin_trial
        if trial is not None and trial.pinned is None:
            self._try_pinning(trial, executor.next_step)
            return
        if self._calibrated:
            return
        self._calibrated = True
        since = trial.start + 1 if trial is not None and trial.pinned and trial.start is not None else WARM_UP
        in_run = executor.measured_costs(since_step=since, to_next=True)  # the executor's own time included
        compute = executor.measured_costs(since_step=since)  # the actions alone, for the kept profile's check
        decision: tuple[StagePlan, Chosen] | None = None
        if self.global_rank == 0:
            self._check_kept_profile(compute)
            decision = self._better(in_run, since)
        decision = self.broadcast(decision)
        if decision is not None:
            self._switch(*decision)

    def _better(self, in_run: StageCosts, since: int) -> tuple[StagePlan, Chosen] | None:
        """Rank 0: the configuration to switch to, by the candidates priced again with what steps
        ``since`` on measured (said either way), or ``None``."""
        assert self.stage_plan is not None and self.stage_plan.plan is not None and self._searched is not None
        scale, fixed = calibration(self._profiled(self.stage_plan), [*in_run.forward, *in_run.backward])
        costs, arguments = self._searched
        small = arguments["small"]
        arguments = {**arguments, "small": None if small is None else (small[0].slowed(scale), small[1])}
        ranked = search(costs.slowed(scale), self.workers, action_seconds=fixed, **arguments)
        running = next((c for c in ranked if self._runs(c)), None)
        if running is None:
            rank_zero_info(f"Calibration after {CALIBRATE_AFTER} steps: the running configuration is not priced")
            return None
        intervals = [b - a for a, b in itertools.pairwise(self._step_starts)][since:]
        found = Calibration(scale, fixed, max(statistics.median(intervals) - running.step_seconds, 0.0))
        self.calibration, self.candidates = found, ranked
        winner = min(ranked, key=found.seconds)
        predicted = found.seconds(running)
        if found.seconds(winner) > predicted * (1 - SWITCH_GAIN):
            rank_zero_info(f"Calibration after {CALIBRATE_AFTER} steps: {found}; keeping {running.label}")
            self.calibrated_step_seconds = predicted
            return None
        self.calibrated_step_seconds = found.seconds(winner)
        rank_zero_info(
            f"Calibration after {CALIBRATE_AFTER} steps: {found}; {winner.label} is predicted "
            f"{1 - found.seconds(winner) / predicted:.0%} faster than {running.label} (running): switching to it\n"
            f"{ranking_table(sorted(ranked, key=found.seconds), SHOWN)}"
        )
        return winner.stage_plan, Chosen.of(winner, self.schedule_options)

    def _check_kept_profile(self, compute: StageCosts) -> None:
        """Rank 0: mark the kept profiles stale (:func:`~lightning_pipe.cost.profile_cache.forget_profile`)
        when the rate of this run's actions, with the contention it measured taken out, is more than
        15% off the profile's (:func:`~lightning_pipe.cost.profile_cache.profile_disagrees`): a profile
        taken on a busier or other machine. What an action costs whatever its rows (the runtime's
        own work) is fitted apart, since profiling again would not change it."""
        assert self.stage_plan is not None and self._searched is not None
        profiled = self._profiled(self.stage_plan)
        contention = self.plan_options.contention
        measured = [seconds / contention for seconds in [*compute.forward, *compute.backward]]
        rate, _ = calibration(profiled, measured)
        if not profile_disagrees(profiled, [rate * seconds for seconds in profiled]):
            return
        small = self._searched[1]["small"]
        reason = f"a run measured its layers {rate:.2f}x as long as this profile"
        marked = [forget_profile(costs, reason) for costs in (self._searched[0], small and small[0]) if costs]
        for path in filter(None, marked):
            rank_zero_info(f"Kept profile {path}: {reason}; the next run measures it anew")

    def _profiled(self, stage_plan: StagePlan) -> list[float]:
        """Each stage's profiled forward seconds, then backward (with the forward again where it
        recomputes), as the run's costs list them."""
        assert stage_plan.plan is not None
        stages = stage_plan.plan.stages
        flags = self.recompute if isinstance(self.recompute, list) else [self.recompute] * len(stages)
        again = zip(stages, flags, strict=True)
        return [s.forward_seconds for s in stages] + [
            s.backward_seconds + (s.forward_seconds if r else 0.0) for s, r in again
        ]

    def _runs(self, candidate: Candidate) -> bool:
        """Whether ``candidate`` is the configuration running."""
        assert self.stage_plan is not None
        flags = self.recompute if isinstance(self.recompute, list) else [self.recompute] * len(candidate.recompute)
        return (
            candidate.schedule == self.options
            and candidate.bounds == self.stage_plan.bounds
            and candidate.stage_plan.replicas == self.stage_plan.replicas
            and list(candidate.recompute) == list(flags)
        )

    def _switch(self, stage_plan: StagePlan, chosen: Chosen) -> None:
        """Every rank: finish the steps in flight, gather the weights and optimizer states by name,
        close the pipeline and run ``chosen`` on ``stage_plan`` from the next batch, each rank taking
        back its stages' weights and states as a resume on another split does."""
        assert self.executor is not None and self._chain is not None
        kept, self.state_dict_type = self.state_dict_type, "full"  # gathered whole, whatever the checkpoints are
        try:
            full = self.broadcast(self.full_state_dict())  # drains first
            state = self.broadcast(self.optimizer_state(self.optimizers[0]))
        finally:
            self.state_dict_type = kept
        self.executor.close()
        self.executor = None
        module = self.lightning_module
        fill([module, *self._chain.layers], module, full, self.optimizers)
        self.load_optimizer_state_dict({"optimizer_states": [state]})
        self._run_chosen(chosen)
        self.stage_plan = stage_plan
        self._step_seconds, self._step_starts = [], []
        if self.global_rank == 0:  # with the calibrated costs (the stage plan's profile is scaled already)
            fixed = self.calibration.fixed if self.calibration is not None else 0.0
            self._prediction = predict(
                stage_plan, self.options, self.microbatches, self.plan_options.contention, self.recompute, fixed
            )

    def _try_pinning(self, trial: PinTrial, step: int) -> None:
        """The pinning trial (every rank; rank 0's step times decide): pin after the unpinned steps,
        and after :data:`PIN_STEPS` pinned ones keep the faster placement."""
        intervals = [b - a for a, b in itertools.pairwise(self._step_starts)]
        if trial.start is None:
            trial.unpinned = self.broadcast(statistics.median(intervals[WARM_UP:]))
            pin_threads(self.local_rank, self.num_processes)
            trial.start = step
            return
        if step < trial.start + PIN_STEPS:
            return
        pinned = self.broadcast(statistics.median(intervals[trial.start + 1 :]))
        assert trial.unpinned is not None
        trial.pinned = pinned < trial.unpinned
        if not trial.pinned:
            place_threads(trial.cores)
        rank_zero_info(
            f"pin_cpus='auto': steps took {format_seconds(pinned)} pinned, {format_seconds(trial.unpinned)} "
            f"unpinned (medians): {'pinned' if trial.pinned else 'unpinned'} from here on"
        )


def _first_part(sample: Any, parts: int) -> Any:
    """The first of ``parts`` micro-batches of ``sample``'s tensors (as the executor cuts them)."""
    skeleton, found = flatten(sample)
    return unflatten(skeleton, list(split_batch(tuple(found), parts)[0]))

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
the search to the flushing families, as they would refuse the others. Where earlier fits of the
model kept calibrations, each candidate is priced with the one kept closest to its family and
micro-batch size (:mod:`lightning_pipe.cost.calibrated`), and the winner's prediction with its own,
each brought to the profile the search prices with (:mod:`.profile_basis`).

:class:`PipelineChoosing` holds these as methods of :class:`~lightning_pipe.strategy.PipelineStrategy`
(one of the parts the strategy's class is assembled from, each a module of its own); what the first
steps measure and the switch they may lead to are :mod:`.calibrating`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
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
from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profiler import chain_seconds
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.planning import PlanOptions, StagePlan, optimizer_copies, profile_costs, timed
from lightning_pipe.runtime.batches import rows_of, split_batch
from lightning_pipe.runtime.contention import measure_contention
from lightning_pipe.runtime.link_speed import allreduce_bandwidth, allreduce_overlap
from lightning_pipe.schedule import rules_of
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.profile_basis import ProfileBasis
from lightning_pipe.util.nested import flatten, unflatten
from lightning_pipe.util.units import format_bandwidth

if TYPE_CHECKING:
    from lightning_pipe.strategy.contract import Call, PipelineModel

__all__ = ["AUTO", "DEFAULT_MICROBATCHES", "SHOWN", "AutoOptions", "Chosen", "PipelineChoosing"]

AUTO = "auto"
DEFAULT_MICROBATCHES: tuple[int, ...] = (2, 4, 8)
"""The micro-batch counts searched unless given (those above the batch's rows are left out)."""
SHOWN = 5
"""Candidates printed at set-up."""


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
        if schedule == AUTO:  # 1F1B's options until the search has chosen; the rule says what it may choose
            start, searched_rule = ScheduleOptions(family="1f1b", microbatches=fixed), rule
        else:
            start = ScheduleOptions(family=schedule, microbatches=fixed, rule=rule)
            searched_rule = rule or rules_of(schedule)[0]
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
        layers, costs = self._profile_whole(model, sample, options, device)
        # micro-batches of one row are left out: a forward may branch on a single row (transformers'
        # attention masks do), which the capture, traced on larger micro-batches, cannot check
        counts = [m for m in self._auto.microbatches if m == 1 or 2 * m <= batch_rows]
        if not counts:
            raise PlanningError(
                f"the batch has {batch_rows} rows: too few for micro-batches of two rows or more with any count "
                f"searched ({list(self._auto.microbatches)}); use larger batches or smaller counts (microbatches=[...])"
            )
        parts = batch_rows / rows_of(sample)
        small = None
        basis = ProfileBasis(layers, costs, parts)
        finer = round(max(counts) / parts)  # the smallest micro-batch searched is profiled too (no file given)
        if finer > 1 and options.profile is None and rows_of(sample) >= finer:
            fewer = _first_part(sample, finer)
            few_layers, few = self._profile_whole(model, fewer, options, device)
            small = (few, batch_rows / rows_of(fewer))
            basis = dataclasses.replace(basis, small=few_layers, small_chain=few, small_parts=small[1])
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
            "reduce_overlap": options.reduce_overlap,
            "names": model.names,
            "base": self.schedule_options,
            "update": self.step_prices.update,
        }
        self._searched = basis, arguments
        prices = self.step_prices
        pinned = self._pinned()
        own = prices.kept is not None  # this model's earlier fits; else, a first fit, other models'

        @functools.cache
        def calibration(family: str, m: int) -> Calibration | None:
            """The closest the model's fits kept, else the rate other models' fits of its kind kept."""
            found = (prices.closest(family, m, pinned) or prices.kept) if own else prices.prior_for(family, m, pinned)
            return basis.to_chain(found, m)

        def priced(candidate: Candidate) -> float:
            found = calibration(candidate.family, candidate.microbatches) or prices.loop
            return candidate.step_seconds if found is None else found.seconds(candidate)

        # the contention prices only the candidates no calibration does (one measured running carries it)
        ranked = search(costs, self.workers, calibrations=calibration, contention=options.contention, **arguments)
        seconds: Callable[[Candidate], float] | None = None
        if own or prices.loop is not None or prices.rates.entries:
            seconds = priced
            ranked.sort(key=seconds)
            winner = calibration(ranked[0].family, ranked[0].microbatches)
            self.step_prices = (
                dataclasses.replace(prices, kept=winner) if own else dataclasses.replace(prices, prior=winner)
            )
        self.candidates = ranked
        shown = ranking_table(ranked, SHOWN, seconds)
        rank_zero_info(
            f"Choosing the pipeline: {len(ranked)} configurations fit, priced in {time.perf_counter() - start:.2f} s; "
            f"the best {min(SHOWN, len(ranked))}:\n{shown}"
        )
        return ranked[0].stage_plan, Chosen.of(ranked[0], self.schedule_options)

    def _profile_whole(
        self, model: PipelineModel, sample: Any, options: PlanOptions, device: torch.device
    ) -> tuple[ChainCosts, ChainCosts]:
        """The layers' profile on ``sample`` (:func:`~lightning_pipe.planning.profile_costs`), and the
        same with each layer's times scaled so that they sum to the chain's timed whole
        (:func:`~lightning_pipe.cost.profiler.chain_seconds`): what a stage runs, without the per-layer
        calls a layer-by-layer profile pays. A profile file given, or a meta-device model, is taken as it is."""
        costs = profile_costs(model.layers, sample, options, device, model.names, self.setup_seconds, self.root_device)
        if options.profile is not None or device.type == "meta":
            return costs, costs
        with timed(self.setup_seconds, "profile"):
            return costs, costs.rescaled(*chain_seconds(model.layers, sample, device=device))

    def _measure_machine(self) -> None:
        """Every rank, for what was not given: the all-reduce bandwidth among the ranks
        (:func:`~lightning_pipe.runtime.link_speed.allreduce_bandwidth`), how much slower the ranks
        compute all at once than alone (:func:`~lightning_pipe.runtime.contention.measure_contention`)
        and how much of an all-reduce runs beside their compute
        (:func:`~lightning_pipe.runtime.link_speed.allreduce_overlap`) become the ones planned with."""
        measured: dict[str, float] = {}
        if self._links_measured:
            measured["bandwidth"] = allreduce_bandwidth(self.root_device)
        if self._contention_measured:
            measured["contention"] = measure_contention(self._objects, self.root_device)
        if self._overlap_measured:
            measured["reduce_overlap"] = allreduce_overlap(self.root_device)
        if not measured:
            return
        self.plan_options = dataclasses.replace(self.plan_options, **measured)
        said = [f"links {format_bandwidth(measured['bandwidth'])} (an all-reduce)"] if "bandwidth" in measured else []
        said += [f"contention {measured['contention']:.2f}"] if "contention" in measured else []
        if "reduce_overlap" in measured:
            said.append(f"{measured['reduce_overlap']:.0%} of an all-reduce beside the compute")
        rank_zero_info(f"Measured among the ranks: {', '.join(said)}")

    def _run_chosen(self, chosen: Chosen) -> None:
        """Every rank: the winner's options become the strategy's, on the pipeline copies of
        :attr:`workers` workers the search priced it on (a family's own shape for the strategy's
        ``stages`` would be another: on 4 ranks with ``stages=2``, Rahimi's ``ddp`` one copy of 4,
        interleaved 1F1B 4 copies of 1)."""
        copies = self.data_parallel
        self.schedule_options = chosen.schedule
        flags = chosen.recompute
        self.recompute = flags[0] if len(set(flags)) == 1 else list(flags)
        self._topology = self._shape(data_parallel=copies)


def _first_part(sample: Any, parts: int) -> Any:
    """The first of ``parts`` micro-batches of ``sample``'s tensors (as the executor cuts them)."""
    skeleton, found = flatten(sample)
    return unflatten(skeleton, list(split_batch(tuple(found), parts)[0]))

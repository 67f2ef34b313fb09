"""The search behind ``schedule="auto"`` (lightning_pipe/auto.py) ranks as a brute force over the same
space does, with the strategy's own prediction and memory model; it keeps within the memory limit,
recomputes exactly the stages that need it, names a limit that works when nothing fits, and searches
the delayed-weight families only when the rule allows them."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.auto import (
    ANY_RULE,
    DELAYED_FAMILIES,
    FLUSHING_FAMILIES,
    STEPS,
    Candidate,
    ranking_table,
    search,
    searched_families,
)
from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.memory import EXTRA_COPIES, MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, evaluate, partition
from lightning_pipe.planning import StagePlan, in_flight_counts, memory_model, predict
from lightning_pipe.schedule import NON_FLUSHING_FAMILIES
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.worker_memory import WorkerMemory

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORKERS = 2
DELAYED = set(DELAYED_FAMILIES)


@st.composite
def chains(draw: st.DrawFn) -> ChainCosts:
    n = draw(st.integers(3, 5))
    positive = st.lists(st.integers(1, 9).map(float), min_size=n, max_size=n)
    sizes = st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n)
    return ChainCosts.from_lists(
        draw(positive), draw(positive), activation=draw(sizes), saved=draw(sizes), params=draw(sizes)
    )


@st.composite
def spaces(draw: st.DrawFn) -> dict[str, object]:
    """A small search space: the micro-batch counts, recomputation and the rules allowed."""
    return {
        "microbatches": tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=2, unique=True))),
        "recompute": draw(st.sampled_from([None, True, False])),
        "rule": draw(st.sampled_from([None, "sync", ANY_RULE, "2bw", "stash"])),
    }


def _layouts(costs: ChainCosts, family: str, stages: int) -> list[tuple[list[list[int]], tuple[int, ...] | None]]:
    """Every contiguous split into ``stages``; for ``ddp`` the time partitioner's (its split does not
    change its time), for ``1f1b_rr`` PipeDream's replicated plan when it replicates."""
    n = len(costs)
    if family == "1f1b_rr":
        plan = partition(PlanRequest(costs, devices=stages, straight=False), "pipedream")
        replicas = tuple(s.replicas for s in plan.stages)
        return [([list(s.layers) for s in plan.stages], replicas)] if max(replicas) > 1 else []
    if stages > n:
        return []
    if family == "ddp":
        plan = partition(PlanRequest(costs, devices=stages, straight=True), "time")
        if len(plan.stages) == stages:
            return [([list(s.layers) for s in plan.stages], None)]
    edges = [[0, *cut, n] for cut in itertools.combinations(range(1, n), stages - 1)]
    return [([list(range(a, b)) for a, b in itertools.pairwise(e)], None) for e in edges]


def _brute_force(costs: ChainCosts, limit: float | None, space: dict[str, object]) -> tuple[float, float]:
    """The least predicted step time over every (family, m, split, recomputing stages) that fits
    ``limit``: each stage's weights and state by ``evaluate``, summed over the stages a worker computes,
    with the activations, gradients and transients its actions hold at its peak (``WorkerMemory``, a
    recomputing stage's activations as ``evaluate`` gives them), and the strategy's prediction; with
    ``recompute=None`` every
    assignment of recomputation to stages is tried. Also the least peak memory of any of them (fitting
    or not)."""
    best, least = math.inf, math.inf
    for (family, rule), m in itertools.product(searched_families(space["rule"]), space["microbatches"]):
        options = ScheduleOptions(family, m, rule=rule).on_workers(WORKERS)
        scaled = costs.scaled(1 / m)
        stages = options.stages_for(WORKERS)
        try:
            counts = in_flight_counts(options, stages, m)
        except PlanningError:
            continue
        models = [memory_model(family, m, EXTRA_COPIES["momentum"], flag, counts) for flag in (False, True)]
        for groups, replicas in _layouts(scaled, family, stages):
            bounds = tuple((g[0], g[-1]) for g in groups)
            extra = {} if replicas is None else {"stage_replicas": list(replicas)}
            try:
                schedule = options.make(len(groups), m, **extra)(STEPS)
            except PlanningError:
                continue
            plain, again = (
                evaluate(scaled, groups, replicas, partitioner="brute", devices=WORKERS, memory=model)
                for model in models
            )
            flag, count = space["recompute"], len(groups)
            patterns = itertools.product((False, True), repeat=count) if flag is None else [(flag,) * count]
            for pattern in patterns:
                chosen = zip(plain.stages, again.stages, pattern, strict=True)
                mixed = replace(plain, stages=tuple(a if r else p for p, a, r in chosen))
                peak = max(WorkerMemory.of(schedule, scaled, bounds).bytes_under(mixed, pattern))
                least = min(least, peak)
                if limit is not None and peak > limit:
                    continue
                stage_plan = StagePlan(bounds, plain, scaled, replicas)
                best = min(best, predict(stage_plan, options, m, recompute=pattern).steady_step)
    return best, least


def _search(costs: ChainCosts, limit: float | None, space: dict[str, object]) -> list[Candidate]:
    return search(costs, WORKERS, memory_limit=limit, **space)  # type: ignore[arg-type]


def _check_ranked(found: list[Candidate], layers: int, limit: float | None, rule: str | None) -> None:
    """Sorted by step time, within the limit, no delayed family unless the rule allows it, contiguous
    stages covering every layer, every worker busy."""
    assert found
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    for c in found:
        assert limit is None or c.peak_memory_bytes <= limit
        assert rule not in (None, "sync") or c.family not in DELAYED
        assert c.rule == "sync" or rule in (ANY_RULE, c.rule)
        assert c.bounds[0][0] == 0 and c.bounds[-1][1] == layers - 1 and len(c.memory_bytes) == WORKERS
        assert all(a[0] <= a[1] and a[1] + 1 == b[0] for a, b in itertools.pairwise(c.bounds))
        # no schedule computes a mini-batch faster than the workers share its compute
        again = zip(c.plan.stages, c.recompute, strict=True)
        work = sum(s.compute_seconds + (s.forward_seconds if r else 0.0) for s, r in again)
        assert c.step_seconds >= c.microbatches * work / WORKERS * (1 - 1e-9)


@SETTINGS
@given(chains(), spaces())
def test_the_winner_is_the_brute_force_best_and_the_list_is_sorted(costs: ChainCosts, space: dict[str, object]) -> None:
    best, _ = _brute_force(costs, None, space)
    found = _search(costs, None, space)
    _check_ranked(found, len(costs), None, space["rule"])  # type: ignore[arg-type]
    assert math.isclose(found[0].step_seconds, best, rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(chains(), spaces(), st.integers(1, 200).map(float))
def test_memory_limits_are_kept_and_a_refusal_names_a_limit_that_works(
    costs: ChainCosts, space: dict[str, object], limit: float
) -> None:
    best, least = _brute_force(costs, limit, space)
    if math.isinf(best):
        with pytest.raises(PlanningError, match=r"memory_limit=\d+") as refused:
            _search(costs, limit, space)
        named = float(re.search(r"memory_limit=(\d+)", str(refused.value)).group(1))
        assert least <= named < least + 1
        found = _search(costs, named, space)
        _check_ranked(found, len(costs), named, space["rule"])  # type: ignore[arg-type]
        return
    found = _search(costs, limit, space)
    _check_ranked(found, len(costs), limit, space["rule"])  # type: ignore[arg-type]
    assert math.isclose(found[0].step_seconds, best, rel_tol=1e-9, abs_tol=1e-12)


def test_delayed_families_only_when_allowed() -> None:
    costs = ChainCosts.from_lists([1.0, 2.0, 3.0, 1.0], [2.0, 4.0, 6.0, 2.0], activation=[1.0] * 4, params=[4.0] * 4)
    assert set(DELAYED_FAMILIES) == set(NON_FLUSHING_FAMILIES) and not set(FLUSHING_FAMILIES) & DELAYED
    strict = search(costs, 2)
    assert {c.family for c in strict} <= set(FLUSHING_FAMILIES)
    assert {"gpipe", "1f1b", "zb_h1", "interleaved", "ddp"} <= {c.family for c in strict}
    assert {c.rule for c in strict} == {"sync"}
    delayed = search(costs, 2, rule=ANY_RULE)
    assert {c.family for c in delayed} >= DELAYED
    assert {(c.family, c.rule) for c in search(costs, 2, rule="stash") if c.family in DELAYED} == {
        ("pipedream", "stash"),
        ("2bw", "stash"),
    }
    with pytest.raises(PlanningError, match="rule='delayed'"):
        search(costs, 2, families=["1f1b", "2bw"])
    with pytest.raises(PlanningError, match="no update rule"):
        search(costs, 2, rule="fast")
    assert {c.family for c in search(costs, 2, families=["2bw"], rule=ANY_RULE)} == {"2bw"}


def test_recomputation_trades_time_for_memory_stage_by_stage() -> None:
    """Recomputing keeps each stage's input instead of its activations (GPipe §2.3) and runs the
    forward again: under a limit only a recomputing configuration fits, and it is slower; a limit only
    1F1B's first stage exceeds (it keeps the most micro-batches in flight) recomputes only there."""
    costs = ChainCosts.from_lists([1.0] * 4, [2.0] * 4, activation=[1.0] * 4, saved=[100.0] * 4)
    split = ((0, 1), (2, 3))
    kept, again = (
        next(c for c in search(costs, 2, microbatches=(4,), families=["1f1b"], recompute=flag) if c.bounds == split)
        for flag in (False, True)
    )
    assert again.recompute == (True, True) and kept.recompute == (False, False)
    assert again.peak_memory_bytes < kept.peak_memory_bytes
    assert again.step_seconds > kept.step_seconds
    tight = search(costs, 2, microbatches=(4,), families=["1f1b"], memory_limit=again.peak_memory_bytes)
    assert all(any(c.recompute) for c in tight)
    first_only = max(again.memory_bytes[0], kept.memory_bytes[1])
    assert kept.memory_bytes[0] > first_only
    mixed = search(costs, 2, microbatches=(4,), families=["1f1b"], memory_limit=first_only)
    chosen = next(c for c in mixed if c.bounds == split)
    assert chosen.recompute == (True, False) and chosen.recomputed == "0"
    assert kept.step_seconds < chosen.step_seconds < again.step_seconds


def test_a_fixed_cost_per_micro_batch_favours_fewer() -> None:
    """The mini-batch is fixed: more micro-batches shrink GPipe's bubble when they cost nothing more
    than their rows, and lose when each action has a fixed cost."""
    costs = ChainCosts.from_lists([1.0, 1.0], [2.0, 2.0])
    free = search(costs, 2, microbatches=(2, 8), families=["gpipe"], recompute=False)
    assert free[0].microbatches == 8 and free[0].bubble_fraction < free[-1].bubble_fraction
    fixed = search(costs, 2, microbatches=(2, 8), families=["gpipe"], recompute=False, action_seconds=1.0)
    assert fixed[0].microbatches == 2


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chains(),
    st.dictionaries(
        st.tuples(st.sampled_from(["gpipe", "1f1b", "ddp"]), st.sampled_from([2, 4])),
        st.tuples(st.floats(0.5, 3.0), st.floats(0.0, 2.0)),
    ),
)
def test_each_family_and_count_is_priced_with_its_own_calibration(
    costs: ChainCosts, rates: dict[tuple[str, int], tuple[float, float]]
) -> None:
    """Per family and micro-batch count, the calibration given (else ``scale`` and
    ``action_seconds``) prices its candidates: the same as searching that family and count alone
    with its rate and fixed seconds per action."""
    space = {"families": ["gpipe", "1f1b", "ddp"], "microbatches": (2, 4), "recompute": False}
    kept = {pair: Calibration(rate, fixed, 0.0) for pair, (rate, fixed) in rates.items()}
    found = search(costs, WORKERS, calibrations=lambda family, m: kept.get((family, m)), scale=1.5, **space)
    for candidate in found:
        alone = kept.get((candidate.family, candidate.microbatches), Calibration(1.5, 0.0, 0.0))
        space_alone = {**space, "families": [candidate.family], "microbatches": (candidate.microbatches,)}
        same = search(costs, WORKERS, scale=alone.scale, action_seconds=alone.fixed, **space_alone)
        match = next(c for c in same if c.bounds == candidate.bounds and c.replicas == candidate.replicas)
        assert math.isclose(candidate.step_seconds, match.step_seconds, rel_tol=1e-12)


def test_replicas_all_reduce_is_priced_beside_the_compute_as_measured_or_as_their_calibration_ran() -> None:
    """Rahimi's ``ddp`` pays its all-reduce: the less of it runs beside the compute
    (``reduce_overlap``), the longer its step, unless a calibration measured on a replicating family
    prices it (its actions carry the all-reduces: priced beside the compute). A pipeline's step does
    not change: it reduces nothing."""
    costs = ChainCosts.from_lists([1.0] * 4, [2.0] * 4, params=[4.0, 4.0, 8.0, 8.0])
    space = {"families": ["1f1b", "ddp"], "microbatches": (2,), "recompute": False, "network": Network(2.0)}

    def steps(**arguments: object) -> dict[tuple[str, tuple], float]:
        found = search(costs, WORKERS, **space, **arguments)  # type: ignore[arg-type]
        return {(c.family, c.bounds): c.step_seconds for c in found}

    beside, half, none = (steps(reduce_overlap=share) for share in (1.0, 0.5, 0.0))
    for key in beside:
        if key[0] == "ddp":
            assert beside[key] < half[key] < none[key]
        else:
            assert beside[key] == half[key] == none[key]
    replicas = Calibration(1.0, 0.0, 0.0, replicating=True)
    assert steps(reduce_overlap=0.0, calibrations=lambda family, m: replicas) == beside
    piped = Calibration(1.0, 0.0, 0.0)
    assert steps(reduce_overlap=0.0, calibrations=lambda family, m: piped) == none


def test_beyond_max_splits_the_partitioners_split_and_its_neighbours() -> None:
    costs = ChainCosts.from_lists([1.0, 5.0, 1.0, 1.0, 1.0, 5.0], [1.0] * 6)
    found = search(costs, 2, max_splits=0, microbatches=(4,), families=["1f1b"])
    cuts = {c.bounds[1][0] for c in found}
    seed = partition(PlanRequest(costs, devices=2, straight=True), "time").stages[1].layers[0]
    assert cuts == {seed - 1, seed, seed + 1}


def test_the_table_shows_the_best_and_says_why() -> None:
    costs = ChainCosts.from_lists([1.0, 2.0, 3.0, 1.0], [2.0, 4.0, 6.0, 2.0], activation=[1.0] * 4, params=[4.0] * 4)
    found = search(costs, 2, memory_limit=1e6, families=["gpipe", "1f1b"])
    table = ranking_table(found, top=3)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 1 and lines[0].startswith("| # | schedule | rule")
    assert lines[-1].startswith(f"{found[0].label} wins: ") and "less time per step than gpipe" in lines[-1]
    assert "of 977 KiB" in lines[-1]
    assert found[1].why.endswith("977 KiB") and "slower than" in found[1].why
    # replicas tie on time (free links): the one with less memory wins, and says so
    tied = search(costs, 2, memory_limit=1e6, families=["ddp", "1f1b_rr"], microbatches=(8,))
    assert tied[0].step_seconds == pytest.approx(tied[1].step_seconds, rel=0.005)
    assert tied[0].why.startswith(f"as fast as {tied[1].label} (within 0.5%) with ")
    assert tied[0].peak_memory_bytes <= tied[1].peak_memory_bytes


def test_memory_model_recomputes_and_the_fast_partitioners_refuse_it() -> None:
    model = MemoryModel("1f1b", 4, extra_copies=1, recompute=True)
    assert model.stage_bytes(10.0, 100.0, downstream=2, input_bytes=3.0) == 2 * 10.0 + 2 * 3.0 + 100.0
    costs = ChainCosts.from_lists([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(PlanningError, match="without recomputation"):
        partition(PlanRequest(costs, devices=2, memory=model), "time")
    with pytest.raises(PlanningError, match=r"memory_limit=\d+"):
        search(ChainCosts.from_lists([1.0, 1.0], [1.0, 1.0], params=[1.0, 1.0]), 2, memory_limit=1.0)


def test_the_families_are_searched_with_the_options_given() -> None:
    """``base`` carries the strategy's other options: interleaving three stages per worker gives six
    stages on two workers, and a CDP form that fixes the micro-batches leaves the other counts out."""
    costs = ChainCosts.from_lists([1.0] * 8, [2.0] * 8, activation=[1.0] * 8, params=[1.0] * 8)
    three = search(costs, 2, families=["interleaved"], microbatches=(4,), base=ScheduleOptions(virtual_stages=3))
    assert three and {len(c.bounds) for c in three} == {6} and {c.schedule.virtual_stages for c in three} == {3}
    dp = search(costs, 2, families=["cdp"], rule=ANY_RULE, microbatches=(2, 4), base=ScheduleOptions(form="dp"))
    assert {c.microbatches for c in dp} == {2}

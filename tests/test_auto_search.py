"""The search behind ``schedule="auto"`` (lightning_pipe/auto.py) ranks as a brute force over the same
space does, with the same simulator and memory model; it keeps within the memory limit, names a limit
that works when nothing fits, and searches the delayed-weight families only when allowed."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.auto import DELAYED_FAMILIES, FLUSHING_FAMILIES, STEPS, Candidate, ranking_table, search
from lightning_pipe.cost.memory import EXTRA_COPIES, MemoryModel
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, evaluate, partition
from lightning_pipe.schedule import NON_FLUSHING_FAMILIES, StageCosts, make_schedule, memory_schedule, simulate

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORKERS = 2
DELAYED = set(NON_FLUSHING_FAMILIES)


@st.composite
def chains(draw: st.DrawFn) -> ChainCosts:
    n = draw(st.integers(3, 6))
    positive = st.lists(st.integers(1, 9).map(float), min_size=n, max_size=n)
    sizes = st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n)
    return ChainCosts.from_lists(
        draw(positive), draw(positive), activation=draw(sizes), saved=draw(sizes), params=draw(sizes)
    )


@st.composite
def spaces(draw: st.DrawFn) -> dict[str, object]:
    """A small search space: the micro-batch counts, recomputation and whether delays are allowed."""
    return {
        "microbatches": tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=2, unique=True))),
        "recompute": tuple(draw(st.lists(st.booleans(), min_size=1, max_size=2, unique=True))),
        "allow_delayed": draw(st.booleans()),
    }


def _brute_force(costs: ChainCosts, limit: float | None, space: dict[str, object]) -> tuple[float, float]:
    """The least predicted step time over every (family, m, recompute, contiguous split) that fits
    ``limit``, priced directly (the simulator on each stage's sums, the memory model through
    ``evaluate``); and the least peak memory of any of them (fitting or not)."""
    families = FLUSHING_FAMILIES + (DELAYED_FAMILIES if space["allow_delayed"] else ())
    best, least = math.inf, math.inf
    for family, m, again in itertools.product(families, space["microbatches"], space["recompute"]):
        try:
            schedule = make_schedule(family, WORKERS, m, STEPS)
        except PlanningError:
            continue
        scaled = costs.scaled(1 / m)
        memory = MemoryModel(
            memory_schedule(family),
            m,
            EXTRA_COPIES["momentum"],
            split_backward=family not in DELAYED,
            accumulation=True,
            recompute=again,
        )
        for cut in range(1, len(costs)):
            groups = [list(range(cut)), list(range(cut, len(costs)))]
            plan = evaluate(scaled, groups, partitioner="brute", devices=WORKERS, memory=memory)
            least = min(least, plan.peak_memory_bytes)
            if limit is not None and plan.peak_memory_bytes > limit:
                continue
            forward = [s.forward_seconds for s in plan.stages]
            backward = [s.backward_seconds + (s.forward_seconds if again else 0.0) for s in plan.stages]
            stage_costs = StageCosts(
                forward=forward,
                backward=backward,
                activation_bytes=[s.output_bytes for s in plan.stages],
                saved_bytes=[s.saved_bytes for s in plan.stages],
                weight_bytes=[s.param_bytes for s in plan.stages],
            )
            best = min(best, simulate(schedule, stage_costs, early_gradients=True).steady_step)
    return best, least


def _search(costs: ChainCosts, limit: float | None, space: dict[str, object]) -> list[Candidate]:
    return search(costs, WORKERS, memory_limit=limit, **space)  # type: ignore[arg-type]


def _check_ranked(found: list[Candidate], layers: int, limit: float | None, allow_delayed: bool) -> None:
    """Sorted by step time, within the limit, no delayed family unless allowed, one contiguous stage
    per worker covering every layer."""
    assert found
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    for c in found:
        assert limit is None or c.peak_memory_bytes <= limit
        assert allow_delayed or c.family not in DELAYED
        assert c.bounds[0][0] == 0 and c.bounds[-1][1] == layers - 1 and c.replicas == (1,) * WORKERS
        assert all(a[0] <= a[1] and a[1] + 1 == b[0] for a, b in itertools.pairwise(c.bounds))
        # no schedule computes a mini-batch faster than its slowest stage computes its share
        slowest = max(s.compute_seconds + (s.forward_seconds if c.recompute else 0.0) for s in c.plan.stages)
        assert c.step_seconds >= c.microbatches * slowest * (1 - 1e-9)


@SETTINGS
@given(chains(), spaces())
def test_the_winner_is_the_brute_force_best_and_the_list_is_sorted(costs: ChainCosts, space: dict[str, object]) -> None:
    best, _ = _brute_force(costs, None, space)
    found = _search(costs, None, space)
    _check_ranked(found, len(costs), None, bool(space["allow_delayed"]))
    assert found[0].step_seconds <= best * (1 + 1e-9) + 1e-12
    assert found[0].step_seconds >= best * (1 - 1e-9) - 1e-12


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
        _check_ranked(found, len(costs), named, bool(space["allow_delayed"]))
        return
    found = _search(costs, limit, space)
    _check_ranked(found, len(costs), limit, bool(space["allow_delayed"]))
    assert math.isclose(found[0].step_seconds, best, rel_tol=1e-9, abs_tol=1e-12)


def test_delayed_families_only_when_allowed() -> None:
    costs = ChainCosts.from_lists([1.0, 2.0, 3.0, 1.0], [2.0, 4.0, 6.0, 2.0], activation=[1.0] * 4, params=[4.0] * 4)
    strict = search(costs, 2)
    assert {c.family for c in strict} <= set(FLUSHING_FAMILIES)
    assert {"gpipe", "1f1b"} <= {c.family for c in strict}
    delayed = search(costs, 2, allow_delayed=True)
    assert {c.family for c in delayed} & DELAYED
    with pytest.raises(PlanningError, match="allow_delayed=True"):
        search(costs, 2, families=["1f1b", "2bw"])
    assert {c.family for c in search(costs, 2, families=["2bw"], allow_delayed=True)} == {"2bw"}


def test_recomputation_trades_time_for_memory() -> None:
    """Recomputing keeps each stage's input instead of its activations (GPipe §2.3) and runs the
    forward again: under a limit only a recomputing configuration fits, and it is slower."""
    costs = ChainCosts.from_lists([1.0] * 4, [2.0] * 4, activation=[1.0] * 4, saved=[100.0] * 4)
    free = search(costs, 2, microbatches=(4,), families=["gpipe"])
    kept, again = (
        next(c for c in free if c.recompute is flag and c.bounds == ((0, 1), (2, 3))) for flag in (False, True)
    )
    assert again.peak_memory_bytes < kept.peak_memory_bytes
    assert again.step_seconds > kept.step_seconds
    tight = search(costs, 2, microbatches=(4,), families=["gpipe"], memory_limit=again.peak_memory_bytes)
    assert all(c.recompute for c in tight)


def test_a_fixed_cost_per_micro_batch_favours_fewer() -> None:
    """The mini-batch is fixed: more micro-batches shrink GPipe's bubble when they cost nothing more
    than their rows, and lose when each action has a fixed cost."""
    costs = ChainCosts.from_lists([1.0, 1.0], [2.0, 2.0])
    free = search(costs, 2, microbatches=(2, 8), families=["gpipe"], recompute=(False,))
    assert free[0].microbatches == 8 and free[0].bubble_fraction < free[-1].bubble_fraction
    fixed = search(costs, 2, microbatches=(2, 8), families=["gpipe"], recompute=(False,), action_seconds=1.0)
    assert fixed[0].microbatches == 2


def test_beyond_max_splits_the_partitioners_split_and_its_neighbours() -> None:
    costs = ChainCosts.from_lists([1.0, 5.0, 1.0, 1.0, 1.0, 5.0], [1.0] * 6)
    found = search(costs, 2, max_splits=0, microbatches=(4,), recompute=(False,))
    cuts = {c.bounds[1][0] for c in found}
    seed = partition(PlanRequest(costs, devices=2, straight=True), "time").stages[1].layers[0]
    assert cuts == {seed - 1, seed, seed + 1}


def test_the_table_shows_the_best_and_says_why() -> None:
    costs = ChainCosts.from_lists([1.0, 2.0, 3.0, 1.0], [2.0, 4.0, 6.0, 2.0], activation=[1.0] * 4, params=[4.0] * 4)
    found = search(costs, 2, memory_limit=1e6)
    table = ranking_table(found, top=3)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 1 and lines[0].startswith("| # | schedule")
    assert lines[-1].startswith(f"{found[0].label} wins: ") and "less time per step than" in lines[-1]
    assert "of 977 KiB" in lines[-1]
    assert found[1].why.endswith("977 KiB") and "slower than" in found[1].why


def test_memory_model_recomputes_and_the_fast_partitioners_refuse_it() -> None:
    model = MemoryModel("1f1b", 4, extra_copies=1, recompute=True)
    assert model.stage_bytes(10.0, 100.0, downstream=2, input_bytes=3.0) == 2 * 10.0 + 2 * 3.0 + 100.0
    costs = ChainCosts.from_lists([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(PlanningError, match="without recomputation"):
        partition(PlanRequest(costs, devices=2, memory=model), "time")
    with pytest.raises(PlanningError, match=r"memory_limit=\d+"):
        search(ChainCosts.from_lists([1.0, 1.0], [1.0, 1.0], params=[1.0, 1.0]), 2, memory_limit=1.0)

"""The fast partitioners equal exhaustive oracles on hundreds of random small chains."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.textbook_dp import textbook_bottleneck
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, evaluate, partition

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
small = st.integers(min_value=0, max_value=9).map(float)


@st.composite
def chains(draw: st.DrawFn, max_layers: int = 7) -> ChainCosts:
    """Random chains; in about half of them skip connections make some cuts carry more than the
    activation of the layer before them (a DAG laid out as a chain)."""
    n = draw(st.integers(min_value=1, max_value=max_layers))
    lists = [draw(st.lists(small, min_size=n, max_size=n)) for _ in range(6)]
    forward, backward, activation, saved, params, kept = lists
    flops = draw(st.one_of(st.none(), st.lists(small, min_size=n, max_size=n)))
    # what a layer saves that the one before it saves too (a ReLU's output, the next layer's input)
    shared = [0.0, *(draw(st.integers(0, int(min(saved[i], saved[i - 1])))) for i in range(1, n))]
    # what a layer's backward holds beyond its saved activations (none in about half the chains)
    transient = draw(st.one_of(st.just([0.0] * n), st.lists(small, min_size=n, max_size=n)))
    chain = ChainCosts.from_lists(
        forward,
        backward,
        activation=activation,
        saved=saved,
        params=params,
        kept=kept,
        flops=flops,
        shared=shared,
        transient=transient,
    )
    if draw(st.booleans()):
        skips = draw(st.lists(small, min_size=n - 1, max_size=n - 1))
        chain = replace(chain, boundary_bytes=tuple(a + b for a, b in zip(activation, skips, strict=False)))
    return chain


@st.composite
def requests(draw: st.DrawFn, max_layers: int = 7, max_devices: int = 4) -> PlanRequest:
    costs = draw(chains(max_layers))
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "pipedream", "2bw"]))
    microbatches = draw(st.one_of(st.none(), st.integers(1, 6))) if schedule != "gpipe" else draw(st.integers(1, 6))
    memory = MemoryModel(
        schedule,
        microbatches,
        extra_copies=draw(st.sampled_from([0, 1, 2, 3])),
        split_backward=draw(st.booleans()),
        accumulation=draw(st.booleans()),
    )
    bandwidth = draw(st.sampled_from([math.inf, 1.0, 4.0, 20.0]))
    limit = draw(st.one_of(st.none(), st.integers(1, 120).map(float)))
    return PlanRequest(
        costs,
        devices=draw(st.integers(1, max_devices)),
        memory_limit=limit,
        memory=memory,
        network=Network(bandwidth),
        straight=draw(st.booleans()),
    )


def _outcome(request: PlanRequest, name: str) -> float | None:
    try:
        return partition(request, name).bottleneck_seconds
    except PlanningError:
        return None


@SETTINGS
@given(requests())
def test_pipedream_and_memory_equal_the_exact_oracle(request: PlanRequest) -> None:
    if request.straight and request.devices > len(request.costs):
        with pytest.raises(PlanningError, match="layers"):
            partition(request, "pipedream")
        return
    oracle = _outcome(request, "exact")
    found = _outcome(request, "pipedream")
    if oracle is None:
        assert found is None
        return
    assert found is not None and math.isclose(found, oracle, rel_tol=1e-9, abs_tol=1e-12)
    plan = partition(request, "pipedream")
    assert plan.devices_used <= request.devices
    if request.memory_limit is not None:
        assert plan.peak_memory_bytes <= request.memory_limit * (1 + 1e-9)
        assert partition(request, "memory").bottleneck_seconds == plan.bottleneck_seconds


@SETTINGS
@given(requests(max_layers=7, max_devices=5))
def test_pipedream_equals_the_textbook_dp(request: PlanRequest) -> None:
    """Our bisection search against PipeDream's DP written as the paper states it (bench/textbook_dp.py),
    which computes stage, all-reduce and cut times itself: a wrong cost evaluation shared by our search
    and the exact oracle (which reuse :func:`evaluate`) shows here. No memory limit: the paper's DP has
    none."""
    if request.straight and request.devices > len(request.costs):
        return
    unlimited = replace(request, memory_limit=None)
    expected = textbook_bottleneck(request.costs, request.devices, request.network, request.straight)
    plan = partition(unlimited, "pipedream")
    assert math.isclose(plan.bottleneck_seconds, expected, rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(requests(max_layers=8))
def test_balanced_partitioners_minimise_their_quantity(request: PlanRequest) -> None:
    costs, devices = request.costs, request.devices
    if devices > len(costs):
        return
    for by, column in (("time", "seconds"), ("params", "param_bytes")):
        values = costs.column(column)
        best = None
        for stages in range(1, devices + 1):
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
                bounds = (0, *cuts, len(costs))
                groups = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
                plan = request.plan_unchecked(by, groups, [1] * stages)
                if request.memory_limit is not None and plan.peak_memory_bytes > request.memory_limit:
                    continue
                worst = max(sum(values[i] for i in group) for group in groups)
                best = worst if best is None else min(best, worst)
        try:
            plan = partition(request, by)
        except PlanningError:
            assert best is None
            continue
        achieved = max(sum(values[i] for i in stage.layers) for stage in plan.stages)
        assert best is not None and math.isclose(achieved, best, rel_tol=1e-9, abs_tol=1e-12)


def _brute_noncontiguous(request: PlanRequest) -> float | None:
    best = None
    for owner in itertools.product(range(request.devices), repeat=len(request.costs)):
        used = sorted(set(owner))
        groups = [[i for i, d in enumerate(owner) if d == u] for u in used]
        plan = evaluate(
            request.costs,
            groups,
            partitioner="brute",
            devices=request.devices,
            network=request.network,
            memory=request.memory,
        )
        if request.memory_limit is not None and plan.peak_memory_bytes > request.memory_limit:
            continue
        best = plan.bottleneck_seconds if best is None else min(best, plan.bottleneck_seconds)
    return best


@settings(max_examples=150, deadline=None)
@given(requests(max_layers=6, max_devices=3))
def test_noncontiguous_search_equals_brute_force(request: PlanRequest) -> None:
    if request.devices > len(request.costs):
        return
    oracle = _brute_noncontiguous(request)
    found = _outcome(request, "noncontiguous")
    if oracle is None:
        assert found is None
    else:
        assert found is not None and math.isclose(found, oracle, rel_tol=1e-9, abs_tol=1e-12)
        assert "proven optimal" in partition(request, "noncontiguous").notes[-1]


@SETTINGS
@given(requests(max_layers=7, max_devices=3))
def test_noncontiguous_never_worse_than_contiguous(request: PlanRequest) -> None:
    if request.devices > len(request.costs):
        return
    straight = PlanRequest(
        request.costs, request.devices, request.memory_limit, request.memory, request.network, straight=True
    )
    contiguous = _outcome(straight, "pipedream")
    found = _outcome(request, "noncontiguous")
    if contiguous is not None:
        assert found is not None and found <= contiguous * (1 + 1e-9) + 1e-12


@SETTINGS
@given(requests(max_layers=7), st.sampled_from([0.05, 0.2, 0.5]))
def test_near_ties_of_the_time_partitioner_are_decided_by_memory(request: PlanRequest, tolerance: float) -> None:
    """With a tolerance ``t``, the ``time`` partitioner returns, among the splits whose slowest stage is
    within ``t`` of the fastest split's (brute force over every split under the memory limit), one
    with the least peak memory, and among those (when the layers have FLOP counts) one whose largest
    stage has the fewest FLOPs."""
    costs, devices = request.costs, request.devices
    if devices > len(costs):
        return
    seconds = costs.column("seconds")
    splits = []
    for stages in range(1, devices + 1):
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
            bounds = (0, *cuts, len(costs))
            groups = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
            plan = request.plan_unchecked("time", groups, [1] * stages)
            if request.memory_limit is None or plan.peak_memory_bytes <= request.memory_limit:
                most = max(sum(costs.layers[i].flops or 0 for i in group) for group in groups)
                splits.append((max(sum(seconds[i] for i in group) for group in groups), plan.peak_memory_bytes, most))
    try:
        plan = partition(replace(request, tolerance=tolerance), "time")
    except PlanningError:
        assert not splits
        return
    fastest = min(time for time, _, _ in splits)
    ties = [(memory, most) for time, memory, most in splits if time <= fastest * (1 + tolerance) * (1 + 1e-9)]
    least = min(memory for memory, _ in ties)
    achieved = max(sum(seconds[i] for i in stage.layers) for stage in plan.stages)
    assert achieved <= fastest * (1 + tolerance) * (1 + 1e-9) + 1e-12
    assert math.isclose(plan.peak_memory_bytes, least, rel_tol=1e-9, abs_tol=1e-9)
    if costs.layers[0].flops is not None:
        fewest = min(most for memory, most in ties if memory <= least * (1 + 1e-9) + 1e-9)
        assert max(sum(costs.layers[i].flops for i in stage.layers) for stage in plan.stages) == fewest


@SETTINGS
@given(requests(max_layers=7), st.data())
def test_the_searchs_stage_memory_is_the_plans(request: PlanRequest, data: st.DataObject) -> None:
    """The contiguous search's memory of a split (``ChainProblem.peak_memory``, which decides near-ties
    and the infeasibility hints) equals the plan's (:func:`evaluate`), the split backward's kept
    gradients counted on every stage but the first."""
    n = len(request.costs)
    stages = data.draw(st.integers(1, min(n, request.devices)))
    cuts = sorted(data.draw(st.permutations(range(1, n)))[: stages - 1])
    bounds = (0, *cuts, n)
    groups = [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]
    plan = request.plan_unchecked("time", groups, [1] * stages)
    spans = [(group[0], group[-1], 1) for group in groups]
    assert math.isclose(request.problem(replicate=False).peak_memory(spans), plan.peak_memory_bytes, abs_tol=1e-9)


def test_a_stage_counts_its_split_backward_unless_it_starts_the_chain() -> None:
    """Two splits are equally fast (the second stage takes 1 s either way); the one whose second stage
    starts at layer 3 keeps that layer's split-backward gradients (1 byte), the other keeps none. The
    search once let the first stage's exemption (``γ = 0`` from layer 0) pass a later stage too."""
    costs = ChainCosts.from_lists([0, 0, 0, 0, 1], [0, 0, 1, 0, 0], kept=[0, 0, 0, 1, 0])
    memory = MemoryModel("1f1b", None, extra_copies=0, split_backward=True)
    for tolerance in (0.0, 0.05):
        plan = partition(PlanRequest(costs, 2, memory=memory, tolerance=tolerance), "time")
        assert [stage.layers for stage in plan.stages] == [(0, 1, 2, 3), (4,)]
        assert plan.peak_memory_bytes == 0
    limited = PlanRequest(costs, 2, memory_limit=0.5, memory=memory, straight=True)
    assert [stage.layers for stage in partition(limited, "pipedream").stages] == [(0, 1, 2, 3), (4,)]

"""Worked examples of the papers, the memory model, and clear errors for bad requests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PARTITIONERS, PlanRequest, next_fit, partition
from lightning_pipe.partition.plan import evaluate

WEIGHTS_ONLY = MemoryModel(extra_copies=0)


def test_beaumont_section_6_1_noncontiguous_halves_nothing_but_beats_contiguous() -> None:
    # chain costs (1, 2, 1) on 2 processors: contiguous period 3, non-contiguous period 2
    costs = ChainCosts.from_lists([1.0, 2.0, 1.0])
    contiguous = partition(PlanRequest(costs, 2, straight=True), "pipedream")
    assert contiguous.bottleneck_seconds == 3.0
    free = partition(PlanRequest(costs, 2), "noncontiguous")
    assert free.bottleneck_seconds == 2.0
    assert sorted(stage.layers for stage in free.stages) == [(0, 2), (1,)]
    assert not free.contiguous
    assert free.to_dict()["stages"][0]["layers"] == [0, 2]


def test_beaumont_lemma_2_only_noncontiguous_fits_the_memory() -> None:
    # weights (1, 2, 1), memory limit 2, two processors
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], params=[1, 2, 1])
    request = PlanRequest(costs, 2, memory_limit=2, memory=WEIGHTS_ONLY, straight=True)
    for name in ("memory", "pipedream"):
        with pytest.raises(PlanningError, match="smallest limit that fits 2 device"):
            partition(request, name)
    with pytest.raises(PlanningError, match="fits on 3 devices"):
        partition(request, "memory")
    plan = partition(PlanRequest(costs, 2, memory_limit=2, memory=WEIGHTS_ONLY), "noncontiguous")
    assert plan.peak_memory_bytes == 2
    assert sorted(stage.layers for stage in plan.stages) == [(0, 2), (1,)]


def test_exact_infeasible_message() -> None:
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], params=[1, 2, 1])
    with pytest.raises(PlanningError, match="no contiguous plan on 2 device"):
        partition(PlanRequest(costs, 2, memory_limit=2, memory=WEIGHTS_ONLY, straight=True), "exact")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=30), st.integers(1, 8))
def test_theorem_5_next_fit_within_twice_any_lower_bound(seconds: list[float], devices: int) -> None:
    bound = max(sum(seconds) / devices, max(seconds))  # T* >= this for any allocation
    groups = next_fit(seconds, devices, 2 * bound * (1 + 1e-12))
    assert groups is not None
    assert all(sum(seconds[i] for i in group) <= 2 * bound * (1 + 1e-9) for group in groups)
    # and so the optimal contiguous plan is within twice the optimal non-contiguous one
    if devices <= len(seconds):
        costs = ChainCosts.from_lists(seconds)
        contiguous = partition(PlanRequest(costs, devices, straight=True), "pipedream").bottleneck_seconds
        assert contiguous <= 2 * bound * (1 + 1e-9)


def test_next_fit_reports_too_few_devices() -> None:
    assert next_fit([1, 1, 1], 1, 2) is None
    assert next_fit([3], 2, 2) is None
    assert next_fit([1, 1, 1], 2, 2) == [[0, 1], [2]]


def test_one_f_one_b_memory_is_min_p_minus_s_m() -> None:
    # four equal stages, each keeps 1 byte per activation: 1F1B stage s keeps min(P - s, m)
    costs = ChainCosts.from_lists([1.0] * 4, saved=[1.0] * 4)
    for microbatches, expected in ((None, [4, 3, 2, 1]), (8, [4, 3, 2, 1]), (2, [2, 2, 2, 1])):
        memory = MemoryModel("1f1b", microbatches, extra_copies=0)
        plan = partition(PlanRequest(costs, 4, memory=memory, straight=True), "uniform")
        assert [stage.memory_bytes for stage in plan.stages] == expected
    gpipe = MemoryModel("gpipe", 6, extra_copies=0)
    plan = partition(PlanRequest(costs, 4, memory=gpipe, straight=True), "uniform")
    assert [stage.memory_bytes for stage in plan.stages] == [6, 6, 6, 6]


def test_weight_versions_and_optimizer_copies() -> None:
    costs = ChainCosts.from_lists([1.0, 1.0], params=[10, 10])
    expected = {"1f1b": [10 * (1 + 3)] * 2, "2bw": [10 * (2 + 3)] * 2, "pipedream": [10 * (2 + 3), 10 * (1 + 3)]}
    for schedule, memory_bytes in expected.items():
        memory = MemoryModel(schedule, None, extra_copies=3)  # Adam: gradient + two moments
        plan = partition(PlanRequest(costs, 2, memory=memory, straight=True), "uniform")
        assert [stage.memory_bytes for stage in plan.stages] == memory_bytes


def test_replicated_stage_follows_pipedream_formula() -> None:
    # one stage replicated 4 times: T = max(sum t, allreduce) / 4 with ring all-reduce 2(r-1)/r * bytes / bw
    costs = ChainCosts.from_lists([8.0], params=[100.0])
    plan = partition(PlanRequest(costs, 4, network=Network(10.0)), "pipedream")
    (stage,) = plan.stages
    assert stage.replicas == 4
    assert stage.sync_seconds == pytest.approx(2 * 3 / 4 * 100 / 10)
    assert plan.bottleneck_seconds == pytest.approx(max(8.0, 15.0) / 4)


def test_communication_can_make_fewer_stages_better() -> None:
    # a cut costs 2*C = 2 * 100 / 10 = 20 > the whole chain: keep everything on one device
    costs = ChainCosts.from_lists([1.0, 1.0], activation=[100, 1])
    plan = partition(PlanRequest(costs, 2, network=Network(10.0), straight=True), "pipedream")
    assert len(plan.stages) == 1 and plan.bottleneck_seconds == 2.0
    # the balanced heuristic ignores communication and pays for the cut
    assert partition(PlanRequest(costs, 2, network=Network(10.0), straight=True), "time").bottleneck_seconds == 20.0


def test_black_gpipe_memory_limit_trades_time_for_memory() -> None:
    costs = ChainCosts.from_lists([4.0, 1.0, 1.0, 1.0, 1.0], params=[1, 1, 1, 1, 9])
    fast = partition(PlanRequest(costs, 2, memory=WEIGHTS_ONLY, straight=True), "pipedream")
    assert fast.bottleneck_seconds == 4.0
    tight = partition(PlanRequest(costs, 2, memory_limit=10, memory=WEIGHTS_ONLY, straight=True), "memory")
    assert tight.peak_memory_bytes <= 10 and tight.bottleneck_seconds == 6.0
    assert [stage.layers for stage in tight.stages] == [(0, 1, 2), (3, 4)]


def test_among_fastest_plans_the_least_memory_is_chosen() -> None:
    # bottleneck 10 is forced by layer 0; layers 1..3 can go anywhere after it: put weight where it fits best
    costs = ChainCosts.from_lists([10.0, 1.0, 1.0, 1.0], params=[0, 5, 5, 5])
    plan = partition(PlanRequest(costs, 3, memory=WEIGHTS_ONLY, straight=True), "pipedream")
    assert plan.bottleneck_seconds == 10.0
    assert plan.peak_memory_bytes == 10.0


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_more_devices_than_layers_is_explained(name: str) -> None:
    costs = ChainCosts.from_lists([1.0, 1.0])
    request = PlanRequest(costs, 3, memory_limit=1e9, straight=True)
    with pytest.raises(PlanningError, match="3 devices but only 2 layers"):
        partition(request, name)


def test_replication_uses_more_devices_than_layers() -> None:
    plan = partition(PlanRequest(ChainCosts.from_lists([1.0, 1.0]), 4), "pipedream")
    assert plan.devices_used == 4 and plan.bottleneck_seconds == 0.5


@pytest.mark.parametrize("devices", [0, -1, 1.5, True])
def test_bad_device_counts(devices: object) -> None:
    with pytest.raises(PlanningError, match="devices must be a whole number >= 1"):
        PlanRequest(ChainCosts.from_lists([1.0]), devices)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_bad_costs(value: float) -> None:
    with pytest.raises(PlanningError, match="must be a finite number >= 0"):
        LayerCost("conv", value, 0, 0, 0, 0)


def test_empty_model_and_bad_options() -> None:
    with pytest.raises(PlanningError, match="no layers"):
        ChainCosts(())
    costs = ChainCosts.from_lists([1.0])
    with pytest.raises(PlanningError, match="unknown partitioner 'fast'; choose one of"):
        partition(PlanRequest(costs, 1), "fast")
    with pytest.raises(PlanningError, match="memory partitioner needs a per-device memory limit"):
        partition(PlanRequest(costs, 1), "memory")
    with pytest.raises(PlanningError, match="memory_limit must be a positive"):
        PlanRequest(costs, 1, memory_limit=0)
    with pytest.raises(PlanningError, match="gpipe keeps all m micro-batches"):
        MemoryModel("gpipe")
    with pytest.raises(PlanningError, match="unknown schedule"):
        MemoryModel("zigzag")
    with pytest.raises(PlanningError, match="bandwidth must be > 0"):
        Network(0)
    with pytest.raises(PlanningError, match="no FLOP counts"):
        partition(PlanRequest(costs, 1), "flops")


def test_heuristic_over_the_limit_points_to_the_memory_partitioner() -> None:
    costs = ChainCosts.from_lists([1.0, 1.0], params=[5, 1])
    with pytest.raises(PlanningError, match="use the memory partitioner"):
        partition(PlanRequest(costs, 1, memory_limit=3, memory=WEIGHTS_ONLY), "uniform")


def test_exact_refuses_large_instances() -> None:
    costs = ChainCosts.from_lists([1.0] * 200)
    with pytest.raises(PlanningError, match="use the pipedream partitioner"):
        partition(PlanRequest(costs, 16), "exact")


def test_large_noncontiguous_uses_heuristics_and_beats_contiguous() -> None:
    seconds = [float((7 * i) % 11 + 1) for i in range(1500)]
    plan = partition(PlanRequest(ChainCosts.from_lists(seconds), 8), "noncontiguous")
    contiguous = partition(PlanRequest(ChainCosts.from_lists(seconds), 8, straight=True), "pipedream")
    assert plan.bottleneck_seconds < contiguous.bottleneck_seconds
    assert plan.bottleneck_seconds == pytest.approx(sum(seconds) / 8)  # list scheduling balances it perfectly
    assert "too many for the exact search" in plan.notes[-1]
    assert sorted(layer for stage in plan.stages for layer in stage.layers) == list(range(1500))


@pytest.mark.parametrize("partitioner", ["time", "pipedream", "memory", "exact"])
def test_equal_bottlenecks_are_broken_by_the_smaller_peak_memory(partitioner: str) -> None:
    """Three layers of 1 s on 2 devices: {0 | 1, 2} and {0, 1 | 2} both have a 2 s bottleneck. Under
    1F1B the first stage keeps 2 micro-batches, the second 1, so with saved bytes [10, 1, 1] the peaks
    are max(2*10, 1+1) = 20 and max(2*11, 1) = 22, and with [1, 1, 10] they are max(2, 11) = 11 and
    max(4, 10) = 10: the planner must take the first split, then the second. Guards against the
    tie-break on peak memory being dropped (300 random chains compare bottlenecks only)."""
    memory = MemoryModel("1f1b", 8, extra_copies=0)
    for saved, groups, peak in (([10, 1, 1], [(0,), (1, 2)], 20), ([1, 1, 10], [(0, 1), (2,)], 10)):
        costs = ChainCosts.from_lists([1.0] * 3, saved=saved)
        limit = 100.0 if partitioner == "memory" else None  # the memory partitioner needs one
        plan = partition(PlanRequest(costs, 2, memory=memory, memory_limit=limit, straight=True), partitioner)
        assert [stage.layers for stage in plan.stages] == groups
        assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (2.0, peak)


def test_replicated_stages_keep_ceil_k_over_r_micro_batches_in_flight() -> None:
    """The memory of replicated stages, worked by hand (PipeDream's NOAM: a stage followed, itself
    included, by k workers and replicated r times keeps ceil(k / r) micro-batches in flight, and under
    weight stashing as many versions). Layers of 100 parameter bytes and 10 saved bytes; stages
    {0, 1} x2, {2} x1, {3} x1 on 4 workers; momentum SGD (2 extra copies).
    - last stage: k = 1, r = 1: 1 in flight; 1F1B: (1 + 2) * 100 + 1 * 10 = 310.
    - middle stage: k = 2, r = 1: 2 in flight: (1 + 2) * 100 + 2 * 10 = 320.
    - first stage: k = 4, r = 2: ceil(4 / 2) = 2 in flight, not 4: (1 + 2) * 200 + 2 * 20 = 640 per replica.
    PipeDream (stashing) keeps as many versions as micro-batches in flight: 3 * 100 + 10 = 310 (last),
    (2 + 2) * 100 + 20 = 420, (2 + 2) * 200 + 40 = 840. Guards against ceil(k / r) replaced by k
    (first stage 680 and 1280)."""
    costs = ChainCosts.from_lists([1.0] * 4, params=[100.0] * 4, saved=[10.0] * 4)
    groups, replicas = [(0, 1), (2,), (3,)], [2, 1, 1]
    for schedule, expected in (("1f1b", [640, 320, 310]), ("pipedream", [840, 420, 310])):
        memory = MemoryModel(schedule, None if schedule == "pipedream" else 8, extra_copies=2)
        plan = evaluate(costs, groups, replicas, partitioner="hand", devices=4, memory=memory)
        assert [stage.memory_bytes for stage in plan.stages] == expected, schedule
    assert MemoryModel("2bw").in_flight(7, 3) == 3 and MemoryModel("2bw").weight_versions(7, 3) == 2
    assert MemoryModel("1f1b", 2).in_flight(5, 2) == 2  # min(ceil(5 / 2), m)

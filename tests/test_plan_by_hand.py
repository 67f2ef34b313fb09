"""Plans worked out by hand: evaluate() and Plan.to_dict() field by field, the partitioners' names,
uneven uniform splits, the exact oracle's enumeration, and every PlanningError's wording."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PARTITIONERS, PlanRequest, evaluate, next_fit, partition
from lightning_pipe.partition.balanced import uniform
from lightning_pipe.partition.exact import _candidates, _replicas, _splits
from lightning_pipe.partition.pipedream import pipedream
from lightning_pipe.partition.plan import _runs

WEIGHTS_ONLY = MemoryModel(extra_copies=0)


def _contiguous_example() -> dict[str, object]:
    """Four layers on 5 devices, stages {0, 1} x2, {2}, {3}; 8 B/s links; 1F1B, m = 3, one extra copy.

    seconds = forward + backward = (1+2, 2+2, 3+1, 4+4) = (3, 4, 4, 8); boundary bytes = activations
    (10, 20, 30); params (100, 200, 300, 400); saved (1, 2, 5, 4).
    - stage 0: compute 7; sync = ring all-reduce of 300 B among 2: 2(2-1)/2 * 300 / 8 = 37.5;
      stage time max(7, 37.5) / 2 = 18.75; k = 4 workers from it to the end, r = 2: ceil(4/2) = 2 in
      flight (k alone, unreplicated, would be min(4, 3) = 3), alpha = 1 version + 1 extra = 2: 2*300 + 2*(1+2) = 606.
    - stage 1: compute 4, no sync, k = 2: 2 in flight: 2*300 + 2*5 = 610; sends cut 2 (30 B).
    - stage 2: compute 8, k = 1: 1 in flight: 2*400 + 1*4 = 804; the last stage sends nothing.
    - cuts after layers 1 and 3: 2*20/8 = 5, 2*30/8 = 7.5. Bottleneck max(18.75, 4, 8, 5, 7.5) = 18.75.
    """
    costs = ChainCosts.from_lists(
        [1, 2, 3, 4], [2, 2, 1, 4], activation=[10, 20, 30, 40], saved=[1, 2, 5, 4], params=[100, 200, 300, 400]
    )
    plan = evaluate(
        costs,
        [[0, 1], [2], [3]],
        [2, 1, 1],
        partitioner="hand",
        devices=5,
        network=Network(8.0),
        memory=MemoryModel("1f1b", 3, extra_copies=1),
        memory_limit=1000.0,
        notes=["by hand"],
    )
    return plan.to_dict()


def test_contiguous_plan_to_dict_by_hand() -> None:
    """Every key and value of the JSON plan for a replicated, communicating, memory-modelled split.
    Guards against misspelt keys, the bandwidth reported as None (or inf when free), wrong stage sums
    (off-by-one ranges), multiplying by the replicas instead of dividing, a missed or extra cut, the
    in-flight count ignoring replicas or the schedule, and output bytes of the last stage (which
    holds the model's 40-byte output per micro-batch in flight instead)."""
    assert _contiguous_example() == {
        "partitioner": "hand",
        "devices": 5,
        "devices_used": 4,
        "contiguous": True,
        "memory_schedule": "1f1b",
        "activations_in_flight": None,
        "microbatches": 3,
        "memory_limit_bytes": 1000.0,
        "bandwidth_bytes_per_second": 8.0,
        "bottleneck_seconds": 18.75,
        "peak_memory_bytes": 844.0,
        "cut_seconds": [5.0, 7.5],
        "stages": [
            {
                "layers": [0, 1],
                "replicas": 2,
                "compute_seconds": 7.0,
                "sync_seconds": 37.5,
                "stage_seconds": 18.75,
                "memory_bytes": 606.0,
                "forward_seconds": 3.0,
                "backward_seconds": 4.0,
                "output_bytes": 20.0,
                "saved_bytes": 3.0,
                "param_bytes": 300.0,
                "activation_bytes": 6.0,  # NCA 2 (4 workers downstream over 2 replicas) x 3 saved
                "backward_bytes": 0.0,
                "transient_bytes": 0.0,
                "kept_bytes": 0.0,
                "weight_bytes": 300.0,  # one version
                "first_backward_bytes": 0.0,
            },
            {
                "layers": [2, 2],
                "replicas": 1,
                "compute_seconds": 4.0,
                "sync_seconds": 0.0,
                "stage_seconds": 4.0,
                "memory_bytes": 610.0,
                "forward_seconds": 3.0,
                "backward_seconds": 1.0,
                "output_bytes": 30.0,
                "saved_bytes": 5.0,
                "param_bytes": 300.0,
                "activation_bytes": 10.0,  # NCA 2 x 5 saved
                "backward_bytes": 0.0,
                "transient_bytes": 0.0,
                "kept_bytes": 0.0,
                "weight_bytes": 300.0,
                "first_backward_bytes": 0.0,
            },
            {
                "layers": [3, 3],
                "replicas": 1,
                "compute_seconds": 8.0,
                "sync_seconds": 0.0,
                "stage_seconds": 8.0,
                "memory_bytes": 844.0,
                "forward_seconds": 4.0,
                "backward_seconds": 4.0,
                "output_bytes": 0.0,
                "saved_bytes": 44.0,  # 4 saved + the model's output
                "param_bytes": 400.0,
                "activation_bytes": 44.0,  # NCA 1 x 44
                "backward_bytes": 0.0,
                "transient_bytes": 0.0,
                "kept_bytes": 0.0,
                "weight_bytes": 400.0,
                "first_backward_bytes": 0.0,
            },
        ],
        "notes": ["by hand"],
    }


def test_a_plan_under_its_familys_own_counts_says_so() -> None:
    """A memory model with the family's own activations in flight per stage (``counts``): the JSON
    plan lists them, and the table says memory was counted under them, not under the closed form's
    schedule name (which, for a 2BW or interleaved run, is not the schedule that runs)."""
    from lightning_pipe.tables import plan_table

    costs = ChainCosts.from_lists([1, 2, 3, 4], [2, 2, 1, 4], activation=[10, 20, 30, 40], saved=[1, 2, 5, 4])
    plan = evaluate(
        costs, [[0, 1], [2, 3]], partitioner="hand", devices=2, memory=MemoryModel(microbatches=4, counts=(3, 1))
    )
    document = plan.to_dict()
    assert document["memory_schedule"] == "1f1b" and document["activations_in_flight"] == [3, 1]
    assert "memory as under the family's own schedule (micro-batches in flight per stage: 3, 1), 4 micro-batches" in (
        plan_table(costs, plan)
    )
    closed = evaluate(costs, [[0, 1], [2, 3]], partitioner="hand", devices=2, memory=MemoryModel("gpipe", 4))
    assert closed.to_dict()["activations_in_flight"] is None
    assert "memory as under gpipe, 4 micro-batches" in plan_table(costs, closed)


def test_noncontiguous_plan_to_dict_by_hand() -> None:
    """Device 0 holds layers {0, 1, 3}, device 1 layer {2}: three runs (0-1 on 0, 2 on 1, 3 on 0),
    each a pipeline stage for memory. Weight stashing (pipedream), no extra copies, replicas default 1.
    seconds (2, 3, 4, 5); params (10, 20, 30, 40); saved (1, 2, 3, 4); boundary (5, 6, 7); 4 B/s.
    - run {3} on device 0: k = 1: 1 version, 1 in flight of 4 saved and the model's 8-byte output: 52.
    - run {2} on device 1: k = 2: 2*30 + 2*3 = 66.
    - run {0, 1} on device 0: k = 3: 3*30 + 3*3 = 99; device 0 holds both runs: 52 + 99 = 151.
    - the runs change owner after layers 1 and 2: cuts 2*6/4 = 3 and 2*7/4 = 3.5.
    - device 0 computes 2+3+5 = 10 (the bottleneck), forward 1+2+4, backward 3; its last layer is the
      chain's last, so it sends nothing; device 1 sends the 7 B after layer 2.
    Guards against the memory of a device's second run overwriting the first (= for +=), the run
    boundaries of _runs, and a non-contiguous stage printed as [first, last]."""
    costs = ChainCosts.from_lists(
        [1, 2, 3, 4], [1, 1, 1, 1], activation=[5, 6, 7, 8], saved=[1, 2, 3, 4], params=[10, 20, 30, 40]
    )
    plan = evaluate(
        costs,
        [[3, 0, 1], [2]],
        partitioner="noncontiguous",
        devices=2,
        network=Network(4.0),
        memory=MemoryModel("pipedream", None, extra_copies=0),
    )
    assert plan.to_dict() == {
        "partitioner": "noncontiguous",
        "devices": 2,
        "devices_used": 2,
        "contiguous": False,
        "memory_schedule": "pipedream",
        "activations_in_flight": None,
        "microbatches": None,
        "memory_limit_bytes": None,
        "bandwidth_bytes_per_second": 4.0,
        "bottleneck_seconds": 10.0,
        "peak_memory_bytes": 151.0,
        "cut_seconds": [3.0, 3.5],
        "stages": [
            {
                "layers": [0, 1, 3],
                "replicas": 1,
                "compute_seconds": 10.0,
                "sync_seconds": 0.0,
                "stage_seconds": 10.0,
                "memory_bytes": 151.0,
                "forward_seconds": 7.0,
                "backward_seconds": 3.0,
                "output_bytes": 0.0,
                "saved_bytes": 15.0,
                "param_bytes": 70.0,
                "activation_bytes": 21.0,  # 1 x (4 + 8) (run {3}) + 3 x 3 (run {0, 1})
                "backward_bytes": 0.0,
                "transient_bytes": 0.0,
                "kept_bytes": 0.0,
                "weight_bytes": 130.0,  # 1 x 40 (run {3}) + 3 x 30 (run {0, 1})
                "first_backward_bytes": 0.0,
            },
            {
                "layers": [2, 2],
                "replicas": 1,
                "compute_seconds": 4.0,
                "sync_seconds": 0.0,
                "stage_seconds": 4.0,
                "memory_bytes": 66.0,
                "forward_seconds": 3.0,
                "backward_seconds": 1.0,
                "output_bytes": 7.0,
                "saved_bytes": 3.0,
                "param_bytes": 30.0,
                "activation_bytes": 6.0,  # 2 x 3
                "backward_bytes": 0.0,
                "transient_bytes": 0.0,
                "kept_bytes": 0.0,
                "weight_bytes": 60.0,  # 2 versions x 30
                "first_backward_bytes": 0.0,
            },
        ],
        "notes": [],
    }


def test_free_network_is_reported_as_no_bandwidth_and_defaults_apply() -> None:
    """Without network or memory model, evaluate uses a free network (no bandwidth, zero cuts) and
    1F1B with momentum (2 extra copies). Guards against the defaults being lost and the free network
    reported as an infinite bandwidth. Two layers of params 10, saved 1, on two straight stages:
    stage 0 keeps 2 in flight: 3*10 + 2 = 32; stage 1: 3*10 + 1 + the model's 100-byte output = 131."""
    costs = ChainCosts.from_lists([1.0, 2.0], saved=[1, 1], params=[10, 10], activation=[100, 100])
    plan = evaluate(costs, [[0], [1]], partitioner="hand", devices=2)
    document = plan.to_dict()
    assert document["bandwidth_bytes_per_second"] is None
    assert document["cut_seconds"] == [0.0]
    assert [stage.memory_bytes for stage in plan.stages] == [32.0, 131.0]
    assert [stage.replicas for stage in plan.stages] == [1, 1]
    assert plan.bottleneck_seconds == 2.0


def test_seconds_override_changes_compute_only() -> None:
    """``seconds`` replaces the per-layer time used for stage times; forward/backward stay measured.
    Guards against the override being ignored or always applied."""
    costs = ChainCosts.from_lists([1.0, 2.0], [1.0, 1.0])
    plan = evaluate(costs, [[0], [1]], partitioner="hand", devices=2, seconds=[5.0, 7.0])
    assert [stage.compute_seconds for stage in plan.stages] == [5.0, 7.0]
    assert [stage.forward_seconds for stage in plan.stages] == [1.0, 2.0]
    assert plan.bottleneck_seconds == 7.0
    measured = evaluate(costs, [[0], [1]], partitioner="hand", devices=2)
    assert [stage.compute_seconds for stage in measured.stages] == [2.0, 3.0]


def test_runs_are_maximal_by_hand() -> None:
    """Guards against off-by-one run ends, a wrong first run start, and runs not split on a change."""
    assert _runs([0, 0, 1, 1, 0]) == [(0, 1, 0), (2, 3, 1), (4, 4, 0)]
    assert _runs([0, 1, 1]) == [(0, 0, 0), (1, 2, 1)]
    assert _runs([7]) == [(0, 0, 7)]


@pytest.mark.parametrize(
    ("groups", "replicas", "message"),
    [
        ([[0], []], None, r"^stage 1 has no layers$"),
        ([[0, 1], [1, 2, 3]], None, r"^layer 1 is assigned to stages 0 and 1$"),
        ([[0, 1]], None, r"^layer 2 is assigned to no stage$"),
        ([[0, 1], [2, 3]], [1], r"^need one replica count >= 1 per stage, got \[1\]$"),
        ([[0, 1], [2, 3]], [1, 0], r"^need one replica count >= 1 per stage, got \[1, 0\]$"),
    ],
)
def test_malformed_partitions_are_refused(groups: list[list[int]], replicas: list[int] | None, message: str) -> None:
    """Guards against empty stages, doubly or never assigned layers and bad replica counts passing."""
    costs = ChainCosts.from_lists([1.0] * 4)
    with pytest.raises(PlanningError, match=message):
        evaluate(costs, groups, replicas, partitioner="hand", devices=4)


# -- partitioners ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_every_plan_carries_its_partitioner_name_and_the_request(name: str) -> None:
    """Guards against a partitioner reporting another (or a garbled) name, and against the request's
    devices, network, memory model, limit and notes not reaching the plan."""
    costs = ChainCosts(ChainCosts.from_lists([1.0, 2.0, 3.0], flops=[1, 2, 3]).layers, notes=("profiled",))
    memory = MemoryModel("2bw", 4, extra_copies=1)
    request = PlanRequest(costs, 2, memory_limit=1e9, memory=memory, network=Network(1e9), straight=True)
    plan = partition(request, name)
    assert plan.partitioner == name
    assert (plan.devices, plan.memory, plan.network, plan.memory_limit) == (2, memory, Network(1e9), 1e9)
    assert plan.notes[0] == "profiled"


def test_default_partitioner_is_pipedream() -> None:
    """Guards against a garbled default name."""
    request = PlanRequest(ChainCosts.from_lists([1.0, 1.0]), 2)
    assert partition(request).partitioner == "pipedream"
    assert pipedream(request).partitioner == "pipedream"


def test_unknown_partitioner_lists_all_names() -> None:
    """Guards against a garbled list of choices."""
    with pytest.raises(
        PlanningError,
        match=r"^unknown partitioner 'fast'; choose one of uniform, params, time, flops, pipedream, memory, "
        r"noncontiguous, exact$",
    ):
        partition(PlanRequest(ChainCosts.from_lists([1.0]), 1), "fast")


@pytest.mark.parametrize(
    "name", ["uniform", "time", "params", "flops", "pipedream", "memory", "noncontiguous", "exact"]
)
def test_too_few_layers_message_names_the_partitioner(name: str) -> None:
    """Straight pipelines need a layer per device; the message starts with the partitioner's name.
    Guards against a None or garbled name and against the advice being lost."""
    costs = ChainCosts.from_lists([1.0, 1.0], flops=[1, 1])
    request = PlanRequest(costs, 3, memory_limit=1e9, straight=True)
    with pytest.raises(
        PlanningError,
        match=rf"^{name}: 3 devices but only 2 layers, and each device needs at least one layer: use --devices 2 "
        r"or fewer, split the model into more layers, or let the pipedream partitioner replicate stages$",
    ):
        partition(request, name)


@pytest.mark.parametrize("name", ["uniform", "time", "pipedream", "noncontiguous", "exact"])
def test_as_many_devices_as_layers_is_fine(name: str) -> None:
    """One layer per device is the limit, not over it. Guards against ``>=`` in the layer check."""
    plan = partition(PlanRequest(ChainCosts.from_lists([3.0, 3.0, 3.0]), 3, straight=True), name)
    assert [stage.layers for stage in plan.stages] == [(0,), (1,), (2,)]


def test_uniform_gives_the_first_stages_one_more_layer() -> None:
    """5 layers on 3 devices: divmod(5, 3) = (1, 2): sizes 2, 2, 1, one replica each. Guards against
    the remainder being subtracted, given to one stage too many, or stages starting at 1."""
    plan = uniform(PlanRequest(ChainCosts.from_lists([1.0] * 5), 3))
    assert [stage.layers for stage in plan.stages] == [(0, 1), (2, 3), (4,)]
    assert [stage.replicas for stage in plan.stages] == [1, 1, 1]
    assert plan.devices_used == 3 and plan.bottleneck_seconds == 2.0


def test_balanced_keeps_a_straight_pipeline_and_ignores_cuts() -> None:
    """time-balancing (1, 10) on 2 devices splits {0} | {1}: replicating one stage of 11 s over both
    devices would be 5.5 s, but balanced partitioners never replicate. Layers of 0.125 s with 1 B
    cuts on a 2 B/s link: cuts are free while balancing (halves of 0.25 s each), though a 1 s cut
    would make one stage (0.5 s) better, and the plan then reports the measured cut. Guards against
    the replicate and with_cuts flags being flipped."""
    plan = partition(PlanRequest(ChainCosts.from_lists([1.0, 10.0]), 2), "time")
    assert [(stage.layers, stage.replicas) for stage in plan.stages] == [((0,), 1), ((1,), 1)]
    costs = ChainCosts.from_lists([0.125] * 4, activation=[1] * 4)
    for name in ("time", "params"):
        costs_by = costs if name == "time" else ChainCosts.from_lists([1.0] * 4, activation=[1] * 4, params=[0.125] * 4)
        plan = partition(PlanRequest(costs_by, 2, network=Network(2.0)), name)
        assert [stage.layers for stage in plan.stages] == [(0, 1), (2, 3)], name
        assert plan.cut_seconds == (1.0,)


def test_balanced_by_params_balances_params_not_time() -> None:
    """seconds (1, 1, 1, 4), params (4, 1, 1, 1) on 2 devices: by params {0} | {1, 2, 3} = max(4, 3);
    by time {0, 1, 2} | {3} = max(3, 4). Guards against the balanced quantity being replaced by time."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0, 4.0], params=[4, 1, 1, 1])
    by_params = partition(PlanRequest(costs, 2), "params")
    assert [stage.layers for stage in by_params.stages] == [(0,), (1, 2, 3)]
    by_time = partition(PlanRequest(costs, 2), "time")
    assert [stage.layers for stage in by_time.stages] == [(0, 1, 2), (3,)]


def test_pipedream_replicates_unless_straight() -> None:
    """One layer of 8 s, 100 parameter bytes, 10 B/s, 4 devices: replicated 4 times it takes
    max(8, 2*3/4*100/10 = 15) / 4 = 3.75 s; straight, one device, 8 s. Guards against the
    replicate flag being inverted or lost."""
    costs = ChainCosts.from_lists([8.0], params=[100.0])
    network = Network(10.0)
    replicated = partition(PlanRequest(costs, 4, network=network), "pipedream")
    assert [stage.replicas for stage in replicated.stages] == [4] and replicated.bottleneck_seconds == 3.75
    exact = partition(PlanRequest(costs, 4, network=network), "exact")
    assert [stage.replicas for stage in exact.stages] == [4] and exact.bottleneck_seconds == 3.75
    straight = partition(PlanRequest(costs, 1, network=network, straight=True), "pipedream")
    assert [stage.replicas for stage in straight.stages] == [1] and straight.bottleneck_seconds == 8.0


def test_pipedream_pays_for_cuts() -> None:
    """A 2·100/10 = 20 s cut costs more than the whole 2 s chain: pipedream keeps one stage. Guards
    against cuts being dropped from the planner's problem."""
    costs = ChainCosts.from_lists([1.0, 1.0], activation=[100, 1])
    plan = partition(PlanRequest(costs, 2, network=Network(10.0), straight=True), "pipedream")
    assert [stage.layers for stage in plan.stages] == [(0, 1)] and plan.bottleneck_seconds == 2.0


def test_memory_partitioner_needs_a_limit() -> None:
    """Guards against the check being inverted and the advice being changed."""
    with pytest.raises(
        PlanningError,
        match=r"^the memory partitioner needs a per-device memory limit \(e\.g\. --memory-limit 16GB\); "
        r"without one, use the pipedream partitioner$",
    ):
        partition(PlanRequest(ChainCosts.from_lists([1.0]), 1), "memory")


def test_memory_limit_is_checked_with_a_tolerance_only() -> None:
    """uniform on params (5, 1), weights only: stage 0 needs 5 B, stage 1 1 B. A limit of exactly 5 B
    fits; 3 B does not, and the error names stage 0 (the worst, not the last) and both sizes. Guards
    against ``>=`` at the limit, a tolerance that shrinks the limit or doubles it."""
    costs = ChainCosts.from_lists([1.0, 1.0], params=[5, 1])
    plan = partition(PlanRequest(costs, 2, memory_limit=5, memory=WEIGHTS_ONLY), "uniform")
    assert plan.peak_memory_bytes == 5
    with pytest.raises(
        PlanningError,
        match=r"^uniform: stage 0 needs 5 B, over the limit of 3 B: use the memory partitioner, which plans "
        r"within the limit$",
    ):
        partition(PlanRequest(costs, 2, memory_limit=3, memory=WEIGHTS_ONLY), "uniform")


@pytest.mark.parametrize("limit", [0, -1.0, math.nan])
def test_memory_limit_must_be_positive(limit: float) -> None:
    """Guards against zero, negative or NaN limits passing (``< 0``, ``and``)."""
    with pytest.raises(PlanningError, match=r"^memory_limit must be a positive number of bytes, got "):
        PlanRequest(ChainCosts.from_lists([1.0]), 1, memory_limit=limit)


def test_small_memory_limits_and_one_device_are_valid() -> None:
    """Guards against the bounds becoming ``<= 1`` (limit) or ``>= 2`` (devices)."""
    request = PlanRequest(ChainCosts.from_lists([1.0]), 1, memory_limit=0.5, memory=WEIGHTS_ONLY)
    assert request.memory_limit == 0.5 and request.devices == 1
    with pytest.raises(PlanningError, match=r"^devices must be a whole number >= 1; got 0$"):
        PlanRequest(ChainCosts.from_lists([1.0]), 0)


# -- the exact oracle --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.booleans())
def test_exact_enumerates_every_contiguous_plan_once(layers: int, devices: int, replicate: bool) -> None:
    """_splits yields each split of the chain into s non-empty contiguous groups exactly once
    (C(L-1, s-1) of them), _replicas each replica tuple with r >= 1 and Σr <= D (C(D, s) of them,
    all ones when straight), and _candidates counts their products. Guards against off-by-one
    ranges that drop or duplicate plans and a miscounted refusal threshold."""
    total = 0
    for stages in range(1, min(layers, devices) + 1):
        splits = list(_splits(layers, stages))
        assert len(splits) == math.comb(layers - 1, stages - 1)
        for groups in splits:
            assert [layer for group in groups for layer in group] == list(range(layers))
            assert len(groups) == stages and all(groups)
        counts = list(_replicas(stages, devices, replicate))
        expected = (
            [c for c in itertools.product(range(1, devices + 1), repeat=stages) if sum(c) <= devices]
            if replicate
            else [(1,) * stages]
        )
        assert sorted(counts) == sorted(expected) and len(set(counts)) == len(counts)
        total += len(splits) * len(counts)
    assert _candidates(layers, devices, replicate) == total


def test_exact_by_hand() -> None:
    """Straight (1, 2, 3, 4) on 2 devices: {0,1,2} | {3} = 6 beats {0,1} | {2,3} = 7 and one stage
    (10). With weights of 1 B per layer (weights only) its peak is 3 B, so a 3 B limit still admits
    it. Guards against ``>=`` at the limit, extra stages, and missing single-stage plans."""
    costs = ChainCosts.from_lists([1.0, 2.0, 3.0, 4.0], params=[1, 1, 1, 1])
    for limit in (None, 3.0):
        request = PlanRequest(costs, 2, memory_limit=limit, memory=WEIGHTS_ONLY, straight=True)
        plan = partition(request, "exact")
        assert [stage.layers for stage in plan.stages] == [(0, 1, 2), (3,)]
        assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (6.0, 3.0)
    one = partition(PlanRequest(ChainCosts.from_lists([2.0]), 1), "exact")
    assert [stage.layers for stage in one.stages] == [(0,)] and one.bottleneck_seconds == 2.0


def test_exact_replicates_only_the_cheap_stage() -> None:
    """Layers of 4 s, params (1000, 0), 1 B/s, 3 devices: replicating layer 0 costs a 2(r-1)/r·1000 s
    all-reduce, so the best is {0} | {1} at 4 s. Guards against replica counts starting at 2."""
    costs = ChainCosts.from_lists([4.0, 4.0], params=[1000, 0])
    plan = partition(PlanRequest(costs, 3, network=Network(1.0)), "exact")
    assert plan.bottleneck_seconds == 4.0
    assert [stage.layers for stage in plan.stages] == [(0,), (1,)] and plan.stages[0].replicas == 1


def test_exact_refusal_counts_the_candidates() -> None:
    """19 layers on 19 devices, straight: Σ_s C(18, s-1) = 2^18 = 262144 candidate plans, over the
    200000 enumerated. Guards against a wrong count in the message."""
    costs = ChainCosts.from_lists([1.0] * 19)
    with pytest.raises(
        PlanningError,
        match=r"^exact: 262144 candidate plans for 19 layers on 19 devices, more than the 200000 it enumerates; "
        r"use the pipedream partitioner \(also optimal\) for this size$",
    ):
        partition(PlanRequest(costs, 19, straight=True), "exact")


def test_exact_refusal_counts_replicated_candidates() -> None:
    """2 layers on 633 devices with replication: one stage (633 replica counts) or two (C(633, 2) =
    200028 pairs with r0 + r1 <= 633): 200661 candidates, over the limit although a straight count
    (2) is tiny. Guards against the count ignoring replication (which would enumerate them all)."""
    with pytest.raises(PlanningError, match=r"^exact: 200661 candidate plans for 2 layers on 633 devices"):
        partition(PlanRequest(ChainCosts.from_lists([1.0, 1.0]), 633), "exact")


def test_exact_keeps_trying_replica_counts_after_one_over_the_limit() -> None:
    """Layers of 4 s, saved (10, 20), no weights, 1F1B unbounded, limit 25 B, 4 devices. One stage
    keeps 10 + 20 = 30 B per replica: over. Split {0} | {1}: stage 1 keeps 20 B (1 in flight). Stage 0
    keeps 10·ceil(k/r0) with k = r0 + r1: (1, 1) 20 B at 4 s, (1, 2) 30 B over, (2, 2) 20 B at
    max(4/2, 4/2) = 2 s. The answer is (2, 2) at 2 s. Guards against abandoning a split's remaining
    replica counts at the first one over the limit."""
    costs = ChainCosts.from_lists([4.0, 4.0], saved=[10, 20])
    request = PlanRequest(costs, 4, memory_limit=25, memory=MemoryModel("1f1b", None, extra_copies=0))
    plan = partition(request, "exact")
    assert [(stage.layers, stage.replicas) for stage in plan.stages] == [((0,), 2), ((1,), 2)]
    assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (2.0, 20.0)


def test_exact_infeasible_names_the_limit() -> None:
    """Weights (1, 2, 1), limit 2 B, 2 straight devices: every split has a 3 B stage."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], params=[1, 2, 1])
    with pytest.raises(PlanningError, match=r"^exact: no contiguous plan on 2 device\(s\) fits 2 B per device$"):
        partition(PlanRequest(costs, 2, memory_limit=2, memory=WEIGHTS_ONLY, straight=True), "exact")


# -- Next Fit ----------------------------------------------------------------------------------------


def test_next_fit_at_exact_capacity() -> None:
    """A layer or a group that reaches the capacity exactly still fits; the load restarts at 0 on a
    new device; zero-cost layers join the current device. Guards against ``>=`` for ``>``, a load
    reset to 1 or to the layer's cost, a load starting at 1, and ``<`` devices."""
    assert next_fit([2.0], 1, 2.0) == [[0]]
    assert next_fit([1.0, 1.0], 1, 2.0) == [[0, 1]]
    assert next_fit([1.0, 1.0, 1.0, 1.0], 2, 2.0) == [[0, 1], [2, 3]]
    assert next_fit([1.0, 1.0, 1.0, 1.0], 2, 3.0) == [[0, 1, 2], [3]]
    assert next_fit([0.0, 0.0, 2.0, 0.0], 1, 2.0) == [[0, 1, 2, 3]]
    assert next_fit([1.0, 2.0, 1.0], 2, 2.0) is None


def test_an_infeasible_memory_limit_says_which_limit_or_device_count_fits() -> None:
    """Four layers of 4 B of weights (nothing else), one second each, 2 devices, limit 5 B: no device
    holds two layers. The best 2-device plan (2 s) is two layers per device: 8 B is the smallest
    limit; one layer per device fits 5 B on 4 devices. Guards the hint's figures (the least memory
    among the fastest plans, the device count of a straight split) and the micro-batch count."""
    costs = ChainCosts.from_lists([1.0] * 4, params=[4] * 4)
    request = PlanRequest(costs, 2, memory_limit=5.0, memory=MemoryModel("1f1b", 2, extra_copies=0))
    with pytest.raises(PlanningError) as refused:
        partition(request, "pipedream")
    assert str(refused.value) == (
        "no partition on 2 device(s) fits the memory limit of 5 B per device under 1f1b, 2 micro-batches: "
        "the smallest limit that fits 2 device(s) is 8 B; 5 B fits on 4 devices"
    )


def test_a_layer_larger_than_the_limit_is_named() -> None:
    """Weights (4, 9, 4) B, limit 5 B: no device count helps, layer 1 alone needs 9 B; the fastest
    2-device plan (2 s, e.g. {0, 1} and {2}) needs 13 B. No micro-batch count in the message when the
    memory model has none. Guards which layer is named and its own figure."""
    costs = ChainCosts.from_lists([1.0] * 3, params=[4, 9, 4])
    request = PlanRequest(costs, 2, memory_limit=5.0, memory=MemoryModel("1f1b", None, extra_copies=0))
    with pytest.raises(PlanningError) as refused:
        partition(request, "pipedream")
    assert str(refused.value) == (
        "no partition on 2 device(s) fits the memory limit of 5 B per device under 1f1b: the smallest limit "
        "that fits 2 device(s) is 13 B; no device count fits 5 B: layer 1 alone needs 9 B"
    )


def test_a_worker_counts_its_largest_layer_once_for_the_gradient_it_accumulates() -> None:
    """Layers of 40, 10, 30 and 20 parameter bytes: stage {0, 2} (two runs of layers on one worker)
    adds 40 once, stage {1, 3} adds 20, on top of its weights, gradient, activations (1F1B, m = 2)."""
    costs = ChainCosts.from_lists([1.0] * 4, [1.0] * 4, params=[40.0, 10.0, 30.0, 20.0], saved=[0.0] * 4)
    plain = MemoryModel("1f1b", 2, extra_copies=1)
    counted = MemoryModel("1f1b", 2, extra_copies=1, accumulation=True)
    without = evaluate(costs, [[0, 2], [1, 3]], partitioner="hand", devices=2, memory=plain)
    within = evaluate(costs, [[0, 2], [1, 3]], partitioner="hand", devices=2, memory=counted)
    added = [b.memory_bytes - a.memory_bytes for a, b in zip(without.stages, within.stages, strict=True)]
    assert added == [40.0, 20.0]

"""The non-contiguous partitioner's parts by hand: list scheduling, the branch and bound's pruning
(counted node by node on tiny chains), its node budget, and chains where only an intact search
finds the optimum (Beaumont et al. §6).

Node counts below are derived by walking the search: layers are placed in chain order, layer 0 only on
device 0, layer ``l`` on the devices already used plus one new device, tried in increasing order of
load (ties by device number); a child is pruned when its period (largest load or cut so far) reaches
the best period found, or its device's memory floor exceeds the limit; a node is also pruned when the
average load ``(placed + remaining) / devices`` reaches the best period. Every visited node counts.
"""

from __future__ import annotations

import importlib

import pytest

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition

# ``lightning_pipe.partition.noncontiguous`` is shadowed by the function of that name in the package.
module = importlib.import_module("lightning_pipe.partition.noncontiguous")

WEIGHTS_ONLY = MemoryModel(extra_copies=0)
PROVEN = "noncontiguous: proven optimal by exhaustive branch and bound"


def _search(request: PlanRequest) -> module._Search:
    """Run the branch and bound from scratch (no heuristic incumbent)."""
    search = module._Search(request, None)
    search.run()
    return search


def _layers(plan) -> list[tuple[int, ...]]:
    return sorted(stage.layers for stage in plan.stages)


def test_list_scheduling_places_longest_first_on_the_least_loaded_device() -> None:
    """(1, 2) on 3 devices: layer 1 (2 s) goes first, to device 0; layer 0 to the least loaded,
    device 1 (ties by number). (1, 1): layers 0 and 1 on devices 0 and 1. No move follows: a device's
    last layer ``x`` went there when it was least loaded, so any device ``d`` has ``load_d + y >=
    load_worst`` for each of its layers ``y >= x`` (LPT order). Guards against the move search taking
    layers that are not on the busiest device, or accepting moves that do not lower the period."""
    assert module._list_scheduling(PlanRequest(ChainCosts.from_lists([1.0, 2.0]), 3)) == [1, 0]
    assert module._list_scheduling(PlanRequest(ChainCosts.from_lists([1.0, 1.0]), 3)) == [0, 1]
    assert module._list_scheduling(PlanRequest(ChainCosts.from_lists([4.0, 1.0, 1.0]), 3)) == [0, 1, 2]


def test_as_plan_names_and_orders_the_groups() -> None:
    """Owner (1, 0, 1): device 1 holds layers 0 and 2 and comes first (groups by first layer), one
    replica each, named for the partitioner, notes kept. Guards against a wrong name or lost notes."""
    plan = module._as_plan(PlanRequest(ChainCosts.from_lists([1.0, 2.0, 1.0]), 2), [1, 0, 1], ["why"])
    assert [stage.layers for stage in plan.stages] == [(0, 2), (1,)]
    assert [stage.replicas for stage in plan.stages] == [1, 1]
    assert (plan.partitioner, plan.notes, plan.bottleneck_seconds) == ("noncontiguous", ("why",), 2.0)


def test_sub_second_layers_are_searched_like_any_others() -> None:
    """The hand chain (2, 3, 3, 2, 2) of test_noncontiguous_by_hand scaled by 1/8: the heuristics
    reach 0.875 s, the optimum {1, 2} | {0, 3, 4} is 0.75 s (exact in binary). Guards against a search
    starting from a period or cut of 1 s instead of 0, which prunes every sub-second allocation."""
    request = PlanRequest(ChainCosts.from_lists([0.25, 0.375, 0.375, 0.25, 0.25]), 2)
    plan = partition(request, "noncontiguous")
    assert plan.bottleneck_seconds == 0.75
    assert _layers(plan) == [(0, 3, 4), (1, 2)]
    assert plan.notes == (PROVEN,)


def test_cut_costs_are_charged_only_where_the_device_changes() -> None:
    """Chain (2, 3, 3, 2, 2) on 2 devices, bandwidth 1, activations (0, 5, 0, 5): cuts 0 s after
    layers 0 and 2, 10 s after layers 1 and 3. {1, 2} | {0, 3, 4} changes device only at the free cuts:
    6 s, and it is the only split of the 12 s into 6 + 6. Contiguous: {0, 1, 2} | {3, 4} = 8 (the others
    pay 10 s or 9 s of compute); list scheduling (0, 0, 1, 1, 0) pays 10 s. Guards against charging the
    cut before the previous layer, charging cuts when the device stays the same, and abandoning the
    other devices once one is pruned (layer 2 on device 0, the less loaded, is pruned by its 10 s cut)."""
    costs = ChainCosts.from_lists([2.0, 3.0, 3.0, 2.0, 2.0], activation=[0, 5, 0, 5, 0])
    plan = partition(PlanRequest(costs, 2, network=Network(1.0)), "noncontiguous")
    assert plan.bottleneck_seconds == 6.0
    assert _layers(plan) == [(0, 3, 4), (1, 2)]
    assert plan.notes == (PROVEN,)


def test_an_allocation_exactly_at_the_memory_limit_is_found() -> None:
    """Chain (2, 3, 3, 2, 2) on 2 devices, weights (1, 1, 1, 1, 0), saved bytes only on layer 4 (1 B),
    weights only, limit 3 B. The optimum {1, 2} | {0, 3, 4} (6 s) holds 2 B and 1 + 1 + 1 B (layer 4
    ends the chain, so one micro-batch in flight): exactly the limit. The heuristics stop at 7 s.
    Guards against a strict floor test, a tolerance that shrinks the limit, non-zero starting floors,
    and a floor that assumes more than one micro-batch in flight."""
    costs = ChainCosts.from_lists([2.0, 3.0, 3.0, 2.0, 2.0], params=[1, 1, 1, 1, 0], saved=[0, 0, 0, 0, 1])
    plan = partition(PlanRequest(costs, 2, memory_limit=3.0, memory=WEIGHTS_ONLY), "noncontiguous")
    assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (6.0, 3.0)
    assert _layers(plan) == [(0, 3, 4), (1, 2)]


def test_only_the_search_fits_when_list_scheduling_does_not() -> None:
    """Chain (3, 1, 1), weights (1, 2, 1), weights only, limit 2 B, 2 devices. List scheduling puts
    layer 0 on device 0 and layers 1, 2 on device 1 (3 B); every contiguous split has a 3 B device. Only
    {0, 2} | {1} fits: 4 s. The search starts with no incumbent. Guards against comparing a first
    feasible allocation to a missing one."""
    costs = ChainCosts.from_lists([3.0, 1.0, 1.0], params=[1, 2, 1])
    request = PlanRequest(costs, 2, memory_limit=2.0, memory=WEIGHTS_ONLY)
    assert module._list_scheduling(request) == [0, 1, 1]
    plan = partition(request, "noncontiguous")
    assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (4.0, 2.0)
    assert _layers(plan) == [(0, 2), (1,)]


def test_a_faster_allocation_over_the_limit_is_refused() -> None:
    """Chain (1, 1), saved bytes (1, 0), weights only, limit 1.5 B, 2 devices. {0} | {1} has period 1
    but its first stage keeps 2 micro-batches (2 B); {0, 1} keeps 1 B: 2 s. The search reaches the
    {0} | {1} leaf (its floor is 1 B). Guards against accepting a leaf that is faster but does not fit."""
    costs = ChainCosts.from_lists([1.0, 1.0], saved=[1, 0])
    plan = partition(PlanRequest(costs, 2, memory_limit=1.5, memory=WEIGHTS_ONLY), "noncontiguous")
    assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (2.0, 1.0)


def test_contiguous_start_is_a_straight_pipeline() -> None:
    """41 layers of 1 s (too many for the search), 2 devices, bandwidth 1, 50 B activations except
    0 B after layer 20: every cut costs 100 s but that one. The contiguous split there is
    max(21, 20) = 21 s; list scheduling alternates devices and pays 100 s. Guards against taking the
    contiguous start from a replicated solution (one stage on both devices, 20.5 s with free weights),
    whose layers would all land on one device: 41 s."""
    activation = [50.0] * 41
    activation[20] = 0.0
    costs = ChainCosts.from_lists([1.0] * 41, activation=activation)
    plan = partition(PlanRequest(costs, 2, network=Network(1.0)), "noncontiguous")
    assert plan.bottleneck_seconds == 21.0
    assert [stage.layers for stage in plan.stages] == [tuple(range(21)), tuple(range(21, 41))]


def test_moderate_chain_is_proven_optimal_within_the_budget() -> None:
    """20 layers (1, 3, ..., 13, 2, ..., 12, 1, ..., 13), 140 s on 4 devices: no period is below
    140 / 4 = 35 s, and 35 s is reached, so the search stops as soon as it finds it. Guards against
    a pruning bound that is not met with equality (average load ``>=`` the best period), a lower bound
    that subtracts the remaining work, or loads that go down when a layer is added: each makes the
    search run out of its node budget."""
    seconds = [float((2 * i) % 13 + 1) for i in range(20)]
    assert sum(seconds) == 140.0
    plan = partition(PlanRequest(ChainCosts.from_lists(seconds), 4), "noncontiguous")
    assert plan.bottleneck_seconds == 35.0
    assert plan.notes == (PROVEN,)


def test_search_nodes_three_unit_layers_on_two_devices() -> None:
    """(1, 1, 1) on 2 devices, no incumbent. Root (layer 0) -> device 0 [node 2] -> layer 1: device 1
    (load 0) first [node 3] -> layer 2: device 0 (tie, lower number) [leaf, node 4, period 2, best];
    device 1 reaches 2, pruned. Back at layer 1: device 0 reaches 2, pruned. 4 nodes. Guards against
    miscounting nodes, trying devices by number instead of load, opening two devices for layer 0 or
    skipping ahead, ignoring the load in a child's period, and pruning on ``>`` or only when the memory
    also overflows."""
    search = _search(PlanRequest(ChainCosts.from_lists([1.0, 1.0, 1.0]), 2))
    assert search.nodes == 4
    assert search.best.bottleneck_seconds == 2.0 and _layers(search.best) == [(0, 2), (1,)]


def test_search_nodes_four_unit_layers_on_three_devices() -> None:
    """(1, 1, 1, 1) on 3 devices, no incumbent: layer 0 on device 0 [2], 1 on device 1 [3], 2 on
    device 2 [4], 3 on device 0 (all at load 1, lowest number) [leaf 5, period 2, best]; every other
    child then reaches 2. 5 nodes. Guards against opening a device beyond the next unused one."""
    search = _search(PlanRequest(ChainCosts.from_lists([1.0] * 4), 3))
    assert search.nodes == 5
    assert search.best.bottleneck_seconds == 2.0


def test_search_carries_the_period_down() -> None:
    """(1, 3, 1) on 3 devices, no incumbent: layer 0 on device 0 [2], layer 1 on device 1 [3, period
    3], layer 2 on device 2 [leaf 4, best 3 s]; layer 2 on device 0 has load 2 but the period is already
    3: pruned, as are the rest. 4 nodes. Guards against a child's period forgetting the loads above it."""
    search = _search(PlanRequest(ChainCosts.from_lists([1.0, 3.0, 1.0]), 3))
    assert search.nodes == 4
    assert search.best.bottleneck_seconds == 3.0


def test_search_prunes_on_cut_costs() -> None:
    """(1, 1, 1) on 3 devices, bandwidth 1, activations (0, 2): cut 0 s after layer 0, 4 s after layer
    1. Layer 0 on device 0 [2], layer 1 on device 1 [3], layer 2 on device 2 [leaf 4, 4 s with the
    cut, best]; on device 0 the cut makes 4 s: pruned; on device 1 no cut [leaf 5, 2 s, best]. Back at
    layer 1, device 0 reaches 2 s: pruned. 5 nodes. Guards against leaving cuts out of the bound."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], activation=[0, 2, 0])
    search = _search(PlanRequest(costs, 3, network=Network(1.0)))
    assert search.nodes == 5
    assert search.best.bottleneck_seconds == 2.0 and _layers(search.best) == [(0,), (1, 2)]


def test_search_refutes_an_impossible_memory_limit_in_three_nodes() -> None:
    """(1, 1, 1), 1 B of weights each, weights only, limit 1 B, 2 devices: layer 0 on device 0 [2],
    layer 1 on device 1 [3], layer 2 overflows both; back at layer 1, device 0 would hold 2 B. 3 nodes,
    nothing fits, and partition says so. Guards against floors that go down when a layer is added, a
    memory test that needs the period to be pruned too, a missing or doubled limit."""
    request = PlanRequest(ChainCosts.from_lists([1.0] * 3, params=[1, 1, 1]), 2, memory_limit=1.0, memory=WEIGHTS_ONLY)
    search = _search(request)
    assert (search.nodes, search.best) == (3, None)
    with pytest.raises(PlanningError, match="even with any layer on any device"):
        partition(request, "noncontiguous")


def test_search_floor_counts_saved_bytes() -> None:
    """(1, 1, 1), weights (1, 0, 1), saved (0, 1, 0), weights only, limit 1 B, 3 devices: every layer
    has a 1 B floor, so each device takes one layer: [2], [3], leaf [4]; there the middle stage keeps 2
    micro-batches (2 B) and does not fit. Any second layer on a device overflows. 4 nodes, nothing fits.
    Guards against subtracting the saved bytes from the floor."""
    costs = ChainCosts.from_lists([1.0] * 3, params=[1, 0, 1], saved=[0, 1, 0])
    search = _search(PlanRequest(costs, 3, memory_limit=1.0, memory=WEIGHTS_ONLY))
    assert (search.nodes, search.best) == (4, None)


def test_search_restores_floors_when_backtracking() -> None:
    """(1, 1, 1), weights (1, 1, 2), weights only, limit 2 B, 2 devices, no incumbent: layer 0 on
    device 0 [2], layer 1 on device 1 [3], layer 2 (2 B) overflows both; back at layer 1, device 0
    (2 B) [4], then layer 2 on device 1, empty again [leaf 5: {0, 1} | {2}, 2 s, 2 B]. 5 nodes. Guards
    against device 1's floor not returning to 0 after layer 1 leaves it."""
    costs = ChainCosts.from_lists([1.0] * 3, params=[1, 1, 2])
    search = _search(PlanRequest(costs, 2, memory_limit=2.0, memory=WEIGHTS_ONLY))
    assert search.nodes == 5
    assert _layers(search.best) == [(0, 1), (2,)]


def test_node_budget_is_inclusive() -> None:
    """The (1, 1, 1) search on 2 devices visits 4 nodes (test above), the 4th being the leaf that
    finds the optimum. With a budget of 4 it completes; with 3 it stops before that leaf and says it
    is not exhaustive. Guards against ``>=``/``<`` for the budget comparisons."""
    request = PlanRequest(ChainCosts.from_lists([1.0, 1.0, 1.0]), 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "NODE_BUDGET", 4)
        search = module._Search(request, None)
        assert search.run() is True
        assert search.best.bottleneck_seconds == 2.0
        patch.setattr(module, "NODE_BUDGET", 3)
        search = module._Search(request, None)
        assert search.run() is False
        assert search.best is None


def test_forty_layers_over_the_budget_are_not_called_too_many() -> None:
    """40 layers may be searched (EXACT_LAYERS is inclusive); with no node budget left the note says
    the budget ran out, not that 40 layers are too many. Guards against ``>=`` in the size test of the
    note and a missing note."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "NODE_BUDGET", 0)
        plan = partition(PlanRequest(ChainCosts.from_lists([1.0] * 40), 2), "noncontiguous")
    assert plan.bottleneck_seconds == 20.0
    assert plan.notes == ("noncontiguous: best found within 0 search nodes (not proven optimal)",)

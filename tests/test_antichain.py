"""The antichain search (PipeDream §3.1 over downsets) against brute force, the chain DP, and
PipeDream's published profiles."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.pipedream_graph import LayerDag, load_pipedream_dag
from lightning_pipe.cost.records import LayerCost
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.partition.antichain import AntichainPlan, antichain_plan, downsets

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MOST_ORDERS = 60  # topological orders the brute force walks per graph
small = st.integers(min_value=0, max_value=9).map(float)
networks = st.sampled_from([Network(), Network(1.0), Network(4.0)])


def _layer(name: str, seconds: float, activation: float = 1.0, params: float = 0.0) -> LayerCost:
    return LayerCost(name, seconds, 0.0, activation, activation, params)


def _orders(dag: LayerDag, limit: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every topological order of ``dag`` (the first ``limit`` of them)."""
    producers = [{src for src, dst in dag.edges if dst == node} for node in range(len(dag.layers))]

    def extend(placed: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if len(placed) == len(dag.layers):
            yield placed
            return
        for node in range(len(dag.layers)):
            if node not in placed and producers[node] <= set(placed):
                yield from extend((*placed, node))

    return itertools.islice(extend(()), limit)


@st.composite
def dags(draw: st.DrawFn, max_layers: int = 8) -> LayerDag:
    """Random DAGs: edges between random pairs, layers numbered in a shuffled order (so the index order
    is not always topological), and, where the graph has more than ``MOST_ORDERS`` topological
    orders, edges added between the first unordered pairs until it has no more."""
    n = draw(st.integers(min_value=1, max_value=max_layers))
    label = draw(st.permutations(range(n)))
    pairs = list(itertools.combinations(range(n), 2))
    chosen = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    edges = [(label[i], label[j]) for (i, j), keep in zip(pairs, chosen, strict=True) if keep]
    layers = tuple(LayerCost(f"n{i}", draw(small), draw(small), draw(small), 0.0, draw(small)) for i in range(n))
    dag = LayerDag(layers, tuple(edges))
    for i, j in pairs:
        if len(list(_orders(dag, MOST_ORDERS + 1))) <= MOST_ORDERS:
            break
        dag = LayerDag(layers, (*dag.edges, (label[i], label[j])))
    return dag


def _check_plan(dag: LayerDag, found: AntichainPlan, devices: int) -> None:
    """Stages cover the graph once, each is convex, ``order`` is topological with every stage a run
    of it, and the plan uses at most ``devices`` workers."""
    assert sorted(itertools.chain.from_iterable(found.stages)) == list(range(len(dag.layers)))
    assert found.order == tuple(itertools.chain.from_iterable(found.stages))
    position = {node: i for i, node in enumerate(found.order)}
    assert all(position[src] < position[dst] for src, dst in dag.edges)
    stage_of = {node: s for s, stage in enumerate(found.stages) for node in stage}
    assert all(stage_of[src] <= stage_of[dst] for src, dst in dag.edges)  # convex: no path leaves and returns
    assert [len(stage) for stage in found.stages] == [len(stage.layers) for stage in found.plan.stages]
    assert found.plan.devices_used <= devices
    assert found.chain.layers == tuple(dag.layers[node] for node in found.order)


@SETTINGS
@given(dags())
def test_downsets_are_every_downward_closed_set(dag: LayerDag) -> None:
    closed = [
        sum(1 << node for node in subset)
        for size in range(len(dag.layers) + 1)
        for subset in itertools.combinations(range(len(dag.layers)), size)
        if all(src in subset for src, dst in dag.edges if dst in subset)
    ]
    found = downsets(dag)
    assert sorted(found) == sorted(closed)
    assert [mask.bit_count() for mask in found] == sorted(mask.bit_count() for mask in found)


@SETTINGS
@given(dags(), st.integers(1, 4), networks, st.booleans())
def test_equals_brute_force_over_every_order_and_split(
    dag: LayerDag, devices: int, network: Network, straight: bool
) -> None:
    """Every topological order, each laid out as a chain and split every contiguous way with every
    replica assignment (the ``exact`` partitioner): the antichain search finds the best of them all."""
    if straight and devices > len(dag.layers):
        with pytest.raises(PlanningError, match="straight pipeline"):
            antichain_plan(dag, devices, network=network, straight=True)
        return
    if not straight:
        devices = min(devices, 3)  # replica assignments grow fast
    found = antichain_plan(dag, devices, network=network, straight=straight)
    _check_plan(dag, found, devices)
    requests = (PlanRequest(dag.chain(order), devices, network=network, straight=straight) for order in _orders(dag))
    oracle = min(partition(request, "exact").bottleneck_seconds for request in requests)
    assert found.bottleneck_seconds == pytest.approx(oracle, rel=1e-12, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(small, small, small, small), min_size=1, max_size=24),
    st.integers(1, 8),
    networks,
    st.booleans(),
)
def test_a_chain_gets_the_chain_dp_answer(
    costs: list[tuple[float, float, float, float]], devices: int, network: Network, straight: bool
) -> None:
    layers = tuple(LayerCost(f"l{i}", f, b, a, a, p) for i, (f, b, a, p) in enumerate(costs))
    dag = LayerDag(layers, tuple((i, i + 1) for i in range(len(layers) - 1)))
    if straight and devices > len(layers):
        return  # both refuse (tests/test_partition_optimal.py, test_refusals below)
    found = antichain_plan(dag, devices, network=network, straight=straight)
    chain = partition(PlanRequest(dag.chain(), devices, network=network, straight=straight), "pipedream")
    assert found.order == tuple(range(len(layers)))
    assert found.bottleneck_seconds == chain.bottleneck_seconds


def test_a_branch_placed_beside_the_other_beats_the_node_number_order() -> None:
    """a feeds b and c, both feed d. The parser's order a, b, c, d splits at best 5 | 3 on two
    devices; the antichain search puts c with a: {a, c} | {b, d}, 4 | 4. The cut after {a, c}
    carries a's output to b and c's to d."""
    dag = LayerDag(
        (_layer("a", 1, 10), _layer("b", 1, 20), _layer("c", 3, 30), _layer("d", 3, 40)),
        ((0, 1), (0, 2), (1, 3), (2, 3)),
    )
    network = Network(1000.0)
    chain = partition(PlanRequest(dag.chain(), 2, network=network, straight=True), "pipedream")
    found = antichain_plan(dag, 2, network=network, straight=True)
    assert chain.bottleneck_seconds == 5
    assert found.stages == ((0, 2), (1, 3))
    assert found.order == (0, 2, 1, 3)
    assert found.bottleneck_seconds == 4
    assert found.plan.cut_seconds == (2 * (10 + 30) / 1000.0,)
    assert [stage.compute_seconds for stage in found.plan.stages] == [4, 4]


TEN_GBIT = Network(10e9 / 8)  # PipeDream's slower cluster, as recipes/pipedream/run.py
SETTINGS = {
    "replicated, 10 Gbit/s": (False, TEN_GBIT),
    "straight, free": (True, Network()),
    "straight, 10 Gbit/s": (True, TEN_GBIT),
}
# measured (docs/planning.md, bench/antichain_plans.py): where the antichain plan is strictly faster
STRICTLY_BETTER = {
    ("resnet18", "straight, free", 8),
    ("resnet50", "straight, free", 8),
    ("resnet50", "straight, 10 Gbit/s", 2),
    ("resnet50", "straight, 10 Gbit/s", 4),
    ("resnet50", "straight, 10 Gbit/s", 8),
    ("resnet101", "straight, 10 Gbit/s", 4),
    ("resnet101", "straight, 10 Gbit/s", 8),
}


@pytest.mark.parametrize("profile", ["resnet18", "resnet50", "resnet101"])
def test_published_profiles_never_worse_than_the_chain(pipedream_profiles: Path, profile: str) -> None:
    """On PipeDream's ResNet profiles on 2, 4 and 8 devices, in the settings of docs/planning.md: the
    antichain plan is at least as fast as the chain DP on the parser's topological order, and strictly
    faster exactly where the table there says so."""
    dag = load_pipedream_dag(pipedream_profiles / profile / "graph.txt")
    for (setting, (straight, network)), devices in itertools.product(SETTINGS.items(), (2, 4, 8)):
        found = antichain_plan(dag, devices, network=network, straight=straight)
        _check_plan(dag, found, devices)
        chain = partition(PlanRequest(dag.chain(), devices, network=network, straight=straight), "pipedream")
        assert found.bottleneck_seconds <= chain.bottleneck_seconds * (1 + 1e-12)
        better = found.bottleneck_seconds < chain.bottleneck_seconds * (1 - 1e-9)
        assert better == ((profile, setting, devices) in STRICTLY_BETTER), (profile, setting, devices)


def test_inception_v3_is_out_of_reach_and_says_so(pipedream_profiles: Path) -> None:
    dag = load_pipedream_dag(pipedream_profiles / "inception_v3" / "graph.txt")
    with pytest.raises(PlanningError, match=r"more than 20000 downsets .* chain partitioner"):
        antichain_plan(dag, 4)


def test_refusals() -> None:
    two = (_layer("a", 1), _layer("b", 1))
    with pytest.raises(PlanningError, match="has a cycle through a, b"):
        LayerDag(two, ((0, 1), (1, 0)), name="loop")
    with pytest.raises(PlanningError, match="cycle"):
        LayerDag(two, ((1, 1),))
    with pytest.raises(PlanningError, match="no layers"):
        LayerDag(())
    with pytest.raises(PlanningError, match=r"edge 0 -> 2 names a layer outside 0..1"):
        LayerDag(two, ((0, 2),))
    with pytest.raises(PlanningError, match="pairs of integer indices"):
        LayerDag(two, ((0, 1.5),))
    dag = LayerDag(two, ((0, 1),), name="pair")
    with pytest.raises(PlanningError, match=r"3 devices but only 2 layers.*allow replicated stages"):
        antichain_plan(dag, 3, straight=True)
    with pytest.raises(PlanningError, match="devices"):
        antichain_plan(dag, 0)
    with pytest.raises(PlanningError, match="puts layer 1 before its producer 0"):
        dag.chain((1, 0))
    with pytest.raises(PlanningError, match="each of the 2 layers once"):
        dag.chain((0, 0))
    assert math.isclose(antichain_plan(dag, 3).bottleneck_seconds, 2 / 3)  # replicas take the extra devices

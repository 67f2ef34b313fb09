"""PipeDream's dynamic program over antichains: a branching graph of layers split into stages.

PipeDream (Narayanan et al. 2019, §3.1 "Work partitioning") does not split a branching model
(ResNet's skip connections, Inception's branches) along one topological order. Its states are
antichains of the layer graph, each standing for the layers up to and including it: a downward-closed
set (an ideal, "downset"). A stage is the difference ``D \\ D'`` of two nested downsets, hence a
convex set of layers, and the replicated-stage recurrence runs over those states:

    A(D, m) = min over D' ⊊ D, 1 ≤ r ≤ m of max(A(D', m - r), 2·C(D'), T(D \\ D', r)),   A(∅, m) = 0,

where ``T(S, r) = max(Σ_S (u_F + u_B), allreduce(Σ_S W, r)) / r`` and ``2·C(D')`` carries, there and
back, the output of every layer of ``D'`` that feeds a layer outside it. That is the time model of
the chain partitioner (:mod:`lightning_pipe.partition.pipedream`, :func:`evaluate`): a stage's cut
counts the bytes a topological order with the stages contiguous would carry across it, so a graph
that is a chain gets the chain's answer. ``A(D, m)`` is the best with at most ``m`` workers; among
equal times the last stage takes the fewest replicas, then the most layers.

States. PipeDream's optimizer builds an "antichain DAG" from the graph's first source, moving from an
antichain by replacing one node of its augmented form (with the nodes before it that still feed
layers outside) by a consumer of that node, closing over the consumer's producers. With one source,
every layer whose producers are all placed is such a consumer, so the moves reach every non-empty
downset: the whole lattice. With several, another source has no producer to be reached from and
joins only with a layer it feeds, so fewer (GNMT, three sources: 5,169 of its 6,819 non-empty
downsets from node4, counted with a re-statement of PipeDream's rule). Here every downset is a
state, grown one ready layer at a time, so the search holds PipeDream's and is never worse.

Size. The recurrence compares each state with every state inside it: ``O(P·M²)`` for ``P ≤ S²/2``
nested pairs of ``S`` states, as in PipeDream, whose optimizer tabulates every pair. PipeDream's
published profiles give (the empty downset counted) AlexNet 23, VGG-16 41, ResNet-18 101,
ResNet-50 241, ResNet-101 411, DenseNet-121 431 and GNMT 6,820 states, but Inception-v3 221,565:
its auxiliary classifier, ten layers off Mixed_6e, runs beside Mixed_7a-7c, whose parallel
branches multiply the count: up to S²/2 = 2.5e10 pairs. PipeDream's restriction does not shrink
that lattice (Inception has one source), so :func:`downsets` stops at ``max_states`` and says what
would work.

Not a :data:`~lightning_pipe.partition.PARTITIONERS` entry: a :class:`PlanRequest` carries a chain
(:class:`ChainCosts`), whose edges are gone, and this planner has no memory limit or tie tolerance
to honour. It takes a :class:`LayerDag` and returns, beside the stages as sets of layers, the
topological order that makes each stage a run of consecutive layers, the graph laid out in it, and
the plan of those runs measured by :func:`evaluate` like every other planner's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.pipedream_graph import LayerDag
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.partition.plan import Plan, evaluate

__all__ = ["MAX_STATES", "AntichainPlan", "antichain_plan", "downsets"]

MAX_STATES = 20_000
"""Downsets enumerated before giving up (GNMT, the largest published profile in reach, has 6,820)."""


@dataclass(frozen=True)
class AntichainPlan:
    """A split of a :class:`LayerDag` into stages.

    Attributes:
        stages: each stage's layers (indices into ``dag.layers``), in pipeline order; each is convex
            (a path between two of its layers stays inside it), the difference of two nested downsets.
        order: a topological order of the graph in which each stage is a run of consecutive layers.
        chain: the graph laid out in ``order`` (:meth:`LayerDag.chain`).
        plan: the stages as runs of ``chain``, with their replicas, compute, all-reduce and stage times
            and the bottleneck, measured by :func:`evaluate`.
        states: downsets the search enumerated, the empty one included.
    """

    stages: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    chain: ChainCosts
    plan: Plan
    states: int

    @property
    def bottleneck_seconds(self) -> float:
        """Time per micro-batch of the slowest stage or cut."""
        return self.plan.bottleneck_seconds


def _bits(mask: int) -> list[int]:
    found = []
    while mask:
        low = mask & -mask
        found.append(low.bit_length() - 1)
        mask ^= low
    return found


def downsets(dag: LayerDag, max_states: int = MAX_STATES) -> list[int]:
    """Every downward-closed set of ``dag``'s layers (bit ``i``: layer ``i``), smallest first.

    Grown from the empty set by adding, one at a time, a layer whose producers are all in: each
    downset is reached, and every set so reached is one. Smaller sets come first, so a set's proper
    subsets precede it.
    """
    producers = [0] * len(dag.layers)
    consumers: list[list[int]] = [[] for _ in dag.layers]
    for src, dst in dag.edges:
        producers[dst] |= 1 << src
        consumers[src].append(dst)
    first_ready = sum(1 << node for node, mask in enumerate(producers) if mask == 0)
    found, level = [0], {0: first_ready}
    while level:
        grown: dict[int, int] = {}
        for placed, ready in level.items():
            for node in _bits(ready):
                bigger = placed | 1 << node
                if bigger in grown:
                    continue
                still = ready & ~(1 << node)
                for nxt in consumers[node]:
                    if producers[nxt] & ~bigger == 0:
                        still |= 1 << nxt
                grown[bigger] = still
        found.extend(grown)
        if len(found) > max_states:
            raise PlanningError(
                f"{dag.name or 'the graph'}: more than {max_states} downsets (antichain states) of up to "
                f"{next(iter(grown)).bit_count()} of its {len(dag.layers)} layers; the antichain "
                "search compares every pair of nested states, so branches that run side by side for long are "
                "out of its reach: plan a topological order with the chain partitioner (the pipedream "
                "partitioner on dag.chain()), or pass a larger max_states if the time is there "
                "(about S²/2 pairs of S states)"
            )
        level = grown
    return found


def _packed(masks: list[int], layers: int) -> np.ndarray:
    """The sets as rows of 64-bit words, for vectorised subset tests."""
    words = (layers + 63) // 64
    full = (1 << 64) - 1
    return np.array([[(mask >> (64 * w)) & full for w in range(words)] for mask in masks], dtype=np.uint64)


def _state_costs(dag: LayerDag, masks: list[int], network: Network) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per downset: compute seconds, parameter bytes, and the cut after it in seconds."""
    consumers = [0] * len(dag.layers)
    for src, dst in dag.edges:
        consumers[src] |= 1 << dst
    seconds, params, cuts = [], [], []
    for mask in masks:
        inside = _bits(mask)
        seconds.append(sum(dag.layers[node].seconds for node in inside))
        params.append(sum(dag.layers[node].param_bytes for node in inside))
        leaving = sum(dag.layers[node].activation_bytes for node in inside if consumers[node] & ~mask)
        cuts.append(network.cut_seconds(leaving))
    return np.array(seconds), np.array(params), np.array(cuts)


def antichain_plan(
    dag: LayerDag,
    devices: int,
    *,
    network: Network | None = None,
    straight: bool = False,
    max_states: int = MAX_STATES,
) -> AntichainPlan:
    """The stages of ``dag`` with the smallest bottleneck on at most ``devices`` workers (module
    docstring), each stage replicated unless ``straight`` (one worker per stage)."""
    check_whole("devices", devices, 1)
    network = network or Network()
    layers = len(dag.layers)
    if straight and devices > layers:
        raise PlanningError(
            f"{dag.name or 'the graph'}: {devices} devices but only {layers} layers, and a straight pipeline "
            f"gives each device at least one layer: use {layers} devices or fewer, or allow replicated stages"
        )
    masks = downsets(dag, max_states)
    seconds, params, cuts = _state_costs(dag, masks, network)
    cuts[0] = 0.0  # the empty downset: the first stage receives nothing
    packed = _packed(masks, layers)
    sizes = np.array([mask.bit_count() for mask in masks])
    level_start = np.searchsorted(sizes, sizes, side="left")
    most_replicas = 1 if straight else devices

    best = np.full((len(masks), devices + 1), np.inf)
    best[0] = 0.0
    came_from = np.zeros((len(masks), devices + 1), dtype=np.int64)
    replicas = np.zeros((len(masks), devices + 1), dtype=np.int64)
    for state in range(1, len(masks)):
        earlier = packed[: level_start[state]]
        inner = np.flatnonzero(np.all((earlier & ~packed[state]) == 0, axis=1))
        compute = seconds[state] - seconds[inner]
        weights = params[state] - params[inner]
        before = best[inner]
        for r in range(1, most_replicas + 1):
            stage = np.maximum(np.maximum(compute, network.allreduce_seconds(weights, r)) / r, cuts[inner])
            candidates = np.maximum(before[:, : devices + 1 - r], stage[:, None])  # column j: m = j + r
            pick = np.argmin(candidates, axis=0)
            value = candidates[pick, np.arange(devices + 1 - r)]
            better = value < best[state, r:]
            best[state, r:] = np.where(better, value, best[state, r:])
            came_from[state, r:] = np.where(better, inner[pick], came_from[state, r:])
            replicas[state, r:] = np.where(better, r, replicas[state, r:])

    stages, counts = [], []
    state, workers = len(masks) - 1, devices
    while state:
        previous, r = int(came_from[state, workers]), int(replicas[state, workers])
        stages.append(masks[state] & ~masks[previous])
        counts.append(r)
        state, workers = previous, workers - r
    stages.reverse()
    counts.reverse()
    position = {node: i for i, node in enumerate(dag.order)}
    groups = tuple(tuple(sorted(_bits(stage), key=position.__getitem__)) for stage in stages)
    order = tuple(node for group in groups for node in group)
    chain = dag.chain(order)
    spans, first = [], 0
    for group in groups:
        spans.append(list(range(first, first + len(group))))
        first += len(group)
    plan = evaluate(
        chain,
        spans,
        counts,
        partitioner="antichain",
        devices=devices,
        network=network,
        notes=[
            *chain.notes,
            f"antichain search (PipeDream §3.1) over {len(masks)} downsets; stages are runs of this topological order",
        ],
    )
    return AntichainPlan(stages=groups, order=order, chain=chain, plan=plan, states=len(masks))

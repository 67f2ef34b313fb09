"""The non-contiguous partitioner on hand-solved chains: where only its exhaustive search finds the
optimum, its memory tolerance, its notes, and its error messages (Beaumont et al. §6)."""

from __future__ import annotations

import pytest

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.partition.noncontiguous import _list_scheduling

WEIGHTS_ONLY = MemoryModel(extra_copies=0)
PROVEN = "noncontiguous: proven optimal by exhaustive branch and bound"


def test_only_the_search_finds_the_optimum() -> None:
    """Chain (2, 3, 3, 2, 2) on 2 devices, total 12. The best contiguous split is {0, 1} | {2, 3, 4}
    = max(5, 7) = 7 (the others: 10, 8, and 2 | ... ). Longest processing time first places 1, 2,
    0, 3, 4 on devices 0, 1, 0, 1, 0 (loads 7 and 5) and no single move lowers 7. The optimum is
    {1, 2} = 6 against {0, 3, 4} = 6. Guards against the branch and bound being skipped, pruning the
    optimum, or the result being claimed optimal without it."""
    request = PlanRequest(ChainCosts.from_lists([2.0, 3.0, 3.0, 2.0, 2.0]), 2)
    assert _list_scheduling(request) == [0, 0, 1, 1, 0]
    plan = partition(request, "noncontiguous")
    assert plan.bottleneck_seconds == 6.0
    assert sorted(stage.layers for stage in plan.stages) == [(0, 3, 4), (1, 2)]
    assert [stage.replicas for stage in plan.stages] == [1, 1]
    assert plan.notes == (PROVEN,)


def test_memory_limit_excludes_the_fastest_allocation() -> None:
    """Chain (1, 1, 2), weights (3, 3, 0), weights only, 2 devices. {0, 1} | {2} has period 2 but a
    6 B device; {0, 2} | {1} and {0} | {1, 2} have period 3 and 3 B devices. With a 4 B limit the
    answer is 3; with exactly 3 B too (the limit is inclusive). Guards against a limit tolerance that
    doubles the limit, and against a strict comparison refusing a plan exactly at the limit."""
    costs = ChainCosts.from_lists([1.0, 1.0, 2.0], params=[3, 3, 0])
    assert partition(PlanRequest(costs, 2, memory=WEIGHTS_ONLY), "noncontiguous").bottleneck_seconds == 2.0
    for limit in (4.0, 3.0):
        plan = partition(PlanRequest(costs, 2, memory_limit=limit, memory=WEIGHTS_ONLY), "noncontiguous")
        assert (plan.bottleneck_seconds, plan.peak_memory_bytes) == (3.0, 3.0), limit


def test_forty_layers_are_still_searched_exhaustively() -> None:
    """EXACT_LAYERS = 40 is inclusive: 40 layers of 1 s on one device is proven optimal (the bound
    prunes at the root). Guards against ``<`` for ``<=``."""
    plan = partition(PlanRequest(ChainCosts.from_lists([1.0] * 40), 1), "noncontiguous")
    assert plan.bottleneck_seconds == 40.0 and plan.notes == (PROVEN,)


def test_large_chains_say_why_they_are_not_proven() -> None:
    """41 layers: the heuristics only, and the note says so, with the sizes. Guards against the note's
    wording or the threshold test."""
    plan = partition(PlanRequest(ChainCosts.from_lists([1.0] * 41), 1), "noncontiguous")
    assert plan.notes == (
        "noncontiguous: best of the optimal contiguous split and list scheduling; 41 layers is too many for "
        "the exact search (at most 40). Within 2x of the optimum with free communication and no memory limit "
        "(Beaumont Thm 5)",
    )


def test_infeasible_small_chain_is_proven_infeasible() -> None:
    """Weights (1, 2, 1), weights only, a 1 B limit: layer 1 alone needs 2 B, on any device."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], params=[1, 2, 1])
    with pytest.raises(
        PlanningError,
        match=r"^noncontiguous: no allocation of 3 layers on 2 device\(s\) fits 1 B per device, even with any "
        r"layer on any device: raise the memory limit or add devices$",
    ):
        partition(PlanRequest(costs, 2, memory_limit=1, memory=WEIGHTS_ONLY), "noncontiguous")


def test_infeasible_large_chain_is_not_claimed_proven() -> None:
    """41 layers, the last weighing 2 B, a 1 B limit: no heuristic fits and no search ran, so the
    message must not claim that no allocation exists. Guards against the two wordings being swapped."""
    costs = ChainCosts.from_lists([1.0] * 41, params=[0] * 40 + [2])
    with pytest.raises(
        PlanningError,
        match=r"^noncontiguous: no allocation of 41 layers on 2 device\(s\) fits 1 B per device \(search not "
        r"exhaustive at this size\): raise the memory limit or add devices$",
    ):
        partition(PlanRequest(costs, 2, memory_limit=1, memory=WEIGHTS_ONLY), "noncontiguous")


def test_costs_notes_come_first() -> None:
    """Notes of the profile (e.g. a DAG laid out as a chain) precede the partitioner's. Guards against
    either being dropped."""
    costs = ChainCosts(ChainCosts.from_lists([1.0, 1.0]).layers, notes=("a DAG as a chain",))
    plan = partition(PlanRequest(costs, 2), "noncontiguous")
    assert plan.notes == ("a DAG as a chain", PROVEN)

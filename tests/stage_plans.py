"""Stage plans built by hand for the tests of what a plan predicts."""

from __future__ import annotations

from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition import evaluate
from lightning_pipe.planning import StagePlan


def one_layer_per_stage(forward: list[float], backward: list[float]) -> StagePlan:
    """One layer per stage, planned as the strategy plans (activations of 1 kB, weights of 10 kB)."""
    n = len(forward)
    costs = ChainCosts.from_lists(forward, backward, activation=[1e3] * n, params=[1e4] * n)
    plan = evaluate(costs, [[s] for s in range(n)], partitioner="auto", devices=n)
    return StagePlan(tuple((s, s) for s in range(n)), plan, costs)

"""A pipeline's plan gives every worker a stage, even when fewer stages would be as fast (one layer's
time bounds every split): the partitioner's plan is cut further without a slower bottleneck than the
best split into as many stages (brute force; near-ties within the planner's tolerance). The plan's
stage durations also space CDP's dp-form replicas."""

from __future__ import annotations

import itertools
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe import planning
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.planning import PlanOptions, StagePlan, plan_stages, schedule_of
from lightning_pipe.schedule.cyclic import cue_after
from lightning_pipe.schedule.options import ScheduleOptions


def _bottleneck(seconds: list[float], bounds: tuple[tuple[int, int], ...]) -> float:
    return max(sum(seconds[first : last + 1]) for first, last in bounds)


def _best_bottleneck(seconds: list[float], stages: int) -> float:
    """Brute force: the smallest largest stage over every split into ``stages`` contiguous stages."""
    layers = len(seconds)
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        edges = [0, *cuts, layers]
        best = min(best, max(sum(seconds[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_worker_gets_a_stage_and_the_bottleneck_stays_the_fastest(data: st.DataObject) -> None:
    seconds = data.draw(st.lists(st.sampled_from([0.001, 0.01, 1.0, 50.0]), min_size=2, max_size=8))
    workers = data.draw(st.integers(2, len(seconds)))
    profile = ChainCosts.from_lists(seconds, [0.0] * len(seconds), params=[1.0] * len(seconds))
    layers = [nn.Identity() for _ in seconds]
    with mock.patch.object(planning, "profile_layers", lambda *_, **__: profile):
        plan = plan_stages(layers, torch.zeros(1), workers, PlanOptions(), MemoryModel(), torch.device("cpu"))
    assert len(plan.bounds) == workers == len(plan.plan.stages)
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == len(seconds) - 1
    assert all(a[1] + 1 == b[0] and a[0] <= a[1] for a, b in itertools.pairwise(plan.bounds))
    tolerance = PlanOptions().tolerance  # near-ties of measured times are decided by memory
    assert _bottleneck(seconds, plan.bounds) <= _best_bottleneck(seconds, workers) * (1 + tolerance) + 1e-12


def test_a_plan_of_fewer_stages_is_cut_and_says_so() -> None:
    """A first layer slower than all the others together: fewer stages are as fast as four, which
    the plan then has, with a note."""
    seconds = [50.0, 1.0, 1.0, 1.0, 1.0]
    profile = ChainCosts.from_lists(seconds, [0.0] * len(seconds), params=[1.0] * len(seconds))
    with mock.patch.object(planning, "profile_layers", lambda *_, **__: profile):
        plan = plan_stages([nn.Identity()] * 5, torch.zeros(1), 4, PlanOptions(), MemoryModel(), torch.device("cpu"))
    assert plan.bounds == ((0, 0), (1, 1), (2, 2), (3, 4))
    assert any("split to one per worker" in note for note in plan.plan.notes), plan.plan.notes


def test_cdp_dp_replicas_start_by_the_plans_durations() -> None:
    """The strategy's schedule of CDP's dp form spaces the replicas by the planned stages' forward and
    backward seconds: four equal stages whose backwards take twice the forwards start each replica
    after the previous one's third forward (a quarter of the pass), not its second (two actions)."""
    profile = ChainCosts.from_lists([1.0] * 4, [2.0] * 4, params=[1.0] * 4)
    with mock.patch.object(planning, "profile_layers", lambda *_, **__: profile):
        plan = plan_stages([nn.Identity()] * 4, torch.zeros(1), 4, PlanOptions(), MemoryModel(), torch.device("cpu"))
    schedule = schedule_of(plan, ScheduleOptions("cdp", form="dp"), 4)(2)
    assert schedule.params["cue_after"] == cue_after(4, 4, ([1.0] * 4, [2.0] * 4)) == 2
    given = schedule_of(StagePlan(plan.bounds), ScheduleOptions("cdp", form="dp"), 4)(2)  # balance=: no durations
    assert given.params["cue_after"] == 1

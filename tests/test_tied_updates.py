"""A one-worker non-flushing program whose tied stages update together
(``lightning_pipe/schedule/tied_updates.py``), on CDP's single form under both rules.

Properties, on random stage counts, micro-batches, steps and groups of sharing stages: the result is a
valid schedule holding the same actions; every update of a stage in a group follows every gradient
of that step of the stages of its group; every action follows the update that makes the version it
uses; and without a group of two stages the program is returned as it was.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import Kind, validate
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.schedule.tied_updates import with_tied_updates


@st.composite
def _cases(draw: st.DrawFn) -> tuple:
    stages = draw(st.integers(2, 5))
    microbatches = draw(st.integers(stages - 1, stages + 2))
    rule = draw(st.sampled_from(["cdp_v1", "cdp_v2"]))
    steps = draw(st.integers(1, 3))
    schedule = (
        ScheduleOptions("cdp", microbatches, form="single", rule=rule).on_workers(1).make(stages, microbatches)(steps)
    )
    group = draw(st.lists(st.integers(0, stages - 1), min_size=2, max_size=stages, unique=True))
    return schedule, [tuple(sorted(group))]


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_tied_updates_follow_every_gradient_of_their_group(case: tuple) -> None:
    schedule, groups = case
    tied = with_tied_updates(schedule, groups)
    validate(tied)
    (order,) = tied.orders
    assert sorted(map(repr, order)) == sorted(map(repr, schedule.orders[0]))
    position = {(a.kind, a.stage, a.microbatch, a.step): i for i, a in enumerate(order)}
    (group,) = groups
    for i, action in enumerate(order):
        if action.kind is Kind.UPDATE and action.stage in group:
            gradients = [
                j for j, a in enumerate(order) if a.kind is Kind.B and a.stage in group and a.step == action.step
            ]
            assert gradients and max(gradients) < i
        if action.kind in (Kind.F, Kind.B) and action.version:
            assert position[(Kind.UPDATE, action.stage, None, action.version - 1)] < i


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_a_program_without_tied_stages_is_kept(case: tuple) -> None:
    schedule, _ = case
    assert with_tied_updates(schedule, []) is schedule
    assert with_tied_updates(schedule, [(0,)]).orders == schedule.orders


def _names(order: tuple) -> list[str]:
    return [f"{a.kind.name[0]}{a.stage}.{a.microbatch}s{a.step}" for a in order]


def test_an_update_before_a_sharing_stages_last_gradient_moves_with_what_needs_its_version() -> None:
    """CDP-v2 on 2 stages, 4 micro-batches: stage 1's update of step 0 ran before stage 0's last
    backward of the step, and micro-batch 0's forward on stage 1 of step 1 uses the version it makes;
    both now follow that backward (and stage 1's last update its own step's), the rest in place."""
    schedule = ScheduleOptions("cdp", 4, form="single", rule="cdp_v2").on_workers(1).make(2, 4)(2)
    before, shown = _names(schedule.orders[0]), _names(with_tied_updates(schedule, [(0, 1)]).orders[0])
    assert before[15:20] == ["F0.0s1", "U1.Nones0", "B0.3s0", "F1.0s1", "U0.Nones0"]
    assert shown[15:20] == ["F0.0s1", "B0.3s0", "U1.Nones0", "F1.0s1", "U0.Nones0"]
    assert before[-3:] == ["U1.Nones1", "B0.3s1", "U0.Nones1"]
    assert shown[-3:] == ["B0.3s1", "U1.Nones1", "U0.Nones1"]
    assert shown[:15] == before[:15] and shown[20:-3] == before[20:-3]


def test_only_one_worker_is_reordered() -> None:
    schedule = ScheduleOptions("cdp", 2).make(2, 2)(2)
    with pytest.raises(PlanningError, match="on one worker, not 2"):
        with_tied_updates(schedule, [(0, 1)])

"""Transfers per time step, as the simulator predicts them (Fournier & Oyallon 2024, Table 1's "max
com. steps between 2 time steps", §4.2 and §4.4), every action one time step: DP reduces each
stage's gradient at the end of the step, every worker to every other; CDP's dp form passes partial
and whole sums point to point during the step, at most two messages per worker and time step; its
ZeRO form passes each stage's state to one worker at a time, at most one message per worker and time
step."""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import StageCosts, make_schedule, simulate

STEPS = 6


def _steady(family: str, workers: int, category: str, **options: object) -> list[list[int]]:
    """Per worker, the messages of ``category`` sent in each time step of steps 2 and 3 (a step is
    2N time steps: N stages each way), away from the start and the drain."""
    schedule = make_schedule(family, workers, workers, STEPS, **options)
    sent = simulate(schedule, StageCosts.uniform(workers, 1.0, 1.0)).sent_per_time_step(1.0, category)
    return [row[4 * workers : 8 * workers] for row in sent]


@pytest.mark.parametrize("workers", [3, 4, 5, 6])
def test_cdp_spreads_the_reduction_over_the_step_where_dp_sends_it_at_its_end(workers: int) -> None:
    dp = _steady("ddp", workers, "reduce")
    assert max(max(row) for row in dp) == workers - 1  # each worker's gradient to every other at once
    assert sum(map(sum, dp)) == 2 * workers * workers * (workers - 1)  # P stages, two steps
    cdp = _steady("cdp", workers, "reduce", form="dp")
    assert max(max(row) for row in cdp) == 2  # a partial sum on, and a whole sum on, at most
    assert sum(map(sum, cdp)) == 2 * workers * 2 * (workers - 1)  # the ring: 2(N - 1) per stage and step
    busy = sum(1 for row in cdp for sent in row if sent)
    assert busy > sum(1 for row in dp for sent in row if sent)  # spread over more time steps


@pytest.mark.parametrize("workers", [2, 3, 4, 5, 6])
def test_the_zero_form_passes_a_stage_to_one_worker_at_a_time(workers: int) -> None:
    """At most one state per worker and time step; over the run, one message per change of worker
    along each stage's relay (counted on the schedule)."""
    zero = _steady("cdp", workers, "weight", form="zero")
    assert max(max(row) for row in zero) == 1
    schedule = make_schedule("cdp", workers, workers, STEPS, form="zero")
    where = {action.key: w for w, order in enumerate(schedule.orders) for action in order}
    passes = sum(where[a.key] != where[b.key] for relay in schedule.relays for a, b in itertools.pairwise(relay))
    sent = simulate(schedule, StageCosts.uniform(workers, 1.0, 1.0)).sent_per_time_step(1.0, "weight")
    assert sum(map(sum, sent)) == passes > 0


def test_a_time_step_must_be_positive() -> None:
    simulation = simulate(make_schedule("cdp", 2, 2, 2, form="dp"), StageCosts.uniform(2))
    with pytest.raises(PlanningError, match="a time step must be positive"):
        simulation.sent_per_time_step(0.0)

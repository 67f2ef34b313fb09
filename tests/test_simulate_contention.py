"""Workers sharing one machine in the simulator (``StageCosts.contention``).

Oracle: the definition of processor sharing, checked on the predicted timeline itself, with the
dependency rules of the independent reference replay (tests/test_simulate_reference.py):

- every action starts when the reference replay would start it, given how long each action lasted;
- every action's work is done: the integral over its interval of its speed, ``1 / (1 + (c - 1)
  (n(t) - 1) / (W - 1))`` with ``n(t)`` workers computing at time ``t``, equals its time alone.

Together they determine the timeline. Plus two worked examples computed by hand.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import FAMILIES, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.ir import Action, Kind
from tests.test_simulate_reference import (
    _family_options,
    _positions,
    duration,
    early_backwards,
    reference_replay,
    stage_costs,
)

Spans = dict[tuple[int, int], tuple[float, float]]


def _speeds(spans: Spans, workers: int, contention: float) -> list[tuple[float, float, list[tuple[int, int]]]]:
    """Between consecutive interval ends: the actions computing and the speed each has."""
    times = sorted({t for span in spans.values() for t in span})
    pieces = []
    for left, right in itertools.pairwise(times):
        computing = [n for n, (start, end) in spans.items() if start <= left and right <= end and end > start]
        if not computing:
            continue
        slowdown = 1 + (contention - 1) * (len(computing) - 1) / max(workers - 1, 1)
        pieces.append((left, right, computing, 1 / slowdown))
    return pieces


def _work_done(spans: Spans, workers: int, contention: float) -> dict[tuple[int, int], float]:
    """Seconds of its own work each action did: its speed integrated over its interval."""
    done = dict.fromkeys(spans, 0.0)
    for left, right, computing, speed in _speeds(spans, workers, contention):
        for node in computing:
            done[node] += (right - left) * speed
    return done


def _when_done(spans: Spans, workers: int, contention: float, node: tuple[int, int], work: float) -> float:
    """When ``node`` has done ``work`` seconds of its own work."""
    if work <= 0:
        return spans[node][0]
    for left, right, computing, speed in _speeds(spans, workers, contention):
        if node in computing:
            if (right - left) * speed >= work:
                return left + work / speed
            work -= (right - left) * speed
    return spans[node][1]


@settings(max_examples=120, deadline=None)
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    stages=st.integers(2, 4),
    microbatches=st.integers(1, 4),
    steps=st.integers(1, 2),
    contention=st.sampled_from([1.0001, 1.25, 2.0, 3.5]),
    early_gradients=st.booleans(),
    data=st.data(),
)
def test_every_action_does_its_work_at_the_shared_speed(
    family: str,
    stages: int,
    microbatches: int,
    steps: int,
    contention: float,
    early_gradients: bool,
    data: st.DataObject,
) -> None:
    """Guards the processor-sharing replay: a wrong speed law (counting waiting workers, or the
    worker itself), a rate not updated when a worker starts or stops, an action started before its
    inputs arrived or its worker was free, and transfers, fetches, overheads or blocking sends
    handled unlike the one-pass replay."""
    try:
        schedule = make_schedule(family, stages, microbatches, steps, **_family_options(family, stages))
    except PlanningError:
        reject()
    costs = data.draw(stage_costs(stages))
    alone = reference_replay(schedule, costs, early_gradients)
    sim = simulate(schedule, replace(costs, contention=contention), early_gradients=early_gradients)
    spans = {(i.worker, p): (i.start, i.end) for p, i in _positions(sim.timeline)}
    lasted = {node: end - start for node, (start, end) in spans.items()}
    share = {node: duration(costs, Action(Kind.I, schedule.orders[node[0]][node[1]].stage)) for node in spans}
    leaves = {
        node: _when_done(spans, schedule.workers, contention, node, share[node])
        for node in (early_backwards(schedule) if early_gradients else ())
    }
    replayed = reference_replay(schedule, costs, early_gradients, seconds=lasted, leaves=leaves)
    for node, (start, _) in spans.items():
        assert math.isclose(start, replayed.start[node], rel_tol=1e-9, abs_tol=1e-9), node
    done = _work_done(spans, schedule.workers, contention)
    for node, work in done.items():
        own = alone.end[node] - alone.start[node]
        assert math.isclose(work, own, rel_tol=1e-9, abs_tol=1e-9), (node, work, own)
    plain = alone.report["makespan"]  # the one-pass replay's, equal to the reference's
    assert plain - 1e-9 <= sim.makespan <= contention * plain + 1e-9


def test_one_f_one_b_on_two_shared_workers_by_hand() -> None:
    """1F1B, 2 stages, 2 micro-batches, F = 1 and B = 2 s alone, both workers computing at once run
    at half speed (contention 2). Worker 0's first forward runs alone (0-1); the next forwards of
    both share (1-3); stage 1's first backward runs alone (3-5); stage 0's first backward (2 s of
    work) shares 5-9 with stage 1's forward (5-7) and half of its last backward (7-9), whose other
    half runs alone (9-10); stage 0's last backward alone (10-12). Without sharing: 9 s."""
    schedule = make_schedule("1f1b", 2, 2, 1)
    sim = simulate(schedule, StageCosts.uniform(2, contention=2.0))
    assert [(i.worker, str(i.action), i.start, i.end) for i in sim.timeline if i.end > i.start] == [
        (0, "0F0v0", 0.0, 1.0),
        (0, "0F1v0", 1.0, 3.0),
        (0, "0B0v0", 5.0, 9.0),
        (0, "0B1v0", 10.0, 12.0),
        (1, "1F0v0", 1.0, 3.0),
        (1, "1B0v0", 3.0, 5.0),
        (1, "1F1v0", 5.0, 7.0),
        (1, "1B1v0", 7.0, 10.0),
    ]
    assert sim.makespan == 12.0 and simulate(schedule, StageCosts.uniform(2)).makespan == 9.0


def test_the_slowdown_grows_with_the_workers_computing() -> None:
    """GPipe's fill on 3 workers with contention 3: one worker alone runs at full speed, two at half
    (1 + 2·1/2 = 2 times slower), three at a third. Forwards of 1 s end at 1, 3 (two at once), 6
    (three), 8 (two), 9 (alone). Guards the ``(n - 1)/(W - 1)`` law between alone and all busy."""
    sim = simulate(make_schedule("gpipe", 3, 3, 1), StageCosts.uniform(3, contention=3.0))
    forwards = sorted({i.end for i in sim.timeline if i.action.kind.value == "F"})
    assert forwards == [1.0, 3.0, 6.0, 8.0, 9.0]


@pytest.mark.parametrize("value", [0.5, 0.0, math.inf, math.nan])
def test_a_contention_below_one_or_not_finite_is_refused(value: float) -> None:
    with pytest.raises(PlanningError, match=r"contention must be a finite factor >= 1 \(1: no sharing\)"):
        StageCosts.uniform(2, contention=value)

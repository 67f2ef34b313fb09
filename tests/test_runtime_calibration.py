"""Stage costs measured in a running pipeline: means per stage and kind, waits excluded, pooled over
ranks, against a direct computation; the executor's collective; clear errors when nothing was
measured."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.calibration import alone_costs, measured_seconds, stage_costs
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import Kind, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.ir import Action
from lightning_pipe.schedule.simulation import Interval
from tests.reference import batches, build_stages

_KINDS = {
    "whole": (Kind.F, Kind.B, Kind.UPDATE),
    "halves": (Kind.F, Kind.I, Kind.W, Kind.UPDATE),
    "both": (Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE),  # 1F1B's cool-down splits some backwards
}


@st.composite
def _timelines(draw: st.DrawFn) -> tuple[int, list[list[Interval]]]:
    """2-3 stages, each with whole backwards, split ones or both, 1-3 ranks, each rank's intervals
    covering every stage and kind at least once."""
    stages = draw(st.integers(2, 3))
    modes = draw(st.lists(st.sampled_from(sorted(_KINDS)), min_size=stages, max_size=stages))
    timelines = []
    for rank in range(draw(st.integers(1, 3))):
        intervals, clock = [], 0.0
        keys = [(s, k) for s in range(stages) for k in _KINDS[modes[s]]]
        keys += draw(st.lists(st.sampled_from(keys), max_size=12))
        for stage, kind in keys:
            duration = draw(st.floats(1e-4, 0.1))
            waited = draw(st.floats(0.0, 1.0)) * duration
            step = draw(st.integers(0, 4))
            action = Action(kind, stage, None if kind is Kind.UPDATE else 0, step)
            intervals.append(Interval(rank, action, clock, clock + duration, waited))
            clock += duration
        timelines.append(intervals)
    return stages, timelines


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_to_the_next_action_counts_the_time_between_actions_with_the_one_before(data: st.DataObject) -> None:
    """One rank's actions over one or more calls, with gaps between them, cues (not measured) among
    them and the training loop's time between calls: with ``to_next`` each measured action lasts from
    its start to the next measured one's of the same call, the last of a call to the end of the call's
    last interval, less every wait in between; the time between calls counts with no action (direct
    computation)."""
    intervals, clock, call = [], 0.0, 0
    for _ in range(data.draw(st.integers(1, 12))):
        if intervals and data.draw(st.booleans()):
            call += 1
            clock += data.draw(st.floats(0.0, 1.0))  # the loop between two calls
        kind = data.draw(st.sampled_from([Kind.F, Kind.B, Kind.UPDATE, Kind.SIGNAL, Kind.WAIT]))
        duration = data.draw(st.floats(1e-4, 0.1))
        waited = data.draw(st.floats(0.0, 1.0)) * duration
        action = Action(kind, 0, None if kind is Kind.UPDATE else 0, data.draw(st.integers(0, 2)))
        intervals.append(Interval(0, action, clock, clock + duration, waited, call))
        clock += duration + data.draw(st.floats(0.0, 0.01))  # the executor's own time before the next one
    since = data.draw(st.integers(0, 2))
    expected: dict = {}
    measured = [p for p, i in enumerate(intervals) if i.action.kind in (Kind.F, Kind.B, Kind.UPDATE)]
    for p in measured:
        interval = intervals[p]
        if interval.action.step < since:
            continue
        same_call = [q for q, i in enumerate(intervals) if q > p and i.call == interval.call]
        later = [q for q in same_call if q in measured]
        if later:
            seconds = intervals[later[0]].start - interval.start - sum(i.waited for i in intervals[p : later[0]])
        else:
            last = same_call[-1] if same_call else p
            seconds = intervals[last].end - interval.start - sum(i.waited for i in intervals[p : last + 1])
        before = [i for i in intervals[:p] if i.action.kind is Kind.B]
        key = (
            0,
            interval.action.kind,
            interval.action.kind is Kind.B and any(i.action.step == interval.action.step for i in before),
        )
        total, count = expected.get(key, (0.0, 0))
        expected[key] = (total + max(seconds, 0.0), count + 1)
    got = measured_seconds(intervals, since, to_next=True)
    assert got.keys() == expected.keys()
    for key, (total, count) in expected.items():
        assert got[key][1] == count and math.isclose(got[key][0], total, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=60, deadline=None)
@given(case=_timelines(), since=st.integers(0, 2))
def test_means_pooled_over_ranks_equal_a_direct_computation(case: tuple, since: int) -> None:
    stages, timelines = case
    adding = set()  # a B or W after another of its stage and step on its rank (rank order)
    for timeline in timelines:
        for position, i in enumerate(timeline):
            gradient = (Kind.B, Kind.W)
            before = [j for j in timeline[:position] if j.action.kind in gradient]
            if i.action.kind in gradient and any(
                (j.action.stage, j.action.step) == (i.action.stage, i.action.step) for j in before
            ):
                adding.add(id(i))
    every = [i for timeline in timelines for i in timeline if i.action.step >= since]

    def mean(stage: int, kind: Kind, adds: bool = False) -> float:
        """Of a stage's first backwards of a step (adding ones where no first is measured), or adding ones."""
        own = [i for i in every if i.action.stage == stage and i.action.kind is kind]
        chosen = [i for i in own if (id(i) in adding) == adds] or own
        return statistics.fmean(max(i.end - i.start - i.waited, 0.0) for i in chosen)  # rounding: never < 0

    def extra(stage: int) -> float | None:
        for kind in (Kind.B, Kind.W):
            kinds = {id(i) in adding for i in every if i.action.stage == stage and i.action.kind is kind}
            if kinds == {True, False}:
                return mean(stage, kind, True) - mean(stage, kind)
        return None

    present = {(i.action.stage, i.action.kind) for i in every}
    halves = [{(s, Kind.I), (s, Kind.W)} <= present for s in range(stages)]
    complete = all((s, Kind.F) in present and ((s, Kind.B) in present or halves[s]) for s in range(stages))
    ranks = [measured_seconds(timeline, since) for timeline in timelines]
    if not complete:
        with pytest.raises(PlanningError, match="no forward and backward of stage"):
            stage_costs(ranks, stages)
        return
    costs = stage_costs(ranks, stages, latency=1e-5)

    def close(value: float, expected: float) -> bool:
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-15)

    for s in range(stages):
        assert close(costs.forward[s], mean(s, Kind.F))
        assert close(costs.update[s], mean(s, Kind.UPDATE) if (s, Kind.UPDATE) in present else 0.0)
        whole = mean(s, Kind.B) if (s, Kind.B) in present else mean(s, Kind.I) + mean(s, Kind.W)
        assert close(costs.backward[s], whole)
        if not any(halves):
            assert costs.input_grad is None and costs.weight_grad is None
        elif halves[s]:
            assert close(costs.input_grad[s], mean(s, Kind.I)) and close(costs.weight_grad[s], mean(s, Kind.W))
        else:
            assert costs.input_grad[s] == costs.weight_grad[s] == costs.backward[s] / 2
    extras = [extra(s) for s in range(stages)]
    if all(e is None for e in extras):
        assert costs.accumulate is None
    for s, e in enumerate(extras if costs.accumulate is not None else ()):
        half = costs.weight_grad[s] if costs.weight_grad is not None else costs.backward[s] / 2
        assert close(costs.accumulate[s], max(e or 0.0, -min(costs.backward[s], half)))
    assert costs.latency == 1e-5


def test_an_unmeasured_extra_for_adding_is_priced_per_byte_of_gradient() -> None:
    """Stage 0 runs a step's first backward (1 s) and an adding one (1.5 s): its extra is 0.5 s for
    100 bytes of gradient. Stage 1 runs a first whole backward (2 s) and an adding one split into
    halves (I 0.5 s, W 3 s), as 1F1B's last stage at m = 2 does: no first weight half to compare
    with, so its extra of 50 bytes is priced at stage 0's rate, 0.25 s (0 without the sizes).
    Guards against a stage's extra taken from another kind's first, and against leaving it out."""

    def interval(rank: int, kind: Kind, stage: int, microbatch: int, start: float, end: float) -> Interval:
        return Interval(rank, Action(kind, stage, microbatch, 0), start, end)

    stage0 = [interval(0, Kind.F, 0, 0, 0, 1), interval(0, Kind.B, 0, 0, 1, 2), interval(0, Kind.B, 0, 1, 2, 3.5)]
    stage1 = [interval(1, Kind.F, 1, 0, 0, 1), interval(1, Kind.B, 1, 0, 1, 3)]
    stage1 += [interval(1, Kind.I, 1, 1, 3, 3.5), interval(1, Kind.W, 1, 1, 3.5, 6.5)]
    ranks = [measured_seconds(stage0), measured_seconds(stage1)]
    sized = stage_costs(ranks, 2, [100.0, 50.0])
    assert sized.backward == [1.0, 2.0] and sized.weight_grad == [0.5, 3.0]
    assert sized.accumulate == [0.5, 0.25]
    assert stage_costs(ranks, 2).accumulate == [0.5, 0.0]


def test_a_stage_never_measured_is_named_with_what_to_do() -> None:
    forward = Interval(0, Action(Kind.F, 0, 0, 0), 0.0, 1.0)
    backward = Interval(0, Action(Kind.B, 0, 0, 0), 1.0, 3.0)
    with pytest.raises(PlanningError, match=r"stage\(s\) \[1\].*since_step.*timeline_length"):
        stage_costs([measured_seconds([forward, backward])], 2)
    with pytest.raises(PlanningError, match=r"stage\(s\) \[0\]"):
        stage_costs([measured_seconds([forward, backward], since_step=1)], 1)


LOOP_SECONDS = 0.2
"""What the training loop spends between two calls, in :func:`_measure`: far more than an action."""


def _measure(rank: int, family: str) -> tuple[object, object, list[list[Interval]]]:
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, 3, k),
        build_stages(2),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    for inputs, targets in batches(5):
        executor.step(inputs, targets)
        time.sleep(LOOP_SECONDS)
    executor.drain()
    costs = executor.measured_costs(since_step=2, bandwidth=1e9)
    to_next = executor.measured_costs(since_step=2, to_next=True)
    # both ways from one gather: the same as each asked alone
    assert executor.measured_costs_both(since_step=2) == (executor.measured_costs(since_step=2), to_next)
    timelines: list[list[Interval]] = [None] * 2
    dist.all_gather_object(timelines, list(executor.timeline))
    executor.close()
    return costs, to_next, timelines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["1f1b", "zb_h1", "2bw"])
def test_executor_measures_the_same_costs_on_every_rank(family: str) -> None:
    (costs, to_next, timelines), (other, _, _) = run_local(_measure, 2, family, timeout=90)
    assert costs == other
    # the loop's time between calls counts with no action, though a non-flushing call ends on one
    assert max(*to_next.forward, *to_next.backward, *(to_next.accumulate or ())) < LOOP_SECONDS / 4, to_next
    for timeline in timelines:
        calls = [i.call for i in timeline]
        assert calls == sorted(calls) and len(set(calls)) >= 5  # five calls (and 2BW's drain), in order
    expected = stage_costs([measured_seconds(t, since_step=2) for t in timelines], 2, bandwidth=1e9)
    assert costs == expected
    assert all(f > 0 for f in costs.forward) and all(u > 0 for u in costs.update)
    # halves are measured where backwards ran split: every stage of zero bubble; in 1F1B, stage 1's
    # cool-down backward (it sends its input gradient early), stage 0 keeping halves of its whole one
    assert (costs.input_grad is not None) == (family != "2bw")
    if family == "1f1b":
        assert costs.input_grad[0] == costs.weight_grad[0] == costs.backward[0] / 2
        kinds = {i.action.kind for timeline in timelines for i in timeline if i.action.stage == 1}
        assert {Kind.B, Kind.I, Kind.W} <= kinds
    assert simulate(make_schedule("gpipe", 2, 4, 2), costs).steady_step > 0


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(["1f1b", "gpipe", "2bw", "cdp", "zb_h1", "pipedream"]),
    stages=st.integers(2, 3),
    microbatches=st.integers(2, 5),
    contention=st.sampled_from([1.2, 1.6, 2.5]),
    data=st.data(),
)
def test_alone_costs_replay_to_the_means_a_shared_run_measured(
    family: str, stages: int, microbatches: int, contention: float, data: st.DataObject
) -> None:
    """Round trip: replay a schedule on workers sharing a machine with known costs alone, take each
    stage's mean seconds per action from the replayed timeline as a measurement would, and find costs
    alone that replay to the same means (never above them; not always the original costs: ties
    between actions can make several costs give the same means). Guards against dividing by the wrong
    stretch (another kind's, the whole schedule's, none) and against stopping the iteration early."""
    seconds = st.floats(0.1, 3.0)
    forward = data.draw(st.lists(seconds, min_size=stages, max_size=stages))
    backward = data.draw(st.lists(seconds, min_size=stages, max_size=stages))
    update = data.draw(st.lists(st.floats(0.0, 1.0), min_size=stages, max_size=stages))
    accumulate = data.draw(st.lists(st.floats(0.0, 0.5), min_size=stages, max_size=stages))
    truth = StageCosts(forward, backward, input_grad=[b / 3 for b in backward], update=update, accumulate=accumulate)
    schedule = make_schedule(family, stages, microbatches, 3)
    shared = simulate(schedule, dataclasses.replace(truth, contention=contention), early_gradients=True)
    measured = stage_costs([measured_seconds(shared.timeline)], stages, contention=contention)
    recovered = alone_costs(measured, schedule, early_gradients=True)
    assert recovered.contention == contention
    replayed = simulate(schedule, recovered, early_gradients=True)
    again = stage_costs([measured_seconds(replayed.timeline)], stages, contention=contention)
    names = ("forward", "update", *(("input_grad", "weight_grad") if family == "zb_h1" else ("backward",)))
    # alone_costs' tolerance is relative to the largest mean, an adding backward's included
    adding = [b + a for b, a in zip(measured.backward, measured.accumulate or [0.0] * stages, strict=True)]
    every = ("forward", "backward", "input_grad", "weight_grad", "update")
    scale = max(max(getattr(measured, name) or [0.0]) for name in every)
    halves = zip(measured.weight_grad or [], measured.accumulate or [], strict=False)  # either may be absent
    scale = max(scale, *adding, *(w + a for w, a in halves))
    for name in names:
        assert getattr(again, name) == pytest.approx(getattr(measured, name), rel=1e-6, abs=1e-6 * scale), name
    if measured.accumulate is not None:  # a difference of two means, each to the tolerance
        assert again.accumulate == pytest.approx(measured.accumulate, abs=2e-6 * scale)
    for name in names:  # each kind alone takes no longer than beside the others
        assert all(
            a <= m * (1 + 1e-9) + 1e-12 for a, m in zip(getattr(recovered, name), getattr(measured, name), strict=True)
        )


def test_alone_costs_of_the_worked_one_f_one_b() -> None:
    """The 1F1B timeline of tests/test_simulate_contention.py (2 stages, 2 micro-batches, F = 1 and
    B = 2 s alone, contention 2) measures stage 0's forwards at 1 and 2 s and its backwards at 4 and
    2 s, stage 1's forwards at 2 and 2 s and its backwards at 2 and 3 s: from those means the
    costs alone come back."""
    measured = StageCosts([1.5, 2.0], [3.0, 2.5], contention=2.0)
    recovered = alone_costs(measured, make_schedule("1f1b", 2, 2, 1))
    assert recovered.forward == pytest.approx([1.0, 1.0]) and recovered.backward == pytest.approx([2.0, 2.0])


def test_alone_costs_without_contention_are_the_measured_ones() -> None:
    measured = StageCosts([1.0, 2.0], [2.0, 3.0])
    assert alone_costs(measured, make_schedule("1f1b", 2, 4, 2)) is measured

"""The executor's timeline kept as plain values: it gives back the intervals appended, the latest
``maxlen``; the suffix it gives a calibration measures what the whole timeline measures; and what it
holds is not walked by the garbage collector."""

from __future__ import annotations

import gc
import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.runtime.calibration import measured_seconds
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.schedule import Kind, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.ir import Action
from lightning_pipe.schedule.simulation import Interval

_OPTIONAL = st.none() | st.integers(0, 7)
_ACTIONS = st.builds(
    Action, st.sampled_from(list(Kind)), st.integers(0, 7), _OPTIONAL, st.integers(0, 9), _OPTIONAL, _OPTIONAL
)
_TIMES = st.floats(0.0, 100.0, allow_nan=False)
_INTERVALS = st.builds(Interval, st.integers(0, 3), _ACTIONS, _TIMES, _TIMES, _TIMES, st.integers(0, 20))


@settings(max_examples=150, deadline=None)
@given(st.lists(_INTERVALS, max_size=40), st.none() | st.integers(0, 12), st.integers(0, 10))
def test_it_gives_back_the_latest_intervals_and_the_suffix_from_a_step(
    appended: list[Interval], maxlen: int | None, step: int
) -> None:
    timeline = Timeline(maxlen)
    for interval in appended:
        timeline.append(interval)
    kept = appended if maxlen is None else appended[max(len(appended) - maxlen, 0) :] if maxlen else []
    assert list(timeline) == kept and len(timeline) == len(kept) and timeline.maxlen == maxlen
    assert timeline.since(step) == list(itertools.dropwhile(lambda i: i.action.step < step, kept))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb_h1", "pipedream", "2bw", "cdp"]),
    st.integers(2, 3),
    st.integers(2, 4),
    st.integers(1, 5),
    st.integers(0, 4),
)
def test_a_calibration_measures_the_same_on_the_suffix_as_on_the_whole_timeline(
    family: str, stages: int, microbatches: int, actions_per_call: int, since: int
) -> None:
    """Each worker's replayed actions of 5 steps of a schedule (non-flushing ones, whose steps
    interleave, among them), cut into calls of ``actions_per_call``: what every stage's actions of
    steps ``>= since`` took, each alone and each until the next action, is the same measured on
    :meth:`Timeline.since` as on every interval kept."""
    schedule = make_schedule(family, stages, microbatches, 5)
    costs = StageCosts([0.010 + 0.002 * s for s in range(stages)], [0.020 + 0.003 * s for s in range(stages)])
    replay = simulate(schedule, costs).timeline
    for worker in range(schedule.workers):
        timeline = Timeline()
        ran = sorted((i for i in replay if i.worker == worker), key=lambda i: i.start)
        for position, interval in enumerate(ran):
            timeline.append(
                Interval(worker, interval.action, interval.start, interval.end, 0.001, position // actions_per_call)
            )
        for to_next in (False, True):
            suffix = measured_seconds(timeline.since(since), since, to_next)
            whole = measured_seconds(list(timeline), since, to_next)
            assert suffix.keys() == whole.keys()
            for key, (seconds, count) in whole.items():  # the waits summed from another start: rounding
                assert suffix[key][1] == count and math.isclose(suffix[key][0], seconds, rel_tol=1e-9)


def test_the_intervals_it_holds_are_not_tracked_by_the_garbage_collector() -> None:
    """10,000 intervals appended add no object for a collection to walk (as objects, 20,000)."""
    timeline = Timeline(None)
    gc.collect()
    before = len(gc.get_objects())
    for step in range(10_000):
        timeline.append(Interval(1, Action(Kind.F, 2, step % 4, step, 3, None), step * 1.0, step + 0.5, 0.1, step))
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert len(timeline) == 10_000

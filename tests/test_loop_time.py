"""The training loop's own time per step: measured from the steps' starts and the executor's calls,
kept per device kind and number of processes, and priced into a model's first fit."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.loop_time import KEPT_LOOPS, keep_loop_seconds, kept_loop_seconds, loop_path, loop_seconds
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.step_prices import LOOP_MEASURED_ON, StepPrices
from tests.stage_plans import one_layer_per_stage

SECONDS = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(SECONDS, SECONDS), min_size=1, max_size=12), SECONDS)
def test_the_loop_time_is_what_each_step_spends_outside_the_executor(
    steps: list[tuple[float, float]], t0: float
) -> None:
    """Oracle: steps built from their executor call and loop time (a start, the call, the loop, the next
    start) give back the median loop time over every step whose next one started."""
    starts = list(itertools.accumulate((inside + loop for inside, loop in steps), initial=t0))
    got = loop_seconds(starts, [inside for inside, _ in steps])
    assert got is not None and math.isclose(got, statistics.median(loop for _, loop in steps), abs_tol=1e-9)
    # the last step's next start not known yet: that step is left out
    shorter = loop_seconds(starts[:-1], [inside for inside, _ in steps])
    assert shorter == (None if len(steps) == 1 else pytest.approx(statistics.median(lp for _, lp in steps[:-1])))


def test_a_clock_read_before_the_call_ended_counts_no_time() -> None:
    """A step whose next start reads earlier than its call's end (clocks of another origin) counts 0,
    not negative time; no step with a next one: nothing measured."""
    assert loop_seconds([0.0, 1.0], [1.5]) == 0.0
    assert loop_seconds([0.0], [1.0]) is None
    assert loop_seconds([], []) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 0.1, allow_nan=False), min_size=1, max_size=9))
def test_the_last_fits_are_kept_and_their_median_priced(values: list[float]) -> None:
    """Brute force: after keeping each value in turn, the kept price is the median of the last
    :data:`KEPT_LOOPS`; the file holds no more than them."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name) / "cache"  # made when the first is kept
        assert kept_loop_seconds(directory, "cpu", 2) is None
        for count, value in enumerate(values, 1):
            assert keep_loop_seconds(directory, "cpu", 2, value) == loop_path(directory, "cpu", 2)
            last = values[max(count - KEPT_LOOPS, 0) : count]
            assert kept_loop_seconds(directory, "cpu", 2) == pytest.approx(statistics.median(last))
        runs = json.loads(loop_path(directory, "cpu", 2).read_text())["runs"]
        assert len(runs) == min(len(values), KEPT_LOOPS) and all("written" in run for run in runs)


def test_each_device_kind_and_number_of_processes_keeps_its_own(tmp_path: Path) -> None:
    keep_loop_seconds(tmp_path, "cpu", 2, 0.002)
    keep_loop_seconds(tmp_path, "cuda:1", 8, 0.004)
    assert kept_loop_seconds(tmp_path, "cpu", 2) == 0.002
    assert kept_loop_seconds(tmp_path, "cuda:0", 8) == 0.004  # the kind, not the index
    assert kept_loop_seconds(tmp_path, "cpu", 4) is None
    assert kept_loop_seconds(tmp_path, "cuda", 2) is None


def test_what_cannot_be_read_or_is_no_time_is_left_out(tmp_path: Path) -> None:
    """An unreadable file prices nothing and is replaced by the next fit's; entries that are not a
    number of seconds are skipped; no time (not finite, negative) is not kept; an unwritable
    directory keeps nothing and the fit goes on."""
    path = loop_path(tmp_path, "cpu", 2)
    path.write_text("{not json")
    assert kept_loop_seconds(tmp_path, "cpu", 2) is None
    assert keep_loop_seconds(tmp_path, "cpu", 2, 0.003) == path
    assert kept_loop_seconds(tmp_path, "cpu", 2) == 0.003
    runs = [{"seconds": "1"}, {"seconds": True}, {"seconds": -1.0}, {"seconds": math.inf}, {}, {"seconds": 0.001}]
    path.write_text(json.dumps({"runs": [*runs, "not an entry"]}))
    assert kept_loop_seconds(tmp_path, "cpu", 2) == 0.001
    for value in (math.nan, math.inf, -0.5):
        assert keep_loop_seconds(tmp_path, "cpu", 2, value) is None
    blocked = tmp_path / "a file"
    blocked.write_text("")
    assert keep_loop_seconds(blocked, "cpu", 2, 0.002) is None


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-3, 1.0), st.floats(1e-3, 1.0)), min_size=2, max_size=3),
    st.floats(0.0, 0.05),
    st.sampled_from(["gpipe", "1f1b", "2bw", "cdp"]),
    st.integers(3, 6),
)
def test_a_first_fit_prices_each_step_with_the_loop_time_kept(
    stages: list[tuple[float, float]], loop: float, family: str, m: int
) -> None:
    """Oracle: with no calibration of the model kept, the prediction is the simulated step with the
    loop's time beyond its actions, as a calibration of that alone prices it: added to a flushing
    step, beside the busiest worker's actions in a non-flushing one. A calibration of the model,
    where one is kept, prices the step instead."""
    plan = one_layer_per_stage([f for f, _ in stages], [b for _, b in stages])
    options = ScheduleOptions(family=family, microbatches=m).on_workers(len(stages))
    alone = StepPrices()
    simulation, step = alone.predict(plan, options, m, 1.0, False)
    assert simulation is not None and step == simulation.steady_step
    priced = StepPrices(loop=Calibration(1.0, 0.0, loop, LOOP_MEASURED_ON))
    again, with_loop = priced.predict(plan, options, m, 1.0, False)
    assert again is not None and math.isclose(again.steady_step, simulation.steady_step)
    busiest = max(simulation.busy) / simulation.schedule.steps
    expected = step + loop if simulation.schedule.flush else max(step, busiest + loop)
    assert with_loop is not None and math.isclose(with_loop, expected, rel_tol=1e-12)
    kept = Calibration(1.0, 0.0, 0.0, "an earlier fit")
    assert StepPrices(kept=kept, loop=priced.loop).predict(plan, options, m, 1.0, False)[1] == pytest.approx(step)


def test_the_report_says_what_priced_the_first_fit() -> None:
    loop = Calibration(1.0, 0.0, 0.0021, LOOP_MEASURED_ON)
    said = StepPrices(loop=loop).said()
    assert "2.1 ms of the training loop's own time" in said and "no run of this model kept" in said
    assert "training loop" not in StepPrices().said()
    assert "training loop" not in StepPrices(kept=Calibration(1.0, 0.0, 0.0), loop=loop).said()

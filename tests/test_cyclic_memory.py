"""Activation memory of DP against CDP (:mod:`lightning_pipe.train.cyclic_memory`): the simulator's
figures on the paper's step model (Fournier & Oyallon 2024, §4.1-4.2: every stage one unit of
activations and one time step each way), the per-worker sum against a brute-force sampling, and the
runtime's measurement on one device against the simulator's."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import StageCosts, simulate
from lightning_pipe.schedule.cyclic import CUE_TOLERANCE, cue_after
from lightning_pipe.train.cyclic_memory import measure, per_worker_peak, plan_split, schedule_of


def _step_model(
    setting: str, kind: str, workers: int, steps: int = 4, backward: float = 1.0, by_time: bool = False
) -> float:
    costs = StageCosts.uniform(workers, 1.0, backward, saved_bytes=[1.0] * workers)
    durations = (costs.forward, costs.backward) if by_time else None
    simulation = simulate(schedule_of(setting, kind, workers, workers, durations)(steps), costs)
    return per_worker_peak(simulation.memory_timeline, workers)


def _cyclic_order_peak(stages: int, microbatches: int, steps: int) -> int:
    """Brute force: the most stage activations alive on one device running the cyclic timeline in
    order (forward of stage ``j`` of micro-batch ``g`` at ``2g + j``, its backward at
    ``2g + 2P - 1 - j``; backwards first within a time step), each held from its forward to its
    backward."""
    events = []
    for g in range(steps * microbatches):
        for j in range(stages):
            events += [(2 * g + j, 1, +1), (2 * g + 2 * stages - 1 - j, 0, -1)]
    alive = peak = 0
    for _, _, change in sorted(events):
        alive += change
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("workers", [2, 3, 4, 5, 8])
def test_step_model_on_processes_keeps_the_papers_n_plus_one_over_two(workers: int) -> None:
    """N replicas, each two time steps after the previous: (N + 1) / 2 units per worker at the peak,
    where DP, every replica at once, holds N (Table 1's ``(N+1)/2 B Psi_A`` against ``N B Psi_A``)."""
    assert _step_model("processes", "dp", workers) == workers
    assert _step_model("processes", "cdp", workers) == pytest.approx((workers + 1) / 2)


@pytest.mark.parametrize("workers", [3, 4, 5, 8])
def test_replicas_cued_by_time_keep_n_plus_one_over_two_when_backwards_take_twice_the_forwards(workers: int) -> None:
    """With backwards twice the forwards, two actions are less than 1/N of a pass: replicas started two
    actions apart hold more than (N + 1) / 2 units at their peak. Started 1/N of the pass apart (the
    stages' durations given), they hold (N + 1) / 2 again."""
    dp = _step_model("processes", "dp", workers, backward=2.0)
    assert dp == workers
    assert _step_model("processes", "cdp", workers, backward=2.0) > (workers + 1) / 2
    assert _step_model("processes", "cdp", workers, backward=2.0, by_time=True) == pytest.approx((workers + 1) / 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.data())
def test_the_cue_follows_the_last_action_by_one_nth_of_the_pass(workers: int, data: st.DataObject) -> None:
    """Any stage durations: the cue follows the last action of a pass ending by 1/N of it, 1% of it
    allowed (brute force over the pass's actions; the first action when none does)."""
    seconds = st.lists(st.floats(0.01, 3.0), min_size=workers, max_size=workers)
    forward, backward = data.draw(seconds), data.draw(seconds)
    ends = list(itertools.accumulate([*forward, *reversed(backward)]))
    by = [a for a in range(len(ends)) if ends[a] <= ends[-1] / workers * (1 + CUE_TOLERANCE)]
    assert cue_after(workers, workers, (forward, backward)) == max(by, default=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.floats(0.1, 3.0), st.floats(0.1, 3.0))
def test_replicas_cued_by_time_run_as_fast_as_dp(workers: int, forward: float, backward: float) -> None:
    """Stages of equal durations, backwards faster or slower than forwards: replicas started 1/N of a
    pass apart (as nearly as whole actions allow) are never slower than DP's by more than the 1%
    the cue may fall late."""
    costs = StageCosts.uniform(workers, forward, backward, saved_bytes=[1.0] * workers)
    dp = simulate(schedule_of("processes", "dp", workers, workers)(6), costs)
    by_time = simulate(schedule_of("processes", "cdp", workers, workers, (costs.forward, costs.backward))(6), costs)
    assert by_time.throughput >= dp.throughput * (1 - CUE_TOLERANCE)


def test_durations_are_checked() -> None:
    with pytest.raises(PlanningError, match="3 forward and 2 backward durations for 2 stages"):
        cue_after(2, 2, ([1.0] * 3, [1.0] * 2))
    with pytest.raises(PlanningError, match="cannot be negative"):
        cue_after(2, 2, ([1.0, -1.0], [1.0, 1.0]))


@pytest.mark.parametrize("workers", [2, 3, 4, 5, 8])
def test_step_model_on_one_device_equals_the_cyclic_order_counted_by_hand(workers: int) -> None:
    """One device runs the timeline's actions one after another: DP holds all N micro-batches' N
    units; CDP what the brute-force count of the cyclic order gives (N²/2 rounded up: a little less
    than on N processes, a step's backwards freeing before its forwards)."""
    assert _step_model("one device", "dp", workers) * workers == workers * workers
    expected = _cyclic_order_peak(workers, workers, 4)
    assert _step_model("one device", "cdp", workers) * workers == pytest.approx(expected)
    assert expected == (workers * workers + 1) // 2


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), min_size=1, max_size=8),
        min_size=1,
        max_size=4,
    )
)
def test_per_worker_peak_equals_a_sampled_sum(curves: list[list[tuple[int, int]]]) -> None:
    """Each curve a step function ``(time, level from then on)``; the peak of their sum, sampled at
    every time any of them changes (each curve's last change at a time wins), divided by the workers."""
    curves = [sorted(curve) for curve in curves]

    def level(curve: list[tuple[int, int]], time: int) -> int:
        return next((value for moment, value in reversed(curve) if moment <= time), 0)

    moments = {moment for curve in curves for moment, _ in curve}
    expected = max(sum(level(curve, moment) for curve in curves) for moment in moments)
    assert per_worker_peak(curves, 3) == pytest.approx(expected / 3)


def _chain(width: int = 64, blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 5))


@pytest.mark.timeout(120)
def test_runtime_on_one_device_measures_what_the_simulator_predicts() -> None:
    """An MLP of 4 blocks in 4 stages, 4 micro-batches on one device: the runtime's saved bytes give
    CDP/DP within 2 points of the simulator's figure from the profile, and below the (N+1)/2N the
    paper gives for N processes."""
    microbatch = torch.randn(8, 64)
    split = plan_split(_chain, microbatch, 4)
    result = measure(_chain, microbatch, 5, "one device", 4, split, steps=3)
    assert abs(result.ratio("measured") - result.ratio("predicted")) <= 0.02, (result.measured, result.predicted)
    assert result.ratio("measured") <= result.ideal


def test_settings_and_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="setting must be one of"):
        schedule_of("two devices", "dp", 2, 2)
    with pytest.raises(ValueError, match="kind 'dp' or 'cdp'"):
        schedule_of("processes", "zero", 2, 2)

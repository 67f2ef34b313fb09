"""Activation memory of DP against CDP (:mod:`lightning_pipe.train.cyclic_memory`): the simulator's
figures on the paper's step model (Fournier & Oyallon 2024, §4.1-4.2: every stage one unit of
activations and one time step each way), the per-worker sum against a brute-force sampling, and the
runtime's measurement on one device against the simulator's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.schedule import StageCosts, simulate
from lightning_pipe.train.cyclic_memory import measure, per_worker_peak, plan_split, schedule_of


def _step_model(setting: str, kind: str, workers: int, steps: int = 4) -> float:
    costs = StageCosts.uniform(workers, 1.0, 1.0, saved_bytes=[1.0] * workers)
    simulation = simulate(schedule_of(setting, kind, workers, workers)(steps), costs)
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

"""The pipeline's float16 loss scale follows ``torch.amp.GradScaler``'s rule exactly (the oracle:
the scaler itself, driven by the same overflows)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.schedule import FAMILIES, NON_FLUSHING_FAMILIES, make_schedule


def _scaler_after(overflows: list[bool], **settings_: float) -> dict:
    """A CPU GradScaler's state after steps whose gradient is ``inf`` where ``overflows`` says."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **settings_)
    states = []
    for overflow in overflows:
        scaler.scale(weight.sum())  # creates the scale tensor, as a backward would
        weight.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(optimizer)
        scaler.update()
        states.append(scaler.state_dict())
    return states


@settings(max_examples=60, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    init_exponent=st.integers(-10, 120),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.25, 2.0**-30, 0.3]),
    interval=st.integers(1, 5),
)
def test_loss_scale_follows_grad_scaler(
    overflows: list[bool], init_exponent: int, growth: float, backoff: float, interval: int
) -> None:
    """Back-off, growth after ``growth_interval`` good steps, float32 rounding and the cap at the
    largest float32 (a growth to ``inf`` is not taken) are GradScaler's, step by step."""
    options = {"init_scale": 2.0**init_exponent, "growth_factor": growth, "backoff_factor": backoff}
    expected = _scaler_after(overflows, growth_interval=interval, **options)
    scale = LossScale.from_state_dict(torch.amp.GradScaler("cpu", growth_interval=interval, **options).state_dict())
    for overflow, state in zip(overflows, expected, strict=True):
        scale.update(overflow)
        assert scale.state_dict() == state


def test_loss_scale_refuses_bad_settings() -> None:
    for bad, pattern in [
        ({"scale": 0.0}, "positive finite"),
        ({"growth_factor": 1.0}, "growth_factor must be above 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            LossScale(**bad)


def test_non_flushing_families_are_those_whose_steps_overlap() -> None:
    """The strategy refuses float16 for :data:`NON_FLUSHING_FAMILIES` before building a schedule:
    the list must be exactly the families whose schedules do not flush."""
    needs = {"1f1b_star": {"period": 3.0}, "kperiodic": {"k": 1}}
    overlapping = set()
    for family in FAMILIES:
        stages = 4 if family in ("interleaved", "looped_bfs", "lpp", "fslpp") else 2
        if not make_schedule(family, stages, 4, 3, **needs.get(family, {})).flush:
            overlapping.add(family)
    assert overlapping == set(NON_FLUSHING_FAMILIES)


def test_a_rule_the_family_does_not_run_is_refused_when_the_options_are_made() -> None:
    """The strategy's constructor (through ``ScheduleOptions``) refuses the pair before any process
    starts, naming the families that run the rule."""
    from lightning_pipe.errors import PlanningError
    from lightning_pipe.schedule.options import ScheduleOptions

    with pytest.raises(PlanningError, match=r"gpipe runs the 'sync' update rule, not 'cdp_v2'; 'cdp_v2' runs on cdp"):
        ScheduleOptions("gpipe", rule="cdp_v2")
    with pytest.raises(PlanningError, match=r"2bw runs the '2bw' or 'stash' update rule, not 'vertical'"):
        ScheduleOptions("2bw", rule="vertical")
    assert ScheduleOptions("pipedream", rule="vertical").rule == "vertical"

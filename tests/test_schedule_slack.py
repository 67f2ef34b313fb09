"""Slack: extra warm-up forwards per link for 1F1B, PipeDream and 2BW (schedule/pipeline.py).

Oracles: the warm-up each stage must have, ``(P - s - 1)(1 + k)``; a worked order; and the steady
period of a 2-stage non-flushing 1F1B with per-message delay ``d``, derived by hand. Stage 0 runs
``F(i), B(i - w), F(i + 1)`` with ``w = 1 + k``; ``B(i - w)`` waits for the gradient that leaves
stage 0 with ``F(i - w)``'s activation and comes back ``2d + F + B`` later. Writing ``e(i)`` for
the end of ``F(i)``, ``e(i + 1) = max(e(i), e(i - w) + 2d + F + B) + F + B``, whose steady period is
``p = max(F + B, (2(F + B) + 2d) / (1 + w))``, the larger cycle mean of that max-plus recurrence:
plain 1F1B (``w = 1``) pays ``d`` per micro-batch, and slack ``k`` hides a round trip of up to
``k(F + B)``.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cli import main
from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.schedule import SLACK_FAMILIES, Kind, StageCosts, make_schedule, simulate
from tests.reference import leading_forwards

_RULES = {"1f1b": [None], "pipedream": ["stash", "vertical"], "2bw": ["2bw", "stash"]}


def _label(action) -> str:
    if action.kind is Kind.UPDATE:
        return f"U@{action.step}"
    return f"{action.kind.name}{action.microbatch}@{action.step}v{action.version}"


@settings(max_examples=80, deadline=None)
@given(
    family=st.sampled_from(SLACK_FAMILIES),
    stages=st.integers(1, 5),
    microbatches=st.integers(1, 8),
    slack=st.integers(0, 3),
    data=st.data(),
)
def test_each_stage_warms_up_with_its_slack(family: str, stages: int, microbatches: int, slack: int, data) -> None:
    rule = data.draw(st.sampled_from(_RULES[family]))
    options = {"rule": rule} if rule else {}
    warmup = (stages - 1) * (1 + slack)
    if family == "2bw" and microbatches < warmup:
        with pytest.raises(PlanningError, match=r"m >= .*= " + str(warmup)):
            make_schedule(family, stages, microbatches, 3, slack=slack, **options)
        return
    schedule = make_schedule(family, stages, microbatches, 3, slack=slack, **options)  # validated
    for stage, order in enumerate(schedule.orders):
        # a flushing 1F1B warms up within the step, the others over the stream of every step; the
        # warm-up's forwards are followed by the first pair's, before the first backward
        jobs = microbatches if schedule.flush else 3 * microbatches
        assert leading_forwards(order) == min(jobs, (stages - stage - 1) * (1 + slack) + 1), (stage, order)
    assert schedule.params.get("slack", 0) == slack


def test_a_worked_2bw_order_with_slack_one() -> None:
    schedule = make_schedule("2bw", 2, 2, 3, slack=1)
    first, second = ([_label(a) for a in order] for order in schedule.orders)
    assert first[:7] == ["F0@0v0", "F1@0v0", "F0@1v0", "B0@0v0", "F1@1v0", "B1@0v0", "U@0"]
    assert first[7:] == ["F0@2v1", "B0@1v0", "F1@2v1", "B1@1v0", "U@1", "B0@2v1", "B1@2v1", "U@2"]
    assert second[:4] == ["F0@0v0", "B0@0v0", "F1@0v0", "B1@0v0"]  # the last stage needs no slack


@settings(max_examples=60, deadline=None)
@given(
    forward=st.floats(0.1, 5.0),
    backward=st.floats(0.1, 5.0),
    delay=st.floats(0.0, 6.0),
    slack=st.integers(0, 2),
    family=st.sampled_from(["pipedream", "2bw"]),
)
def test_slack_hides_the_round_trip_of_a_two_stage_stream(
    forward: float, backward: float, delay: float, slack: int, family: str
) -> None:
    microbatches = 1 + slack if family == "2bw" else 1
    schedule = make_schedule(family, 2, microbatches, 48, slack=slack)
    costs = StageCosts.uniform(2, forward, backward, latency=delay)
    work, w = forward + backward, 1 + slack
    period = max(work, (2 * work + 2 * delay) / (1 + w))
    # the steady regime repeats every 1 + w micro-batches: 24 steps in the middle (no fill, no drain)
    # hold whole repeats for w <= 3
    ends = simulate(schedule, costs).step_end
    assert (ends[36] - ends[12]) / 24 == pytest.approx(microbatches * period, rel=1e-6)


def test_slack_is_refused_where_it_does_not_apply_or_is_not_whole() -> None:
    with pytest.raises(PlanningError, match=r"gpipe takes no slack.*1f1b, pipedream, 2bw"):
        make_schedule("gpipe", 2, 2, slack=1)
    for bad in (-1, 1.5, True):
        with pytest.raises(PlanningError, match="slack must be a whole number"):
            make_schedule("2bw", 2, 4, slack=bad)
    with pytest.raises(PlanningError, match=r"m >= \(P - 1\)\(1 \+ slack\) = 6 .*at most 0"):
        make_schedule("2bw", 4, 4, slack=1)


def test_the_simulate_command_takes_slack(capsys) -> None:
    assert main(["simulate", "--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--steps", "4"]) == 0
    plain = capsys.readouterr().out
    assert (
        main(["simulate", "--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--steps", "4", "--slack", "1"])
        == 0
    )
    slacked = capsys.readouterr().out
    assert "NCA per stage" in slacked and plain != slacked
    with pytest.raises(SystemExit):
        main(["simulate", "--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--slack", "-1"])
    assert "expected a whole number >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("family", "options", "answer"),
    [
        ("2bw", {"rule": "stash", "slack": 1}, "make_schedule('2bw', 2, 4, k, rule='stash', slack=1)"),
        ("pipedream", {"rule": "vertical"}, "make_schedule('pipedream', 2, 4, k, rule='vertical')"),
        ("cdp", {"form": "pyramid"}, "make_schedule('cdp', 2, 4, k, rule='cdp_v2', form='pyramid')"),
    ],
)
def test_a_non_flushing_schedule_given_whole_is_answered_with_its_own_options(
    family: str, options: dict, answer: str
) -> None:
    schedule = make_schedule(family, 2, 4, 2, **options)
    # the rule and params a non-flushing schedule carries rebuild it: they are what the answer repeats
    assert make_schedule(family, 2, 4, 2, rule=schedule.rule, **schedule.params) == schedule
    with pytest.raises(PlanningError, match=re.escape(answer)):
        PipelineExecutor(schedule, [], None, None)

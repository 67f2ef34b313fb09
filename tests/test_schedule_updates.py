"""Where a non-flushing 1F1B places its updates: after the step's last backward, and under 2BW's rule
also after the forwards that follow it and do not need it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe.schedule import FAMILY_RULES, StageCosts, make_schedule, rules_of, simulate
from lightning_pipe.schedule.ir import Kind


@given(
    stages=st.integers(2, 5), extra=st.integers(0, 4), steps=st.integers(2, 5), rule=st.sampled_from(["2bw", "stash"])
)
def test_an_update_waits_for_the_forwards_that_do_not_need_it(stages: int, extra: int, steps: int, rule: str) -> None:
    """For every stage and step ``t``: ``UPDATE(t)`` comes after every backward of step ``t`` and
    before any backward of step ``t + 1`` (one gradient buffer at a time) and any action using the
    version it makes; under the ``2bw`` rule no forward of a step ``<= t + 1`` directly follows it
    (those compute with the version before it, and the stages downstream wait for them), under
    ``stash`` (the newest version per forward) it stays right after the last backward. Two weight
    versions at most, whatever the placement. Guards against an update delaying a forward it need
    not delay, and against deferring one past an action that needs it."""
    m = stages - 1 + extra
    schedule = make_schedule("2bw", stages, m, steps, rule=rule)
    for order in schedule.orders:
        for position, update in enumerate(order):
            if update.kind is not Kind.UPDATE:
                continue
            t = update.step
            before, after = order[:position], order[position + 1 :]
            assert sum(a.kind is Kind.B and a.step == t for a in before) == m
            assert not any(a.kind is Kind.B and a.step > t for a in before)
            assert not any(a.version is not None and a.version > t for a in before)
            follows = after[0] if after else None
            if rule == "2bw":
                assert follows is None or not (follows.kind is Kind.F and follows.step <= t + 1)
            else:
                assert before[-1].kind is Kind.B and before[-1].step == t
    assert max(simulate(schedule, StageCosts.uniform(stages)).weight_versions) <= 2


@pytest.mark.parametrize("family", sorted(FAMILY_RULES))
def test_a_familys_default_rule_is_the_one_it_lists_first(family: str) -> None:
    """``rules_of`` names a family's default rule first (error messages and the Hydra configs rely on
    it): a schedule made without a rule runs that one. CDP listed CDP-v1 first while its generator
    ran CDP-v2."""
    assert make_schedule(family, 2, 2, 3).rule == rules_of(family)[0]

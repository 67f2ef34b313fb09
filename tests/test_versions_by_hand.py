"""Weight versions of every update rule, written out by hand for small cases from the papers'
definitions (not read off ``make_schedule``), plus what ``assign_versions`` must leave alone.

Version ``v`` of a stage is its weights after ``v`` updates; step ``t``'s update makes ``t + 1``.

- sync (GPipe, 1F1B-flush): step ``t`` computes with ``θ_t``.
- 2BW (Narayanan et al. 2021) = CDP-v1 (Fournier & Oyallon 2024): ``θ_{t+1} = θ_t − γ/N Σ_i ∇f_i(θ_{t−1})``,
  and ``θ_{−1} = θ_0``.
- CDP-v2: micro-batch ``i`` (1-based) uses ``θ_{t−1}`` on stages ``1..N−i`` and ``θ_t`` on stages
  ``N−i+1..N``; 0-based, stage ``j`` uses ``θ_t`` when ``i + j >= N − 1``.
- stash (PipeDream §3.3, weight stashing): a forward uses the newest version of its stage on its
  worker; the backward reuses that (stashed) version.
- vertical sync (PipeDream §3.3): every stage of a micro-batch uses the version its first stage used.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import COMPUTE, Action, Kind, Schedule, validate
from lightning_pipe.schedule.versions import RULES, assign_versions
from tests.reference import hand_schedule


def _strip(schedule: Schedule) -> Schedule:
    """The schedule with every version removed."""
    return schedule.with_orders(
        [[Action(a.kind, a.stage, a.microbatch, a.step, None, a.peer) for a in order] for order in schedule.orders]
    )


def _gpipe(stages: int, microbatches: int, steps: int, split: bool = False) -> Schedule:
    """A plain fill-drain order written here (worker ``s`` runs stage ``s``), without versions; with
    ``split`` every backward is an ``I`` then a ``W``."""
    orders = []
    for s in range(stages):
        order = []
        for t in range(steps):
            order += [Action(Kind.F, s, i, t) for i in range(microbatches)]
            for i in reversed(range(microbatches)):
                order += [Action(Kind.I, s, i, t), Action(Kind.W, s, i, t)] if split else [Action(Kind.B, s, i, t)]
            order.append(Action(Kind.UPDATE, s, None, t))
        orders.append(order)
    return Schedule("hand", stages, microbatches, steps, orders, tuple((s,) for s in range(stages)))


def _versions(schedule: Schedule) -> dict[tuple[int, int], list[list[int]]]:
    """``{step: [[version of micro-batch i on stage j for i] for j]}`` of the forwards, after checking
    that every backward half carries its forward's version."""
    forward = {(a.stage, a.microbatch, a.step): a.version for _, _, a in schedule.actions() if a.kind is Kind.F}
    for _, _, a in schedule.actions():
        if a.kind in (Kind.B, Kind.I, Kind.W):
            assert a.version == forward[(a.stage, a.microbatch, a.step)], a
    return {
        t: [[forward[(s, i, t)] for i in range(schedule.microbatches)] for s in range(schedule.stages)]
        for t in range(schedule.steps)
    }


# three stages, three micro-batches, three steps: {step: [stage 0's micro-batches, stage 1's, stage 2's]}
SYNC = {0: [[0, 0, 0]] * 3, 1: [[1, 1, 1]] * 3, 2: [[2, 2, 2]] * 3}
# θ_{t-1}, with θ_{-1} = θ_0
ONE_STEP_LATE = {0: [[0, 0, 0]] * 3, 1: [[0, 0, 0]] * 3, 2: [[1, 1, 1]] * 3}
# i + j >= 2 (0-based) takes θ_t: stage 0 only for its last micro-batch, stage 2 for all of them
CDP_V2 = {
    0: [[0, 0, 0], [0, 0, 0], [0, 0, 0]],
    1: [[0, 0, 1], [0, 1, 1], [1, 1, 1]],
    2: [[1, 1, 2], [1, 2, 2], [2, 2, 2]],
}


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("sync", SYNC), ("2bw", ONE_STEP_LATE), ("cdp_v1", ONE_STEP_LATE), ("cdp_v2", CDP_V2)],
)
@pytest.mark.parametrize("split", [False, True])
def test_formula_rules_by_hand(rule: str, expected: dict, split: bool) -> None:
    """Three stages, micro-batches and steps: the versions of each formula rule, from the tables above
    (including the CDP-v2 boundary ``i + j == N - 1`` and step 0's ``θ_{-1} = θ_0``). Guards against a
    rule mixed up with another, ``t - 1`` off by one, a missing ``max(·, 0)``, the wrong comparison
    or sum in CDP-v2, and split backward halves not sharing their forward's version."""
    versioned = assign_versions(_gpipe(3, 3, 3, split), rule)
    assert versioned.rule == rule
    assert _versions(versioned) == expected


def test_cdp_v2_on_two_stages_by_hand() -> None:
    """N = 2, micro-batches 0 and 1, two steps: micro-batch 0 uses θ_{t-1} on stage 0 and θ_t on
    stage 1; micro-batch 1 uses θ_t on both (CDP-v2 with 1-based i = 1, 2). Guards against the
    condition reading ``i - j`` or a bound other than ``N - 1``."""
    expected = {0: [[0, 0], [0, 0]], 1: [[0, 1], [1, 1]]}
    assert _versions(assign_versions(_gpipe(2, 2, 2), "cdp_v2")) == expected


# PipeDream's 1F1B, two stages, two micro-batches, three steps. Stage 0 (worker 0) runs two forwards
# ahead; each worker updates its stage after the step's second backward. Stash: a forward takes the
# number of updates its worker has done so far, its backward the same. Worker 0's third forward
# (0F0@1) still precedes the first update: version 0; 0F1@1 follows it: version 1; and so on.
PIPEDREAM_STASH = [
    "0F0v0 0F1v0 0B0v0 0F0@1v0 0B1v0 0UPDATE 0F1@1v1 0B0@1v0 0F0@2v1 0B1@1v1 0UPDATE@1 0F1@2v2 0B0@2v1 0B1@2v2 "
    "0UPDATE@2",
    "1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE 1F0@1v1 1B0@1v1 1F1@1v1 1B1@1v1 1UPDATE@1 1F0@2v2 1B0@2v2 1F1@2v2 1B1@2v2 "
    "1UPDATE@2",
]
# Vertical sync: stage 1 takes stage 0's versions micro-batch by micro-batch (1F0@1 -> 0, 1F1@1 -> 1,
# 1F0@2 -> 1, 1F1@2 -> 2), even though worker 1 already has newer weights.
PIPEDREAM_VERTICAL = [
    PIPEDREAM_STASH[0],
    "1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE 1F0@1v0 1B0@1v0 1F1@1v1 1B1@1v1 1UPDATE@1 1F0@2v1 1B0@2v1 1F1@2v2 1B1@2v2 "
    "1UPDATE@2",
]


@pytest.mark.parametrize(("rule", "orders"), [("stash", PIPEDREAM_STASH), ("vertical", PIPEDREAM_VERTICAL)])
def test_pipedream_stash_and_vertical_by_hand(rule: str, orders: list[str]) -> None:
    """Two-stage PipeDream 1F1B over three steps, versions worked out by hand. Guards against stashing
    reading the wrong count (per worker instead of per stage, after instead of before), backwards not
    reusing their forward's version, and vertical sync following another stage than the first."""
    expected = hand_schedule(orders, ((0,), (1,)), 2, 2, 3)
    versioned = assign_versions(_strip(expected), rule)
    assert versioned == expected.with_orders(expected.orders, rule=rule)
    validate(versioned)


# One worker holding both stages, one micro-batch, two steps. Stage 1's update of step 0 happens
# before stage 0's second forward; stage 0's update only after it. Stash: 0F0@1 sees stage 0's
# zero updates (version 0) although the worker has already done one update (of stage 1); 1F0@1 sees
# stage 1's one update (version 1). Vertical: 1F0@1 takes 0F0@1's version, 0.
SHARED_STASH = "0F0v0 1F0v0 1B0v0 1UPDATE 0F0@1v0 0B0v0 0UPDATE 1F0@1v1 1B0@1v1 1UPDATE@1 0B0@1v0 0UPDATE@1"
SHARED_VERTICAL = "0F0v0 1F0v0 1B0v0 1UPDATE 0F0@1v0 0B0v0 0UPDATE 1F0@1v0 1B0@1v0 1UPDATE@1 0B0@1v0 0UPDATE@1"


@pytest.mark.parametrize("rule", ["stash", "vertical"])
@pytest.mark.parametrize("split", [False, True])
def test_stash_and_vertical_on_a_flushing_order_are_sync(rule: str, split: bool) -> None:
    """With a flush after every step, each forward of step ``t`` runs after its stage's ``t`` updates
    and before the next: stashing and vertical sync both give ``θ_t``, the sync table (where CDP-v2
    would give stage 0's first micro-batches ``θ_{t-1}``). Guards against stash or vertical falling
    through to a formula rule."""
    versioned = assign_versions(_gpipe(3, 3, 3, split), rule)
    assert versioned.rule == rule
    assert _versions(versioned) == SYNC


@pytest.mark.parametrize(("rule", "order"), [("stash", SHARED_STASH), ("vertical", SHARED_VERTICAL)])
def test_stash_counts_updates_per_stage_not_per_worker(rule: str, order: str) -> None:
    """A worker with two stages: each stage's forwards see that stage's updates only. Guards against
    stashing counting every update of the worker, and vertical sync reading stage 1's own count."""
    expected = hand_schedule([order], ((0,), (0,)), 2, 1, 2)
    assert assign_versions(_strip(expected), rule) == expected.with_orders(expected.orders, rule=rule)
    validate(expected)


def test_stash_refuses_forwards_on_a_worker_that_does_not_own_the_stage() -> None:
    """FSDP-style: worker 0 runs stage 1's forward but only worker 1 holds stage 1's weights, so
    there is no local version to stash. Guards against the refusal losing its explanation."""
    schedule = hand_schedule(["0F0 1F0 1B0 0B0 0UPDATE", "1UPDATE"], ((0,), (1,)), 2, 1, 1)
    for rule in ("stash", "vertical"):
        with pytest.raises(
            PlanningError,
            match=r"^hand: weight stashing needs each stage's forwards on a worker that owns its weights; 1F0 runs on "
            r"worker 0$",
        ):
            assign_versions(schedule, rule)


@pytest.mark.parametrize("rule", ["sync", "2bw", "cdp_v1", "cdp_v2"])
def test_formula_rules_do_not_need_owners_for_forwards(rule: str) -> None:
    """The same FSDP-style schedule under a formula rule gets its versions (all 0 in one step). Guards
    against computing the stash (and its ownership refusal) for rules that do not use it."""
    schedule = hand_schedule(["0F0 1F0 1B0 0B0 0UPDATE", "1UPDATE"], ((0,), (1,)), 2, 1, 1)
    versioned = assign_versions(schedule, rule)
    assert [a.version for a in versioned.orders[0] if a.kind in COMPUTE] == [0, 0, 0, 0]
    validate(versioned)


def test_unknown_rule_is_refused_with_the_choices() -> None:
    """An unknown rule names itself and every known one. Guards against an unknown rule silently
    falling through to a formula."""
    with pytest.raises(
        PlanningError, match=r"^unknown update rule 'Sync'; choose one of sync, stash, vertical, 2bw, cdp_v1, cdp_v2$"
    ):
        assign_versions(_gpipe(2, 2, 1), "Sync")


_kinds = st.sampled_from([Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE, Kind.SEND_F, Kind.RECV_B, Kind.FETCH])


@st.composite
def _orders(draw) -> tuple[int, int, int, list[list[Action]]]:
    stages, microbatches, steps = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    action = st.builds(
        Action,
        _kinds,
        st.integers(0, stages - 1),
        st.integers(0, microbatches - 1),
        st.integers(0, steps - 1),
        st.none() | st.integers(0, 5),
        st.none() | st.integers(0, 3),
    )
    return stages, microbatches, steps, draw(st.lists(st.lists(action, max_size=8), min_size=1, max_size=3))


@settings(max_examples=60, deadline=None)
@given(drawn=_orders(), rule=st.sampled_from(["sync", "2bw", "cdp_v1", "cdp_v2"]))
def test_only_compute_versions_change(drawn, rule: str) -> None:
    """Property: ``assign_versions`` keeps every action's kind, stage, micro-batch, step and peer and
    every non-compute action as it was, replaces compute versions by the rule's (between ``t - 1``
    and ``t``, never below 0) and records the rule. Guards against fields shuffled or dropped when the
    action is rebuilt, versions given to UPDATE or transfers, and the rule not recorded."""
    stages, microbatches, steps, orders = drawn
    schedule = Schedule("drawn", stages, microbatches, steps, orders, tuple((0,) for _ in range(stages)), rule="sync")
    versioned = assign_versions(schedule, rule)
    assert versioned.rule == rule and versioned.owners == schedule.owners
    assert [len(order) for order in versioned.orders] == [len(order) for order in schedule.orders]
    for before, after in zip(
        (a for o in schedule.orders for a in o), (a for o in versioned.orders for a in o), strict=True
    ):
        if before.kind in COMPUTE:
            assert (after.kind, after.stage, after.microbatch, after.step, after.peer) == (
                before.kind,
                before.stage,
                before.microbatch,
                before.step,
                before.peer,
            )
            assert max(before.step - 1, 0) <= after.version <= before.step
        else:
            assert after == before


def test_every_rule_is_known() -> None:
    """The rules the module documents are the ones it accepts. Guards against a rule dropped from
    ``RULES`` (it would be refused as unknown)."""
    assert RULES == ("sync", "stash", "vertical", "2bw", "cdp_v1", "cdp_v2")
    for rule in RULES:
        assert assign_versions(_gpipe(2, 2, 2), rule).rule == rule

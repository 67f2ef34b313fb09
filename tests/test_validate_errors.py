"""Every way :func:`lightning_pipe.schedule.validate` refuses a schedule, each on a hand-made broken
schedule, with the message pointing at the worker, the position and what is wrong; and the boundary
cases (index 0, the last index, version == step) that must pass."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import Action, Kind, Schedule, make_schedule, validate
from lightning_pipe.schedule.graph import Graph
from lightning_pipe.schedule.lower import with_transfers
from tests.reference import hand_action, hand_schedule


def _tokens(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, order)) for order in schedule.orders]


def _refused(schedule: Schedule, message: str) -> None:
    """``validate`` raises a PlanningError whose message contains ``message`` verbatim."""
    with pytest.raises(PlanningError, match=re.escape(message)):
        validate(schedule)


def _replace_at(schedule: Schedule, worker: int, position: int, action: Action) -> Schedule:
    orders = [list(order) for order in schedule.orders]
    orders[worker][position] = action
    return schedule.with_orders(orders)


# 1F1B, 2 stages, 2 micro-batches, 2 steps (sync versions):
# worker 0: 0F0v0 0F1v0 0B0v0 0B1v0 0UPDATE 0F0@1v1 0F1@1v1 0B0@1v1 0B1@1v1 0UPDATE@1
# worker 1: 1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE 1F0@1v1 1B0@1v1 1F1@1v1 1B1@1v1 1UPDATE@1
ONE_F_ONE_B = [
    "0F0v0 0F1v0 0B0v0 0B1v0 0UPDATE 0F0@1v1 0F1@1v1 0B0@1v1 0B1@1v1 0UPDATE@1",
    "1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE 1F0@1v1 1B0@1v1 1F1@1v1 1B1@1v1 1UPDATE@1",
]


def _base() -> Schedule:
    return hand_schedule(ONE_F_ONE_B, ((0,), (1,)), stages=2, microbatches=2, steps=2)


def _all_nodes(schedule: Schedule) -> list[tuple[int, int]]:
    return [(worker, position) for worker, position, _ in schedule.actions()]


def test_the_hand_made_base_is_what_make_schedule_builds_and_is_valid() -> None:
    """The base every broken schedule below starts from is a valid schedule, so each refusal is due
    to the one edit. Guards the tests themselves (and a validator refusing valid 1F1B)."""
    assert _tokens(make_schedule("1f1b", 2, 2, 2)) == ONE_F_ONE_B
    graph = validate(_base())
    assert isinstance(graph, Graph) and sorted(graph.order()) == sorted(_all_nodes(_base()))


@pytest.mark.parametrize(
    ("family", "stages", "microbatches", "steps", "options"),
    [
        ("gpipe", 1, 1, 1, {}),  # one worker
        ("1f1b", 2, 3, 3, {}),  # versions 1 and 2, updates of later steps after their use
        ("zb_h1", 2, 2, 2, {}),  # split backwards I + W
        ("fsdp", 2, 2, 2, {}),  # compute on workers that do not own the stage
        ("2bw", 2, 2, 3, {}),  # no flush: a step runs before the previous update
        ("1f1b_rr", 2, 2, 2, {"stage_replicas": [2, 1]}),  # replicated stage, several owners
    ],
)
def test_valid_schedules_return_a_graph_whose_order_covers_every_action(
    family: str, stages: int, microbatches: int, steps: int, options: dict
) -> None:
    """A valid schedule passes and its graph orders each action exactly once. Guards against a check
    made too strict (off by one at index 0, at version == step, for a lone worker, for a worker
    computing a stage it does not own) and against ``validate`` not returning the graph."""
    schedule = make_schedule(family, stages, microbatches, steps, **options)
    graph = validate(schedule)
    assert isinstance(graph, Graph) and graph.schedule is schedule
    order = graph.order()
    assert len(order) == len(set(order)) and sorted(order) == sorted(_all_nodes(schedule))


def test_a_helper_worker_may_compute_with_a_version_its_owner_produced() -> None:
    """Worker 1 owns nothing and computes step 1 at version 1 from its very first position; the
    UPDATE that makes version 1 is on worker 0. Guards against the "version used before this
    worker's UPDATE" check firing when the producing update is on another worker (the graph orders
    those), e.g. a default of 0 or 1 instead of "no such update here"."""
    schedule = hand_schedule(
        ["0F0v0 0B0v0 0UPDATE 0UPDATE@1", "0F0@1v1 0B0@1v1"], ((0,),), stages=1, microbatches=1, steps=2
    )
    assert sorted(validate(schedule).order()) == sorted(_all_nodes(schedule))


def test_a_gradient_sent_after_the_update_is_fine() -> None:
    """Lowered GPipe with worker 1's SEND_B moved after its UPDATE: sending the input gradient after
    the weights changed is harmless. Guards against the "gradient after its update" check applying
    to every action of the stage and step rather than to the weight gradients (B and W)."""
    lowered = with_transfers(make_schedule("gpipe", 2, 1))
    assert _tokens(lowered)[1] == "1RECV_F0 1F0v0 1B0v0 1SEND_B0 1UPDATE"
    orders = [list(order) for order in lowered.orders]
    orders[1][3], orders[1][4] = orders[1][4], orders[1][3]
    moved = lowered.with_orders(orders)
    assert sorted(validate(moved).order()) == sorted(_all_nodes(moved))


# -- nothing to run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("orders", [[], [""], ["", ""]])
def test_no_workers_or_no_actions(orders: list[str]) -> None:
    """No workers at all, or workers with empty orders. Guards against an empty schedule slipping
    through the first check (it would pass or fail later with a misleading message)."""
    _refused(hand_schedule(orders, ((0,),), 1, 1, 1), "hand: the schedule has no workers or no actions")


# -- owners and ranges ------------------------------------------------------------------------------


def test_owner_lists_must_match_the_stages() -> None:
    """One owner list for two stages. Guards against the count check being dropped or inverted."""
    _refused(replace(_base(), owners=((0,),)), "hand: 1 owner lists for 2 stages")
    _refused(replace(_base(), owners=((0,), (1,), (1,))), "hand: 3 owner lists for 2 stages")


@pytest.mark.parametrize(
    ("owners", "message"),
    [
        (((0,), ()), "hand: stage 1 has invalid owners ()"),
        (((0,), (2,)), "hand: stage 1 has invalid owners (2,)"),  # == workers: one past the last
        (((-1,), (1,)), "hand: stage 0 has invalid owners (-1,)"),
        (((0, 5), (1,)), "hand: stage 0 has invalid owners (0, 5)"),
    ],
)
def test_owners_must_be_workers(owners: tuple, message: str) -> None:
    """A stage with no owner, or an owner that is not a worker (negative, == workers). Guards
    against ``<`` turned into ``<=``, ``or`` into ``and``, and the check dropped."""
    _refused(replace(_base(), owners=owners), message)


@pytest.mark.parametrize(
    ("worker", "position", "action", "shown"),
    [
        (0, 0, Action(Kind.F, 2, 0, 0, 0), "2F0v0"),  # stage == stages
        (1, 0, Action(Kind.F, -1, 0, 0, 0), "-1F0v0"),
        (0, 2, Action(Kind.B, 0, 0, 2, 0), "0B0@2v0"),  # step == steps
        (0, 2, Action(Kind.B, 0, 0, -1, 0), "0B0@-1v0"),
        (0, 1, Action(Kind.F, 0, 2, 0, 0), "0F2v0"),  # micro-batch == micro-batches
        (1, 3, Action(Kind.B, 1, -1, 0, 0), "1B-1v0"),
        (0, 0, Action(Kind.F, 0, None, 0, 0), "0Fv0"),  # compute without a micro-batch
        (1, 9, Action(Kind.UPDATE, 1, None, 2), "1UPDATE@2"),  # update of a step beyond the last
        (1, 4, Action(Kind.UPDATE, 2, None, 0), "2UPDATE"),  # update of a stage beyond the last
    ],
)
def test_out_of_range_actions_are_pointed_at(worker: int, position: int, action: Action, shown: str) -> None:
    """An action whose stage, step or micro-batch is outside the schedule (one past the end or
    negative), or a compute with no micro-batch: the error names the worker, the position, the action
    and the sizes. Guards against each bound being off by one, dropped, or joined with ``and``."""
    broken = _replace_at(_base(), worker, position, action)
    _refused(
        broken,
        f"hand: worker {worker} position {position} ({shown}) is outside 2 stages, 2 micro-batches, 2 steps",
    )


def test_in_range_boundaries_pass_the_range_check() -> None:
    """Stage, step and micro-batch at 0 and at their last index, and updates without a micro-batch,
    are in range: the 1F1B base has all of them. Guards against ``0 <=`` turned into ``0 <`` and
    against range checks applied to the micro-batch of an UPDATE."""
    keys = {(a.stage, a.microbatch, a.step) for _, _, a in _base().actions()}
    assert {(0, 0, 0), (1, 1, 1), (0, None, 0), (1, None, 1)} <= keys
    validate(_base())


# -- missing or repeated work -----------------------------------------------------------------------


def _drop(schedule: Schedule, worker: int, position: int) -> Schedule:
    orders = [list(order) for order in schedule.orders]
    del orders[worker][position]
    return schedule.with_orders(orders)


def _insert(schedule: Schedule, worker: int, position: int, action: Action) -> Schedule:
    orders = [list(order) for order in schedule.orders]
    orders[worker].insert(position, action)
    return schedule.with_orders(orders)


NEEDS = "it needs exactly one F and either one B or one I and one W"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: _drop(s, 1, 0), "stage 1, micro-batch 0, step 0 has 0 F, 1 B, 0 I and 0 W"),
        (lambda s: _drop(s, 0, 8), "stage 0, micro-batch 1, step 1 has 1 F, 0 B, 0 I and 0 W"),
        (lambda s: _insert(s, 1, 1, hand_action("1F0v0")), "stage 1, micro-batch 0, step 0 has 2 F, 1 B"),
        (lambda s: _insert(s, 1, 2, hand_action("1B0v0")), "stage 1, micro-batch 0, step 0 has 1 F, 2 B, 0 I"),
        (
            lambda s: _insert(_insert(s, 0, 3, hand_action("0I1v0")), 0, 4, hand_action("0W1v0")),
            "stage 0, micro-batch 1, step 0 has 1 F, 1 B, 1 I and 1 W",
        ),
        (lambda s: _insert(s, 0, 3, hand_action("0W1v0")), "stage 0, micro-batch 1, step 0 has 1 F, 1 B, 0 I and 1 W"),
        (lambda s: _insert(s, 0, 3, hand_action("0I1v0")), "stage 0, micro-batch 1, step 0 has 1 F, 1 B, 1 I and 0 W"),
    ],
)
def test_missing_or_repeated_work_is_named(edit, message: str) -> None:
    """A forward or backward missing, repeated, or a full backward alongside a split one. Guards
    against the count checks being joined with ``and`` (a missing backward alone must be caught) and
    against accepting other count combinations."""
    _refused(edit(_base()), f"hand: {message}")
    _refused(edit(_base()), NEEDS)


ZB = [
    "0F0v0 0F1v0 0I0v0 0W0v0 0I1v0 0W1v0 0UPDATE",
    "1F0v0 1I0v0 1W0v0 1F1v0 1I1v0 1W1v0 1UPDATE",
]


@pytest.mark.parametrize(
    ("worker", "position", "message"),
    [
        (1, 2, "stage 1, micro-batch 0, step 0 has 1 F, 0 B, 1 I and 0 W"),  # I without W
        (1, 1, "stage 1, micro-batch 0, step 0 has 1 F, 0 B, 0 I and 1 W"),  # W without I
        (0, 0, "stage 0, micro-batch 0, step 0 has 0 F, 0 B, 1 I and 1 W"),  # split backward, no forward
    ],
)
def test_split_backward_needs_both_halves(worker: int, position: int, message: str) -> None:
    """Zero bubble with one half of a split backward (or the forward) missing. Guards against
    accepting a lone ``I`` or ``W``."""
    zero_bubble = hand_schedule(ZB, ((0,), (1,)), 2, 2, 1)
    assert _tokens(make_schedule("zb_h1", 2, 2)) == ZB
    validate(zero_bubble)
    _refused(_drop(zero_bubble, worker, position), f"hand: {message}")


# -- updates ----------------------------------------------------------------------------------------


def test_update_on_a_worker_that_does_not_own_the_stage() -> None:
    """Worker 1 updates stage 0 (owned by worker 0): the error names worker, position, stage and the
    owners. Guards against the ownership check being dropped or inverted."""
    broken = _insert(_base(), 1, 4, hand_action("0UPDATE"))
    _refused(broken, "hand: worker 1 position 4 (0UPDATE): worker 1 does not own stage 0 (owners [0])")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: _drop(s, 0, 9), "hand: worker 0 owns stage 0 but updates it 0 times in step 1"),
        (lambda s: _drop(s, 1, 4), "hand: worker 1 owns stage 1 but updates it 0 times in step 0"),
        (lambda s: _insert(s, 0, 5, hand_action("0UPDATE")), "worker 0 owns stage 0 but updates it 2 times in step 0"),
        (lambda s: s.with_orders(s.orders, owners=((0,), (0, 1))), "worker 0 owns stage 1 but updates it 0 times"),
    ],
)
def test_each_owner_updates_each_stage_once_per_step(edit, message: str) -> None:
    """A missing update, an update applied twice, an owner (of a replicated stage) that never
    updates. Guards against counting updates wrongly (``= 1`` instead of ``+= 1``) or not per
    (worker, stage, step)."""
    _refused(edit(_base()), message)


@pytest.mark.parametrize(
    ("schedule", "worker", "source", "target", "message"),
    [
        # worker 0's UPDATE of step 0 moved before its backward of micro-batch 1
        (_base, 0, 4, 3, "hand: worker 0 position 4 (0B1v0): its gradient comes after UPDATE of stage 0 step 0 "),
        # zero bubble: the UPDATE moved before the last weight-gradient half W
        (
            lambda: hand_schedule(ZB, ((0,), (1,)), 2, 2, 1),
            1,
            6,
            5,
            "hand: worker 1 position 6 (1W1v0): its gradient comes after UPDATE of stage 1 step 0 at position 5",
        ),
    ],
)
def test_a_gradient_after_its_update_is_refused(schedule, worker: int, source: int, target: int, message: str) -> None:
    """A backward (or W) of a step after this worker's UPDATE of that step: the gradient would be
    lost. Guards against the check being dropped, applied to the wrong kinds, or reading the wrong
    update (the graph would then report a deadlock, not the cause)."""
    base = schedule()
    orders = [list(order) for order in base.orders]
    orders[worker].insert(target, orders[worker].pop(source))
    _refused(base.with_orders(orders), message)


# -- versions ---------------------------------------------------------------------------------------


def test_a_version_used_before_this_workers_update_makes_it() -> None:
    """Stage 0's step-1 forward at version 1 moved before worker 0's UPDATE of step 0 (2BW-like, the
    forward may run before the update, but then with version 0). Guards against the check being
    dropped, looking up the wrong update (step v or v - 2) or another worker's."""
    base = _base()
    orders = [list(order) for order in base.orders]
    orders[0].insert(4, orders[0].pop(5))  # 0F0@1v1 before 0UPDATE
    _refused(
        base.with_orders(orders),
        "hand: worker 0 position 4 (0F0@1v1) uses version 1 before this worker's UPDATE of step 0 produces it",
    )
    # the same move at version 0 is fine: it is 2BW's delayed weights
    orders[0][4] = hand_action("0F0@1v0")
    orders[0][7] = hand_action("0B0@1v0")
    validate(base.with_orders(orders))


def test_a_version_two_steps_ahead_names_the_update_that_makes_it() -> None:
    """Three steps; worker 1's step-2 forward at version 2 moved before its UPDATE of step 1. Guards
    against reporting (or checking) the update of the wrong step."""
    three = make_schedule("1f1b", 2, 1, 3)
    assert _tokens(three)[1] == "1F0v0 1B0v0 1UPDATE 1F0@1v1 1B0@1v1 1UPDATE@1 1F0@2v2 1B0@2v2 1UPDATE@2"
    orders = [list(order) for order in three.orders]
    orders[1].insert(5, orders[1].pop(6))
    _refused(
        three.with_orders(orders),
        "1f1b: worker 1 position 5 (1F0@2v2) uses version 2 before this worker's UPDATE of step 1 produces it",
    )


def test_a_compute_without_a_version() -> None:
    """A backward with no version. Guards against unversioned schedules reaching the simulator."""
    broken = _replace_at(_base(), 1, 3, hand_action("1B1"))
    _refused(broken, "hand: worker 1 position 3 (1B1) has no weight version assigned")


def test_a_version_beyond_its_step() -> None:
    """Step 0 using version 1, which only step 0's update makes. Guards against ``>`` turned into
    ``>=`` (version == step is the sync rule and must pass: the base has it) and the check dropped."""
    broken = _replace_at(_base(), 1, 0, hand_action("1F0v1"))
    _refused(broken, "hand: worker 1 position 0 (1F0v1) uses version 1, but step 0 can see at most version 0")
    broken = _replace_at(_base(), 0, 8, hand_action("0B1@1v2"))
    _refused(broken, "hand: worker 0 position 8 (0B1@1v2) uses version 2, but step 1 can see at most version 1")


def test_a_backward_at_another_version_than_its_forward() -> None:
    """Step 1's backward of micro-batch 0 at version 0 while its forward used version 1 (both are
    allowed for step 1 on their own). Guards against the forward's version not being recorded or
    not compared with its backward's."""
    broken = _replace_at(_base(), 0, 7, hand_action("0B0@1v0"))
    _refused(
        broken,
        "hand: worker 0 position 7 (0B0@1v0) uses version 0 but its forward used 1: a micro-batch's gradient must "
        "be taken at the weights of its forward",
    )


def test_split_backward_halves_use_the_forwards_version() -> None:
    """Two steps of zero bubble with an I or a W of step 1 at version 0 while the forward used 1.
    Guards against checking only full backwards."""
    zb = make_schedule("zb_h1", 2, 1, 2)
    assert _tokens(zb)[0] == "0F0v0 0I0v0 0W0v0 0UPDATE 0F0@1v1 0I0@1v1 0W0@1v1 0UPDATE@1"
    _refused(_replace_at(zb, 0, 5, hand_action("0I0@1v0")), "zb_h1: worker 0 position 5 (0I0@1v0) uses version 0 but")
    _refused(
        _replace_at(zb, 0, 6, hand_action("0W0@1v0")), "zb_h1: worker 0 position 6 (0W0@1v0) uses version 0 but its"
    )


def test_versions_are_checked_before_updates() -> None:
    """A forward of step 0 at version 1 placed before the update of step 0 breaks two rules; the
    cause is the impossible version, so that is what is reported. Guards against the checks being
    reordered into a misleading "used before the update" message."""
    broken = _replace_at(_base(), 0, 0, hand_action("0F0v1"))
    _refused(broken, "uses version 1, but step 0 can see at most version 0")


# -- deadlock ---------------------------------------------------------------------------------------


def test_a_cycle_between_workers_is_a_deadlock() -> None:
    """Worker 1 runs micro-batch 1 first, while worker 0 waits for micro-batch 0's gradient before
    running micro-batch 1's forward. Every action is present and versioned, only the order is
    impossible. Guards against the graph's cycle check not being run by ``validate``."""
    broken = hand_schedule(
        ["0F0v0 0B0v0 0F1v0 0B1v0 0UPDATE", "1F1v0 1B1v0 1F0v0 1B0v0 1UPDATE"], ((0,), (1,)), 2, 2, 1
    )
    _refused(broken, "hand: the schedule deadlocks: worker 0 at position 1 (0B0v0) waits for 1B0v0 on worker 1")

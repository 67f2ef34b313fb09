"""The IR: every family validates on a grid, text round trips, invalid schedules are pointed at."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import FAMILIES, Action, Kind, Schedule, StageCosts, make_schedule, simulate, validate
from lightning_pipe.schedule.versions import assign_versions
from tests.reference import pipedream_stash, pipedream_vertical

GRID = [(p, m, steps) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8) for steps in (1, 2, 3)]


def _options(family: str, stages: int) -> dict:
    return {
        "1f1b_star": {"period": 4.0},
        "kperiodic": {"k": 2},
        "lpp": {"groups": 2, "replicas": 2 if stages % 2 == 0 else 1},
        "fslpp": {"groups": 2, "replicas": 2 if stages % 2 == 0 else 1},
    }.get(family, {})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_validates_on_the_grid_or_says_why_not(family: str) -> None:
    for stages, microbatches, steps in GRID:
        try:
            schedule = make_schedule(family, stages, microbatches, steps, **_options(family, stages))
        except PlanningError as error:
            message = str(error)
            if family in ("interleaved", "looped_bfs"):
                assert stages % 2 and "multiple of virtual_stages" in message
            else:
                assert family in ("2bw", "cdp") and microbatches < stages - 1 and "P - 1" in message
            continue
        assert schedule.family == family and schedule.stages == stages
        sim = simulate(schedule, StageCosts.uniform(stages))
        assert sim.makespan > 0 and 0 <= sim.bubble_fraction < 1


def test_json_round_trip_keeps_everything() -> None:
    for family in ("interleaved", "cdp", "zb_h1", "fslpp"):
        schedule = make_schedule(family, 4, 4, 2, **_options(family, 4))
        again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
        assert again == schedule


def test_a_stage_speaks_through_its_first_owner() -> None:
    """``first_owner`` and ``first_owners``: the first of each stage's owners (LPP holds every stage on
    two workers)."""
    schedule = make_schedule("lpp", 4, 4, 1, groups=2, replicas=2)
    assert schedule.owners == ((0, 2), (1, 3), (0, 2), (1, 3))
    assert schedule.first_owners == (0, 1, 0, 1) == tuple(schedule.first_owner(s) for s in range(4))


def test_torch_action_strings_round_trip() -> None:
    schedule = make_schedule("1f1b", 3, 4)
    text = schedule.to_torch()
    assert text[0][:4] == ["0F0", "0F1", "0F2", "0B0"]
    assert text[2][:2] == ["2F0", "2B0"]
    imported = Schedule.from_torch(text, family="1f1b")
    assert assign_versions(imported, "sync") == make_schedule("1f1b", 3, 4)
    zb = make_schedule("zb_h1", 2, 2)
    assert {a[1] for a in zb.to_torch()[0]} == {"F", "I", "W"}
    assert Action.from_torch("1W3") == Action(Kind.W, 1, 3)
    assert Action.from_torch("0SEND_F1") == Action(Kind.SEND_F, 0, 1)
    with pytest.raises(PlanningError, match=r"not a torch\.distributed\.pipelining action"):
        Action.from_torch("F0")
    with pytest.raises(PlanningError, match="cover one step"):
        make_schedule("1f1b", 2, 2, 2).to_torch()


def test_from_torch_accepts_idle_slots_and_rank_dict() -> None:
    imported = Schedule.from_torch({0: ["0F0", None, "0B0"], 1: [None, "1F0", "1B0"]})
    validate(assign_versions(imported, "sync"))


def _edit(schedule: Schedule, worker: int, edit) -> Schedule:
    orders = [list(order) for order in schedule.orders]
    edit(orders[worker])
    return schedule.with_orders(orders)


def test_missing_and_repeated_work_is_named() -> None:
    base = make_schedule("1f1b", 2, 2)
    dropped = _edit(base, 1, lambda order: order.pop(0))
    with pytest.raises(PlanningError, match=r"stage 1, micro-batch 0, step 0 has 0 F"):
        validate(dropped)
    repeated = _edit(base, 0, lambda order: order.insert(0, order[0]))
    with pytest.raises(PlanningError, match="has 2 F"):
        validate(repeated)


def test_deadlock_points_at_the_waiting_workers() -> None:
    base = make_schedule("gpipe", 2, 2)
    # worker 1 runs its backward of micro-batch 0 before the forward it needs
    swapped = _edit(base, 1, lambda order: order.insert(0, order.pop(2)))
    with pytest.raises(PlanningError, match=r"deadlocks: .*worker 1 at position 0 \(1B0v0\)"):
        validate(swapped)


def test_update_and_version_errors() -> None:
    base = make_schedule("1f1b", 2, 2, 2)
    early = _edit(base, 0, lambda order: order.insert(1, order.pop(order.index(Action(Kind.UPDATE, 0, None, 0)))))
    with pytest.raises(PlanningError, match="gradient comes after UPDATE"):
        validate(early)
    orders = [list(o) for o in base.orders]
    index = next(i for i, a in enumerate(orders[0]) if a.kind is Kind.B and a.step == 1)
    a = orders[0][index]
    orders[0][index] = Action(a.kind, a.stage, a.microbatch, a.step, a.version - 1)
    with pytest.raises(PlanningError, match="its forward used"):
        validate(base.with_orders(orders))
    unversioned = base.with_orders([[Action(a.kind, a.stage, a.microbatch, a.step) for a in o] for o in base.orders])
    with pytest.raises(PlanningError, match="no weight version assigned"):
        validate(unversioned)
    with pytest.raises(PlanningError, match="worker 1 does not own stage 0"):
        validate(_edit(base, 1, lambda order: order.append(Action(Kind.UPDATE, 0, None, 0))))


def test_explicit_transfers_must_match() -> None:
    base = make_schedule("gpipe", 2, 1)
    orders = [list(o) for o in base.orders]
    orders[1].insert(0, Action(Kind.RECV_F, 1, 0, 0, peer=0))
    with pytest.raises(PlanningError, match="no matching SEND_F on worker 0"):
        validate(base.with_orders(orders))
    orders[0].insert(1, Action(Kind.SEND_F, 0, 0, 0, peer=1))
    validate(base.with_orders(orders))


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(PlanningError, match="unknown schedule 'zigzag'"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(PlanningError, match="microbatches must be a whole number >= 1"):
        make_schedule("gpipe", 2, 0)
    with pytest.raises(PlanningError, match="needs k"):
        make_schedule("kperiodic", 2, 2)
    with pytest.raises(PlanningError, match="needs a period"):
        make_schedule("1f1b_star", 2, 2)
    with pytest.raises(PlanningError, match="runs the 'sync' update rule"):
        make_schedule("gpipe", 2, 2, rule="2bw")
    with pytest.raises(PlanningError, match="stages must be a multiple of replicas"):
        make_schedule("lpp", 3, 4, replicas=2)
    with pytest.raises(PlanningError, match="replicated 2 times needs at least 2 micro-batches per step"):
        make_schedule("1f1b_rr", 2, 1, stage_replicas=[2, 1])


def test_transfers_cost_time_and_can_block_the_sender() -> None:
    schedule = make_schedule("gpipe", 2, 1)
    base = dict(forward=[1.0, 1.0], backward=[2.0, 2.0], activation_bytes=[10.0, 10.0])
    free = simulate(schedule, StageCosts(**base))
    slow = simulate(schedule, StageCosts(**base, bandwidth=5.0))
    assert free.makespan == 6.0 and slow.makespan == 6.0 + 2 * 2.0
    assert slow.received_bytes["activation"] == [0.0, 10.0] and slow.received_bytes["gradient"] == [10.0, 0.0]
    two = make_schedule("gpipe", 2, 2)
    overlapped = simulate(two, StageCosts(**base, bandwidth=5.0))
    blocking = simulate(two, StageCosts(**base, bandwidth=5.0, overlap=False))
    assert blocking.makespan > overlapped.makespan
    late = simulate(schedule, StageCosts(**base, bandwidth=5.0, latency=0.25))
    assert late.makespan == 6.0 + 2 * (2.0 + 0.25)  # one activation, one gradient message
    with pytest.raises(PlanningError, match="latency must be"):
        StageCosts(**base, latency=-1.0)
    with pytest.raises(PlanningError, match="overhead must be"):
        StageCosts(**base, overhead=float("inf"))
    for bad in (-1.0, float("nan")):
        with pytest.raises(PlanningError, match="forward must hold finite numbers >= 0"):
            StageCosts(forward=[1.0, bad], backward=[1.0, 1.0])


def test_message_overhead_is_charged_to_sender_and_receiver() -> None:
    # gpipe, 2 stages, 1 micro-batch: F0 sends (o), F1 receives (o), B1 sends (o), B0 receives (o); all
    # four on the critical path
    schedule = make_schedule("gpipe", 2, 1)
    base = dict(forward=[1.0, 1.0], backward=[2.0, 2.0])
    loaded = simulate(schedule, StageCosts(**base, overhead=0.5, latency=0.25))
    assert loaded.makespan == 6.0 + 4 * 0.5 + 2 * 0.25
    assert loaded.busy == [3.0 + 2 * 0.5, 3.0 + 2 * 0.5]


@given(
    family=st.sampled_from(["gpipe", "1f1b", "2bw", "zb_h1"]),
    stages=st.integers(2, 4),
    microbatches=st.integers(3, 5),
    overhead=st.floats(0.01, 1.0),
)
@settings(max_examples=30, deadline=None)
def test_overhead_adds_to_each_worker_once_per_message(
    family: str, stages: int, microbatches: int, overhead: float
) -> None:
    """Property: a worker's busy time grows by the overhead times the messages it sends and receives."""
    schedule = make_schedule(family, stages, microbatches, 2)
    costs = StageCosts.uniform(stages)
    plain, loaded = simulate(schedule, costs), simulate(schedule, replace(costs, overhead=overhead))
    received = [sum(loaded.transfers[c][w] for c in loaded.transfers) for w in range(schedule.workers)]
    for w in range(schedule.workers):
        messages = (loaded.busy[w] - plain.busy[w]) / overhead  # those it received and those it sent
        assert messages == pytest.approx(round(messages)) and round(messages) >= received[w]
    assert sum(loaded.busy) - sum(plain.busy) == pytest.approx(2 * sum(received) * overhead)
    assert loaded.makespan >= plain.makespan


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spelled_out_transfers_validate_and_simulate_the_same(family: str) -> None:
    from lightning_pipe.schedule.lower import with_transfers

    schedule = make_schedule(family, 4, 4, 2, **_options(family, 4))
    lowered = with_transfers(schedule)
    validate(lowered)
    costs = StageCosts.uniform(4, activation_bytes=[1.0] * 4, weight_bytes=[1.0] * 4, bandwidth=2.0)
    spelled, implied = simulate(lowered, costs), simulate(schedule, costs)
    assert spelled.makespan == implied.makespan
    # each message once: on its RECV, not again on the compute that uses it
    assert (spelled.sent_bytes, spelled.received_bytes, spelled.transfers) == (
        implied.sent_bytes,
        implied.received_bytes,
        implied.transfers,
    )
    kinds = [a.kind for order in lowered.orders for a in order]
    assert kinds.count(Kind.SEND_F) == kinds.count(Kind.RECV_F)
    assert kinds.count(Kind.SEND_B) == kinds.count(Kind.RECV_B)
    assert (Kind.FETCH in kinds) == (family in ("fsdp", "fslpp"))


def test_lowered_1f1b_matches_torch_conventions() -> None:
    from lightning_pipe.schedule.lower import with_transfers

    orders = with_transfers(make_schedule("1f1b", 2, 2)).to_torch()
    assert orders[0] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert orders[1] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(["pipedream", "2bw"]),
    rule=st.sampled_from(["stash", "vertical"]),
    stages=st.integers(2, 5),
    microbatches=st.integers(1, 4),
    slack=st.integers(0, 2),
    steps=st.integers(1, 5),
)
def test_stash_and_vertical_versions_follow_pipedreams_definitions(
    family: str, rule: str, stages: int, microbatches: int, slack: int, steps: int
) -> None:
    """Every forward and backward carries the version PipeDream's definitions give (the in-flight
    counts of its 1F1B order, ``tests/reference.py``), not one read off the schedule itself. Guards
    against vertical sync made to behave like stashing, or stashing reading a newer version."""
    # 2BW runs stashing only, and needs the first stage's warm-up to fit in a step
    assume(family == "pipedream" or (rule == "stash" and microbatches >= (stages - 1) * (1 + slack)))
    rules = {"stash": pipedream_stash, "vertical": pipedream_vertical}
    expected = rules[rule](stages, microbatches, slack)
    schedule = make_schedule(family, stages, microbatches, steps, rule=rule, slack=slack)
    for _, _, action in schedule.actions():
        if action.kind in (Kind.F, Kind.B):
            assert action.version == expected(action.stage, action.microbatch, action.step), action


def _with_version(schedule: Schedule, stage: int, microbatch: int, step: int, version: int) -> Schedule:
    """``schedule`` with the forward and backward of one micro-batch on one stage set to ``version``."""
    return schedule.with_orders(
        [
            [
                replace(a, version=version)
                if a.kind in (Kind.F, Kind.B) and (a.stage, a.microbatch, a.step) == (stage, microbatch, step)
                else a
                for a in order
            ]
            for order in schedule.orders
        ]
    )


def test_versions_that_do_not_exist_yet_and_missing_or_extra_updates_are_refused() -> None:
    """Each check of the validator's version and update rules, with the schedule a plausible bug
    would make. Guards against the "uses a version before it exists" check (and the others) being
    disabled: no generator produces these schedules."""
    late = make_schedule("2bw", 2, 2, 3)
    first = next(a for a in late.orders[0] if a.kind is Kind.F and a.step == 1)
    assert first.version == 0  # runs before stage 0's UPDATE of step 0 (2BW's delayed weights)
    with pytest.raises(PlanningError, match=r"uses version 1 before this worker's UPDATE of step 0 produces it"):
        validate(_with_version(late, 0, first.microbatch, 1, 1))
    flushing = make_schedule("1f1b", 2, 2, 2)
    with pytest.raises(PlanningError, match=r"uses version 1, but step 0 can see at most version 0"):
        validate(_with_version(flushing, 1, 0, 0, 1))
    update = Action(Kind.UPDATE, 0, None, 1)
    twice = _edit(flushing, 0, lambda order: order.append(update))
    with pytest.raises(PlanningError, match=r"worker 0 owns stage 0 but updates it 2 times in step 1"):
        validate(twice)
    never = _edit(flushing, 0, lambda order: order.remove(update))
    with pytest.raises(PlanningError, match=r"worker 0 owns stage 0 but updates it 0 times in step 1"):
        validate(never)

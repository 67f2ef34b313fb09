"""Hand-worked simulations and the simulator's input checking (schedule/simulate.py).

Each timeline below is derived in its docstring from the rules of docs/simulation.md: an action
starts when its worker is free and its inputs have arrived; a message arrives ``latency + bytes /
bandwidth`` after its producer ends; a blocking sender (``overlap=False``) stays busy while it
sends; a worker computing a stage it does not own fetches that stage's weights, starting when its
previous compute started, and frees them when it moves to another stage.
"""

from __future__ import annotations

import math

import pytest

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import Action, Kind, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.simulation import Simulation

KNOWN_KEYS = [
    "accumulate",
    "activation_bytes",
    "backward",
    "bandwidth",
    "contention",
    "forward",
    "input_grad",
    "latency",
    "overhead",
    "overlap",
    "reduce_overlap",
    "saved_bytes",
    "update",
    "weight_bytes",
    "weight_grad",
]


def _times(sim: Simulation) -> dict[tuple[int, str], tuple[float, float]]:
    return {(i.worker, str(i.action)): (i.start, i.end) for i in sim.timeline}


def _gpipe_one_microbatch() -> Simulation:
    """GPipe, 2 stages, 1 micro-batch: worker 0 runs ``F0 B0 U0``, worker 1 ``F1 B1 U1``.

    F = [1, 2], B = [3, 4], update = [0.5, 0.25], activation bytes [8, 4], bandwidth 4, latency 0.5:
    a message of stage 0's output takes 0.5 + 8 / 4 = 2.5.

    - F0: 0 -> 1; its activation reaches worker 1 at 1 + 2.5 = 3.5; F1: 3.5 -> 5.5; B1: 5.5 -> 9.5;
      U1: 9.5 -> 9.75 (its only gradient is local).
    - The gradient (the size of stage 0's output, 8 bytes) reaches worker 0 at 9.5 + 2.5 = 12: B0: 12 -> 15;
      U0: 15 -> 15.5. Makespan 15.5.
    - Busy 1 + 3 + 0.5 = 4.5 and 2 + 4 + 0.25 = 6.25; idle 11 and 9.25; bubble 20.25 / 31.
    - One live activation per stage and worker (saved bytes 16 and 32).
    - Weights: worker 0 holds version 0 from 0 to 15.5 (the update) and version 1 from 15.5 on: the
      free of version 0 comes first at 15.5, so one copy at a time (2 bytes); worker 1 likewise (6 bytes).
    """
    costs = StageCosts(
        forward=[1.0, 2.0],
        backward=[3.0, 4.0],
        update=[0.5, 0.25],
        activation_bytes=[8.0, 4.0],
        saved_bytes=[16.0, 32.0],
        weight_bytes=[2.0, 6.0],
        bandwidth=4.0,
        latency=0.5,
    )
    return simulate(make_schedule("gpipe", 2, 1), costs)


def test_a_hand_worked_gpipe_timeline() -> None:
    """Guards arrival = producer end + latency + bytes / bandwidth, the sizes of activations and
    gradients, update durations, and the busy/idle/bubble arithmetic."""
    sim = _gpipe_one_microbatch()
    assert _times(sim) == {
        (0, "0F0v0"): (0.0, 1.0),
        (0, "0B0v0"): (12.0, 15.0),
        (0, "0UPDATE"): (15.0, 15.5),
        (1, "1F0v0"): (3.5, 5.5),
        (1, "1B0v0"): (5.5, 9.5),
        (1, "1UPDATE"): (9.5, 9.75),
    }
    assert sim.makespan == 15.5 and sim.step_end == [15.5] and sim.steady_step == 15.5
    assert sim.throughput == 1 / 15.5
    assert sim.busy == [4.5, 6.25] and sim.idle == [11.0, 9.25]
    assert sim.bubble_fraction == pytest.approx(20.25 / 31)


def test_a_backward_adding_to_its_steps_gradients_costs_accumulate_more() -> None:
    """One worker, 1F1B over 3 micro-batches and 2 steps (F 1, B 2, accumulate 0.5, update 1): the
    first backward of each step costs 2, the two after it 2.5, zero bubble's split halves likewise
    (its first W 1, the others 1.5). 1F1B: per step 3 + 2 + 2.5 + 2.5 + 1 = 11. Guards the extra on
    the first backward of a step, on the second step's first one, and on none of the halves."""
    costs = StageCosts(forward=[1.0], backward=[2.0], update=[1.0], accumulate=[0.5])
    sim = simulate(make_schedule("1f1b", 1, 3, 2), costs)
    backwards = [i.end - i.start for i in sim.timeline if i.action.kind is Kind.B]
    assert backwards == [2.0, 2.5, 2.5, 2.0, 2.5, 2.5]
    assert sim.makespan == 22.0
    split = simulate(make_schedule("zb_h1", 1, 3, 1), StageCosts([1.0], [2.0], input_grad=[1.0], accumulate=[0.5]))
    halves = {kind: [i.end - i.start for i in split.timeline if i.action.kind is kind] for kind in (Kind.I, Kind.W)}
    assert halves == {Kind.I: [1.0, 1.0, 1.0], Kind.W: [1.0, 1.5, 1.5]}


def test_to_dict_reports_every_field_of_the_hand_worked_gpipe() -> None:
    """Guards every key and value of the JSON report (a renamed, dropped or swapped key)."""
    assert _gpipe_one_microbatch().to_dict() == {
        "family": "gpipe",
        "rule": "sync",
        "stages": 2,
        "microbatches": 1,
        "steps": 1,
        "workers": 2,
        "makespan": 15.5,
        "step_end": [15.5],
        "steady_step": 15.5,
        "throughput": 1 / 15.5,
        "bubble_fraction": pytest.approx(20.25 / 31),
        "busy": [4.5, 6.25],
        "idle": [11.0, 9.25],
        "nca": [1, 1],
        "peak_activations": {"count": [1, 1], "bytes": [16.0, 32.0]},
        "weight_versions": [1, 1],
        "peak_weight_bytes": [2.0, 6.0],
        "received_bytes": {
            "activation": [0.0, 8.0],
            "gradient": [8.0, 0.0],
            "reduce": [0.0, 0.0],
            "weight": [0.0, 0.0],
            "cue": [0.0, 0.0],
        },
        "sent_bytes": {
            "activation": [8.0, 0.0],
            "gradient": [0.0, 8.0],
            "reduce": [0.0, 0.0],
            "weight": [0.0, 0.0],
            "cue": [0.0, 0.0],
        },
        "transfers": {"activation": [0, 1], "gradient": [1, 0], "reduce": [0, 0], "weight": [0, 0], "cue": [0, 0]},
    }


def test_a_blocking_sender_is_busy_while_it_sends() -> None:
    """GPipe, 2 stages, 2 micro-batches, F = 1, B = 2, 4-byte activations at 2 bytes/s: each message
    takes 2. Guards the blocked sender (``overlap=False``) and that its sends do not count as busy.

    Overlapped: F0(0) 0-1, F0(1) 1-2; F1(0) 3-4, F1(1) 4-5 (arrived at 4), B1(0) 5-7, B1(1) 7-9;
    B0(0) 9-11, B0(1) 11-13 (arrived at 11): makespan 13.
    Blocking: F0(0) 0-1 then sends until 3; F0(1) 3-4, sends until 6; F1(0) 3-4, F1(1) 6-7 (arrived
    at 4 + 2); B1(0) 7-9, sends until 11; B1(1) 11-13, sends until 15; the update of worker 1 starts at 15;
    B0(0) 11-13 (arrived 9 + 2), B0(1) 15-17 (arrived 13 + 2): makespan 17.
    """
    schedule = make_schedule("gpipe", 2, 2)
    base = {"forward": [1.0, 1.0], "backward": [2.0, 2.0], "activation_bytes": [4.0, 4.0], "bandwidth": 2.0}
    overlapped = simulate(schedule, StageCosts(**base))
    blocking = simulate(schedule, StageCosts(**base, overlap=False))
    assert overlapped.makespan == 13.0
    assert _times(blocking) == {
        (0, "0F0v0"): (0.0, 1.0),
        (0, "0F1v0"): (3.0, 4.0),
        (0, "0B0v0"): (11.0, 13.0),
        (0, "0B1v0"): (15.0, 17.0),
        (0, "0UPDATE"): (17.0, 17.0),
        (1, "1F0v0"): (3.0, 4.0),
        (1, "1F1v0"): (6.0, 7.0),
        (1, "1B0v0"): (7.0, 9.0),
        (1, "1B1v0"): (11.0, 13.0),
        (1, "1UPDATE"): (15.0, 15.0),
    }
    assert blocking.busy == [6.0, 6.0] and blocking.makespan == 17.0


def test_fsdp_fetches_weights_of_stages_it_does_not_own() -> None:
    """FSDP, 2 stages, 2 micro-batches: worker w runs micro-batch w through both stages and owns stage w.
    F = 1, B = 2, weight bytes [4, 8] at 4 bytes/s (fetches of stage 0 take 1, of stage 1 take 2).
    Guards the fetch (its start at the previous compute's start, its bytes, counts and owners' share),
    the freeing of fetched copies and the reduce of gradients to the owner's update.

    Worker 0: 0F0 0-1; 1F0 needs stage 1, fetched from 0 (the start of 0F0) to 2: 1F0 2-3; 1B0 3-5 (same
    copy); 0B0 5-7 (owned: the copy is freed at 5). Worker 1: 0F1 fetches stage 0 from 0 to 1: 1-2;
    1F1 2-3 (owned, copy freed at 2); 1B1 3-5; 0B1 fetches stage 0 again from 3 (1B1's start) to 4, runs
    5-7, and keeps the copy to the end (7). Reduces: 0B1's gradient (4 bytes, 1) reaches 0UPDATE at 8,
    1B0's (8 bytes, 2) reaches 1UPDATE at 7. Makespan 8.

    Weights held: worker 0 its stage 0 (4 bytes) from 0 plus the copy of stage 1 (8 bytes) from 0 to 5:
    2 copies, 12 bytes. Worker 1 its stage 1 (8) plus stage 0 (4) from 0 to 2 and from 3 to 7: 2, 12 bytes.
    """
    costs = StageCosts.uniform(2, weight_bytes=[4.0, 8.0], bandwidth=4.0)
    sim = simulate(make_schedule("fsdp", 2, 2), costs)
    assert _times(sim) == {
        (0, "0F0v0"): (0.0, 1.0),
        (0, "1F0v0"): (2.0, 3.0),
        (0, "1B0v0"): (3.0, 5.0),
        (0, "0B0v0"): (5.0, 7.0),
        (0, "0UPDATE"): (8.0, 8.0),
        (1, "0F1v0"): (1.0, 2.0),
        (1, "1F1v0"): (2.0, 3.0),
        (1, "1B1v0"): (3.0, 5.0),
        (1, "0B1v0"): (5.0, 7.0),
        (1, "1UPDATE"): (7.0, 7.0),
    }
    assert sim.received_bytes["weight"] == [8.0, 8.0] and sim.sent_bytes["weight"] == [8.0, 8.0]
    assert sim.transfers["weight"] == [1, 2]
    assert sim.received_bytes["reduce"] == [4.0, 8.0] and sim.sent_bytes["reduce"] == [8.0, 4.0]
    assert sim.transfers["reduce"] == [1, 1]
    assert sim.weight_versions == [2, 2] and sim.peak_weight_bytes == [12.0, 12.0]
    assert sim.nca == [2, 2] and sim.peak_activations == [2, 2]


def test_early_gradients_leave_after_the_input_gradient_share() -> None:
    """GPipe, 2 stages, 1 micro-batch, F = 1, B = [2, 4], 4-byte activations at 4 bytes/s (messages
    take 1). Worker 1's B is a cool-down backward: F0 0-1, F1 2-3, B1 3-7. Its gradient leaves at the
    end, 7, and B0 runs 8-10; with early gradients at 3 + 4 / 2 = 5 (the default half): B0 6-8; with
    an input-gradient share of 1, at 4: B0 5-7. Guards the departure time of early gradients."""
    schedule = make_schedule("gpipe", 2, 1)
    costs = StageCosts(forward=[1.0, 1.0], backward=[2.0, 4.0], activation_bytes=[4.0, 4.0], bandwidth=4.0)
    assert _times(simulate(schedule, costs))[(0, "0B0v0")] == (8.0, 10.0)
    assert _times(simulate(schedule, costs, early_gradients=True))[(0, "0B0v0")] == (6.0, 8.0)
    split = StageCosts(**{**costs.__dict__, "input_grad": [1.0, 1.0]})
    assert _times(simulate(schedule, split, early_gradients=True))[(0, "0B0v0")] == (5.0, 7.0)


def test_a_reduce_from_an_early_backward_waits_for_its_weight_gradients() -> None:
    """Regression: with early gradients a cool-down backward sent its *weight* gradients to another
    replica's update as early as its input gradient, before they were computed.

    DDP, 2 stages, 2 micro-batches: worker w runs micro-batch w through both stages; both own both
    stages. F = 1, B = 2, weight bytes [0, 10] at 1 byte/s. 1B1 on worker 1 runs 2-4 (a cool-down
    backward); its stage-1 gradients reach worker 0's update of stage 1 at 4 + 10 = 14, not at
    2 + 1 + 10 = 13; symmetrically for worker 1. Makespan 14, with or without early gradients.
    """
    schedule = make_schedule("ddp", 2, 2)
    costs = StageCosts.uniform(2, weight_bytes=[0.0, 10.0], bandwidth=1.0)
    assert simulate(schedule, costs).makespan == 14.0
    early = simulate(schedule, costs, early_gradients=True)
    assert early.makespan == 14.0
    assert _times(early)[(0, "1UPDATE")] == (14.0, 14.0)


@pytest.mark.parametrize(("reduce_overlap", "makespan"), [(1.0, 14.0), (0.5, 15.0), (0.0, 20.0)])
def test_the_share_of_an_all_reduce_beside_the_compute_keeps_its_senders_busy(
    reduce_overlap: float, makespan: float
) -> None:
    """DDP, 2 stages, 2 micro-batches (as above), F = 1, B = 2, weight bytes [4, 10] at 1 byte/s: each
    worker runs 0F 1F 1B 0B and the updates; a stage's all-reduce takes its bytes' seconds from the end
    of the backward that made the gradient, and keeps that worker busy for ``1 - reduce_overlap`` of it.

    All beside the compute: 1B 2-4, 0B 4-6; stage 1 arrives at 4 + 10 = 14, stage 0 at 6 + 4 = 10:
    makespan 14. Half: 1B 2-4, busy until 4 + 5 = 9; 0B 9-11, busy until 13; stage 0 arrives at
    11 + 4 = 15: makespan 15. None: 1B 2-4, busy until 14; 0B 14-16; stage 0 arrives at 20. The
    blocked seconds are not busy (as a blocking sender's)."""
    costs = StageCosts.uniform(2, weight_bytes=[4.0, 10.0], bandwidth=1.0, reduce_overlap=reduce_overlap)
    sim = simulate(make_schedule("ddp", 2, 2), costs)
    assert sim.makespan == makespan
    start = {1.0: 4.0, 0.5: 9.0, 0.0: 14.0}[reduce_overlap]
    assert _times(sim)[(0, "0B0v0")] == (start, start + 2.0) == _times(sim)[(1, "0B1v0")]
    assert sim.busy == [6.0, 6.0]


def test_the_share_of_an_all_reduce_beside_the_compute_leaves_pipelines_as_they_are() -> None:
    """No all-reduce, nothing blocked: a pipeline's activations and gradients still overlap."""
    costs = {"forward": [1.0, 1.0], "backward": [2.0, 2.0], "activation_bytes": [4.0, 4.0], "bandwidth": 2.0}
    for family in ("gpipe", "1f1b", "2bw"):
        schedule = make_schedule(family, 2, 4)
        assert _times(simulate(schedule, StageCosts(**costs, reduce_overlap=0.0))) == _times(
            simulate(schedule, StageCosts(**costs))
        )


def test_the_steady_step_is_the_mean_spacing_of_the_later_half_of_the_steps() -> None:
    """1F1B, 1 stage, 1 micro-batch, F = 1, B = 2, update 1: each step takes 4 and ends at 4, 8, 12, ...
    With 4 steps the later half (steps 2, 3) is measured from the end of step 1: (16 - 8) / 2 = 4; with
    3 steps, steps 1 and 2 from the end of step 0: (12 - 4) / 2 = 4. Guards the steady-state formula
    (the throughput is micro-batches per steady step)."""
    costs = StageCosts.uniform(1, update=[1.0])
    for steps in (2, 3, 4):
        sim = simulate(make_schedule("1f1b", 1, 1, steps), costs)
        assert sim.step_end == [4.0 * (t + 1) for t in range(steps)]
        assert sim.steady_step == 4.0 and sim.throughput == 0.25
    uneven = StageCosts(forward=[1.0], backward=[2.0], update=[1.0])
    sim = simulate(make_schedule("1f1b", 1, 2, 3), uneven)  # steps of 7: ends 7, 14, 21
    assert sim.step_end == [7.0, 14.0, 21.0] and sim.steady_step == 7.0 and sim.throughput == 2 / 7


def test_zero_costs_give_an_empty_report_without_dividing_by_zero() -> None:
    """Guards the zero-makespan cases: no bubble (not NaN) and an infinite throughput."""
    sim = simulate(make_schedule("gpipe", 2, 2), StageCosts.uniform(2, forward=0.0, backward=0.0))
    assert sim.makespan == 0.0 and sim.bubble_fraction == 0.0 and sim.throughput == math.inf
    assert sim.step_end == [0.0] and sim.steady_step == 0.0 and sim.idle == [0.0, 0.0]
    assert sim.peak_activation_bytes == [0.0, 0.0] and sim.memory_timeline[0][0] == (0.0, 0.0)


def test_durations_of_split_backwards_updates_and_transfers() -> None:
    """Guards the I/W halves: I defaults to half of B and W to the rest of B; explicit values win; an
    update without a cost and a transfer action take no time."""
    halves = StageCosts(forward=[1.0], backward=[3.0])
    assert halves.duration(Action(Kind.I, 0, 0)) == 1.5 and halves.duration(Action(Kind.W, 0, 0)) == 1.5
    given_i = StageCosts(forward=[1.0], backward=[3.0], input_grad=[1.0])
    assert given_i.duration(Action(Kind.I, 0, 0)) == 1.0 and given_i.duration(Action(Kind.W, 0, 0)) == 2.0
    both = StageCosts(forward=[1.0], backward=[3.0], input_grad=[1.0], weight_grad=[0.5], update=[0.25])
    assert both.duration(Action(Kind.W, 0, 0)) == 0.5 and both.duration(Action(Kind.UPDATE, 0)) == 0.25
    assert both.duration(Action(Kind.B, 0, 0)) == 3.0 and both.duration(Action(Kind.F, 0, 0)) == 1.0
    assert halves.duration(Action(Kind.UPDATE, 0)) == 0.0 and halves.duration(Action(Kind.SEND_F, 0, 0)) == 0.0
    assert StageCosts(forward=[1.0], backward=[1.0], latency=0.5, bandwidth=4.0).transfer(6.0) == 2.0
    assert StageCosts(forward=[1.0], backward=[1.0], latency=0.5).transfer(6.0) == 0.5


def test_uniform_costs_default_to_the_papers_unit_costs() -> None:
    """Guards the defaults F = 1, B = 2 of ``StageCosts.uniform``."""
    costs = StageCosts.uniform(3)
    assert list(costs.forward) == [1.0] * 3 and list(costs.backward) == [2.0] * 3 and costs.stages == 3


def test_costs_and_schedule_must_have_the_same_stages() -> None:
    """Guards the stage-count check before the replay."""
    with pytest.raises(PlanningError, match="costs describe 3 stages, the schedule has 2"):
        simulate(make_schedule("gpipe", 2, 1), StageCosts.uniform(3))


# -- StageCosts checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["backward", "input_grad", "weight_grad", "update", "activation_bytes", "saved_bytes", "weight_bytes"]
)
def test_every_per_stage_list_is_checked(name: str) -> None:
    """Guards the length and sign checks of each per-stage list, naming the list and the value."""
    base = {"forward": [1.0, 1.0], "backward": [1.0, 1.0]}
    with pytest.raises(PlanningError, match=f"^costs: {name} has 3 entries, forward has 2$"):
        StageCosts(**{**base, name: [1.0, 1.0, 1.0]})
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(PlanningError, match=rf"^costs: {name} must hold finite numbers >= 0, got {bad!r}$"):
            StageCosts(**{**base, name: [1.0, bad]})
    assert getattr(StageCosts(**{**base, name: [0.0, 0.5]}), name) == [0.0, 0.5]  # zero and fractions are fine


def test_forward_is_checked_and_sets_the_stage_count() -> None:
    """Guards the checks of ``forward`` itself (its values; every other list is measured against it)."""
    with pytest.raises(PlanningError, match=r"^costs: forward must hold finite numbers >= 0, got -1.0$"):
        StageCosts(forward=[-1.0], backward=[1.0])
    with pytest.raises(PlanningError, match=r"^costs: backward has 1 entries, forward has 2$"):
        StageCosts(forward=[0.0, 0.5], backward=[1.0])
    assert StageCosts(forward=[0.0, 0.5], backward=[0.0, 0.0]).stages == 2


def test_bandwidth_latency_and_overhead_are_checked() -> None:
    """Guards the scalar checks: bandwidth > 0 (inf allowed), latency and overhead finite and >= 0."""
    base = {"forward": [1.0], "backward": [1.0]}
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(PlanningError, match=rf"^costs: bandwidth must be > 0 \(or inf\), got {bad!r}$"):
            StageCosts(**base, bandwidth=bad)
    assert StageCosts(**base, bandwidth=0.5).bandwidth == 0.5 and StageCosts(**base).bandwidth == math.inf
    for name in ("latency", "overhead"):
        for bad in (-0.5, math.inf, math.nan):
            with pytest.raises(
                PlanningError, match=rf"^costs: {name} must be a finite number of seconds >= 0, got {bad!r}$"
            ):
                StageCosts(**base, **{name: bad})
        assert getattr(StageCosts(**base, **{name: 0.5}), name) == 0.5


# -- costs files and plans --------------------------------------------------------------------------


def test_a_costs_file_converts_scalars_to_floats() -> None:
    """Guards from_dict: every key passed through, the scalar ones as floats (JSON may hold strings
    or integers)."""
    document = {
        "forward": [1, 2],
        "backward": [2, 4],
        "weight_bytes": [3, 5],
        "bandwidth": "8",
        "latency": 1,
        "overhead": "0.5",
        "overlap": False,
    }
    costs = StageCosts.from_dict(document)
    assert costs == StageCosts(
        forward=[1, 2], backward=[2, 4], weight_bytes=[3, 5], bandwidth=8.0, latency=1.0, overhead=0.5, overlap=False
    )
    assert all(type(getattr(costs, name)) is float for name in ("bandwidth", "latency", "overhead"))


@pytest.mark.parametrize(
    "document",
    [[1, 2], "forward backward", ["forward", "backward"], {"forward": [1]}, {"backward": [1]}, {}],
)
def test_a_costs_file_needs_forward_and_backward(document: object) -> None:
    """Guards the shape check of a costs file (either list missing, or not an object)."""
    with pytest.raises(
        PlanningError, match=r'^c\.json: a costs file is a JSON object with "forward" and "backward" lists$'
    ):
        StageCosts.from_dict(document, source="c.json")
    with pytest.raises(PlanningError, match=r"^costs: a costs file"):  # the default source
        StageCosts.from_dict(document)


def test_a_costs_file_names_unknown_keys_and_bad_values() -> None:
    """Guards the unknown-key message (the unknown and every known key) and the wrapping of bad values."""
    with pytest.raises(PlanningError) as error:
        StageCosts.from_dict({"forward": [1], "backward": [1], "speed": 2, "alpha": 1}, source="c.json")
    assert str(error.value) == f"c.json: unknown keys ['alpha', 'speed']; known: {KNOWN_KEYS}"
    with pytest.raises(PlanningError, match=r"^c\.json: could not convert string to float: 'fast'$"):
        StageCosts.from_dict({"forward": [1], "backward": [1], "bandwidth": "fast"}, source="c.json")
    # a bad value found by StageCosts' own checks (a PlanningError is a ValueError) is named by the source
    # instead of their "costs:"
    with pytest.raises(PlanningError, match=r"^c\.json: forward must hold finite numbers >= 0, got -1$"):
        StageCosts.from_dict({"forward": [-1], "backward": [1]}, source="c.json")
    with pytest.raises(PlanningError, match=r"^costs: forward must hold"):
        StageCosts.from_dict({"forward": [-1], "backward": [1]})


def _plan(**extra: object) -> dict[str, object]:
    stage = {"forward_seconds": 6.0, "backward_seconds": 12.0, "output_bytes": 5, "saved_bytes": 7, "param_bytes": 9}
    return {
        "stages": [
            {**stage, "replicas": 3},
            {**stage, "forward_seconds": 2.0, "backward_seconds": 4.0, "output_bytes": 1, "saved_bytes": 2},
        ],
        **extra,
    }


def test_a_plan_gives_per_stage_costs_and_speeds_up_replicated_stages() -> None:
    """Guards from_plan: a stage replicated r times is r times faster (a stage without ``replicas`` is
    not replicated) unless the schedule places the replicas; sizes and bandwidth are copied."""
    costs = StageCosts.from_plan(_plan(bandwidth_bytes_per_second=100))
    assert costs == StageCosts(
        forward=[2.0, 2.0],
        backward=[4.0, 4.0],
        activation_bytes=[5, 1],
        saved_bytes=[7, 2],
        weight_bytes=[9, 9],
        bandwidth=100.0,
    )
    assert type(costs.bandwidth) is float
    placed = StageCosts.from_plan(_plan(), replicated=True)
    assert list(placed.forward) == [6.0, 2.0] and list(placed.backward) == [12.0, 4.0]
    assert placed.bandwidth == math.inf
    assert StageCosts.from_plan(_plan(bandwidth_bytes_per_second=None)).bandwidth == math.inf


@pytest.mark.parametrize("document", [[], {"stages": 3}, {"stages": {"0": {}}}, {}])
def test_a_plan_must_be_a_plan(document: object) -> None:
    """Guards the shape check of a plan document."""
    with pytest.raises(PlanningError, match=r"^p\.json: not a plan \(run lightning-pipe plan --json to make one\)$"):
        StageCosts.from_plan(document, source="p.json")
    with pytest.raises(PlanningError, match=r"^plan: not a plan"):  # the default source
        StageCosts.from_plan(document)


_STAGE = {"forward_seconds": 1, "backward_seconds": 2, "output_bytes": 3, "saved_bytes": 4, "param_bytes": 5}


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"backward_seconds": 1.0}], r"stages\[0\] lacks forward_seconds, output_bytes, saved_bytes, param_bytes"),
        ([3], r"stages\[0\] lacks forward_seconds, backward_seconds, output_bytes, saved_bytes, param_bytes"),
        ([_STAGE, ["forward_seconds"]], r"stages\[1\] lacks forward_seconds, backward_seconds, output_bytes, .*"),
    ],
)
def test_a_plan_needs_every_stage_cost(stages: list[object], message: str) -> None:
    """Guards the check that every stage is an object with its costs (older plans lack some)."""
    with pytest.raises(PlanningError, match=rf"^p\.json: {message}: re-create the plan with this version$"):
        StageCosts.from_plan({"stages": stages}, source="p.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backward_seconds": "2"}, r"stages\[0\] backward_seconds must be a number, got '2'"),
        ({"param_bytes": True}, r"stages\[0\] param_bytes must be a number, got True"),
        ({"output_bytes": None}, r"stages\[0\] output_bytes must be a number, got None"),
    ],
)
def test_a_plans_stage_costs_are_numbers(change: dict[str, object], message: str) -> None:
    with pytest.raises(PlanningError, match=rf"^p\.json: {message}$"):
        StageCosts.from_plan({"stages": [{**_STAGE, **change}]}, source="p.json")
    with pytest.raises(PlanningError, match=r"^p\.json: bandwidth_bytes_per_second must be bytes per second or null"):
        StageCosts.from_plan({"stages": [_STAGE], "bandwidth_bytes_per_second": "fast"}, source="p.json")


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, True])
def test_a_reduce_overlap_outside_zero_to_one_is_refused(value: float) -> None:
    with pytest.raises(PlanningError, match=r"^costs: reduce_overlap must be a share from 0 .* to 1 .*, got "):
        StageCosts.uniform(2, reduce_overlap=value)

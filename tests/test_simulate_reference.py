"""The simulator against an independent reference replay (schedule/simulate.py).

Oracle: :func:`reference_replay`, a straightforward event loop written from docs/simulation.md and
the simulator's docstrings, not from its code. It repeatedly runs, on each worker, the next action
whose dependencies (from :func:`~lightning_pipe.schedule.graph.build_graph`) are done: the action
starts when its worker is free, its inputs have arrived and (for a stage the worker does not own)
its weights have been fetched. An input from another worker leaves when its producer ends (a
cool-down backward's input gradient, with early gradients: once its input-gradient share is done)
and arrives ``latency + bytes / bandwidth`` later; every message costs ``overhead`` to the action
sending it and to the one receiving it; with ``overlap=False`` the sender stays busy for the
transfer. Every reported field is compared, on random schedules of every family with random
costs. Costs are multiples of 1/4 and bandwidths powers of two, so both sides compute exactly and
ties (frees before allocations at equal times) are real ties.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

from hypothesis import given, reject, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import FAMILIES, Action, Kind, Schedule, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.graph import build_graph
from lightning_pipe.schedule.lower import with_transfers
from tests.reference import hand_schedule

CATEGORIES = ("activation", "gradient", "reduce", "weight", "cue")
CROSS_LABELS = (
    "act",
    "grad",
    "msg",
    "ring",
    "cue",
    "relay",
)  # edges that move data between workers; "weight"/"sync" do not


def duration(costs: StageCosts, action: Action, adds: bool = False) -> float:
    """Seconds of an action: F, B, the I/W halves of B (I defaults to half of B, W to the rest), UPDATE;
    ``adds``: a B or W adding into its step's weight gradients costs ``accumulate`` more."""
    s = action.stage
    half = costs.backward[s] / 2 if costs.input_grad is None else costs.input_grad[s]
    extra = per_stage(costs.accumulate, s) if adds else 0.0
    seconds = {
        Kind.F: costs.forward[s],
        Kind.B: costs.backward[s] + extra,
        Kind.I: half,
        Kind.W: (costs.backward[s] - half if costs.weight_grad is None else costs.weight_grad[s]) + extra,
        Kind.UPDATE: 0.0 if costs.update is None else costs.update[s],
    }
    return seconds.get(action.kind, 0.0)


def adding_gradients(schedule: Schedule) -> set[tuple[int, int]]:
    """Nodes whose B or W has an earlier B or W of the same stage and step on its worker."""
    adding = set()
    for worker, order in enumerate(schedule.orders):
        for position, action in enumerate(order):
            earlier = [a for a in order[:position] if a.kind in (Kind.B, Kind.W)]
            same = [a for a in earlier if (a.stage, a.step) == (action.stage, action.step)]
            if action.kind in (Kind.B, Kind.W) and same:
                adding.add((worker, position))
    return adding


def per_stage(values: object, stage: int) -> float:
    return 0.0 if values is None else float(values[stage])  # type: ignore[index]


def message(costs: StageCosts, receiver: Action, label: str) -> tuple[str, float]:
    """Category and bytes of a message received by ``receiver``: gradients to an UPDATE are a reduce
    of the stage's weights; a forward (or its RECV) takes the previous stage's output; anything else
    takes a gradient the size of its own stage's output; a partial or whole sum passed along a ring
    is a reduce too; a cue carries nothing."""
    if label == "cue":
        return "cue", 0.0
    if label == "relay":  # a relayed stage's state, priced as its weights
        return "weight", per_stage(costs.weight_bytes, receiver.stage)
    if label in ("grad", "ring"):
        return "reduce", per_stage(costs.weight_bytes, receiver.stage)
    if receiver.kind in (Kind.F, Kind.RECV_F):
        return "activation", per_stage(costs.activation_bytes, receiver.stage - 1)
    return "gradient", per_stage(costs.activation_bytes, receiver.stage)


def seconds_on_wire(costs: StageCosts, nbytes: float) -> float:
    return costs.latency + (0.0 if costs.bandwidth == math.inf else nbytes / costs.bandwidth)


def early_backwards(schedule: Schedule) -> set[tuple[int, int]]:
    """Cool-down backwards: a B of a stage s > 0 placed after its worker's last F of that step
    (flushing schedules only) whose input gradient goes to another worker, when that stage has at
    most P - s of them in the step."""
    if not schedule.flush:
        return set()
    backward_on = {(a.stage, a.microbatch, a.step): w for w, _, a in schedule.actions() if a.kind in (Kind.B, Kind.I)}
    early = set()
    for worker, order in enumerate(schedule.orders):
        for position, action in enumerate(order):
            later_forwards = [
                a for a in order[position + 1 :] if a.kind is Kind.F and a.step == action.step
            ]  # none may follow
            leaves = action.kind is Kind.B and action.stage > 0
            if (
                leaves
                and not later_forwards
                and backward_on[(action.stage - 1, action.microbatch, action.step)] != worker
            ):
                early.add((worker, position))
    per_stage_step = Counter((w, schedule.orders[w][p].stage, schedule.orders[w][p].step) for w, p in early)
    return {
        (w, p)
        for w, p in early
        if per_stage_step[(w, schedule.orders[w][p].stage, schedule.orders[w][p].step)]
        <= schedule.stages - schedule.orders[w][p].stage
    }


def peaks(events: list[tuple[float, int, float]]) -> tuple[int, float, list[tuple[float, float]]]:
    """Peak count and bytes of +1/-1 events, frees first at equal times, and the bytes held over time."""
    count, held, best_count, best_held = 0, 0.0, 0, 0.0
    curve = [(0.0, 0.0)]
    for time, delta, nbytes in sorted(events, key=lambda e: (e[0], e[1])):
        count += delta
        held += delta * nbytes
        best_count, best_held = max(best_count, count), max(best_held, held)
        curve.append((time, held))
    return best_count, best_held, curve


@dataclass
class Reference:
    """Everything the reference replay predicts, named like :class:`Simulation`'s fields."""

    start: dict[tuple[int, int], float] = field(default_factory=dict)
    end: dict[tuple[int, int], float] = field(default_factory=dict)
    received: dict[str, list[float]] = field(default_factory=dict)
    sent: dict[str, list[float]] = field(default_factory=dict)
    transfers: dict[str, list[int]] = field(default_factory=dict)
    report: dict[str, object] = field(default_factory=dict)


def reference_replay(
    schedule: Schedule,
    costs: StageCosts,
    early_gradients: bool = False,
    seconds: dict[tuple[int, int], float] | None = None,
    leaves: dict[tuple[int, int], float] | None = None,
) -> Reference:
    """The replay; ``seconds`` replaces each action's own time (its cost plus message overheads) and
    ``leaves`` the time each early input gradient leaves."""
    graph = build_graph(schedule)
    orders, workers = schedule.orders, schedule.workers
    early = early_backwards(schedule) if early_gradients else set()
    adding = adding_gradients(schedule)
    ref = Reference()
    ref.received = {c: [0.0] * workers for c in CATEGORIES}
    ref.sent = {c: [0.0] * workers for c in CATEGORIES}
    ref.transfers = {c: [0] * workers for c in CATEGORIES}

    def incoming(node: tuple[int, int]) -> list[tuple[tuple[int, int], str]]:
        return list(zip(graph.deps.get(node, []), graph.kinds.get(node, []), strict=True))

    # messages each action sends or receives, and how long a blocking sender is held by its sends
    messages: dict[tuple[int, int], int] = defaultdict(int)
    holding: dict[tuple[int, int], float] = defaultdict(float)
    for worker, order in enumerate(orders):
        for position, action in enumerate(order):
            for dep, label in incoming((worker, position)):
                if dep[0] != worker and label in CROSS_LABELS:
                    messages[(worker, position)] += 1
                    messages[dep] += 1
                    if not costs.overlap:
                        holding[dep] += seconds_on_wire(costs, message(costs, action, label)[1])

    free = [0.0] * workers  # when each worker can start its next action
    last_real_start = [0.0] * workers  # start of its previous compute or update: a prefetch starts there
    fetched: list[tuple[int, int] | None] = [None] * workers  # (stage, version) of the weights it fetched
    copies: list[list[float | int]] = []  # [worker, stage, issued, released]
    updated: dict[tuple[int, int, int], float] = {}  # (worker, stage, version) -> end of the update making it
    last_use: dict[tuple[int, int, int], float] = {}  # (worker, stage, version) -> end of its last compute

    def release(worker: int) -> None:
        for copy in copies:
            if copy[0] == worker and copy[3] is None:
                copy[3] = free[worker]
        fetched[worker] = None

    def run(worker: int, position: int) -> None:
        node = (worker, position)
        action = orders[worker][position]
        ready = free[worker]
        for dep, label in incoming(node):
            if dep[0] != worker and label in CROSS_LABELS:
                category, nbytes = message(costs, action, label)
                ref.sent[category][dep[0]] += nbytes
                ref.received[category][worker] += nbytes
                ref.transfers[category][worker] += 1
                if dep in early and label not in ("grad", "ring") and leaves is not None:
                    leaves_at = leaves[dep]
                elif dep in early and label not in ("grad", "ring"):  # only the input gradient leaves early
                    producer = orders[dep[0]][dep[1]]
                    leaves_at = ref.start[dep] + duration(costs, Action(Kind.I, producer.stage))
                else:
                    leaves_at = ref.end[dep]
                ready = max(ready, leaves_at + seconds_on_wire(costs, nbytes))
            else:
                ready = max(ready, ref.end[dep])
        compute = action.kind in (Kind.F, Kind.B, Kind.I, Kind.W)
        version = action.version or 0
        owners = schedule.owners[action.stage]
        if compute and (worker in owners or schedule.relays):  # a relayed stage's state comes with it
            if fetched[worker] is not None:
                release(worker)
        elif compute and fetched[worker] != (action.stage, version):
            if fetched[worker] is not None:
                release(worker)
            nbytes = per_stage(costs.weight_bytes, action.stage)
            ref.received["weight"][worker] += nbytes
            ref.transfers["weight"][worker] += 1
            for owner in owners:
                ref.sent["weight"][owner] += nbytes / len(owners)
            made = [
                ref.end[(w, p)]
                for w, order in enumerate(orders)
                for p, a in enumerate(order)
                if a.kind is Kind.UPDATE and a.stage == action.stage and a.step == version - 1 and (w, p) in ref.end
            ]
            issued = max(min(made, default=0.0), last_real_start[worker])
            ready = max(ready, issued + seconds_on_wire(costs, nbytes))
            copies.append([worker, action.stage, issued, None])
            fetched[worker] = (action.stage, version)
        adds = node in adding
        if node in early:  # split: its input-gradient half, then its weight-gradient half
            halves = Action(Kind.I, action.stage), Action(Kind.W, action.stage)
            working = duration(costs, halves[0]) + duration(costs, halves[1], adds)
        else:
            working = duration(costs, action, adds)
        own = working + costs.overhead * messages[node] if seconds is None else seconds[node]
        end = ready + own
        ref.start[node], ref.end[node] = ready, end
        free[worker] = end + holding[node]
        if compute or action.kind is Kind.UPDATE:
            last_real_start[worker] = ready
        if action.kind is Kind.UPDATE:
            updated[(worker, action.stage, action.step + 1)] = end
        if compute:
            key = (worker, action.stage, version)
            last_use[key] = max(last_use.get(key, end), end)

    cursor = [0] * workers
    progress = True
    while progress:
        progress = False
        for worker in range(workers):
            while cursor[worker] < len(orders[worker]) and all(
                dep in ref.end for dep in graph.deps.get((worker, cursor[worker]), [])
            ):
                run(worker, cursor[worker])
                cursor[worker] += 1
                progress = True
    assert cursor == [len(order) for order in orders], "the reference replay deadlocked"
    for worker in range(workers):
        if fetched[worker] is not None:
            release(worker)

    # the report
    nodes = [(w, p) for w in range(workers) for p in range(len(orders[w]))]
    makespan = max((ref.end[n] for n in nodes), default=0.0)
    busy = [sum(ref.end[(w, p)] - ref.start[(w, p)] for p in range(len(orders[w]))) for w in range(workers)]
    idle = [makespan - b for b in busy]
    step_end = [
        max([ref.end[n] for n in nodes if orders[n[0]][n[1]].step == t], default=0.0) for t in range(schedule.steps)
    ]
    steps = schedule.steps
    if steps == 1:
        steady = step_end[0]
    else:
        later = steps - steps // 2  # the later half of the steps
        steady = (step_end[-1] - step_end[steps - later - 1]) / later
    stage_events: dict[int, list] = defaultdict(list)
    worker_events: dict[int, list] = defaultdict(list)
    for w, p in nodes:
        a = orders[w][p]
        if a.kind is Kind.F:
            last = next(
                (w2, p2)
                for w2, p2 in nodes
                if orders[w2][p2].kind in (Kind.B, Kind.W) and orders[w2][p2].key[1:] == a.key[1:]
            )
            nbytes = per_stage(costs.saved_bytes, a.stage)
            for events in (stage_events[a.stage], worker_events[w]):
                events += [(ref.start[(w, p)], 1, nbytes), (ref.end[last], -1, nbytes)]
    weight_events: dict[int, list] = defaultdict(list)
    held_since = dict.fromkeys(range(schedule.stages), 0.0)  # relayed: since the previous holder's end
    place = {a.key: i for relay in schedule.relays for i, a in enumerate(relay)}  # ties at equal ends
    for node in sorted(nodes, key=lambda n: (ref.end[n], place.get(orders[n[0]][n[1]].key, -1))):
        a = orders[node[0]][node[1]]
        if schedule.relays and a.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.UPDATE):
            nbytes = per_stage(costs.weight_bytes, a.stage)
            weight_events[node[0]] += [(held_since[a.stage], 1, nbytes), (ref.end[node], -1, nbytes)]
            held_since[a.stage] = ref.end[node]
    for s, owners in enumerate(schedule.owners if not schedule.relays else ()):
        nbytes = per_stage(costs.weight_bytes, s)
        for w in owners:
            for v in range(steps + 1):
                if v and (w, s, v) not in updated:
                    continue
                born = updated.get((w, s, v), 0.0)
                dies = max(updated.get((w, s, v + 1), makespan), last_use.get((w, s, v), born))
                weight_events[w] += [(born, 1, nbytes), (dies, -1, nbytes)]
    for w, s, issued, released in copies:
        nbytes = per_stage(costs.weight_bytes, int(s))
        weight_events[int(w)] += [(issued, 1, nbytes), (released, -1, nbytes)]
    activations = [peaks(worker_events[w]) for w in range(workers)]
    weights = [peaks(weight_events[w]) for w in range(workers)]
    ref.report = {
        "makespan": makespan,
        "step_end": step_end,
        "steady_step": steady,
        "throughput": schedule.microbatches / steady if steady > 0 else math.inf,
        "busy": busy,
        "idle": idle,
        "bubble_fraction": sum(idle) / (workers * makespan) if makespan > 0 else 0.0,
        "nca": [peaks(stage_events[s])[0] for s in range(schedule.stages)],
        "peak_activations": [a[0] for a in activations],
        "peak_activation_bytes": [a[1] for a in activations],
        "memory_timeline": [a[2] for a in activations],
        "weight_versions": [v[0] for v in weights],
        "peak_weight_bytes": [v[1] for v in weights],
        "received_bytes": ref.received,
        "sent_bytes": ref.sent,
        "transfers": ref.transfers,
    }
    return ref


def assert_matches(schedule: Schedule, costs: StageCosts, early_gradients: bool) -> None:
    """Every field of ``simulate`` equals the reference's (exact arithmetic; the bubble up to rounding)."""
    ref = reference_replay(schedule, costs, early_gradients)
    sim = simulate(schedule, costs, early_gradients=early_gradients)
    assert [(i.worker, i.action) for i in sim.timeline] == [
        (w, a) for w, order in enumerate(schedule.orders) for a in order
    ]
    assert {(i.worker, p): i.start for p, i in _positions(sim.timeline)} == ref.start
    assert {(i.worker, p): i.end for p, i in _positions(sim.timeline)} == ref.end
    for category, counts in ref.transfers.items():  # every transfer counted is one message logged
        logged = [
            sum(1 for m in sim.messages if m.category == category and m.destination == w) for w in range(len(counts))
        ]
        assert logged == counts, (category, logged, counts)
    for name, expected in ref.report.items():
        got = getattr(sim, name)
        if name == "bubble_fraction":
            assert math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-12), (name, got, expected)
        elif name == "memory_timeline":
            assert [[tuple(p) for p in curve] for curve in got] == expected, name
        else:
            assert got == expected, (name, got, expected)
        assert type(got) is type(expected), name


def _positions(timeline: list) -> list[tuple[int, object]]:
    positions: dict[int, int] = defaultdict(int)
    out = []
    for interval in timeline:
        out.append((positions[interval.worker], interval))
        positions[interval.worker] += 1
    return out


def _family_options(family: str, stages: int) -> dict[str, object]:
    return {
        "1f1b_star": {"period": 3.0},
        "kperiodic": {"k": 1},
        "lpp": {"groups": 2, "replicas": 2 if stages % 2 == 0 else 1},
        "fslpp": {"groups": 2, "replicas": 2 if stages % 2 == 0 else 1},
        "1f1b_rr": {"stage_replicas": [2] + [1] * (stages - 1)},
    }.get(family, {})


quarters = st.integers(0, 12).map(lambda q: q / 4)


@st.composite
def stage_costs(draw: st.DrawFn, stages: int) -> StageCosts:
    def per_stage_list(values: st.SearchStrategy[float], optional: bool = True) -> list[float] | None:
        if optional and draw(st.booleans()):
            return None
        return draw(st.lists(values, min_size=stages, max_size=stages))

    backward = per_stage_list(quarters, optional=False)
    input_grad = None
    if draw(st.booleans()):  # an explicit input-gradient share of the backward
        input_grad = [b * draw(st.integers(0, 4)) / 4 for b in backward]
    return StageCosts(
        forward=per_stage_list(quarters, optional=False),
        backward=backward,
        input_grad=input_grad,
        weight_grad=per_stage_list(quarters),
        update=per_stage_list(quarters),
        accumulate=per_stage_list(quarters),
        activation_bytes=per_stage_list(st.integers(0, 16).map(float)),
        saved_bytes=per_stage_list(st.integers(0, 16).map(float)),
        weight_bytes=per_stage_list(st.integers(0, 16).map(float)),
        bandwidth=draw(st.sampled_from([math.inf, 1.0, 2.0, 4.0])),
        latency=draw(quarters),
        overhead=draw(st.sampled_from([0.0, 0.0, 0.25, 0.5])),
        overlap=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    stages=st.integers(1, 4),
    microbatches=st.integers(1, 4),
    steps=st.integers(1, 3),
    lowered=st.booleans(),
    early_gradients=st.booleans(),
    data=st.data(),
)
def test_simulate_equals_the_reference_replay(
    family: str, stages: int, microbatches: int, steps: int, lowered: bool, early_gradients: bool, data: st.DataObject
) -> None:
    """Guards every timing, traffic and memory rule of the simulator: message arrival, overhead per
    message, blocking sends, early input gradients, weight fetches by non-owners (fsdp, fslpp) and
    their copies, reduce traffic to updates, activation and weight-version peaks, step ends and the
    steady step; on lowered schedules also the spelled-out SEND/RECV messages."""
    try:
        schedule = make_schedule(family, stages, microbatches, steps, **_family_options(family, stages))
    except PlanningError:
        reject()
    if lowered:
        schedule = with_transfers(schedule)
    costs = data.draw(stage_costs(stages))
    assert_matches(schedule, costs, early_gradients)


@settings(max_examples=60, deadline=None)
@given(
    form=st.sampled_from(["pyramid", "single", "dp", "zero"]),
    rule=st.sampled_from(["cdp_v1", "cdp_v2"]),
    stages=st.integers(1, 3),
    extra=st.integers(0, 2),
    steps=st.integers(1, 3),
    data=st.data(),
)
def test_cdp_forms_simulate_as_the_reference_replay(
    form: str, rule: str, stages: int, extra: int, steps: int, data: st.DataObject
) -> None:
    """CDP's pyramid, single-device, dp and ZeRO forms: the dp form's partial and whole sums along its
    rings (reduce traffic, one message per link) and its cues (no bytes, one message), the ZeRO form's
    states passed along its relays (weight traffic, held from the previous action's end) are priced as
    the reference prices them."""
    schedule = make_schedule("cdp", stages, stages + extra, steps, form=form, rule=rule)
    assert_matches(schedule, data.draw(stage_costs(stages)), early_gradients=False)


def _replicated_owner_with_a_fetcher() -> Schedule:
    """Stage 0 owned by workers 0 and 1 (replicas), and computed, for micro-batch 2, by worker 2,
    which owns nothing and fetches it: version 1 after step 0's updates."""
    orders = ["0F0v0 0B0v0 0UPDATE 0F0@1v1 0B0@1v1 0UPDATE@1", "0F1v0 0B1v0 0UPDATE 0F1@1v1 0B1@1v1 0UPDATE@1"]
    return hand_schedule([*orders, "0F2v0 0B2v0 0F2@1v1 0B2@1v1"], ((0, 1),), 1, 3, 2)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), early_gradients=st.booleans())
def test_a_fetch_from_replicated_owners_matches_the_reference(data: st.DataObject, early_gradients: bool) -> None:
    """Guards the share of a fetch each replica sends and the copies of a worker that owns no stage."""
    assert_matches(_replicated_owner_with_a_fetcher(), data.draw(stage_costs(1)), early_gradients)


def _fetch_again_after_one_owned_action() -> Schedule:
    """Worker 0 owns stage 1 and runs F0 (stage 0, fetched), F1 (owned), B0 (stage 0 again: fetched
    again, its copy was freed at F1); worker 1 owns stage 0 and runs B1 (stage 1, fetched) and U0."""
    return hand_schedule(["0F0v0 1F0v0 0B0v0 1UPDATE", "1B0v0 0UPDATE"], ((1,), (0,)), 2, 1, 1)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_run_interrupted_by_one_owned_action_fetches_again(data: st.DataObject) -> None:
    """Guards the end of a fetched run: a copy freed when the worker moves to a stage it owns must be
    fetched again for the next action on that stage, even when only one owned action came between."""
    schedule = _fetch_again_after_one_owned_action()
    costs = data.draw(stage_costs(2))
    assert simulate(schedule, costs).transfers["weight"] == [2, 1]
    assert_matches(schedule, costs, early_gradients=False)


def _scaled(costs: StageCosts, factor: float) -> StageCosts:
    """The same costs in another unit of time: every duration times ``factor``, bandwidth divided by it."""

    def times(values: object) -> list[float] | None:
        return None if values is None else [v * factor for v in values]

    return replace(
        costs,
        forward=times(costs.forward),
        backward=times(costs.backward),
        input_grad=times(costs.input_grad),
        weight_grad=times(costs.weight_grad),
        update=times(costs.update),
        accumulate=times(costs.accumulate),
        latency=costs.latency * factor,
        overhead=costs.overhead * factor,
        bandwidth=costs.bandwidth / factor,
    )


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), stages=st.integers(1, 3), data=st.data())
def test_predictions_do_not_depend_on_the_unit_of_time(family: str, stages: int, data: st.DataObject) -> None:
    """Costs in seconds or in 1/64 s predict the same schedule: times scale, bubble, memory and traffic
    do not. Guards against a threshold written in absolute time (``makespan > 1`` for ``> 0``, a weight
    copy born at t = 1), which every test with costs of about a second passes."""
    try:
        schedule = make_schedule(family, stages, 2, 2, **_family_options(family, stages))
    except PlanningError:
        reject()
    costs = data.draw(stage_costs(stages))
    whole, small = simulate(schedule, costs), simulate(schedule, _scaled(costs, 1 / 64))
    assert small.makespan == whole.makespan / 64 and small.step_end == [t / 64 for t in whole.step_end]
    assert small.steady_step == whole.steady_step / 64
    assert small.throughput == whole.throughput * 64
    assert [(i.start, i.end) for i in small.timeline] == [(i.start / 64, i.end / 64) for i in whole.timeline]
    assert small.bubble_fraction == whole.bubble_fraction
    assert (small.nca, small.peak_activations, small.peak_activation_bytes) == (
        whole.nca,
        whole.peak_activations,
        whole.peak_activation_bytes,
    )
    assert (small.weight_versions, small.peak_weight_bytes) == (whole.weight_versions, whole.peak_weight_bytes)
    assert (small.sent_bytes, small.transfers) == (whole.sent_bytes, whole.transfers)

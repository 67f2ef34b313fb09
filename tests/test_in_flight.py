"""Activations in flight counted from a schedule's orders (lightning_pipe/schedule/in_flight.py), the
memory model that plans with them, and the memory limit kept per worker (``within_workers``).

Oracles: the simulator's replay, which sweeps the same allocations and frees in time
(``Simulation.peak_activation_bytes``, ``Simulation.nca``); the closed forms of Beaumont et al. 2021
§3.2 where they hold (one stage per worker)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.planning import (
    PlanOptions,
    StagePlan,
    every_worker_a_stage,
    in_flight_counts,
    memory_model,
    within_workers,
)
from lightning_pipe.schedule import COMPUTE, FAMILIES, NON_FLUSHING_FAMILIES, StageCosts, simulate
from lightning_pipe.schedule.in_flight import Holding, stage_in_flight, weight_versions, worker_holdings
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.worker_memory import WorkerMemory

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXTRA = {"1f1b_star": {"period": 3.0}, "kperiodic": {"k": 2}}
FORMS = {"cdp": ("pipeline", "pyramid", "dp", "zero", "single")}
CLOSED_FORMS = ("gpipe", "1f1b", "zb_h1", "pipedream", "2bw", "cdp")
"""Families whose workers hold one stage each, which the closed forms price."""


def _options(family: str, form: str | None, workers: int, microbatches: int) -> tuple[ScheduleOptions, int] | None:
    """The family on ``workers`` workers and its stage count, or ``None`` where it cannot run them."""
    extra = {**EXTRA.get(family, {}), **({"form": form} if form else {})}
    try:
        options = ScheduleOptions(family, microbatches, **extra).on_workers(workers)  # type: ignore[arg-type]
        stages = options.stages_for(workers)
        options.make(stages, microbatches)(1)
    except PlanningError:
        return None
    return options, stages


@st.composite
def schedules(draw: st.DrawFn) -> tuple[ScheduleOptions, int, int]:
    family = draw(st.sampled_from([f for f in FAMILIES if f != "1f1b_rr"]))
    form = draw(st.sampled_from(FORMS.get(family, (None,))))
    workers, microbatches = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    found = _options(family, form, workers, microbatches)
    if found is None:
        reject()
    options, stages = found  # type: ignore[misc]
    return options, stages, microbatches


@SETTINGS
@given(schedules(), st.data())
def test_each_workers_peak_is_the_replays(drawn: tuple[ScheduleOptions, int, int], data: st.DataObject) -> None:
    """Counted from the orders, each worker's peak bytes are the replay's in time, whatever the
    actions' durations; a stage's count is the replay's where one worker computes it, and the
    stages' counts bound each worker's peak."""
    options, stages, microbatches = drawn
    schedule = options.make(stages, microbatches)(data.draw(st.integers(1, 4)))
    sizes = st.lists(st.integers(1, 9).map(float), min_size=stages, max_size=stages)
    saved, forward, backward = data.draw(sizes), data.draw(sizes), data.draw(sizes)
    replay = simulate(schedule, StageCosts(forward, backward, saved_bytes=saved))
    peaks = worker_holdings(schedule, [Holding(s) for s in saved])
    assert peaks == pytest.approx(replay.peak_activation_bytes, rel=1e-12)
    counts = stage_in_flight(schedule)
    workers_of = [
        {w for w, order in enumerate(schedule.orders) if any(a.stage == s for a in order)} for s in range(stages)
    ]
    for s, workers in enumerate(workers_of):
        if len(workers) == 1:
            assert counts[s] == replay.nca[s]
    for worker, order in enumerate(schedule.orders):
        mine = {a.stage for a in order if a.kind in COMPUTE}
        assert peaks[worker] <= sum(counts[s] * saved[s] for s in mine) * (1 + 1e-12)


RUNNABLE = [
    (family, workers, m)
    for family in CLOSED_FORMS
    for workers in (1, 2, 3, 4)
    for m in (1, 2, 3, 4, 8)
    if _options(family, None, workers, m) is not None  # the others are refused with a reason
]


@pytest.mark.parametrize(("family", "workers", "microbatches"), RUNNABLE)
def test_the_closed_forms_are_the_counts_where_a_worker_holds_one_stage(
    family: str, workers: int, microbatches: int
) -> None:
    found = _options(family, None, workers, microbatches)
    assert found is not None
    options, stages = found
    counts = in_flight_counts(options, stages, microbatches)
    closed = memory_model(family, microbatches, 0.0)
    assert counts == tuple(closed.in_flight(stages - s) for s in range(stages))


@pytest.mark.parametrize(
    ("family", "workers", "microbatches", "closed", "counted"),
    [
        ("looped_bfs", 2, 8, (4, 3, 2, 1), (8, 8, 8, 8)),  # breadth first: every micro-batch on every stage
        ("pp", 4, 8, (4, 3, 2, 1), (8, 7, 4, 1)),
        ("interleaved", 4, 4, (4, 4, 4, 4, 4, 3, 2, 1), (4, 4, 4, 4, 4, 4, 3, 1)),
        ("ddp", 2, 4, (2, 1), (1, 1)),  # a replica runs each micro-batch through before the next
    ],
)
def test_families_the_closed_forms_miscount(
    family: str, workers: int, microbatches: int, closed: tuple[int, ...], counted: tuple[int, ...]
) -> None:
    """What 1F1B's closed form gave these families, and what their schedules keep."""
    options = ScheduleOptions(family, microbatches).on_workers(workers)
    stages = options.stages_for(workers)
    assert tuple(memory_model(family, microbatches, 0.0).in_flight(stages - s) for s in range(stages)) == closed
    counts = in_flight_counts(options, stages, microbatches)
    assert counts == counted
    model = memory_model(family, microbatches, 0.0, counts=counts)
    assert tuple(model.in_flight(stages - s) for s in range(stages)) == counted


def test_counts_are_checked() -> None:
    with pytest.raises(PlanningError, match="counts must list"):
        MemoryModel(counts=(2, 0))
    with pytest.raises(PlanningError, match="no stage 3 from the end"):
        MemoryModel(counts=(2, 1)).in_flight(3)
    with pytest.raises(PlanningError, match="replicated 2 times"):
        MemoryModel(counts=(2, 1)).in_flight(1, replicas=2)
    assert MemoryModel(counts=(3, 1, 2), extra_copies=0).least_coefficients() == (1.0, 1.0)


def _planner(costs: ChainCosts, options: ScheduleOptions, stages: int, microbatches: int):
    counts = in_flight_counts(options, stages, microbatches)
    memory = memory_model(options.family, microbatches, 1.0, counts=counts)

    def plan_once(plan_options: PlanOptions) -> StagePlan:  # as plan_stages plans straight stages
        request = PlanRequest(
            costs, devices=stages, memory_limit=plan_options.memory_limit, memory=memory, straight=True
        )
        plan = partition(request, "time")
        if len(plan.stages) < stages:
            plan = every_worker_a_stage(request, plan, costs.column("seconds"))
        return StagePlan(tuple((s.layers[0], s.layers[-1]) for s in plan.stages), plan, costs)

    return plan_once


def _worker_needs(stage_plan: StagePlan, options: ScheduleOptions, microbatches: int) -> list[float]:
    """Each worker's bytes as its actions hold them (``WorkerMemory``, whose sweep the tests above
    check against the replay and ``tests/test_allocated_runs.py`` against runs)."""
    assert stage_plan.plan is not None and stage_plan.costs is not None
    schedule = options.make(len(stage_plan.bounds), microbatches)(4)
    held = WorkerMemory.of(schedule, stage_plan.costs, stage_plan.bounds)
    return list(held.bytes_under(stage_plan.plan, [False] * len(stage_plan.bounds)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(1, 9).map(float), min_size=4, max_size=8),
    st.data(),
    st.sampled_from(["interleaved", "looped_bfs", "ddp", "1f1b", "gpipe"]),
    st.integers(1, 400).map(float),
)
def test_a_plan_keeps_the_limit_per_worker_or_is_refused(
    seconds: list[float], data: st.DataObject, family: str, limit: float
) -> None:
    """Whatever the family, a plan returned keeps every worker (its stages together, by the replay)
    within the limit; a refusal names the limit and what each worker needs."""
    n = len(seconds)
    sizes = st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n)
    costs = ChainCosts.from_lists(seconds, seconds, saved=data.draw(sizes), params=data.draw(sizes))
    microbatches = data.draw(st.sampled_from([2, 4]))
    options = ScheduleOptions(family, microbatches).on_workers(2)
    stages = options.stages_for(2)
    plan_once = _planner(costs, options, stages, microbatches)
    try:
        stage_plan = within_workers(plan_once, PlanOptions(memory_limit=limit), options, microbatches)
    except PlanningError as refused:
        assert re.search(r"memory_limit=|limit of|fits", str(refused))
        return
    assert max(_worker_needs(stage_plan, options, microbatches)) <= limit * (1 + 1e-9)


def test_an_interleaved_worker_over_the_limit_with_its_stages_together_is_planned_again() -> None:
    """Each stage of the per-stage plan fits the limit, but worker 0, holding two of them, does not
    (50 bytes of 48): the stages are planned again within smaller shares of it, and fit together."""
    params = [2.0, 4.0, 2.0, 3.0, 2.0, 2.0, 2.0, 2.0]
    costs = ChainCosts.from_lists([1.0] * 8, [1.0] * 8, saved=[2.0, 4.0, 4.0, 0.0, 4.0, 0.0, 1.0, 2.0], params=params)
    options = ScheduleOptions("interleaved", 4).on_workers(2)
    plan_once = _planner(costs, options, 4, 4)
    alone = plan_once(PlanOptions(memory_limit=48.0))
    assert _worker_needs(alone, options, 4) == [50.0, 33.0]
    kept = within_workers(plan_once, PlanOptions(memory_limit=48.0), options, 4)
    assert _worker_needs(kept, options, 4) == [42.0, 36.0]
    with pytest.raises(PlanningError, match=r"computes 2 stages of interleaved and needs .* over memory_limit="):
        within_workers(plan_once, PlanOptions(memory_limit=30.0), options, 4)


def test_a_worker_over_the_limit_is_planned_again_at_a_share_between_the_limit_and_its_half() -> None:
    """At 103 bytes each stage fits alone, but worker 0 holds 116 with its two stages together; within
    half of the limit each no split exists, and within a larger share one does whose workers need 85
    and 94 bytes: the shares between the limit and its half find it (the half alone would refuse)."""
    params = [6.0, 6.0, 0.0, 4.0, 8.0, 7.0, 6.0, 4.0]
    costs = ChainCosts.from_lists([1.0] * 8, [1.0] * 8, saved=[7.0, 5.0, 9.0, 3.0, 8.0, 2.0, 4.0, 2.0], params=params)
    options = ScheduleOptions("interleaved", 4).on_workers(2)
    plan_once = _planner(costs, options, 4, 4)
    assert _worker_needs(plan_once(PlanOptions(memory_limit=103.0)), options, 4) == [116.0, 68.0]
    with pytest.raises(PlanningError, match="fits the memory limit"):
        plan_once(PlanOptions(memory_limit=103.0 / 2))
    kept = within_workers(plan_once, PlanOptions(memory_limit=103.0), options, 4)
    assert kept.bounds == ((0, 0), (1, 2), (3, 4), (5, 7))
    assert _worker_needs(kept, options, 4) == [85.0, 94.0]


@SETTINGS
@given(schedules(), st.data())
def test_gradients_and_transients_raise_a_workers_peak_by_at_most_what_they_add(
    drawn: tuple[ScheduleOptions, int, int], data: st.DataObject
) -> None:
    """A stage's gradient and what its backward holds for a moment raise its worker's peak over its
    activations' alone (the replay's: the test above), by at most what they add."""
    options, stages, microbatches = drawn
    schedule = options.make(stages, microbatches)(data.draw(st.integers(1, 4)))
    sizes = st.lists(st.integers(0, 9).map(float), min_size=stages, max_size=stages)
    saved, gradient, backward = data.draw(sizes), data.draw(sizes), data.draw(sizes)
    alone = worker_holdings(schedule, [Holding(s) for s in saved])
    full = worker_holdings(
        schedule, [Holding(s, g, b, 0.0, b) for s, g, b in zip(saved, gradient, backward, strict=True)]
    )
    for worker, order in enumerate(schedule.orders):
        mine = {a.stage for a in order if a.kind in COMPUTE}
        assert alone[worker] <= full[worker] <= alone[worker] + sum(gradient[s] + backward[s] for s in mine) + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 4),
    st.integers(2, 8),
    st.floats(1, 100),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 100),
)
def test_gpipe_makes_its_gradient_after_its_activations_peak(
    workers: int, microbatches: int, saved: float, gradient: float, backward: float, accumulating: float, first: float
) -> None:
    """Under GPipe a worker runs its m forwards, then its m backwards, then its update: its first
    backward makes the gradient beside every micro-batch's activations, holding ``f`` besides, each
    later one adds to it with one micro-batch fewer held:
    ``max(m·a + g + f, (m - 1)·a + g + b + c)``, not ``m·a + g + b + c``."""
    schedule = ScheduleOptions("gpipe", microbatches).make(workers, microbatches)(2)
    holding = Holding(saved, gradient, backward, accumulating, first)
    expected = max(
        microbatches * saved + gradient + first, (microbatches - 1) * saved + gradient + backward + accumulating
    )
    assert worker_holdings(schedule, [holding] * workers) == pytest.approx([expected] * workers, rel=1e-12)


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb_h1", "interleaved", "2bw", "pipedream", "cdp"])
@pytest.mark.parametrize(("workers", "microbatches"), [(2, 2), (3, 4), (4, 4), (4, 8)])
def test_weight_versions_are_those_the_actions_use(family: str, workers: int, microbatches: int) -> None:
    """A flushing family updates once every action of the step has run: one version. 2BW keeps two
    (Narayanan et al. 2021 §3.1); PipeDream's stashing at most the closed form's one per micro-batch in
    flight (Narayanan et al. 2019 §3.3), fewer where its schedule's actions use fewer; the last
    stage of a non-flushing pipeline, whose backward follows its forward at once, one."""
    found = _options(family, None, workers, microbatches)
    assert found is not None
    options, stages = found
    versions = weight_versions(options.make(stages, microbatches)(4))
    assert sorted(versions) == list(range(stages))
    if family not in NON_FLUSHING_FAMILIES:
        assert set(versions.values()) == {1}
    elif family == "2bw":
        assert set(versions.values()) == {2}
    else:
        closed = MemoryModel("pipedream", microbatches)
        assert all(1 <= versions[s] <= closed.weight_versions(stages - s) for s in range(stages))
        assert versions[stages - 1] == 1

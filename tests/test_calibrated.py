"""What a run measured beyond the profile: the fit of its actions, the time beyond them, and keeping
both for the next run's prediction (``lightning_pipe.cost.calibrated``, ``lightning_pipe.strategy.step_prices``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_pipe import PipelineStrategy
from lightning_pipe.auto import DELAYED_FAMILIES, Candidate, microbatch_costs
from lightning_pipe.cost.calibrated import (
    KEPT_PER_SHAPE,
    Calibration,
    RunShape,
    calibration,
    calibration_path,
    keep_calibration,
    kept_calibration,
    separated,
    typical,
)
from lightning_pipe.cost.loop_time import loop_seconds
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.planning import PREDICTED_STEPS, StagePlan, predict, schedule_of
from lightning_pipe.runtime import run_local
from lightning_pipe.schedule import StageCosts, simulate
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.calibrating import OWN_TIME_SHARE, stale_profile_rate
from lightning_pipe.strategy.choosing import Chosen
from lightning_pipe.strategy.profile_basis import ProfileBasis
from lightning_pipe.strategy.trials import (
    CONFIRM_WITHIN,
    MAX_TRIAL_STEPS,
    SWITCH_GAIN,
    TRIAL_MARGIN,
    TRIAL_SECONDS,
    TRIAL_STEPS,
    WARM_UP,
    Trial,
    Trials,
    closest_calibration,
    trial_candidates,
    trial_kind,
    trial_steps,
)
from tests.lightning_cases import Chain, loader, trainer
from tests.stage_plans import one_layer_per_stage


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(1e-4, 1.0), min_size=2, max_size=8, unique=True),
    st.floats(0.1, 10.0),
    st.floats(0.0, 0.1),
)
def test_calibration_recovers_scale_and_fixed_cost(profiled: list[float], scale: float, fixed: float) -> None:
    """Measured costs that are exactly ``scale × profile + fixed`` give back both (least squares)."""
    assume(max(profiled) - min(profiled) >= 1e-3)  # the scale and the fixed cost are apart only with a spread
    got_scale, got_fixed = calibration(profiled, [scale * x + fixed for x in profiled])
    assert math.isclose(got_scale, scale, rel_tol=1e-6)
    assert math.isclose(got_fixed, fixed, rel_tol=1e-6, abs_tol=1e-9)


def test_calibration_without_spread_or_with_a_negative_intercept_goes_through_zero() -> None:
    assert calibration([1.0, 1.0], [3.0, 3.0]) == (3.0, 0.0)
    scale, fixed = calibration([1.0, 2.0], [1.0, 4.0])  # the line through them crosses below zero
    assert fixed == 0.0 and math.isclose(scale, 9.0 / 5.0)
    with pytest.raises(PlanningError, match="as many measured values"):
        calibration([1.0], [])


def _candidate(family: str, step: float, busiest: float) -> Candidate:
    return Candidate(
        schedule=ScheduleOptions(family=family, microbatches=2),
        recompute=(False, False),
        stage_plan=StagePlan(((0, 0), (1, 1))),
        step_seconds=step,
        bubble_fraction=0.0,
        busiest_seconds=busiest,
        memory_bytes=(0.0, 0.0),
    )


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["1f1b", "gpipe", "ddp", "2bw", "cdp", "pipedream"]),
    st.floats(1e-3, 1.0),
    st.floats(0.1, 1.0),
    st.floats(0.0, 2.0),
    st.floats(1e-3, 1.0),
    st.floats(0.1, 1.0),
)
def test_calibrated_step_meets_the_measured_one_and_overlaps_only_without_flush(
    family: str, step: float, share: float, beyond: float, other_step: float, other_share: float
) -> None:
    """The running configuration is predicted at what it measured (``measured >= its simulated
    step``); another is priced with the same time outside the actions: added to a flushing one's
    step, overlapping a non-flushing one's (between its simulated step and that sum)."""
    running = _candidate(family, step, share * step)
    measured = step * (1 + beyond)
    found = Calibration.fitted(1.0, 0.0, running, measured)
    assert math.isclose(found.seconds(running), measured, rel_tol=1e-9)
    flushing, delayed = (
        _candidate("1f1b", other_step, other_share * other_step),
        _candidate("2bw", other_step, other_share * other_step),
    )
    assert math.isclose(found.seconds(flushing), other_step + found.per_step, rel_tol=1e-9)
    assert other_step <= found.seconds(delayed) <= found.seconds(flushing)


def test_the_closest_calibration_kept_is_read_back(tmp_path: Path) -> None:
    piped = Calibration(1.1, 2e-3, 5e-3, "1f1b m=4, 2026-11-27")
    path = keep_calibration(tmp_path, "key", RunShape("1f1b", 8), piped)
    assert path == calibration_path(tmp_path, "key") and path.exists()
    assert kept_calibration(tmp_path, "key", RunShape("gpipe", 4)) == piped == kept_calibration(tmp_path, "key")
    assert "measured on 1f1b m=4, 2026-11-27" in str(piped)
    replicas = Calibration(2.5, 0.0, 1e-3, "ddp m=2, 2026-11-27", replicating=True)
    keep_calibration(tmp_path, "key", RunShape("ddp", 16), replicas)
    # read back as measured on replicas (the family says so): all-reduces priced as they ran then
    assert Calibration.reduce_overlap(kept_calibration(tmp_path, "key", RunShape("ddp", 16)), 0.2) == 1.0
    assert Calibration.reduce_overlap(kept_calibration(tmp_path, "key", RunShape("1f1b", 8)), 0.2) == 0.2
    assert Calibration.reduce_overlap(None, 0.2) == 0.2
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 8)) == piped  # its own, not the last run's
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 16)) == piped  # the rows of replicas: the family
    assert kept_calibration(tmp_path, "key", RunShape("fsdp", 16)) == replicas  # the same rows and kind
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 4)) == piped  # the same family
    assert kept_calibration(tmp_path, "key", RunShape("gpipe", 4)) == piped  # the same kind
    assert kept_calibration(tmp_path, "key", RunShape("2bw", 16)) == piped  # the same kind before the same rows
    looped = Calibration(3.4, 0.0, 2e-3, "interleaved m=2, 2026-11-28")  # several stages per worker
    keep_calibration(tmp_path, "key", RunShape("interleaved", 8), looped)
    halves = Calibration(2.6, 0.0, 2e-3, "zb_h1 m=2, 2026-11-28")  # each backward in two actions
    keep_calibration(tmp_path, "key", RunShape("zb_h1", 8), halves)
    assert kept_calibration(tmp_path, "key", RunShape("2bw", 8)) == piped  # one stage per worker, as 2BW's
    assert kept_calibration(tmp_path, "key", RunShape("looped_bfs", 8)) == looped  # the same rows and kind
    assert kept_calibration(tmp_path, "key", RunShape("interleaved", 16)) == looped  # the same family
    assert kept_calibration(tmp_path, "key", RunShape("looped_bfs", 4)) == looped  # the same kind
    assert kept_calibration(tmp_path, "key", RunShape("gpipe", 4)) == piped  # not the last kept, of another kind
    assert kept_calibration(tmp_path, "key", RunShape("zb_h1", 4)) == halves  # the same family
    keep_calibration(tmp_path, "key", RunShape("ddp", 16), replicas)  # the last kept again
    assert _figures(kept_calibration(tmp_path, "key")) == _figures(replicas)  # the last kept's shape
    assert len(json.loads(path.read_text())["runs"]) == 5  # a second fit of a shape is kept beside the first
    again = Calibration(0.9, 0.0, 6e-3, "1f1b m=4, 2026-11-30")
    keep_calibration(tmp_path, "key", RunShape("1f1b", 8), again)
    both = kept_calibration(tmp_path, "key", RunShape("1f1b", 8))
    assert _figures(both) == (0.9, 0.0, 5e-3) == _figures(kept_calibration(tmp_path, "key"))  # of two, each the smaller
    assert str(both).endswith(
        "(measured on 1f1b m=4, 2026-11-30; each figure the median of this configuration's last 2 fits)"
    )
    pinned = Calibration(0.7, 0.0, 0.0, "1f1b m=4 pinned, 2026-11-27")
    keep_calibration(tmp_path, "key", RunShape("1f1b", 8, pinned=True), pinned)
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 8, pinned=True)) == pinned
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 8)) == both  # pinning kept apart
    assert kept_calibration(tmp_path, "key", RunShape("1f1b", 8, pinned=None)) == pinned  # not known: the last
    assert len(json.loads(path.read_text())["runs"]) == 7
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


def _figures(found: Calibration | None) -> tuple[float, float, float]:
    assert found is not None
    return found.scale, found.fixed, found.per_step


def test_a_fit_through_a_slow_stretch_does_not_price_the_next(tmp_path: Path) -> None:
    """A CIFAR ResNet-18's CDP fits on 2 CPU processes kept rates of 1.20x the profile, and 1.75x in
    one that ran through a slow stretch of the machine (``docs/measurements.md``): the next fit is
    priced at the others' rate."""
    shape = RunShape("cdp", 16)
    for scale, per_step in ((1.20, 4e-3), (1.75, 9e-3), (1.18, 5e-3)):
        keep_calibration(tmp_path, "key", shape, Calibration(scale, 1e-4, per_step, "cdp m=2, 2026-11-30"))
    assert _figures(kept_calibration(tmp_path, "key", shape)) == (1.20, 1e-4, 5e-3)
    keep_calibration(tmp_path, "key", shape, Calibration(1.90, 1e-4, 9e-3))  # the machine slower from now on
    keep_calibration(tmp_path, "key", shape, Calibration(1.85, 1e-4, 9e-3))
    assert _figures(kept_calibration(tmp_path, "key", shape))[0] == 1.75
    keep_calibration(tmp_path, "key", shape, Calibration(1.88, 1e-4, 9e-3))  # followed within three fits
    assert _figures(kept_calibration(tmp_path, "key", shape)) == (1.85, 1e-4, 9e-3)
    with pytest.raises(PlanningError, match="one kept entry"):
        typical([])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.floats(0.1, 4.0), st.floats(0.0, 1e-2), st.floats(0.0, 1e-1)),
        min_size=1,
        max_size=3 * KEPT_PER_SHAPE,
    )
)
def test_the_last_fits_of_a_shape_are_kept_and_priced_by_their_median(
    fits: list[tuple[bool, float, float, float]],
) -> None:
    """Brute force over fits of two shapes kept in any order: each shape keeps its last
    :data:`KEPT_PER_SHAPE` fits, in the order kept, and is priced with the lower median of each figure
    of them; the other shape's fits, of another kind, do not move it (no drift of its kind is
    measured), and price it where it has none."""
    shapes = {False: RunShape("2bw", 8), True: RunShape("ddp", 8)}
    with tempfile.TemporaryDirectory() as directory:
        for replicated, scale, fixed, per_step in fits:
            keep_calibration(Path(directory), "key", shapes[replicated], Calibration(scale, fixed, per_step))
        runs = json.loads(calibration_path(Path(directory), "key").read_text())["runs"]
        for replicated, shape in shapes.items():
            last = [fit[1:] for fit in fits if fit[0] == replicated][-KEPT_PER_SHAPE:]
            assert [(r["scale"], r["fixed"], r["per_step"]) for r in runs if r["family"] == shape.family] == last
            priced_by = last or [fit[1:] for fit in fits if fit[0] != replicated][-KEPT_PER_SHAPE:]  # none: the other's
            found = kept_calibration(Path(directory), "key", shape)
            assert _figures(found) == tuple(statistics.median_low(figure) for figure in zip(*priced_by, strict=True))


_SHAPES = st.builds(
    RunShape,
    st.sampled_from(["1f1b", "ddp", "2bw", "1f1b_rr", "interleaved", "looped_bfs", "zb_h1"]),
    st.sampled_from([4, 8, 16]),
    st.sampled_from([False, True]),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_SHAPES, min_size=1, max_size=8), _SHAPES | st.builds(RunShape, st.just("1f1b"), st.just(8), st.none()))
def test_a_prediction_takes_the_closest_run_kept(kept: list[RunShape], asked: RunShape) -> None:
    """Brute force: the shape of the last run kept of the same family and rows, else of the same rows and kind
    (replicating stages or not, several stages per worker or one, each backward in two actions or
    one), else of the same rows and
    replication, else of the same family, else of the same kind, else of the same replication, else of
    the same rows, else the last run kept; at each of these, one of the same pinning first (where the
    pinning asked for is known)."""

    def replicated(shape: RunShape) -> bool:
        return shape.family in ("ddp", "1f1b_rr")

    def kind(shape: RunShape) -> tuple[bool, bool, bool]:
        return replicated(shape), shape.family in ("interleaved", "looped_bfs"), shape.family == "zb_h1"

    with tempfile.TemporaryDirectory() as directory:
        for index, shape in enumerate(kept):
            keep_calibration(Path(directory), "key", shape, Calibration(1.0, 0.0, float(index)))
        found = kept_calibration(Path(directory), "key", asked)
    history: dict[RunShape, list[int]] = {}
    for index, shape in enumerate(kept):
        history.setdefault(shape, []).append(index)
    last = {shape: indices[-1] for shape, indices in history.items()}
    for matches in (
        lambda s: s.rows == asked.rows and s.family == asked.family,
        lambda s: s.rows == asked.rows and kind(s) == kind(asked),
        lambda s: s.rows == asked.rows and replicated(s) == replicated(asked),
        lambda s: s.family == asked.family,
        lambda s: kind(s) == kind(asked),
        lambda s: replicated(s) == replicated(asked),
        lambda s: s.rows == asked.rows,
        lambda s: True,
    ):
        among = [index for shape, index in last.items() if matches(shape)]
        pinned_alike = [index for shape, index in last.items() if matches(shape) and shape.pinned == asked.pinned]
        if among:  # the last kept of the closest shape: the median of that shape's last fits
            shape = kept[max(pinned_alike or among)]
            assert _figures(found)[2] == statistics.median_low(history[shape][-KEPT_PER_SHAPE:])
            return


def test_nothing_kept_or_unreadable_is_no_calibration(tmp_path: Path) -> None:
    assert kept_calibration(tmp_path, "none", RunShape("1f1b", 8)) is None
    assert (
        kept_calibration(None, "key") is None
        and keep_calibration(None, "key", RunShape("1f1b", 8), Calibration(1, 0, 0)) is None
    )
    calibration_path(tmp_path, "bad").write_text("{not json")
    assert kept_calibration(tmp_path, "bad") is None
    keep_calibration(tmp_path, "bad", RunShape("gpipe", 8), Calibration(1, 0, 0))  # an unreadable file is replaced
    assert kept_calibration(tmp_path, "bad") == Calibration(1, 0, 0)
    negative = {"scale": 1, "fixed": -1, "per_step": 0, "measured_on": ""}
    calibration_path(tmp_path, "negative").write_text(json.dumps({"runs": [negative]}))
    assert kept_calibration(tmp_path, "negative") is None
    for odd in (True, "1.2", None):  # a figure no fit writes: none read
        calibration_path(tmp_path, "odd").write_text(json.dumps({"runs": [{**negative, "fixed": 0, "scale": odd}]}))
        assert kept_calibration(tmp_path, "odd") is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert (
        keep_calibration(blocked, "key", RunShape("1f1b", 8), Calibration(1, 0, 0)) is None
    )  # a file where the directory would be


@pytest.mark.parametrize("field", ["scale", "fixed", "per_step"])
def test_a_calibration_refuses_what_no_run_measures(field: str) -> None:
    values: dict[str, Any] = {"scale": 1.0, "fixed": 0.0, "per_step": 0.0, field: -1.0}
    with pytest.raises(PlanningError, match=f"calibration {field} must be a finite number >= 0"):
        Calibration(**values)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-3, 1.0), st.floats(1e-3, 1.0), st.floats(0.0, 0.1)), min_size=2, max_size=3),
    st.floats(0.5, 2.0),
    st.floats(0.0, 0.01),
    st.sampled_from(["gpipe", "1f1b", "2bw", "ddp"]),
    st.integers(3, 6),  # at least one micro-batch per worker (ddp), P - 1 of them (2BW)
    st.sampled_from([math.inf, 1e6]),
)
def test_the_prediction_prices_the_run_beyond_the_profile_as_the_simulator_would(
    stages: list[tuple[float, float, float]], scale: float, fixed: float, family: str, m: int, bandwidth: float
) -> None:
    """Oracle: the schedule simulated with each action at ``scale`` × its profile + ``fixed``, each
    stage's update and the links given, built by hand."""
    forward, backward, update = (list(column) for column in zip(*stages, strict=True))
    plan = one_layer_per_stage(forward, backward)
    options = ScheduleOptions(family=family, microbatches=m).on_workers(len(stages))
    got = predict(plan, options, m, 1.0, False, fixed, update, scale, bandwidth)
    costs = StageCosts(
        forward=[scale * f + fixed for f in forward],
        backward=[scale * b + fixed for b in backward],
        update=update,
        activation_bytes=[1e3] * len(stages),
        saved_bytes=[1e3] * len(stages),
        weight_bytes=[1e4] * len(stages),
        bandwidth=bandwidth,
    )
    expected = simulate(schedule_of(plan, options, m)(PREDICTED_STEPS), costs, early_gradients=True)
    assert got is not None and math.isclose(got.steady_step, expected.steady_step, rel_tol=1e-9)
    without = predict(plan, options, m)
    assert without is not None and got.steady_step >= without.steady_step * min(scale, 1.0) - 1e-12


def _fits(rank: int, root: str, directory: str) -> list[dict[str, Any]]:
    """Worker: the same model trained four times with a profile cache in ``directory``: 1F1B on 2
    micro-batches twice, then pinned, then ``schedule="auto"`` on 2 micro-batches; then another model
    (wider) with 1F1B, and a third with 1F1B searched (its split and recomputation: the search's
    pricing); what rank 0 priced."""
    os.environ["LOCAL_RANK"] = str(rank)
    found = []
    fits = (
        ("1f1b", 2, False, 8),
        ("1f1b", 2, False, 8),
        ("1f1b", 2, True, 8),
        ("auto", [2], False, 8),
        ("1f1b", 2, False, 16),
        ("1f1b", [2], False, 24),
    )
    for fit, (schedule, microbatches, pinned, width) in enumerate(fits):
        strategy = PipelineStrategy(
            schedule,
            microbatches=microbatches,
            profile_cache=directory,
            pin_cpus=pinned,
            timeout=timedelta(seconds=60),
        )
        run = trainer(Path(root, str(fit)), strategy, 2)
        run.fit(Chain(width=width), loader(10))
        prices = strategy.step_prices
        found.append(
            {
                "kept": prices.kept,
                "loop": prices.loop,
                "prior": prices.prior,
                "said": prices.said(),
                "rates_kept": [json.loads(p.read_text()) for p in Path(directory).glob("rate-*.json")],
                "own_loop": loop_seconds(strategy._step_starts[WARM_UP:], strategy._step_seconds[WARM_UP:]),
                "loops_kept": [json.loads(p.read_text()) for p in Path(directory).glob("loop-*.json")],
                "simulated": None if strategy.prediction is None else strategy.prediction.steady_step,
                "updates": None if prices.update is None else prices.update.stages(strategy.stage_plan.bounds),
                "planned": strategy.planned_step_seconds,
                "bandwidth": prices.bandwidth,
                "kept_after": [json.loads(p.read_text()) for p in Path(directory).glob("calibration-*.json")],
                "factor": None if strategy._searched is None else strategy._searched[0].factor(strategy.microbatches),
            }
        )
    return found


@pytest.mark.timeout(300)
def test_a_fit_keeps_what_it_measured_and_the_next_fit_predicts_with_it(tmp_path: Path) -> None:
    """The first fit of a model prices the updates (at the optimizer's measured rate) and the links,
    has no calibration yet, and keeps its own beside the profile; the second reads it and predicts its
    step with it: what the first fit measured beyond the profile is in the second's prediction. A
    third fit, pinned, reads the closest kept (the unpinned one) and keeps its own beside it. The
    fourth, ``schedule="auto"`` unpinned, prices its winner with the unpinned one, not the last kept,
    brought from the layer-by-layer profile it was kept against to the chain-timed one it plans with."""
    cache = tmp_path / "profiles"
    ranks = run_local(_fits, 2, str(tmp_path), str(cache), timeout=240)
    first, second, third, chosen, other, searched = ranks[0]
    assert first["kept"] is None and first["updates"] is not None and min(first["updates"]) > 0
    assert first["bandwidth"] is not None and first["bandwidth"] > 0
    (kept_file,) = first["kept_after"]
    (written,) = kept_file["runs"]
    kept = second["kept"]
    assert kept is not None and kept.measured_on.startswith("1f1b m=2")
    assert kept == typical([written])
    assert (written["family"], written["rows"], written["pinned"]) == ("1f1b", 5, False)  # 10 rows, 2 micro-batches
    (again,) = second["kept_after"]  # the second fit keeps its own in the same file, beside the first's
    assert again["runs"][0] == written and again["runs"][1] != written and len(again["runs"]) == 2
    assert second["planned"] is not None and second["planned"] > 0
    assert third["kept"] == typical(again["runs"])
    (both,) = third["kept_after"]
    unpinned = typical(both["runs"][:2])  # brought to the chain-timed profile the search prices with
    assert first["factor"] is None and chosen["factor"] is not None and chosen["factor"] > 0
    assert chosen["kept"] == dataclasses.replace(unpinned, scale=unpinned.scale / chosen["factor"])
    assert unpinned != typical(both["runs"][2:])
    assert [(run["family"], run["rows"], run["pinned"]) for run in both["runs"]] == [
        ("1f1b", 5, False),
        ("1f1b", 5, False),
        ("1f1b", 5, True),
    ]
    # every fit keeps the training loop's time per step (the file of 2 CPU processes); the first fit of
    # another model, with no calibration of its own, prices each step with the median of those kept
    assert first["loop"] is None and first["planned"] == first["simulated"]
    for fit, ran in enumerate(("first", "second", "third")):  # each the smaller of the two ranks' own
        (kept_then,) = ranks[0][fit]["loops_kept"]
        assert kept_then["runs"][-1]["seconds"] == min(rank[fit]["own_loop"] for rank in ranks), ran
    (loops,) = chosen["loops_kept"]
    assert [run["seconds"] for run in loops["runs"]][:3] == [
        run["seconds"] for fit in (first, second, third) for run in fit["loops_kept"][0]["runs"][-1:]
    ]
    assert other["kept"] is None and other["loop"] is not None
    assert math.isclose(other["loop"].per_step, statistics.median(run["seconds"] for run in loops["runs"]))
    assert other["loop"].per_step > 0
    assert math.isclose(other["planned"], other["simulated"] + other["loop"].per_step)  # 1F1B flushes
    # every fit keeps its actions' rate against the layers' profile, with its family, count and pinning;
    # the other model's first fit prices its actions with the lower median of the first model's unpinned
    # fits on 2 micro-batches of a single-stage kind (the pinned one left out: another pinning)
    assert first["prior"] is None and "what fits of other models measured" not in first["said"]
    (rates,) = chosen["rates_kept"]  # as the other model's fit found them (the auto fit kept none: too short)
    calibrations = [(run["scale"], run["fixed"], run["family"], run["pinned"]) for run in both["runs"]]
    assert [(run["scale"], run["fixed"], run["family"], run["pinned"]) for run in rates["runs"]] == calibrations
    assert all(run["microbatches"] == 2 and run["model"] == rates["runs"][0]["model"] for run in rates["runs"])
    alike = [run for run in rates["runs"] if not run["pinned"]]
    prior = other["prior"]
    assert prior is not None and prior.scale == statistics.median_low(run["scale"] for run in alike)
    assert prior.fixed == statistics.median_low(run["fixed"] for run in alike)
    assert prior.per_step == other["loop"].per_step and "what fits of other models measured" in other["said"]
    # a third model's search prices with the rates kept then (the other model's fit's the last), brought
    # to the chain-timed profile it plans with
    (then,) = other["rates_kept"]
    alike = [run for run in then["runs"] if not run["pinned"]]
    factor = searched["factor"]
    assert searched["kept"] is None and searched["prior"] is not None and factor is not None
    assert math.isclose(searched["prior"].scale, statistics.median_low(run["scale"] for run in alike) / factor)
    assert math.isclose(searched["planned"], searched["simulated"] + searched["loop"].per_step)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=8),
    st.floats(0.1, 10.0),
    st.floats(0.0, 0.1),
)
def test_the_rate_and_the_time_between_actions_are_measured_apart(
    profiled: list[float], scale: float, fixed: float
) -> None:
    """Actions computing exactly ``scale ×`` their profile and followed by ``fixed`` of the executor's
    own time give back both, whatever the actions' lengths (no spread needed, unlike a fitted line)."""
    compute = [scale * x for x in profiled]
    got_scale, got_fixed = separated(profiled, compute, [c + fixed for c in compute])
    assert math.isclose(got_scale, scale, rel_tol=1e-9)
    assert math.isclose(got_fixed, fixed, rel_tol=1e-9, abs_tol=1e-12)
    with pytest.raises(PlanningError, match="as many measured values"):
        separated(profiled, compute, [])


FAMILIES = ["1f1b", "gpipe", "ddp", "1f1b_rr", "zb_h1", "2bw", "cdp"]


def _on(family: str, step: float, microbatches: int) -> Candidate:
    candidate = _candidate(family, step, step)
    return dataclasses.replace(candidate, schedule=ScheduleOptions(family=family, microbatches=microbatches))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(FAMILIES), st.floats(0.5, 2.0), st.sampled_from([2, 4])), max_size=12),
    st.lists(st.tuples(st.sampled_from(FAMILIES), st.sampled_from([2, 4])), min_size=1, max_size=3),
    st.floats(0.5, 2.0),
    st.integers(0, 3),
)
def test_the_trials_are_the_best_of_each_family_within_the_margin_and_both_kinds(
    priced: list[tuple[str, float, int]], measured: list[tuple[str, int]], fastest: float, places: int
) -> None:
    """Whatever was measured already: at most ``places``, one per family, in the order priced; a
    family measured, or priced from a run of its kind on as many micro-batches, only when 5% faster
    than the fastest measured; any other within 15% of it; every candidate passed over for no reason
    of these would have overflowed the places; and the best of a kind (flushing or not) that neither
    ran nor made it takes the last place."""
    ranked = sorted((_on(family, step, m) for family, step, m in priced), key=lambda c: c.step_seconds)
    chosen = trial_candidates(ranked, fastest, lambda c: c.step_seconds, measured, places)
    ran = {family for family, _ in measured}
    alike = {(trial_kind(family), m) for family, m in measured}

    def known(c: Candidate) -> bool:
        return c.family in ran or (trial_kind(c.family), c.microbatches) in alike

    def allowed(c: Candidate) -> bool:
        if known(c):
            return c.step_seconds <= fastest * (1 - SWITCH_GAIN)
        return c.step_seconds <= fastest * (1 + TRIAL_MARGIN)

    measured_kinds = {family not in DELAYED_FAMILIES for family in ran}
    last = chosen[-1:]
    special = [c for c in last if c.flushes not in measured_kinds | {c.flushes for c in chosen[:-1]}]
    regular = [c for c in chosen if c not in special]
    assert len(chosen) <= places and len({c.family for c in chosen}) == len(chosen)
    assert not {c.family for c in chosen} & ran
    assert all(allowed(c) for c in regular)
    assert [ranked.index(c) for c in regular] == sorted(ranked.index(c) for c in regular)
    if special:  # the best of a kind neither measured nor otherwise chosen
        assert special[0] == next(c for c in ranked if c.flushes == special[0].flushes)
    for candidate in ranked:
        if candidate in chosen or not allowed(candidate) or candidate.family in ran:
            continue
        earlier = [c for c in regular if ranked.index(c) < ranked.index(candidate)]
        # passed over: its family taken by a better one, or the places full
        taken = {c.family for c in chosen if ranked.index(c) < ranked.index(candidate)}
        assert candidate.family in taken or len(earlier) + len(special) >= places
    if places > 0:
        assert {c.flushes for c in ranked} <= measured_kinds | {c.flushes for c in chosen}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(FAMILIES), st.sampled_from([2, 4]), st.booleans()), min_size=1, max_size=5),
    st.sampled_from(FAMILIES),
    st.sampled_from([2, 4]),
)
def test_a_trial_is_priced_with_the_calibration_of_what_ran_closest_to_it(
    ran: list[tuple[str, int, bool]], family: str, microbatches: int
) -> None:
    """Brute force, the order kept calibrations are looked up in: the calibration of a measured trial
    of the same family and count, else of the same kind and count, else of the same replication and
    count, else the same family, else kind, else replication, else count; the last measured among
    equals; trials without a calibration passed over, and none at all refused."""
    trials = [
        Trial(
            StagePlan(((0, 0), (1, 1))),
            Chosen(ScheduleOptions(f, microbatches=m), (False, False)),
            f"{f} m={m}",
            0.1,
            Calibration(1.0 + index, 0.0, 0.0) if calibrated else None,
        )
        for index, (f, m, calibrated) in enumerate(ran)
    ]
    known = [t for t in trials if t.calibration is not None]
    if not known:
        with pytest.raises(PlanningError, match="no trial measured a calibration"):
            closest_calibration(trials, family, microbatches, 64)
        return
    kind = trial_kind(family)
    tests = [
        lambda f, m: f == family and m == microbatches,
        lambda f, m: trial_kind(f) == kind and m == microbatches,
        lambda f, m: trial_kind(f)[0] == kind[0] and m == microbatches,
        lambda f, m: f == family,
        lambda f, m: trial_kind(f) == kind,
        lambda f, m: trial_kind(f)[0] == kind[0],
        lambda f, m: m == microbatches,
    ]
    pool = known
    for test in tests:  # narrowed by each test in turn, where some trial passes it
        passing = [t for t in pool if test(t.chosen.schedule.family, t.chosen.schedule.microbatches)]
        pool = passing or pool
    assert closest_calibration(trials, family, microbatches, 64) is pool[-1].calibration


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-5, 10.0), st.floats(1e-5, 10.0))
def test_a_trial_lasts_a_quarter_second_in_steps_within_its_bounds(seconds: float, longer: float) -> None:
    """Enough steps to fill :data:`TRIAL_SECONDS` where that takes :data:`TRIAL_STEPS` to
    :data:`MAX_TRIAL_STEPS`; slower steps never get more; no usable time gives the least."""
    steps = trial_steps(seconds)
    assert TRIAL_STEPS <= steps <= MAX_TRIAL_STEPS
    assert steps * seconds >= TRIAL_SECONDS * (1 - 1e-9) or steps == MAX_TRIAL_STEPS
    assert steps == TRIAL_STEPS or (steps - 1) * seconds < TRIAL_SECONDS
    assert trial_steps(seconds + longer) <= steps
    assert trial_steps(0.0) == trial_steps(math.nan) == trial_steps(math.inf) == TRIAL_STEPS


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=8, unique=True),
    st.floats(0.3, 3.0),
    st.floats(0.0, 0.02),
)
def test_a_kept_profile_is_judged_stale_by_the_rate_of_the_work_only_where_it_shows(
    profiled: list[float], rate: float, fixed: float
) -> None:
    """Actions measured at ``rate ×`` their profile + ``fixed`` each: the rate is said where it is more
    than 15% off and the fixed time is at most half the actions' time; nothing where it is within
    15%, or where the fixed time is most of it (the rate not told apart from it)."""
    assume(max(profiled) > 1.5 * min(profiled))  # a line needs actions of different lengths
    measured = [rate * seconds + fixed for seconds in profiled]
    got = stale_profile_rate(profiled, measured)
    hidden = fixed * len(measured) > OWN_TIME_SHARE * sum(measured)
    assume(abs(abs(rate - 1) - 0.15) > 1e-6)  # not on the tolerance's edge
    if hidden or abs(rate - 1) <= 0.15:
        assert got is None
    else:
        assert got is not None and math.isclose(got, rate, rel_tol=1e-6)


def _trial(index: int, seconds: float | None) -> Trial:
    """Configuration ``index`` (its split says which), measured at ``seconds``."""
    plan = StagePlan(((0, index), (index + 1, 9)))
    return Trial(plan, Chosen(ScheduleOptions("1f1b", microbatches=2), (False, False)), f"split {index}", seconds)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 0.2), min_size=1, max_size=4), st.floats(0.05, 0.2), st.floats(0.05, 0.2))
def test_the_closest_two_trials_are_measured_again_in_the_other_order(
    first: list[float], again_a: float, again_b: float
) -> None:
    """Brute force over the first pass: the two fastest within :data:`CONFIRM_WITHIN` are measured
    again, the later-measured first, once; the pick is the least mean of each configuration's medians."""
    trials = Trials([_trial(i, t) for i, t in enumerate(first)], [])
    order = sorted(range(len(first)), key=first.__getitem__)
    close = len(first) > 1 and first[order[1]] <= first[order[0]] * (1 + CONFIRM_WITHIN)
    again = trials.again()
    assert trials.again() == []  # once
    if not close:
        assert again == [] and trials.best().label == f"split {order[0]}"
        return
    pair = sorted(order[:2], reverse=True)
    assert [t.label for t in again] == [f"split {i}" for i in pair] and all(t.seconds is None for t in again)
    trials.measured += [dataclasses.replace(again[0], seconds=again_a), dataclasses.replace(again[1], seconds=again_b)]
    means = {i: first[i] for i in range(len(first))}
    means[pair[0]] = (first[pair[0]] + again_a) / 2
    means[pair[1]] = (first[pair[1]] + again_b) / 2
    best = min(means, key=lambda i: (means[i], i))
    assert trials.best().label == f"split {best}"
    assert math.isclose(trials.seconds_of(trials.best()), means[best])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-4, 1e-2), st.floats(1e-4, 1e-2)), min_size=2, max_size=6),
    st.floats(0.3, 1.0),
    st.floats(0.3, 1.0),
    st.floats(0.2, 3.0),
    st.sampled_from([1, 2, 4, 8]),
    st.booleans(),
)
def test_a_kept_calibration_prices_the_same_actions_on_either_profile(
    times: list[tuple[float, float]], forward: float, backward: float, scale: float, m: int, small: bool
) -> None:
    """A calibration kept against the layer-by-layer profile, brought to the chain-timed one that
    ``schedule="auto"`` prices with, gives every micro-batch count's actions the same seconds in total;
    and back again."""
    layers = ChainCosts.from_lists([f for f, _ in times], [b for _, b in times])
    chain = layers.rescaled(forward * sum(f for f, _ in times), backward * sum(b for _, b in times))
    few = layers.scaled(0.5) if small else None
    basis = ProfileBasis(
        layers, chain, 1.0, few, None if few is None else few.rescaled(forward * 0.4, backward * 0.4), 2.0
    )
    kept = Calibration(scale, 1e-4, 2e-3)
    small_layers = None if few is None else (few, 2.0)
    small_chain = None if few is None else (basis.small_chain, 2.0)

    def total(costs: ChainCosts) -> float:
        return sum(layer.forward_seconds + layer.backward_seconds for layer in costs.layers)

    on_layers = kept.scale * total(microbatch_costs(layers, 1.0, small_layers, m))
    converted = basis.to_chain(kept, m)
    assert math.isclose(converted.scale * total(microbatch_costs(chain, 1.0, small_chain, m)), on_layers, rel_tol=1e-9)
    assert (converted.fixed, converted.per_step) == (kept.fixed, kept.per_step)
    assert math.isclose(basis.to_layers(converted, m).scale, kept.scale, rel_tol=1e-9)
    assert basis.to_chain(None, m) is None

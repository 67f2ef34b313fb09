"""The rate of a pipeline's actions kept per machine: kept and read back per device kind and number of
processes, and what prices a model's first fit from other models' fits of the same kind of schedule."""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.calibrated import Calibration, family_kind
from lightning_pipe.cost.machine_rate import KEPT_RATES, PRIOR_FITS, MachineRates, keep_rate, kept_rates, rate_path
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.step_prices import LOOP_MEASURED_ON, StepPrices
from tests.stage_plans import one_layer_per_stage

FAMILIES = ["gpipe", "1f1b", "2bw", "cdp", "interleaved", "zb_h1", "ddp", "1f1b_rr"]
ENTRY = st.fixed_dictionaries(
    {
        "family": st.sampled_from(FAMILIES),
        "microbatches": st.sampled_from([2, 4]),
        "pinned": st.booleans(),
        "scale": st.floats(0.5, 4.0),
        "fixed": st.floats(0.0, 1e-4),
        "model": st.sampled_from(["this", "other", "third"]),
    }
)


def _alike(entries: list[dict[str, object]], family: str) -> list[dict[str, object]]:
    return [e for e in entries if family_kind(e["family"]) == family_kind(family) and e["model"] != "this"]


@settings(max_examples=200, deadline=None)
@given(st.lists(ENTRY, max_size=16), st.sampled_from(FAMILIES), st.sampled_from([2, 4]), st.booleans(), ENTRY)
def test_a_first_fit_is_priced_from_other_models_fits_of_its_kind(
    entries: list[dict[str, object]], family: str, m: int, pinned: bool, extra: dict[str, object]
) -> None:
    """Oracle: the figures come from kept fits of other models of the same kind of family, none else;
    the closest of those (as many micro-batches, then the same pinning), the last :data:`PRIOR_FITS`
    of them, their lower median (one of theirs)."""
    rates = MachineRates(tuple(entries))
    got = rates.closest(family, m, pinned, "this")
    alike = _alike(entries, family)
    if not alike:
        assert got is None
        return
    assert got is not None and got.per_step == 0.0
    close = max((e["microbatches"] == m, e["pinned"] == pinned) for e in alike)
    fits = [e for e in alike if (e["microbatches"] == m, e["pinned"] == pinned) == close][-PRIOR_FITS:]
    assert got.scale == statistics.median_low(e["scale"] for e in fits)
    assert got.fixed == statistics.median_low(e["fixed"] for e in fits)
    assert got.replicating == family_kind(family)[0]
    # a fit of another kind, or of this model, changes nothing
    if family_kind(extra["family"]) != family_kind(family) or extra["model"] == "this":
        assert MachineRates((*entries, extra)).closest(family, m, pinned, "this") == got


@settings(max_examples=50, deadline=None)
@given(st.lists(ENTRY, min_size=1, max_size=6), st.floats(0.5, 4.0))
def test_the_latest_fits_of_the_closest_shape_price_it(entries: list[dict[str, object]], scale: float) -> None:
    """Oracle: :data:`PRIOR_FITS` fits of the asked shape kept last, all at one rate, give that rate,
    whatever was kept before them."""
    latest = {"family": "gpipe", "microbatches": 4, "pinned": True, "scale": scale, "fixed": 1e-5, "model": "other"}
    got = MachineRates((*entries, *[latest] * PRIOR_FITS)).closest("1f1b", 4, True, "this")
    assert got is not None and got.scale == scale and got.fixed == 1e-5


def test_rates_are_kept_per_device_kind_and_process_count() -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        assert kept_rates(directory, "cpu", 2).entries == ()
        for i in range(KEPT_RATES + 3):
            found = Calibration(1.0 + i / 100, 2e-5, 0.003)
            path = keep_rate(directory, "cpu", 2, "1f1b", 4, False, found, "model")
            assert path == rate_path(directory, "cpu", 2)
        kept = kept_rates(directory, "cpu", 2).entries
        assert len(kept) == KEPT_RATES and kept[-1]["scale"] == pytest.approx(1.0 + (KEPT_RATES + 2) / 100)
        shapes = {(e["family"], e["microbatches"], e["pinned"], e["model"]) for e in kept}
        assert shapes == {("1f1b", 4, False, "model")}
        assert "per_step" not in kept[-1]  # the loop's time is kept apart (loop_time)
        keep_rate(directory, "cuda:1", 8, "gpipe", 2, True, Calibration(1.2, 0.0, 0.0), "model")
        assert len(kept_rates(directory, "cuda:0", 8).entries) == 1  # the kind, not the index
        assert kept_rates(directory, "cpu", 4).entries == () and kept_rates(directory, "cuda", 2).entries == ()
        rate_path(directory, "cpu", 4).write_text("not json")
        assert kept_rates(directory, "cpu", 4).entries == ()
        blocked = directory / "a file"
        blocked.write_text("")
        assert keep_rate(blocked, "cpu", 2, "1f1b", 2, False, Calibration(1.0, 0.0, 0.0), "m") is None


def test_figures_that_are_not_a_rate_are_passed_over() -> None:
    good = {"family": "1f1b", "microbatches": 2, "pinned": False, "scale": 1.1, "fixed": 2e-5, "model": "other"}
    bad = [{**good, "scale": value} for value in (None, "1.5", True, -1.0, 0.0, math.inf)]
    bad += [{**good, "fixed": -1e-5}, {key: value for key, value in good.items() if key != "fixed"}]
    got = MachineRates((good, *bad)).closest("1f1b", 2, False, "this")
    assert got is not None and (got.scale, got.fixed) == (1.1, 2e-5)
    assert MachineRates(tuple(bad)).closest("1f1b", 2, False, "this") is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-3, 1.0), st.floats(1e-3, 1.0)), min_size=2, max_size=3),
    st.floats(0.5, 2.0),
    st.floats(0.0, 1e-3),
    st.floats(0.0, 0.01),
    st.sampled_from(["gpipe", "1f1b", "2bw", "cdp"]),
    st.integers(3, 6),
    st.floats(1.0, 1.5),
)
def test_a_prior_prices_the_fit_as_a_calibration_of_its_own_would(
    stages: list[tuple[float, float]],
    scale: float,
    fixed: float,
    loop: float,
    family: str,
    m: int,
    contention: float,
) -> None:
    """Oracle: a fit priced with the rate other models' fits kept predicts what it would with the same
    figures kept by a fit of its own (no contention: a rate measured running carries it); the model's
    own calibration, where one is kept, prices the fit instead."""
    plan = one_layer_per_stage([f for f, _ in stages], [b for _, b in stages])
    options = ScheduleOptions(family=family, microbatches=m).on_workers(len(stages))
    entry = {"family": "1f1b", "microbatches": m, "pinned": False, "scale": scale, "fixed": fixed, "model": "o"}
    looped = Calibration(1.0, 0.0, loop, LOOP_MEASURED_ON)
    prices = StepPrices(loop=looped, rates=MachineRates((entry,)), model="this")
    prior = prices.prior_for(family, m, False)
    assert prior is not None and (prior.scale, prior.fixed, prior.per_step) == (scale, fixed, loop)
    priced = StepPrices(loop=looped, prior=prior)
    own = StepPrices(kept=Calibration(scale, fixed, loop))
    got, expected = priced.predict(plan, options, m, contention, False), own.predict(plan, options, m, 1.0, False)
    assert got[0] is not None and expected[0] is not None
    assert math.isclose(got[1], expected[1], rel_tol=1e-12)
    assert "what fits of other models measured" in priced.said() and "no run of this model kept" in priced.said()
    kept = Calibration(1.0, 0.0, 0.0, "an earlier fit")
    with_kept = StepPrices(kept=kept, loop=looped, prior=prior).predict(plan, options, m, 1.0, False)
    assert with_kept[1] == StepPrices(kept=kept).predict(plan, options, m, 1.0, False)[1]
    assert StepPrices(loop=looped, rates=MachineRates((entry,)), model="o").prior_for(family, m, False) is None

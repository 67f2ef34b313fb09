"""Calibrations kept for one cut of a model into layers price a fit of another cut of it with nothing
kept (``lightning_pipe.cost.calibrated.other_cuts``, ``lightning_pipe.cost.profile_cache.model_key``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from lightning_pipe.cost.calibrated import (
    Calibration,
    RunShape,
    calibration_path,
    keep_calibration,
    kept_calibration,
    other_cuts,
)
from lightning_pipe.cost.profile_cache import model_key, profile_key
from lightning_pipe.strategy.step_prices import StepPrices

CPU = torch.device("cpu")
OTHER_CUT = "; kept by a fit of another cut of this model into layers"


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)]


def _coarse(layers: list[nn.Module]) -> list[nn.Module]:
    return [nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:])]


def test_every_cut_of_a_model_has_one_model_key_and_its_own_profile_key() -> None:
    fine = _layers()
    coarse = _coarse(fine)
    assert model_key(fine, CPU) == model_key(coarse, CPU)
    assert profile_key(fine, None, (), CPU, 0) != profile_key(coarse, None, (), CPU, 0)
    other = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)]
    assert model_key(other, CPU) != model_key(fine, CPU)
    assert model_key([layer.double() for layer in _layers()], CPU) != model_key(fine, CPU)  # dtypes count
    head = nn.Linear(16, 16)
    tied = nn.Linear(16, 16)
    tied.weight = head.weight  # one tensor held by two layers (tied weights) counts once
    assert model_key([head, tied], CPU) == model_key([nn.Sequential(head, tied)], CPU)
    assert model_key([head, tied], CPU) != model_key([head, nn.Linear(16, 16)], CPU)  # untied: one weight more


def test_a_cut_with_nothing_kept_is_priced_by_the_other_cuts_of_its_model(tmp_path: Path) -> None:
    piped = Calibration(1.1, 1e-5, 2e-3, "gpipe m=2, 2026-11-30")
    later = Calibration(1.2, 2e-5, 3e-3, "1f1b m=2, 2026-11-30")
    elsewhere = Calibration(3.0, 0.0, 0.0, "interleaved m=2, 2026-11-30")
    keep_calibration(tmp_path, "coarse", RunShape("gpipe", 8), piped, model="model")
    keep_calibration(tmp_path, "coarse", RunShape("1f1b", 8), later, model="model")
    keep_calibration(tmp_path, "unrelated", RunShape("interleaved", 8), elsewhere, model="another")
    asked = RunShape("interleaved", 8)
    # the same rows, neither of interleaved's kind: the last kept of the model's, not another model's
    assert kept_calibration(tmp_path, "fine", asked, "model") == dataclasses.replace(
        later, measured_on=later.measured_on + OTHER_CUT
    )
    assert kept_calibration(tmp_path, "fine", RunShape("gpipe", 8), "model") == dataclasses.replace(
        piped, measured_on=piped.measured_on + OTHER_CUT
    )
    assert kept_calibration(tmp_path, "fine", asked) is None  # no model: only its own key
    assert kept_calibration(tmp_path, "fine", asked, "nothing kept") is None
    own = Calibration(1.3, 3e-5, 4e-3, "interleaved m=4, 2026-11-30")
    keep_calibration(tmp_path, "fine", RunShape("interleaved", 4), own, model="model")
    # its own key once it has a fit, though another cut kept the very shape asked
    assert kept_calibration(tmp_path, "fine", RunShape("gpipe", 8), "model") == own
    assert json.loads(calibration_path(tmp_path, "fine").read_text())["model"] == "model"


def test_the_other_cuts_are_read_in_the_order_written_and_unreadable_files_left_out(tmp_path: Path) -> None:
    entry = {"family": "gpipe", "rows": 8, "pinned": False, "scale": 1.0, "fixed": 0.0, "per_step": 0.0}
    newer = {**entry, "scale": 2.0, "measured_on": "newer", "written": "2026-11-30 10:00:01"}
    older = {**entry, "scale": 1.5, "measured_on": "older", "written": "2026-11-30 10:00:00"}
    calibration_path(tmp_path, "a").write_text(json.dumps({"model": "m", "runs": [newer]}))
    calibration_path(tmp_path, "b").write_text(json.dumps({"model": "m", "runs": [older]}))
    calibration_path(tmp_path, "c").write_text(json.dumps({"runs": [{**newer, "scale": 9.0}]}))  # kept unnamed
    calibration_path(tmp_path, "d").write_text("{not json")
    calibration_path(tmp_path, "e").write_text(json.dumps({"model": "m", "runs": "not a list"}))
    assert other_cuts(tmp_path, "m") == [older, newer]
    found = kept_calibration(tmp_path, "f", RunShape("gpipe", 8), "m")
    assert found is not None and found.scale == 1.5  # the lower median of the two: the smaller
    assert found.measured_on.endswith("last 2 fits" + OTHER_CUT)


def test_a_fit_of_another_cut_reads_what_the_first_cut_kept(tmp_path: Path) -> None:
    fine = _layers()
    coarse = _coarse(fine)
    shape = RunShape("1f1b", 4)
    first = StepPrices.of(coarse, None, None, CPU, tmp_path, shape, 8)
    assert first.kept is None and first.model == model_key(fine, CPU)
    found = Calibration(1.25, 1e-5, 1e-3, "1f1b m=2, 2026-11-30")
    assert first.keep("1f1b", 2, False, found) == calibration_path(tmp_path, first.key)
    second = StepPrices.of(fine, None, None, CPU, tmp_path, RunShape("interleaved", 4), 8)
    assert second.key != first.key
    assert second.kept == dataclasses.replace(found, measured_on=found.measured_on + OTHER_CUT)
    assert second.closest("gpipe", 2, False) == second.kept
    calibration_path(tmp_path, first.key).unlink()  # what was kept is read once, when the fit sets up
    assert second.closest("gpipe", 2, False) == second.kept
    assert StepPrices.of(fine, None, None, CPU, tmp_path, RunShape("interleaved", 4), 8).kept is None

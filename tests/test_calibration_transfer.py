"""``bench/calibration_transfer.py``: the lookup rules of kept calibrations replayed on calibration files,
checked against tables worked by hand."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "calibration_transfer.py"


def _kept(directory: Path, fits: list[tuple[str, bool, float]]) -> tuple[Path, dict[str, Any]]:
    """A calibration file of ``fits`` (family, pinned, scale) at 8 rows a micro-batch, in the order kept;
    the bench's names."""
    runs = [
        {
            "family": family,
            "rows": 8,
            "pinned": pinned,
            "scale": scale,
            "fixed": 0,
            "per_step": 0,
            "measured_on": family,
        }
        for family, pinned, scale in fits
    ]
    path = directory / "calibration-key.json"
    path.write_text(json.dumps({"runs": runs}))
    return path, runpy.run_path(str(BENCH))


def test_first_fits_of_a_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each fit of a family new to the model is priced from the fits kept before it: a 2BW fit kept
    after a 1F1B and an interleaved one is priced from the interleaved one (the last kept of its
    replication) by the coarse rule, from 1F1B's (one stage per worker) by the package's."""
    path, bench = _kept(tmp_path, [("1f1b", False, 2.0), ("interleaved", False, 3.4), ("2bw", False, 2.1)])
    fits = list(bench["first_fits"](bench["histories"]([path])))
    assert [entry["family"] for entry, _ in fits] == ["interleaved", "2bw"]
    kinds = bench["KINDS"]
    assert bench["picked"](kinds["replication"], *fits[1]).measured_on == "interleaved"
    assert bench["picked"](kinds["+ split backward (the package's)"], *fits[1]).measured_on == "1f1b"
    bench["main"]([str(tmp_path)])
    table = capsys.readouterr().out
    assert "2 first fits of a family" in table
    assert "| replication | 52% | 52% | 0 of 2 | 62% | 62% | 0 of 1 |" in table  # 3.4 / 2.1 and 2.0 / 3.4
    assert "| + split backward (the package's) | 23% | 23% | 1 of 2 | 5% | 5% | 1 of 1 |" in table


def test_first_fits_of_a_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each fit of a shape new to the model: a 2BW fit kept after a 1F1B and a GPipe one, both of its
    kind and rows, is priced from the last of them (GPipe's) by the package's rule, from the lower
    median of both by the pooled one."""
    path, bench = _kept(tmp_path, [("1f1b", False, 2.0), ("gpipe", False, 2.6), ("2bw", False, 2.1)])
    shapes = list(bench["new_shapes"](bench["histories"]([path])))
    assert [entry["family"] for entry, _ in shapes] == ["gpipe", "2bw"]
    package, undrifted, pooled = bench["SHAPE_RULES"].values()
    assert package(*shapes[1]).measured_on == undrifted(*shapes[1]).measured_on == "gpipe"  # nothing ran after
    assert pooled(*shapes[1]).scale == 2.0
    bench["main"]([str(tmp_path)])
    table = capsys.readouterr().out
    assert "2 first fits of a shape" in table
    # 2.0 / 2.6 and 2.6 / 2.1; pooled, 2.0 / 2.6 and 2.0 / 2.1
    assert "| the closest shape (the package's) | 23% | 23% | 0 of 2 | 24% | 24% | 0 of 1 |" in table
    assert "| the closest shape, no drift followed | 23% | 23% | 0 of 2 | 24% | 24% | 0 of 1 |" in table
    assert "| every shape as close, pooled | 14% | 14% | 1 of 2 | 5% | 5% | 1 of 1 |" in table


def test_fits_of_a_shape_kept_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each fit of a shape kept before: priced with its own shape's fits (the package's), the last fit
    of its rows and kind whatever its pinning, or the last of another family."""
    fits = [("1f1b", False, 2.0), ("2bw", False, 2.4), ("1f1b", True, 2.3), ("1f1b", False, 2.5)]
    path, bench = _kept(tmp_path, fits)
    again = list(bench["kept_shapes"](bench["histories"]([path])))
    assert [(entry["family"], entry["scale"]) for entry, _ in again] == [("1f1b", 2.5)]
    # no drift: neither shape that ran after 1F1B's first fit had run before it
    assert [rule(*again[0]).scale for rule in bench["AGAIN_RULES"].values()] == [2.0, 2.0, 2.0, 2.3, 2.4]
    bench["main"]([str(tmp_path)])
    table = capsys.readouterr().out
    assert "1 fits of a shape kept before" in table
    assert "| its shape's fits (the package's) | 20% | 20% | 0 of 1 | 20% | 20% | 0 of 1 |" in table  # 2.0 / 2.5
    assert "| the last fit of its rows and kind | 8% | 8% | 1 of 1 | 8% | 8% | 1 of 1 |" in table  # 2.3 / 2.5
    assert "| the last of another family | 4% | 4% | 1 of 1 | 4% | 4% | 1 of 1 |" in table  # 2.4 / 2.5


def test_the_drift_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Worked by hand: 2BW at 2.2, 1F1B at 2.0, 2BW again at 2.64 (x 1.2 its first), 1F1B again at 2.5.
    The second 2BW fit is priced with its first (2.2: the 1F1B fit after it had no fit before it, no
    drift), the second 1F1B fit with its first followed by half the drift 2BW measured since:
    2.0 x 1.2 ** 0.5 = 2.19 (no drift followed: 2.0; all of it: 2.4); the last fit of their rows and
    kind, 2.0 and 2.64."""
    fits = [("2bw", False, 2.2), ("1f1b", False, 2.0), ("2bw", False, 2.64), ("1f1b", False, 2.5)]
    path, bench = _kept(tmp_path, fits)
    again = list(bench["kept_shapes"](bench["histories"]([path])))
    assert [(entry["family"], entry["scale"]) for entry, _ in again] == [("2bw", 2.64), ("1f1b", 2.5)]
    package, undrifted, all_drift, latest, _ = bench["AGAIN_RULES"].values()
    assert package(*again[0]).scale == undrifted(*again[0]).scale == 2.2
    assert package(*again[1]).scale == pytest.approx(2.0 * 1.2**0.5)
    assert all_drift(*again[1]).scale == pytest.approx(2.4)
    assert (undrifted(*again[1]).scale, latest(*again[0]).scale, latest(*again[1]).scale) == (2.0, 2.0, 2.64)
    bench["main"]([str(tmp_path)])
    table = capsys.readouterr().out
    # 2.2 / 2.64 - 1 = -16.7% and 2.191 / 2.5 - 1 = -12.4%: median and mean 14.5%
    assert "| its shape's fits (the package's) | 15% | 15% | 0 of 2 | 15% | 15% | 0 of 2 |" in table
    # -16.7% and 2.0 / 2.5 - 1 = -20%
    assert "| its shape's fits, no drift followed | 18% | 18% | 0 of 2 | 18% | 18% | 0 of 2 |" in table
    # -16.7% and 2.4 / 2.5 - 1 = -4%
    assert "| its shape's fits, all the drift followed | 10% | 10% | 1 of 2 | 10% | 10% | 1 of 2 |" in table
    # 2.0 / 2.64 - 1 = -24.2% and 2.64 / 2.5 - 1 = +5.6%
    assert "| the last fit of its rows and kind | 15% | 15% | 1 of 2 | 15% | 15% | 1 of 2 |" in table

"""A kept calibration priced at the machine's rate now: half the drift later fits of the same kind
measured since the priced fits ran (``machine_drift``, ``KeptFits.closest`` in
``lightning_pipe.cost.calibrated``)."""

from __future__ import annotations

import math
import random
import statistics
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.calibrated import (
    DRIFT_FITS,
    DRIFT_SHARE,
    Calibration,
    KeptFits,
    RunShape,
    keep_calibration,
    kept_calibration,
    kept_fits,
    machine_drift,
)

ASKED = RunShape("gpipe", 8)
OTHERS = [RunShape("1f1b", 8), RunShape("2bw", 8), RunShape("cdp", 8, pinned=True), RunShape("zb_h1", 4)]
"""Shapes of ``ASKED``'s kind but ``zb_h1``'s (a backward in two actions: another kind)."""

NEW_OF_ITS_KIND = RunShape("pipedream", 8)
"""A shape of ``ASKED``'s kind that the tests first run after ``ASKED``: its rate then is not known."""


def _keep(directory: Path, fits: list[tuple[RunShape, float]]) -> None:
    for shape, scale in fits:
        keep_calibration(directory, "key", shape, Calibration(scale, 1e-5, 2e-3, f"{shape.family}, 2026-11-30"))


@settings(max_examples=60, deadline=None)
@given(
    own=st.lists(st.floats(0.5, 3.0), min_size=1, max_size=5),
    before=st.lists(st.floats(0.5, 3.0), min_size=3, max_size=3),
    slower=st.floats(0.5, 2.0),
    later=st.lists(st.integers(0, 2), min_size=1, max_size=4),  # a shape's fit before kept (5 kept a shape)
    noise=st.lists(st.tuples(st.sampled_from([3, 4]), st.floats(0.1, 9.0)), max_size=3),
    order=st.randoms(use_true_random=False),
)
def test_a_machine_uniformly_slower_since_prices_half_of_it(
    own: list[float],
    before: list[float],
    slower: float,
    later: list[int],
    noise: list[tuple[int, float]],
    order: random.Random,
) -> None:
    """Fits of three other shapes of the kind asked, then the asked shape's own, then the others again
    at ``slower`` times their first rate (any number of times), with fits of another kind and of a shape
    of its kind first run after the asked one's, at any rate, among them in any order: the machine
    drifted by ``slower`` exactly, and the asked shape is priced at the lower median of its own rates times
    ``slower`` ** :data:`DRIFT_SHARE`; its other figures as they were kept."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        _keep(directory, list(zip(OTHERS[:3], before, strict=True)))
        _keep(directory, [(ASKED, scale) for scale in own])
        after = [(OTHERS[shape], slower * before[shape]) for shape in later]
        after += [(OTHERS[3] if index == 3 else NEW_OF_ITS_KIND, scale) for index, scale in noise]
        order.shuffle(after)
        _keep(directory, after)
        found = kept_calibration(directory, "key", ASKED)
    assert found is not None
    assert found.scale == pytest.approx(statistics.median_low(own) * slower**DRIFT_SHARE, rel=1e-9)
    assert (found.fixed, found.per_step) == (1e-5, 2e-3)


def test_the_drift_a_set_up_report_says(tmp_path: Path) -> None:
    """Worked by hand: GPipe kept at 1.66x the profile while 1F1B and 2BW ran at 1.20x and 1.10x; since,
    1F1B ran at 1.32x (x 1.10) and 2BW at 1.32x (x 1.20): drift x 1.15 (their median), GPipe priced at
    1.66 x 1.15 ** 0.5 = 1.78x. The report says what was followed."""
    _keep(tmp_path, [(OTHERS[0], 1.20), (OTHERS[1], 1.10), (ASKED, 1.66), (OTHERS[0], 1.32), (OTHERS[1], 1.32)])
    found = kept_calibration(tmp_path, "key", ASKED)
    assert found is not None
    assert found.scale == pytest.approx(1.66 * math.sqrt(1.15))
    assert found.measured_on == (
        "gpipe, 2026-11-30; its rate x 1.07 for the machine's drift since (later fits measured x 1.15)"
    )
    assert "drift" not in str(kept_calibration(tmp_path, "key", OTHERS[1]))  # nothing of its kind ran after it


def test_only_the_latest_fits_tell_the_drift() -> None:
    """The median of the last :data:`DRIFT_FITS` ratios: an older one far off does not count; each ratio
    against the lower median of the shape's last fits up to the priced ones; a malformed entry is
    passed over."""
    entries = [
        {"family": "1f1b", "rows": 8, "pinned": False, "scale": 1.0, "fixed": 0.0, "per_step": 0.0, "measured_on": ""},
        {"family": "1f1b", "rows": 8, "pinned": False, "scale": 3.0, "fixed": 0.0, "per_step": 0.0, "measured_on": ""},
        {"family": "gpipe", "rows": 8, "pinned": False, "scale": 1.5, "fixed": 0.0, "per_step": 0.0, "measured_on": ""},
    ]
    ratios = [9.0, 1.2, 1.4, 1.3]  # against the lower median of 1.0 and 3.0: 1.0
    later = [{**entries[0], "scale": ratio} for ratio in ratios]
    broken = {"family": "1f1b", "rows": 8, "pinned": False, "scale": "fast"}
    kind = (False, False, False)
    assert DRIFT_FITS == 3
    assert machine_drift([*entries, *later, broken], 2, kind) == pytest.approx(1.3)
    assert machine_drift([*entries, *later], 2, (True, False, False)) == 1.0  # another kind: none
    assert machine_drift(entries, 2, kind) == 1.0  # nothing after
    found = KeptFits((*entries, *later)).closest(ASKED)
    assert found is not None and found.scale == pytest.approx(1.5 * math.sqrt(1.3))


def test_a_shape_first_priced_from_recent_fits_follows_no_drift(tmp_path: Path) -> None:
    """A shape new to the model priced from the closest shape's fits: later fits whose shapes first ran
    after those do not count (their rate then is not known), so fits of one pass over the
    configurations price each other as measured."""
    _keep(tmp_path, [(OTHERS[0], 1.2), (OTHERS[1], 1.5), (OTHERS[2], 1.9)])
    found = kept_calibration(tmp_path, "key", RunShape("1f1b", 4))  # the closest: 1F1B at other rows
    assert found is not None and found.scale == 1.2
    later = kept_fits(tmp_path, "key").closest(RunShape("gpipe", 4))  # the last of its kind, pinning alike: 2BW
    assert later is not None and (later.scale, later.measured_on) == (1.5, "2bw, 2026-11-30")

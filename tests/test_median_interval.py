"""``bench/median_interval.py``: the sign test's interval for a median, against brute force."""

from __future__ import annotations

import itertools
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.median_interval import median_interval


def _coverage(n: int, low: int, high: int) -> float:
    """By brute force over which of ``n`` draws fall below the median (each with probability 1/2):
    how often the ``low``-th and ``high``-th smallest (0-based) bracket it."""
    hits = 0
    for below in itertools.product((True, False), repeat=n):
        count = sum(below)  # draws below the median: the ordered ones 0 .. count-1
        hits += low < count <= high
    return hits / 2**n


@given(st.lists(st.floats(0.5, 1.5), min_size=1, max_size=14, unique=True), st.sampled_from([0.8, 0.9, 0.95]))
def test_interval_is_the_narrowest_order_statistics_holding_the_level(values: list[float], level: float) -> None:
    found = median_interval(values, level)
    ordered, n = sorted(values), len(values)
    low, high = ordered.index(found.low), ordered.index(found.high)
    assert low == n - 1 - high  # symmetric: the k-th smallest and the k-th largest
    assert found.level == pytest.approx(_coverage(n, low, high))
    assert found.low <= statistics.median(values) <= found.high
    if found.level < level:  # too few values: the widest there is
        assert low == 0
    elif low + 1 < high:  # the next narrower one falls short of the level
        assert _coverage(n, low + 1, high - 1) < level


def test_figures_of_the_docstring() -> None:
    assert str(median_interval([1.0, 2.0, 3.0, 4.0])) == "1.00-4.00 (88%)"
    eight = median_interval([float(v) for v in range(8)])
    assert (eight.low, eight.high, round(eight.level, 3)) == (1.0, 6.0, 0.93)
    sixteen = median_interval([float(v) for v in range(16)])
    assert (sixteen.low, sixteen.high, round(sixteen.level, 3)) == (4.0, 11.0, 0.923)


@pytest.mark.parametrize(("values", "level"), [([], 0.9), ([1.0], 1.0), ([1.0], 0.0)])
def test_bad_input_says_what_is_wrong(values: list[float], level: float) -> None:
    with pytest.raises(ValueError, match=r"no values|level must be between 0 and 1"):
        median_interval(values, level)

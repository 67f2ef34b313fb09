"""A confidence interval for a median that assumes nothing about the noise: a few paired ratios
measured on a shared machine are neither normal nor free of outliers.

Of ``n`` independent draws, each falls below the true median with probability one half, so the
number below it is binomial (n, 1/2), and the ``k``-th smallest and ``k``-th largest draws bracket the
median with probability ``1 - 2 P(B < k)``: the interval of the sign test. With 4 draws the widest,
from the smallest to the largest, holds 87.5%; with 8, from the second to the seventh, 93%; with 16,
from the fifth to the twelfth, 92%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MedianInterval", "median_interval"]


@dataclass(frozen=True)
class MedianInterval:
    """``low`` and ``high`` bracket the median with probability ``level`` (exactly, for
    independent draws of a continuous distribution)."""

    low: float
    high: float
    level: float

    def __str__(self) -> str:
        return f"{self.low:.2f}-{self.high:.2f} ({self.level:.0%})"


def _below(n: int, k: int) -> float:
    """P(B < k) for B binomial (n, 1/2)."""
    return math.fsum(math.comb(n, i) for i in range(k)) / 2**n


def median_interval(values: Sequence[float], level: float = 0.9) -> MedianInterval:
    """The narrowest order-statistic interval of ``values`` that holds their distribution's median
    with probability ``level`` at least; with too few values for that, the widest (smallest to
    largest), with the probability it does hold.

    Raises:
        ValueError: no values, or ``level`` not between 0 and 1."""
    if not values:
        raise ValueError("no values to bracket a median with")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    ordered, n = sorted(values), len(values)
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * _below(n, k + 1) >= level:
        k += 1
    return MedianInterval(ordered[k - 1], ordered[n - k], 1 - 2 * _below(n, k))

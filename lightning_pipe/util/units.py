"""Parsing and printing of byte sizes, bandwidths and durations (``16GB``, ``10GB/s``)."""

from __future__ import annotations

import math
import re

from lightning_pipe.errors import PlanningError

__all__ = ["format_bandwidth", "format_bytes", "format_seconds", "parse_bandwidth", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | float) -> float:
    """``"16GB"`` → 16e9, ``"2GiB"`` → 2·2**30, a bare number is bytes. Decimal units are SI."""
    if isinstance(text, bool):
        raise PlanningError(f"a size is a number of bytes or a string such as 16GB, not {text!r}")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise PlanningError(
                f"cannot read {text!r} as a size: write a number with an optional unit, e.g. 16GB, 1.5GiB, 800MB or 1e9"
            )
        value, unit = float(match.group(1)), match.group(2)
    size = value * _UNITS[unit.lower()]
    if not math.isfinite(size) or size <= 0:
        raise PlanningError(f"a size must be a positive finite number of bytes, got {text!r}")
    return size


def parse_bandwidth(text: str | float) -> float:
    """``"10GB/s"`` → 1e10 bytes per second; ``"inf"`` means no communication cost."""
    if isinstance(text, str):
        if text.strip().lower() in {"inf", "infinite", "infinity"}:
            return math.inf
        text = text.strip()
        if text.lower().endswith("/s"):
            text = text[:-2]
    return parse_bytes(text)


def format_bytes(size: float) -> str:
    """Binary units, three significant digits: ``1.50 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def format_bandwidth(bytes_per_second: float) -> str:
    """``1.5 GiB/s``; ``free`` for an infinite bandwidth."""
    return "free" if math.isinf(bytes_per_second) else f"{format_bytes(bytes_per_second)}/s"


def format_seconds(seconds: float) -> str:
    """``12.3 ms`` style durations."""
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"

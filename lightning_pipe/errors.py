"""Errors that tell the user what is wrong and what would work."""

from __future__ import annotations

import math

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "IncompleteCheckpoint",
    "PlanningError",
    "check_flag",
    "check_positive",
    "check_whole",
]


class PlanningError(ValueError):
    """A planning request that cannot be satisfied or is malformed.

    The message always says what is wrong and, where one exists, what would work instead.
    """


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: of another model, damaged, or mixing parts of
    different saves. The message names the file (or the part of it) and what would work."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint whose save did not finish (a stopped process, a full disk): the message names it,
    says what is missing, and lists the complete checkpoints beside it when it is read to resume."""


class CheckpointSaveError(OSError):
    """A save that failed on some rank, raised on every rank with the path and the cause; the
    checkpoints saved before are intact and nothing of this one is left."""


def check_whole(name: str, value: object, minimum: int, unit: str | None = None, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a whole number (of ``unit``) >= ``minimum``, or ``None`` when
    ``optional`` (``True`` and ``2.0`` are not whole numbers here)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f"a whole number of {unit}" if unit else "a whole number"
        raise PlanningError(f"{name} must be {what} >= {minimum}{', or None' if optional else ''}; got {value!r}")


def check_flag(name: str, value: object, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is ``True`` or ``False``, or ``None`` when ``optional`` (``"yes"`` and
    ``1`` are not flags here: a string is always true)."""
    if isinstance(value, bool) or (optional and value is None):
        return
    raise PlanningError(f"{name} must be True or False{', or None' if optional else ''}; got {value!r}")


def check_positive(name: str, value: object, unit: str | None = None, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a finite number (of ``unit``) > 0, or ``None`` when ``optional``
    (``True`` and ``"30"`` are not numbers here)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        what = f"a number of {unit}" if unit else "a number"
        raise PlanningError(f"{name} must be {what} > 0{', or None' if optional else ''}; got {value!r}")

"""Errors that tell the user what is wrong and what would work."""

from __future__ import annotations

__all__ = ["PlanningError", "check_whole"]


class PlanningError(ValueError):
    """A planning request that cannot be satisfied or is malformed.

    The message always says what is wrong and, where one exists, what would work instead.
    """


def check_whole(name: str, value: object, minimum: int, unit: str) -> None:
    """Refuse an option that is neither ``None`` nor a whole number of ``unit`` >= ``minimum``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise PlanningError(f"{name} must be a whole number of {unit} >= {minimum}, or None; got {value!r}")

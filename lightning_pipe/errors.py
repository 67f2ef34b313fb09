"""Errors that tell the user what is wrong and what would work."""

from __future__ import annotations

__all__ = ["PlanningError"]


class PlanningError(ValueError):
    """A planning request that cannot be satisfied or is malformed.

    The message always says what is wrong and, where one exists, what would work instead.
    """

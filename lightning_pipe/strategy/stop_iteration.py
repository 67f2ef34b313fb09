"""A ``StopIteration`` inside a step is an error, not the end of the data.

Lightning's loops take a ``StopIteration`` for the end of the epoch's data: one raised inside a step
(the user's code, or the pipeline) would end the epoch there without a word, on every rank, with the
rest of its batches untrained (plain Lightning does the same with a step's own). The strategy's step
hooks turn it into a ``RuntimeError`` that names the hook and the rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["no_stop_iteration"]


def no_stop_iteration(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a strategy's step method) with a ``StopIteration`` raised inside it turned into a
    ``RuntimeError``."""

    @functools.wraps(hook)
    def guarded(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(strategy, *args, **kwargs)
        except StopIteration as error:
            raise RuntimeError(
                f"StopIteration raised inside {hook.__name__} on rank {strategy.global_rank} ({error!r}): Lightning "
                "would take it for the end of the epoch's data and end the epoch there without a word; an exhausted "
                "iterator in the step (next() without a default) is the usual cause"
            ) from error

    return guarded

"""``ckpt_path="last"`` that resumes from the newest complete checkpoint.

Lightning resolves ``"last"`` to the newest of the ``last*.ckpt`` checkpoints of the ``ModelCheckpoint``
callbacks (and the ``OnExceptionCheckpoint`` file), by modification time, before any strategy hook
runs. The strategy's launchers (which Lightning calls first, with the fit's arguments) resolve it
beforehand the same way, after two repairs: the temporaries of writers that died are removed and a
checkpoint renamed aside for a replacement that never came is put back (:func:`~.atomic.sweep`); and
an incomplete candidate (a file another writer left cut short) is skipped, with a warning naming it,
for the newest complete one. Checkpoints the strategy wrote are always complete (:mod:`.atomic`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.strategy.atomic import sweep
from lightning_pipe.strategy.checkpoint_files import newest_complete

__all__ = ["complete_last"]


def complete_last(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], trainer: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``function``'s arguments with ``ckpt_path="last"`` replaced by the newest complete candidate
    when a newer one is incomplete; unchanged otherwise (Lightning then resolves ``"last"`` itself)."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    directories = {Path(d) for d in _checkpoint_directories(trainer)}
    for directory in directories:
        sweep(directory)
    candidates = [str(path) for path in _last_candidates(trainer)]
    chosen, skipped = newest_complete(candidates)
    if not skipped or chosen is None:
        return args, kwargs
    rank_zero_warn(
        f'ckpt_path="last": {", ".join(str(p) for p in skipped)} is incomplete (a save that did not finish); '
        f"resuming from {chosen}, the newest complete one"
    )
    bound.arguments["ckpt_path"] = str(chosen)
    return bound.args, bound.kwargs


def _checkpoint_callbacks(trainer: Any) -> list[Any]:
    return [callback for callback in trainer.callbacks if hasattr(callback, "_find_last_checkpoints")]


def _checkpoint_directories(trainer: Any) -> list[str]:
    """Where the trainer's checkpoint callbacks write (those with a directory set)."""
    found = [callback.dirpath for callback in _checkpoint_callbacks(trainer) if callback.dirpath]
    return found + [str(Path(path).parent) for path in _on_exception_paths(trainer)]


def _last_candidates(trainer: Any) -> set[str]:
    """What Lightning looks at for ``"last"``: the ``OnExceptionCheckpoint`` file and every
    ``ModelCheckpoint``'s ``last*.ckpt``."""
    candidates = set(_on_exception_paths(trainer))
    for callback in _checkpoint_callbacks(trainer):
        candidates |= callback._find_last_checkpoints(trainer)
    return candidates


def _on_exception_paths(trainer: Any) -> list[str]:
    """The files of the trainer's ``OnExceptionCheckpoint`` callbacks (of either Lightning package)."""
    return [c.ckpt_path for c in trainer.callbacks if type(c).__name__ == "OnExceptionCheckpoint"]

"""Errors that tell the user what is wrong and what would work, typed by the phase that raises them.

- :class:`PlanningError` (a ``ValueError``): set-up. The request cannot be met or is malformed, and
  nothing of the run has happened with it: the strategy's or the schedule's options, a model the
  pipeline cannot capture or split, a plan or memory limit that does not fit the model, a checkpoint
  resumed on a split it cannot take. Change the request and start again.
- :class:`PipelineRuntimeError` (a ``RuntimeError``): running. The pipeline is built and met, in a
  training or evaluation step, something it cannot go on with: step code that breaks the model
  contract (no loss returned, ``forward`` not called or called with two different inputs, an
  attribute the captured graph holds changed, a value it cannot log), a batch it cannot cut into
  micro-batches, messages between stages that do not match, a call made out of order (a checkpoint
  restored or written while steps are in flight).
- :class:`CheckpointError` and its kinds: a checkpoint that cannot be read as asked, or a save that
  failed (:class:`CheckpointSaveError`, an ``OSError``).

The user's own exceptions, raised in their step or their modules, are never turned into these: they
reach the caller with their own type (on every rank, see :mod:`lightning_pipe.runtime.failure`).
"""

from __future__ import annotations

import math

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "IncompleteCheckpoint",
    "PipelineRuntimeError",
    "PlanningError",
    "check_flag",
    "check_positive",
    "check_whole",
]


class PlanningError(ValueError):
    """A planning request that cannot be satisfied or is malformed.

    Raised by the planning tools (partitioners, schedules, cost models) and while the pipeline is
    set up, before it runs a step with the request (see the module
    docstring; once it runs, :class:`PipelineRuntimeError`). The message always says what is wrong
    and, where one exists, what would work instead.
    """


class PipelineRuntimeError(RuntimeError):
    """What the pipeline, once running, cannot go on with: step code that breaks the model contract,
    a batch it cannot cut, messages between stages that do not match, a call made out of order.

    Unlike :class:`PlanningError` (set-up, a ``ValueError``: the options, the model's split, the plan)
    it is raised in a training or evaluation step, the executor's action loop or a save or restore
    while the pipeline runs. The message says what happened and what would work instead.
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

"""A checkpoint save that every rank takes part in and agrees on.

Lightning calls ``save_checkpoint`` on every rank. A pipeline's save is a collective: in the full
format rank 0 writes what the ranks gathered to it; in the sharded format every rank writes its own
stages. :func:`save_together` runs either in four steps:

1. global rank 0 names the save (a random id stamped on every part) and, for a directory, makes the
   temporary directory the ranks write into, beside the checkpoint (:mod:`.atomic`); it tells every
   rank;
2. each rank writes its part, catching its own failure;
3. rank 0 gathers every rank's outcome: if every part was written it renames the directory into place,
   otherwise it removes it;
4. rank 0 tells every rank the outcome: each returns, or each raises the same
   :class:`~lightning_pipe.errors.CheckpointSaveError`, naming the checkpoint, the rank that failed,
   its error and, when the disk was full, the space left.

A rank that dies during the save breaks the collectives: the others remove the temporaries of the
writers that died on their host (:func:`~.atomic.sweep`) and raise
:class:`~lightning_pipe.errors.CheckpointSaveError` with what the job recorded (the rank that died).
In every case the checkpoints saved before are left as they were.
"""

from __future__ import annotations

import dataclasses
import errno
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_pipe.errors import CheckpointSaveError
from lightning_pipe.strategy.atomic import publish, remove, sweep, temporary_name
from lightning_pipe.util.units import format_bytes

__all__ = ["SaveRanks", "save_together"]

_NEARLY_FULL = 1 << 20  # free bytes below which a failed write is put down to a full disk


@dataclasses.dataclass(frozen=True)
class SaveRanks:
    """The ranks of a save: this one (``rank``), the process group over all of them (``None``: this
    process alone) and the error a rank that failed recorded for the job (``aborted``)."""

    rank: int
    group: Any = None
    aborted: Callable[[], BaseException] | None = None

    def broadcast(self, obj: Any, path: Path) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        self._collective(path, lambda: dist.broadcast_object_list(box, 0, group=self.group))
        return box[0]

    def gather(self, obj: Any, path: Path) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
        if self.group is None:
            return [obj]
        gathered: list[Any] | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        self._collective(path, lambda: dist.gather_object(obj, gathered, dst=0, group=self.group))
        return gathered

    def _collective(self, path: Path, run: Callable[[], None]) -> None:
        """``run()``; when it fails (a rank died or stopped), clean up after the dead writers on this
        host and raise the job's error as a failed save."""
        try:
            run()
        except RuntimeError as error:
            sweep(path.parent)
            cause = self.aborted() if self.aborted is not None else error
            raise CheckpointSaveError(
                f"could not save the checkpoint {path}: another rank stopped during the save "
                f"({type(cause).__name__}: {cause}). {_INTACT}"
            ) from cause


_INTACT = "The checkpoints saved before are intact; nothing of this one is left"


def save_together(
    path: str | Path, write: Callable[[Path | None, str], None], directory: bool, ranks: SaveRanks
) -> None:
    """Save the checkpoint ``path`` (global rank 0's) on every rank: ``write(temporary, save_id)``
    writes this rank's part (``temporary``: the directory to write into when ``directory``, else
    ``None``: rank 0 writes the file itself, atomically). Returns on every rank once the checkpoint is
    in place.

    Raises:
        CheckpointSaveError: on every rank, when a rank failed to write its part or died.
    """
    path = Path(path)
    plan: tuple[Path, Path | None, str, str | None] | None = None
    if ranks.rank == 0:
        temporary = temporary_name(path) if directory else None
        failure = _attempt(lambda: _prepare(path, temporary), path)
        plan = (path, temporary, secrets.token_hex(8), failure)
    path, temporary, save_id, failure = ranks.broadcast(plan, path)
    try:
        if failure is None:
            failure = _attempt(lambda: write(temporary, save_id), path)
        outcomes = ranks.gather(failure, path)
        outcome = None
        if outcomes is not None:  # rank 0
            outcome = next(((rank, f) for rank, f in enumerate(outcomes) if f is not None), None)
            if outcome is None and temporary is not None:
                published = _attempt(lambda: publish(temporary, path), path)
                outcome = None if published is None else (0, published)
        outcome = ranks.broadcast(outcome, path)
    except CheckpointSaveError:  # a rank died: whoever is left removes the directory it was written into
        if temporary is not None:
            remove(temporary)
        raise
    if outcome is not None and temporary is not None:
        remove(temporary)
    if outcome is not None:
        rank, described = outcome
        raise CheckpointSaveError(f"could not save the checkpoint {path}: rank {rank} failed: {described}. {_INTACT}")


def _prepare(path: Path, temporary: Path | None) -> None:
    """Rank 0, before a save: the checkpoint's directory, cleaned of dead writers' temporaries, and
    the temporary directory the ranks write into."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path.parent)
    if temporary is not None:
        temporary.mkdir()


def _attempt(run: Callable[[], object], path: Path) -> str | None:
    """``None`` when ``run()`` succeeds, else what went wrong, said for every rank to read."""
    try:
        run()
    except (Exception, CheckpointException) as error:
        return _describe(error, path.parent)
    return None


def _describe(error: BaseException, directory: Path) -> str:
    """The error's type and message (DCP's per-rank errors unwrapped), and the disk's free space when
    the disk is full."""
    causes = list(_causes(error))
    shown = next((c for c in causes if not isinstance(c, CheckpointException)), error)
    text = f"{type(shown).__name__}: {str(shown).strip().splitlines()[-1] if str(shown).strip() else ''}"
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return text
    full = any(getattr(c, "errno", None) == errno.ENOSPC for c in causes) or free < _NEARLY_FULL
    return f"{text} (the disk holding {directory} is full: {format_bytes(free)} free)" if full else text


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, the errors it was raised from, and the errors of the ranks DCP collected in it."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            pending += [wrapped for wrapped, _ in current.failures.values()]
        pending += [c for c in (current.__cause__, current.__context__) if c is not None]

"""Reading the checkpoint a run is given, and finding the complete ones.

A full checkpoint is one ``torch.save`` file: a zip archive whose index (the central directory) is its
last part, so a file cut short by a save that did not finish has none, which :func:`check_file` finds
without reading the rest. A sharded checkpoint is a directory, checked part by part
(:func:`.sharded.check_sharded`). A refusal names the file, says what is missing, and lists the
complete checkpoints beside it, newest first; ``ckpt_path="last"`` skips an incomplete ``last``
checkpoint by itself (:func:`newest_complete`).

The strategy writes every checkpoint atomically (:mod:`.atomic`), so what it wrote is never
incomplete: these checks are for files that other writers left, or that were cut short on the way
(a copy, a disk that failed).
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning_pipe.errors import CheckpointError, IncompleteCheckpoint
from lightning_pipe.strategy.atomic import TEMPORARY
from lightning_pipe.strategy.sharded import METADATA, check_sharded, is_sharded, load_sharded

__all__ = ["check_complete", "check_file", "complete_beside", "load_checkpoint", "newest_complete"]

_ZIP = b"PK\x03\x04"  # how a zip archive (torch.save's format since PyTorch 1.6) begins
_LISTED = 5  # complete checkpoints named in a refusal


def check_file(path: str | Path) -> None:
    """Refuse a checkpoint file that is empty or a zip archive without its index (cut short)."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise IncompleteCheckpoint(f"{path} is incomplete: it is empty; {_UNFINISHED}")
    with open(path, "rb") as handle:
        if handle.read(len(_ZIP)) != _ZIP:
            return  # not torch.save's zip format: reading it will tell
    try:
        zipfile.ZipFile(path).close()
    except zipfile.BadZipFile:
        raise IncompleteCheckpoint(
            f"{path} is incomplete: its {size} bytes end before the archive's index (torch.save writes it last); "
            f"{_UNFINISHED}"
        ) from None


_UNFINISHED = "a save that did not finish leaves this (its process was stopped, or the disk filled)"


def check_complete(path: str | Path) -> None:
    """Refuse ``path`` unless it is a complete checkpoint file or sharded directory."""
    if Path(path).is_dir():
        check_sharded(path)
    else:
        check_file(path)


def _complete(path: Path) -> bool:
    try:
        check_complete(path)
    except (CheckpointError, OSError):
        return False
    return True


def _written_at(path: Path) -> float:
    """When a checkpoint was finished: a sharded directory's ``meta.pt`` is written last."""
    return (path / METADATA).stat().st_mtime if path.is_dir() else path.stat().st_mtime


def complete_beside(path: str | Path) -> list[Path]:
    """The complete checkpoints (``*.ckpt`` files, sharded directories) in ``path``'s directory, but
    ``path``, newest first."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    found = [
        entry
        for entry in path.parent.iterdir()
        if entry != path
        and not entry.name.startswith(TEMPORARY)
        and (is_sharded(entry) or (entry.is_file() and entry.suffix == ".ckpt"))
        and _complete(entry)
    ]
    return sorted(found, key=_written_at, reverse=True)


def _listing(path: Path) -> str:
    """The complete checkpoints beside ``path``, as a refusal names them."""
    beside = complete_beside(path)
    if not beside:
        return "There is no complete checkpoint beside it."
    named = ", ".join(
        f"{entry.name} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(_written_at(entry)))})"
        for entry in beside[:_LISTED]
    )
    more = f" and {len(beside) - _LISTED} more" if len(beside) > _LISTED else ""
    return f"Complete checkpoints beside it, newest first: {named}{more}: resume from one of them."


def load_checkpoint(path: str | Path, read_file: Callable[[], dict[str, Any]], weights_only: bool | None) -> dict:
    """The checkpoint at the local ``path`` (a file read by ``read_file``, or a sharded directory),
    refused with its name and the reason when it is incomplete, damaged or not a checkpoint."""
    path = Path(path)
    try:
        if is_sharded(path):
            return load_sharded(path, weights_only)
        if path.is_dir():
            raise CheckpointError(
                f"{path} is a directory without the files of a sharded checkpoint ({METADATA}, .metadata, "
                "*.distcp): give a checkpoint file, or a directory PipelineStrategy(state_dict_type='sharded') wrote"
            )
        check_file(path)
        try:
            return read_file()
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as error:
            raise CheckpointError(
                f"{path} cannot be read as a checkpoint ({type(error).__name__}: {error}); it is damaged or not a "
                "checkpoint torch.save wrote"
            ) from error
    except IncompleteCheckpoint as error:
        raise IncompleteCheckpoint(f"{error}. {_listing(path)}") from None


def newest_complete(candidates: Iterable[str | Path]) -> tuple[Path | None, list[Path]]:
    """Among ``candidates`` (paths, some perhaps missing), the newest complete checkpoint, and the
    existing candidates newer than it that are incomplete."""
    existing = [Path(p) for p in candidates if Path(p).is_file() or is_sharded(p)]
    existing.sort(key=lambda p: p.stat().st_mtime, reverse=True)  # as Lightning orders them
    skipped = []
    for candidate in existing:
        if _complete(candidate):
            return candidate, skipped
        skipped.append(candidate)
    return None, skipped


def check_same_model(source: str, model: str, held: dict[str, Any], saved: Any) -> None:
    """Refuse a checkpoint ``state_dict`` (``saved``) of another model than ``held`` (the module's
    ``state_dict(keep_vars=True)``): entries missing or unexpected, or of other shapes, named."""
    missing = [name for name in held if name not in saved]
    unexpected = [name for name in saved if name not in held]
    shapes = (
        saved.shapes() if hasattr(saved, "shapes") else {k: v.shape for k, v in saved.items() if hasattr(v, "shape")}
    )
    resized = [
        f"{name} {tuple(shapes[name])} (the module's: {tuple(held[name].shape)})"
        for name in held
        if name in shapes and tuple(shapes[name]) != tuple(held[name].shape)
    ]
    if not (missing or unexpected or resized):
        return
    problems = [
        f"{len(found)} {what}: {_some(found)}"
        for found, what in (
            (missing, "entries of the module missing from it"),
            (unexpected, "entries the module does not have"),
            (resized, "entries of another shape"),
        )
        if found
    ]
    raise CheckpointError(
        f"{source} is not a checkpoint of this {model}: {'; '.join(problems)}. Resume with the module the checkpoint "
        "was written for (or load the entries that match with load_state_dict(strict=False) yourself)"
    )


def _some(names: list[str], shown: int = 5) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more

"""Checkpoints that appear under their name only when complete.

Every checkpoint the strategy writes (a file, or a sharded directory) is first written under a
temporary name in the directory it belongs to, flushed to the disk, and then renamed over its final
name: a rename within one filesystem is atomic, so a reader sees the previous checkpoint or the new
one, never part of one, whatever stops the writer (a kill, a full disk, a power cut). A failed write
removes its temporary; a writer killed outright cannot, so the temporaries of processes that no longer
run are removed by the next save or load in that directory (:func:`sweep`), or at once by the other
ranks of the job when they see the writer die.

Temporaries are hidden and never contain the checkpoint's name (``.lightning_pipe.tmp-<host>-<pid>-<id>``):
Lightning looks for ``hpc_ckpt_<N>`` and ``last*.ckpt`` by name, and must not take a temporary for one.

A directory cannot be renamed over a non-empty one. It is swapped with the old one in one step where
the filesystem can (Linux's ``renameat2(RENAME_EXCHANGE)``: ext4, XFS, btrfs, tmpfs), and the old one
then removed; elsewhere (NFS, Lustre) the old one is first renamed aside, marked with the name it
held, so that :func:`sweep` puts it back if the writer is killed between the two renames.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["TEMPORARY", "publish", "remove", "sweep", "temporary_name", "write_file"]

TEMPORARY = ".lightning_pipe.tmp-"  # a checkpoint being written
_ASIDE = ".lightning_pipe.old-"  # a checkpoint being replaced (filesystems without an atomic swap)
_TARGET = ".lightning_pipe.target"  # inside an aside directory: the name it is to get back
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def temporary_name(path: str | Path, prefix: str = TEMPORARY) -> Path:
    """A name beside ``path`` for a temporary, unique to this process and call."""
    return Path(path).with_name(f"{prefix}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def write_file(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write the file ``path`` with ``write(handle)``, atomically: it appears (or replaces the file
    there) only once ``write`` returned and the bytes are on the disk; if anything fails, ``path``
    is as it was and no temporary is left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        publish(temporary, path)
    except BaseException:
        remove(temporary)
        raise


def publish(temporary: str | Path, path: str | Path) -> None:
    """Put the complete ``temporary`` (a file or a directory) under the name ``path``, replacing what
    was there, atomically where the filesystem allows (see the module's docstring)."""
    temporary, path = Path(temporary), Path(path)
    if not path.is_dir() and not temporary.is_dir():
        os.replace(temporary, path)
    elif not path.exists() and not path.is_symlink():
        os.rename(temporary, path)
    elif _exchange(temporary, path):
        remove(temporary)  # now the old checkpoint
    else:
        aside = temporary_name(path, _ASIDE)
        if path.is_dir():
            (path / _TARGET).write_text(path.name)
        os.rename(path, aside)
        os.rename(temporary, path)
        remove(aside)
    _sync_directory(path.parent)


def remove(path: str | Path) -> None:
    """Delete the file or directory ``path`` if it exists (a directory is first renamed to a
    temporary, so that no half-deleted checkpoint is ever seen under its name)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        doomed = path if path.name.startswith((TEMPORARY, _ASIDE)) else temporary_name(path)
        with contextlib.suppress(FileNotFoundError):
            if doomed != path:
                os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep(directory: str | Path) -> list[Path]:
    """Clean up after writers on this host that died: delete their temporaries in ``directory`` and
    put back a checkpoint that was renamed aside for a replacement that never arrived. Returns the
    temporaries removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        prefix = next((p for p in (TEMPORARY, _ASIDE) if entry.name.startswith(p)), None)
        if prefix is None or not _writer_gone(entry.name[len(prefix) :]):
            continue
        target = entry / _TARGET
        if prefix == _ASIDE and target.is_file():
            original = directory / target.read_text()
            if not original.exists():
                target.unlink()
                os.rename(entry, original)
                continue
        remove(entry)
        removed.append(entry)
    return removed


def _writer_gone(tag: str) -> bool:
    """Whether the process named in a temporary's ``<host>-<pid>-<id>`` ran on this host and ended."""
    host, _, pid = tag.rpartition("-")[0].rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return _zombie(int(pid))


def _zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended but its parent has not collected it yet (Linux's state Z)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2``); ``False`` where the system
    or the filesystem cannot."""
    rename = getattr(_libc(), "renameat2", None)
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _sync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (the rename) to the disk, where the system allows it."""
    with contextlib.suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)

"""Faults injected into checkpoint writes, for the tests of what a failed save leaves behind.

:class:`Fault` wraps ``open`` (``builtins.open`` and ``io.open``, which ``pathlib`` and
``torch.distributed.checkpoint`` use) in one process: the ``nth`` file this rank opens for writing
under a temporary name (:data:`lightning_pipe.strategy.atomic.TEMPORARY`, where every save of the
strategy writes first) gets ``after`` bytes, and then the process is killed (``SIGKILL``, as a
scheduler or the out-of-memory killer does: no handler runs) or the write raises ``ENOSPC`` as a full
disk does. Before acting it writes ``fault-<rank>.json`` into a directory of records (not on the disk
that may be full): the file, the bytes written and the time, so a test can show the fault landed
mid-write and time how fast the other ranks stop.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from lightning_pipe.strategy.atomic import TEMPORARY
from tests.lightning_cases import fit_case


class _Faulty:
    """A file opened for writing that fails after ``budget`` bytes."""

    def __init__(self, handle: Any, fault: Fault, path: str) -> None:
        self._handle, self._fault, self._path, self._written = handle, fault, path, 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        room = self._fault.after - self._written
        if size <= room:
            self._written += size
            return self._handle.write(data)
        self._handle.write(memoryview(data).cast("B")[: max(room, 0)])
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._fault.act(self._path, self._written + max(room, 0))
        raise AssertionError("unreachable")

    def __enter__(self) -> _Faulty:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class Fault:
    """On rank ``rank``, the ``nth`` write-open of a temporary file gets ``after`` bytes, then
    ``kind``: ``"kill"`` (SIGKILL) or ``"full"`` (``OSError(ENOSPC)``)."""

    def __init__(self, records: str, rank: int, kind: str, nth: int, after: int) -> None:
        self.records, self.rank, self.kind, self.nth, self.after = records, rank, kind, nth, after
        self.opened = 0
        self._open = builtins.open

    def install(self) -> None:
        original = self._open

        def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = original(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax") and TEMPORARY in str(file):
                self.opened += 1
                if self.opened == self.nth:
                    return _Faulty(handle, self, str(file))
            return handle

        builtins.open = io.open = opening

    def act(self, path: str, written: int) -> None:
        record = {"path": path, "written": written, "time": time.time(), "kind": self.kind}
        Path(self.records, f"fault-{self.rank}.json").write_text(json.dumps(record))
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def faulty_fit(
    rank: int, root: str, case: dict[str, Any], fault: dict[str, Any] | None, records: str
) -> dict[str, Any]:
    """Worker of ``run_local``: ``case`` trained under ``root`` with ``fault`` on its rank; an error
    that stops this rank is written to ``records/outcome-<rank>.json`` (type, message, time) before it
    is raised again."""
    if fault is not None and fault["rank"] == rank:
        Fault(records, **fault).install()
    try:
        return fit_case(rank, str(Path(root) / case["name"]), case)
    except BaseException as error:
        record = {"type": type(error).__name__, "message": str(error), "time": time.time()}
        Path(records, f"outcome-{rank}.json").write_text(json.dumps(record))
        raise

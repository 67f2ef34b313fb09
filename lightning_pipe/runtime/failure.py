"""Stop every rank within seconds when one fails, instead of the 30-minute collective timeout.

How a failure travels (no helper thread, no polling):

- a rank that raises writes its error, pickled, to the job's key-value store (first failure wins),
  then tears its pipeline groups down (:meth:`~lightning_pipe.runtime.transport.Transport.abort`):
  the connections to it close;
- a rank that dies closes its connections with it;
- a rank whose wait fails on a closed connection reads the store and raises the recorded error
  itself — the user's exception (an out-of-memory error, a ``ValueError`` of the step) with its own
  type and message, a note naming the rank it was raised on, and :func:`raised_elsewhere` true — or
  :class:`PipelineAborted` when it cannot be rebuilt here (an exception class that does not pickle)
  or a peer died (recorded, so ranks further along name the same rank); then it tears its own groups
  down, so ranks waiting on it stop too.

A rank that hangs alive is caught by the wait timeout of the transport.
"""

from __future__ import annotations

import contextlib
import pickle

import torch.distributed as dist

__all__ = ["FailureBoard", "PipelineAborted", "add_note", "raised_elsewhere"]

_ABORT = "lightning_pipe/abort"
_RAISED_ON = "lightning_pipe_raised_on_rank"  # set on an error rebuilt from another rank's record
_NO_RECORD = "a peer's process ended without recording an error (killed, or it died: see its own log)"


class PipelineAborted(RuntimeError):
    """Another rank failed (or died) and its error cannot be raised here; the message names it."""


def raised_elsewhere(error: BaseException) -> bool:
    """Whether ``error`` stops this rank because another rank failed (it is that rank's error)."""
    return isinstance(error, PipelineAborted) or hasattr(error, _RAISED_ON)


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``: shown under the error's message in its traceback (Python >= 3.11)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


class FailureBoard:
    """The record of the job's first failure, in the store every rank shares.

    Args:
        store: the default process group's store (hosted by rank 0's process).
        rank: this rank.
    """

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def fail(self, error: BaseException) -> None:
        """Record that this rank failed with ``error`` (the error itself when it pickles)."""
        message = f"rank {self.rank} failed with {type(error).__name__}: {error}"
        try:
            record = pickle.dumps((self.rank, message, error))
            pickle.loads(record)  # an exception class whose constructor takes other arguments does not rebuild
        except Exception:
            record = pickle.dumps((self.rank, message, None))
        self._record(record)

    def report(self, message: str) -> None:
        """Record ``message`` as the job's failure unless one is recorded already."""
        self._record(pickle.dumps((None, message, None)))

    def _record(self, record: bytes) -> None:
        with contextlib.suppress(Exception):  # reporting must never hide the original error
            self.store.compare_set(_ABORT, b"", record)

    def aborted(self) -> BaseException:
        """The error this rank stops with: the recorded one (see the module docstring)."""
        try:
            record = self.store.get(_ABORT) if self.store.check([_ABORT]) else b""
        except Exception as error:  # the store lives in rank 0's process
            return PipelineAborted(
                f"pipeline stopped on rank {self.rank}: the job's store is unreachable ({error}); the rank that "
                "hosts it (rank 0) probably died"
            )
        rank, message, error = pickle.loads(record) if record else (None, _NO_RECORD, None)
        if error is None:
            return PipelineAborted(f"pipeline stopped on rank {self.rank}: {message}")
        setattr(error, _RAISED_ON, rank)
        add_note(error, f"raised on rank {rank}; rank {self.rank} stopped because of it")
        return error

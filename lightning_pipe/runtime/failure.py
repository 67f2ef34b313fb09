"""Stop every rank within seconds when one fails, instead of the 30-minute collective timeout.

How a failure travels (no helper thread, no polling):

- a rank that raises writes its error to the job's key-value store (first failure wins), then tears
  its pipeline groups down (:meth:`~lightning_pipe.runtime.transport.Transport.abort`): the
  connections to it close;
- a rank that dies closes its connections with it;
- a rank whose wait fails on a closed connection reads the store and raises
  :class:`PipelineAborted` with the recorded error (or records the peer's death if nothing is
  recorded), then tears its own groups down, so ranks waiting on it stop too.

A rank that hangs alive is caught by the wait timeout of the transport.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["FailureBoard", "PipelineAborted"]

_ABORT = "lightning_pipe/abort"


class PipelineAborted(RuntimeError):
    """Another rank failed; the message names it and its error."""


class FailureBoard:
    """The record of the job's first failure, in the store every rank shares.

    Args:
        store: the default process group's store (hosted by rank 0's process).
        rank: this rank.
    """

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def fail(self, error: BaseException) -> None:
        """Record that this rank failed with ``error``."""
        self.report(f"rank {self.rank} failed with {type(error).__name__}: {error}")

    def report(self, message: str) -> None:
        """Record ``message`` as the job's failure unless one is recorded already."""
        with contextlib.suppress(Exception):  # reporting must never hide the original error
            self.store.compare_set(_ABORT, "", message)

    def aborted(self) -> PipelineAborted:
        """The error this rank stops with: the recorded failure."""
        try:
            message = self.store.get(_ABORT).decode() if self.store.check([_ABORT]) else ""
        except Exception as error:  # the store lives in rank 0's process
            return PipelineAborted(
                f"pipeline stopped on rank {self.rank}: the job's store is unreachable ({error}); the rank that "
                "hosts it (rank 0) probably died"
            )
        return PipelineAborted(f"pipeline stopped on rank {self.rank}: {message or 'a peer failed'}")

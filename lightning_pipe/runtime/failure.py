"""Stop every rank within seconds when one fails, instead of the 30-minute collective timeout.

A rank that raises writes its error to the process group's key-value store before re-raising; a
rank that dies without a word stops its heartbeat. Every wait in the runtime polls :meth:`Watchdog.check`,
which raises :class:`PipelineAborted` naming the failed rank and its exception (or its silence).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch.distributed as dist

__all__ = ["PipelineAborted", "Watchdog"]

_ABORT = "lightning_pipe/abort"
_BEAT = "lightning_pipe/heartbeat/"


class PipelineAborted(RuntimeError):
    """Another rank failed; the message names it and its error."""


class Watchdog:
    """Failure detection for one rank.

    Args:
        store: the store every rank of the job shares (the default process group's store).
        rank, world_size: this rank and how many there are.
        heartbeat_seconds: how often this rank proves it is alive (from a daemon thread).
        dead_after_seconds: a rank silent for this long is declared dead.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        heartbeat_seconds: float = 0.5,
        dead_after_seconds: float = 10.0,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.dead_after = dead_after_seconds
        self._interval = heartbeat_seconds
        self._next_check = 0.0
        self._next_pulse = 0.0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"lightning_pipe-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"{_BEAT}{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return

    def close(self) -> None:
        """Stop the heartbeat (before the process group and its store go away)."""
        self._stop.set()
        self._thread.join()

    def fail(self, error: BaseException) -> None:
        """Tell every rank that this one failed (first failure wins)."""
        message = f"rank {self.rank} failed with {type(error).__name__}: {error}"
        with contextlib.suppress(Exception):  # reporting must never hide the original error
            self.store.compare_set(_ABORT, "", message)

    def check(self, force: bool = False) -> None:
        """Raise PipelineAborted if another rank failed or went silent (rate limited to every 20 ms)."""
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + 0.02
        try:
            self._check(now, force)
        except PipelineAborted:
            raise
        except Exception as error:  # the store lives on rank 0's process
            raise PipelineAborted(
                f"pipeline stopped on rank {self.rank}: the job's store is unreachable ({error}); the rank that hosts "
                "it (rank 0) probably died"
            ) from error

    def _check(self, now: float, force: bool) -> None:
        if self.store.check([_ABORT]):
            message = self.store.get(_ABORT).decode()
            if message:
                raise PipelineAborted(f"pipeline stopped on rank {self.rank}: {message}")
        if not force and now < self._next_pulse:
            return
        self._next_pulse = now + 0.5
        wall = time.time()
        for other in range(self.world_size):
            if other == self.rank:
                continue
            beat = float(self.store.get(f"{_BEAT}{other}").decode())
            if wall - beat > self.dead_after:
                raise PipelineAborted(
                    f"pipeline stopped on rank {self.rank}: rank {other} went silent (no heartbeat for "
                    f"{wall - beat:.1f} s): it died or hangs"
                )

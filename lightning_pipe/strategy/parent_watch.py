"""A re-run rank stops when the rank that launched it is gone during start-up.

Lightning's default launch re-runs the script for ranks 1..N-1 as child processes of rank 0, and
watches the children: one that fails takes the others down. Nothing watches rank 0 for them: when
rank 0 fails before the ranks are connected (its port is taken, a bad argument, an error while
planning), the children wait in the process group's rendezvous or first collective for its timeout
(30 minutes by default). :class:`ParentWatch` is a daemon thread in each child that notices, within a
second, that its parent has exited (the child is re-parented) and ends the child with a message.

It watches only while the ranks start and plan: once the pipeline is built, a failing rank stops the
others through the job's store (:mod:`lightning_pipe.runtime.failure`), and a rank 0 that ends its
script first must not cut short a child that is still finishing its own.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["LAUNCHER_PID", "ParentWatch"]

LAUNCHER_PID = "LIGHTNING_PIPE_LAUNCHER_PID"  # set by rank 0 before it re-runs the script: the children's parent
_POLL_SECONDS = 0.5


class ParentWatch:
    """Ends this process (exit status 1) if its parent ``parent`` exits (or has exited already: the
    child may start after rank 0 failed) before :meth:`stop`.

    Args:
        rank: this process's rank (for the message).
        parent: the process id of the rank that launched this one.
    """

    def __init__(self, rank: int, parent: int) -> None:
        self.rank, self.parent = rank, parent
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_pipe-parent-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            if os.getppid() != self.parent:
                print(
                    f"lightning_pipe: rank {self.rank} stops: the process that launched it (rank 0, pid "
                    f"{self.parent}) exited while the ranks were starting; its error is in its output",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            self._stopped.wait(_POLL_SECONDS)

    def stop(self) -> None:
        """Stop watching (the pipeline is up)."""
        self._stopped.set()

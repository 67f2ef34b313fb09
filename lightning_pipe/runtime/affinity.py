"""Each pipeline process's threads on cores of its own.

Left to the scheduler, the processes of a pipeline on one machine, each with its compute thread and
gloo's transport threads, move between the cores; on the 2-core machine of ``docs/measurements.md``
that made every action 25-45% slower than the same compute alone. With the threads of each process
kept on a core of its own, 2BW and CDP ran 1.14-1.18x and 1F1B 1.01-1.10x faster
(``bench/pinning.py``). Linux only (``os.sched_setaffinity``).

Data-loader worker processes started afterwards inherit the placement: with few cores per process,
give the loader few workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from lightning_pipe.errors import PlanningError

__all__ = ["cores_of", "pin_threads"]


def cores_of(local_rank: int, local_processes: int, allowed: Iterable[int]) -> set[int]:
    """The cores of process ``local_rank`` of ``local_processes`` on one machine: the ``allowed``
    cores in order, cut into equal consecutive shares (a remainder stays unused)."""
    cores = sorted(allowed)
    if local_processes > len(cores):
        raise PlanningError(
            f"cannot give each of {local_processes} processes a core of its own: this process may use "
            f"{len(cores)} core(s) ({cores}); run fewer processes per machine, or leave pin_cpus off"
        )
    share = len(cores) // local_processes
    return set(cores[local_rank * share : (local_rank + 1) * share])


def pin_threads(local_rank: int, local_processes: int) -> set[int]:
    """Keep every thread of this process, and the threads and processes it starts later, on its
    share of the cores (:func:`cores_of`); returns that share."""
    if not hasattr(os, "sched_setaffinity"):
        raise PlanningError("pin_cpus needs Linux (os.sched_setaffinity); leave it off on this system")
    cores = cores_of(local_rank, local_processes, os.sched_getaffinity(0))
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), cores)
    return cores

"""Each pipeline process's threads on cores of its own.

Left to the scheduler, the processes of a pipeline on one machine, each with its compute thread and
gloo's transport threads, move between the cores. On the 2-core machine of ``docs/measurements.md``,
with the threads of each process kept on a core of its own, 2BW and CDP ran 1.14-1.18x and 1F1B
1.01-1.10x faster (``bench/pinning.py``), and an action's cost inside a pipeline over the same compute
alone fell from 25-45% to 11-35%. Linux only (``os.sched_setaffinity``).

Data-loader worker processes started afterwards inherit the placement: with few cores per process,
give the loader few workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from lightning_pipe.errors import PlanningError

__all__ = ["cores_of", "pin_threads", "place_threads"]


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
    place_threads(cores)
    return cores


def place_threads(cores: set[int]) -> None:
    """Every thread of this process (and those it starts later) on ``cores``."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread), cores)

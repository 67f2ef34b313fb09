"""How busy other processes keep the machine's processors: was a profile measured on a quiet machine?

A profile measured while other processes compute holds their slowdown, and a kept profile
(:mod:`.profile_cache`) hands it to every later run. The load of a window of time is the
processors' busy time over it less this process's own, over the window's wall time times the
processors: 0 is a machine where nothing else ran, 1 one where other work kept every processor busy.

- On Linux the busy time is ``/proc/stat``'s ``cpu`` line (user, nice, system, irq, softirq and steal
  ticks, over ``SC_CLK_TCK``; steal counts: a hypervisor's other guests took the processor), the
  processors its ``cpuN`` lines, this process's own time :func:`time.process_time` (every thread).
  Ticks are 10 ms: a window of 0.1 s on 2 processors resolves 5% of the machine, and one shorter
  than :data:`SHORTEST_WINDOW` nothing (its load is ``None``: unknown).
- Elsewhere (macOS) the 1-minute load average (:func:`os.getloadavg`) at the window's end, less this
  process's mean use of processors over the window, over :func:`os.cpu_count`: coarse, and it lags.
- Where neither exists the load is ``None``: unknown.

A window is :data:`LOADED` or more when other work took a quarter of the machine or more. Measured on
this package's 2-processor machine: one other process spinning while an MLP of 1024-wide layers was
profiled on both processors made the profile 1.7-2.4x as long and read as a load of 0.31-0.44 (it
shared the processors with the profiler's threads); profiles on the quiet machine read 0.00-0.03.
Only the processors are watched: another process on the same GPU is not seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LOADED", "QUIET_WINDOW", "SHORTEST_WINDOW", "CpuReading", "current_load", "load_between", "read_cpu"]

LOADED = 0.25
"""The load from which a profile's times are not trusted: a quarter of the machine's processors busy
with other work."""
QUIET_WINDOW = 0.1
"""Seconds :func:`current_load` watches the machine for."""
SHORTEST_WINDOW = 0.05
"""Seconds below which a window's load is unknown: 5 ticks of each processor."""


@dataclass(frozen=True)
class CpuReading:
    """The processors' counters at one moment (seconds, cumulative).

    Attributes:
        wall: :func:`time.monotonic`.
        own: this process's processor time, every thread (:func:`time.process_time`).
        busy: every processor's busy time since boot (``/proc/stat``), ``None`` where not read.
        load_average: the 1-minute load average, where ``busy`` is not read (``None`` without either).
        cpus: processors on the machine.
    """

    wall: float
    own: float
    busy: float | None
    load_average: float | None
    cpus: int


def read_cpu() -> CpuReading:
    """The processors' counters now (see the module docstring for what is read where)."""
    wall, own = time.monotonic(), time.process_time()
    try:
        with open("/proc/stat") as handle:
            lines = handle.read().splitlines()
    except OSError:
        try:
            average = os.getloadavg()[0]
        except (AttributeError, OSError):  # Windows has no load average
            average = None
        return CpuReading(wall, own, None, average, os.cpu_count() or 1)
    ticks = [int(value) for value in lines[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return CpuReading(wall, own, busy, None, max(cpus, 1))


def load_between(start: CpuReading, end: CpuReading) -> float | None:
    """The share of the machine's processors other processes kept busy between two readings (0 to 1,
    rounded to 0.01), or ``None`` when neither counter was read or the window is shorter than
    :data:`SHORTEST_WINDOW`."""
    wall = end.wall - start.wall
    own = end.own - start.own
    if wall < SHORTEST_WINDOW:
        return None
    if start.busy is not None and end.busy is not None:
        others = end.busy - start.busy - own
    elif end.load_average is not None:
        others = (end.load_average - own / wall) * wall
    else:
        return None
    return round(min(max(others / (wall * end.cpus), 0.0), 1.0), 2)


def current_load(read: Callable[[], CpuReading] = read_cpu, seconds: float = QUIET_WINDOW) -> float | None:
    """The machine's load over the next ``seconds`` (this process sleeps meanwhile), read with ``read``."""
    start = read()
    time.sleep(seconds)
    return load_between(start, read())

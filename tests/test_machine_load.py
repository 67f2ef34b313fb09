"""The load other processes put on the machine: computed from readings by hand, and read for real on
Linux while a child process spins."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_pipe.cost.machine_load import CpuReading, current_load, load_between, read_cpu


def test_the_load_is_the_others_busy_time_over_the_machine() -> None:
    """1 s on 2 processors, 1.5 s of them busy of which 0.5 s this process's own: the others kept
    1 s of the 2 busy."""
    start, end = CpuReading(0.0, 0.0, 10.0, None, 2), CpuReading(1.0, 0.5, 11.5, None, 2)
    assert load_between(start, end) == 0.5


def test_without_proc_stat_the_load_average_less_this_process_stands_for_it() -> None:
    """Load average 2.5 at the end of a 2 s window over which this process used 1 s (0.5 processors
    on average), 4 processors: the others kept 2 of 4 busy."""
    start, end = CpuReading(0.0, 0.0, None, None, 4), CpuReading(2.0, 1.0, None, 2.5, 4)
    assert load_between(start, end) == 0.5


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        (CpuReading(1.0, 0.0, None, None, 2), None),  # nothing read: unknown
        (CpuReading(0.01, 0.0, 10.02, None, 2), None),  # shorter than ticks resolve: unknown
        (CpuReading(1.0, 0.9, 10.5, None, 2), 0.0),  # this process's time read finer than the ticks
        (CpuReading(1.0, 0.0, 13.0, None, 2), 1.0),  # more than the machine: a counter's rounding
    ],
)
def test_unknown_and_out_of_range_loads(end: CpuReading, expected: float | None) -> None:
    assert load_between(CpuReading(0.0, 0.0, 10.0, None, 2), end) == expected


def test_the_current_load_is_read_over_a_short_window() -> None:
    """:func:`current_load` reads twice, ``seconds`` apart, with the reader it is given."""
    readings = iter([CpuReading(0.0, 0.0, 0.0, None, 2), CpuReading(0.1, 0.0, 0.15, None, 2)])
    assert current_load(lambda: next(readings), seconds=0.0) == 0.75


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_a_spinning_process_is_seen_and_this_ones_own_work_is_not() -> None:
    """A child process spinning on one processor while this one sleeps: at least 0.6 of one
    processor's share of the machine (the tick counters and other work elsewhere blur the rest).
    This process spinning: the machine's busy time holds its own time, which the load takes out."""
    reading = read_cpu()
    assert reading.busy is not None and reading.cpus >= 1
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.3)  # the interpreter started
        seen = current_load(seconds=0.5)
    finally:
        child.kill()
        child.wait()
    assert seen is not None and seen >= 0.6 / reading.cpus
    start = read_cpu()
    while time.monotonic() - start.wall < 0.3:
        pass
    end = read_cpu()
    assert end.busy is not None and start.busy is not None
    assert end.own - start.own > 0.2
    assert end.busy - start.busy > end.own - start.own - 0.05  # two ticks of each counter's rounding

"""The pause of one full garbage collection in a pipeline worker, with and without the heap frozen.

Run: ``python bench/gc_pause.py [--repeats 7]``.

A process that imported torch and lightning_pipe (and built a pipeline's programs) tracks a few
hundred thousand objects; Python's automatic full collection walks all of them, at a moment of its
own on each rank. The executor's policy (``lightning_pipe/runtime/garbage.py``) freezes the objects
alive when it starts, so its collections skip them. Prints the tracked objects and the median,
fastest and slowest full collection, before and after :func:`gc.freeze`; then, the heap frozen, with an
executor's full timeline of its latest 100,000 actions (``timeline_length``'s default) held two ways:
as ``Interval`` objects (how the executor kept it before 2026-11-30) and as the executor keeps it
(:class:`lightning_pipe.runtime.timeline.Timeline`, tuples of plain values).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque

import torch  # noqa: F401  (the heap a worker has)

from lightning_pipe.runtime.program import Program
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.schedule import Kind, make_schedule
from lightning_pipe.schedule.ir import Action
from lightning_pipe.schedule.simulation import Interval

TIMELINE_LENGTH = 100_000


def pauses(repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    _programs = Program.build(lambda k: make_schedule("2bw", 2, 2, k))  # kept alive: a worker's own objects
    print(f"{'heap':>20} {'tracked objects':>16} {'median ms':>10} {'fastest':>8} {'slowest':>8}")
    ways = {"as is": None, "frozen": None, "+ timeline, objects": deque, "+ timeline, values": Timeline}
    for label, kept in ways.items():
        if label == "frozen":
            gc.freeze()
        if kept is not None:
            timeline = kept(maxlen=TIMELINE_LENGTH)
            for step in range(TIMELINE_LENGTH):
                timeline.append(
                    Interval(0, Action(Kind.F, 0, step % 4, step, step), float(step), step + 0.5, 0.0, step)
                )
        seconds = pauses(args.repeats)
        print(
            f"{label:>20} {len(gc.get_objects()):>16} {statistics.median(seconds) * 1e3:>10.1f} "
            f"{min(seconds) * 1e3:>8.1f} {max(seconds) * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()

"""What starting ``run_local``'s processes costs: 2 processes that import Lightning, started and joined,
spawned (each imports torch and Lightning itself) against forked from a forkserver that imported them
once (``run_local``'s way, :mod:`lightning_pipe.runtime.launch`), in alternating rounds.

Run: ``python bench/process_start.py [--rounds 3]``. Printed: seconds per start of the 2 processes,
median over the rounds, the forkserver's own first start apart, and the ratio spawn/forkserver.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from lightning_pipe.runtime.launch import PRELOADED


def _child() -> None:
    import lightning  # noqa: F401 - what every worker of a test or benchmark imports


def _start(context: mp.context.BaseContext) -> float:
    begin = time.monotonic()
    processes = [context.Process(target=_child) for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return time.monotonic() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spawn, forkserver = mp.get_context("spawn"), mp.get_context("forkserver")
    forkserver.set_forkserver_preload(list(PRELOADED))
    first = _start(forkserver)  # the server starts and imports PRELOADED
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for _ in range(args.rounds):
        times["spawn"].append(_start(spawn))
        times["forkserver"].append(_start(forkserver))
    print("| start of 2 processes | median s |")
    print("| --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} |")
    print(f"| forkserver's first (the server's own start) | {first:.3f} |")
    print(f"spawn / forkserver: {statistics.median(times['spawn']) / statistics.median(times['forkserver']):.0f}x")


if __name__ == "__main__":
    main()

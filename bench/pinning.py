"""Our pipelines with each process's threads pinned to a core of its own, against the same runs left
to the scheduler: the same two processes, configurations in a shuffled order, paired rounds.

Run: ``python bench/pinning.py [--rounds 8] [--steps 20] [--rows 32] [--microbatches 2 4 8]
[--families 1f1b 2bw cdp]``. The model and timing are ``bench/runtime_speed.py``'s (2 stages of 4
Linear+ReLU blocks of 512, one thread per process, gloo). Pinned: every thread of rank ``r`` (gloo's
included) may only run on its share of the allowed cores, as ``pin_cpus`` places it; unpinned: on all.
Printed: ms per step (median over the rounds) and the median of the rounds' pinned/unpinned speed-ups.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics

import runtime_speed as bench

from lightning_pipe.runtime.affinity import cores_of, place_threads
from lightning_pipe.runtime.launch import run_local


def worker(rank: int, args: argparse.Namespace) -> dict[tuple[str, int, bool], list[float]]:
    everywhere = os.sched_getaffinity(0)
    own = cores_of(rank, 2, everywhere)  # what pin_cpus gives this rank
    runs = list(itertools.product(args.families, args.microbatches, (False, True)))
    times: dict[tuple[str, int, bool], list[float]] = {run: [] for run in runs}
    for round_index in range(args.rounds):
        for family, microbatches, pinned in random.Random(round_index).sample(runs, len(runs)):
            model = bench.default_model(args.rows, microbatches, args.steps)
            batches = bench.data(args.steps + bench.WARMUP, model)
            place_threads(own if pinned else everywhere)
            seconds, _ = bench.ours(rank, family, microbatches, batches, model)
            place_threads(everywhere)
            times[(family, microbatches, pinned)].append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--families", nargs="+", default=["1f1b", "2bw", "cdp"])
    args = parser.parse_args()
    results = run_local(worker, 2, args, timeout=3600)
    per_round = {key: [max(pair) for pair in zip(*(r[key] for r in results), strict=True)] for key in results[0]}
    print(f"micro-batches of {args.rows} rows, {args.rounds} rounds of {args.steps} steps")
    print(f"{'family':>8} {'m':>3} {'unpinned ms':>11} {'pinned ms':>9} {'pinned speed-up':>15}")
    for family, microbatches in itertools.product(args.families, args.microbatches):
        free, pinned = per_round[(family, microbatches, False)], per_round[(family, microbatches, True)]
        ratio = statistics.median(f / p for f, p in zip(free, pinned, strict=True))
        print(
            f"{family:>8} {microbatches:>3} {statistics.median(free) * 1e3:>11.1f} "
            f"{statistics.median(pinned) * 1e3:>9.1f} {ratio:>14.2f}x"
        )


if __name__ == "__main__":
    main()

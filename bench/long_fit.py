"""A long fit's step, window by window: does what the executor keeps of every action slow it down?

    python bench/long_fit.py                              # 24,000 steps, windows of 3,000, 1 round (about 4 minutes)
    python bench/long_fit.py --steps 48000 --rounds 2

``bench/strategy_overhead.py``'s small 2-stage MLP (3072 features, 128 wide, one block a stage and
the head, 64 rows, SGD with momentum, ``self.log`` every step) is trained with
``PipelineStrategy("1f1b", microbatches=2)`` on 2 CPU processes for ``--steps`` steps (50 batches,
repeated), and rank 0's time per step is taken over each window of ``--window`` steps (the wall time
of the window over its steps, so the executor's garbage collections, every 50 calls, are in it).

The executor keeps its latest 100,000 actions (``timeline_length``; 6 a step here: full from step
16,667), and every full collection walks what the collector tracks. The fit runs twice in the same
processes, in turn (the order swapped each round), the timeline kept two ways:

- ``values``: as the executor keeps it (:class:`lightning_pipe.runtime.timeline.Timeline`): tuples of
  plain values, which the collector stops tracking;
- ``objects``: a ``deque`` of :class:`~lightning_pipe.schedule.simulation.Interval` objects and their
  actions, as the executor kept them before 2026-11-30.

Prints, per window, the milliseconds per step of each (the median over the rounds) and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections import deque
from typing import Any

import lightning as L
from strategy_overhead import MLP, _prepare, _strategy, data, loader, trainer

from lightning_pipe.runtime import executor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.schedule.simulation import Interval

UNIQUE_BATCHES = 50
"""Batches made once and repeated: 24,000 distinct ones of 64 x 3072 would take 19 GB."""


class ObjectTimeline(deque):
    """The timeline as the executor kept it before: the intervals themselves, as objects."""

    def __init__(self, maxlen: int | None) -> None:
        super().__init__(maxlen=maxlen)

    def since(self, step: int) -> list[Interval]:
        return list(itertools.dropwhile(lambda interval: interval.action.step < step, self))


WAYS: dict[str, type] = {"values": Timeline, "objects": ObjectTimeline}


class Stamps(L.Callback):
    """The moment each training batch ended."""

    def __init__(self) -> None:
        self.moments: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.moments.append(time.perf_counter())


def _fit(model: argparse.Namespace, way: str) -> list[float]:
    """Seconds per step in each window of one fit, the timeline kept ``way``."""
    executor.Timeline = WAYS[way]  # what the executor builds its timeline with, in this process
    batches = [batch for _, batch in zip(range(model.steps), itertools.cycle(data(UNIQUE_BATCHES, model)))]
    stamps = Stamps()
    with tempfile.TemporaryDirectory(prefix="long_fit_") as root:
        strategy = _strategy("1f1b", 2, model, 2)
        trainer(strategy, 2, stamps, model.steps, root).fit(MLP(model), loader(batches))
    moments, window = stamps.moments, model.window
    return [(moments[i + window] - moments[i]) / window for i in range(0, len(moments) - window, window)]


def _worker(rank: int, model: argparse.Namespace) -> dict[str, list[list[float]]]:
    _prepare(rank)
    results: dict[str, list[list[float]]] = {way: [] for way in WAYS}
    for round_index in range(model.rounds):
        for way in list(WAYS)[:: 1 if round_index % 2 == 0 else -1]:
            results[way].append(_fit(model, way))
    executor.Timeline = Timeline
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24_000)
    parser.add_argument("--window", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model = argparse.Namespace(width=128, depth=1, batch=64, features=3072, log=True, **vars(args))
    results = run_local(_worker, 2, model, timeout=60 + args.rounds * args.steps * 0.05)[0]
    median = {way: [statistics.median(column) for column in zip(*runs, strict=True)] for way, runs in results.items()}
    print(f"rank 0's ms per step, {args.rounds} round(s), windows of {args.window} steps")
    print(f"{'steps':>13} {'values':>8} {'objects':>8} {'objects / values':>17}")
    for index, (values, objects) in enumerate(zip(median["values"], median["objects"], strict=True)):
        steps = f"{index * args.window}-{(index + 1) * args.window}"
        print(f"{steps:>13} {values * 1e3:>8.2f} {objects * 1e3:>8.2f} {objects / values:>17.2f}")


if __name__ == "__main__":
    main()

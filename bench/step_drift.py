"""How far one configuration's step moves over one fit on this machine: the noise that a prediction
and ``schedule="auto"``'s pick are judged against.

    python bench/step_drift.py                                    # GPT-2, CDP on 2 micro-batches, 110 steps
    python bench/step_drift.py --model mlp --schedule 1f1b --microbatches 4 --steps 200

The model of ``bench/auto_plan.py``'s zoo is trained once, on 2 CPU processes, with one fixed
configuration (no trials, no switch); rank 0's steps (the wall time between its
``on_train_batch_end`` calls) are printed as medians of ``--window`` steps, with the spread of those
medians: (largest - smallest) / median. ``bench/auto_plan.py`` compares configurations measured
minutes apart over 6 steps each, and the pick's trials over 4; a spread here as large as the
differences between its configurations says that its rows cannot be told apart to that precision.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auto_plan import MODELS, _quiet
from trainer_runs import timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local


def _worker(rank: int, model: str, config: dict[str, object], steps: int) -> list[float]:
    os.environ["LOCAL_RANK"] = str(rank)
    _quiet()
    entry = MODELS[model]
    data = TensorDataset(*entry.data(entry.rows * steps))
    trainer, timer = timed_trainer(PipelineStrategy(**config, start_method="popen"), "step_drift_")
    trainer.fit(entry.build(), DataLoader(data, batch_size=entry.rows, drop_last=True))
    return [b - a for a, b in itertools.pairwise(timer.ends)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--schedule", default="cdp")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--pin", action="store_true", help="each process's threads on a core of its own")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    config = {"schedule": args.schedule, "microbatches": args.microbatches, "pin_cpus": args.pin}
    steps = run_local(_worker, 2, args.model, config, args.steps, timeout=60 + 10 * args.steps)[0]
    steps = steps[3:]  # the first steps build and warm the pipeline
    windows = [(i, steps[i : i + args.window]) for i in range(0, len(steps), args.window)]
    windows = [(i, window) for i, window in windows if len(window) >= 3]
    print(f"{args.model}, {args.schedule} m={args.microbatches}{' pinned' if args.pin else ''}, {len(steps)} steps")
    print("| steps | median step |")
    print("| --- | --- |")
    for i, window in windows:
        print(f"| {3 + i}-{3 + i + len(window) - 1} | {statistics.median(window) * 1e3:.1f} ms |")
    medians = [statistics.median(window) for _, window in windows]
    middle = statistics.median(medians)
    print(f"\nspread of the {args.window}-step medians: {(max(medians) - min(medians)) / middle:.0%} of their median")


if __name__ == "__main__":
    main()

"""The training loop's own time per step: what a fit spends outside the executor's call, on each rank.

Run: ``python bench/loop_time.py [--models mlp transformer] [--steps 40]`` (about 3 minutes for the
five models). For each model of ``bench/auto_plan.py``'s zoo, on 2 CPU processes, one fit of GPipe on
2 micro-batches (after the bench's warm-up fit) runs ``--steps`` steps; each rank prints the median
step and the median time a step spends outside the executor's call
(:func:`lightning_pipe.cost.loop_time.loop_seconds` over the steps after the warm-up ones, as the
strategy measures and keeps it), and the fit's set-up prediction, which for a model with no
calibration kept is the profile's simulation plus the loop's time the fits before it kept (one
profile cache for the whole run, as a user's machine keeps one).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile

import auto_plan
from torch.utils.data import DataLoader
from trainer_runs import timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.cost.loop_time import loop_seconds
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.trials import WARM_UP


def fit(rank: int, model: str, steps: int, cache: str) -> tuple[float, float, float | None]:
    """Worker: the fit's median step, its loop time on this rank, and (rank 0) its prediction."""
    os.environ["LOCAL_RANK"] = str(rank)
    auto_plan._quiet()
    entry = auto_plan.MODELS[model]
    auto_plan._warm_up(entry, argparse.Namespace(warmup=4, steps=6))
    strategy = PipelineStrategy("gpipe", microbatches=2, start_method="popen", profile_cache=cache)
    trainer, timer = timed_trainer(strategy, "loop_time_")
    trainer.fit(entry.build(), DataLoader(auto_plan._Cycled(entry, steps), batch_size=entry.rows, drop_last=True))
    step = statistics.median(b - a for a, b in itertools.pairwise(timer.ends[WARM_UP:]))
    loop = loop_seconds(strategy._step_starts[WARM_UP:], strategy._step_seconds[WARM_UP:])
    assert loop is not None
    return step, loop, strategy.planned_step_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(auto_plan.MODELS), default=list(auto_plan.MODELS))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="loop_time_profiles_")
    print("| model | step | loop, rank 0 | loop, rank 1 | loop / step | set-up prediction | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        (step, first, predicted), (_, second, _) = run_local(fit, 2, model, args.steps, cache, timeout=900)
        error = "-" if predicted is None else f"{predicted / step - 1:+.0%}"
        shown = "-" if predicted is None else f"{predicted * 1e3:.1f} ms"
        print(
            f"| {model} | {step * 1e3:.1f} ms | {first * 1e3:.2f} ms | {second * 1e3:.2f} ms | "
            f"{min(first, second) / step:.0%} | {shown} | {error} |"
        )


if __name__ == "__main__":
    main()

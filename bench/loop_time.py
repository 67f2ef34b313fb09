"""The training loop's own time per step: what a fit spends outside the executor's call, on each rank;
and how close a model's first fit is predicted.

Run: ``python bench/loop_time.py [--models mlp transformer] [--steps 40] [--rounds 4]`` (about 1.5
minutes a round for the five models). For each model of ``bench/auto_plan.py``'s zoo, on 2 CPU
processes, one fit of GPipe on 2 micro-batches (after the bench's warm-up fit) runs ``--steps``
steps; each rank prints the median step and the median time a step spends outside the executor's
call (:func:`lightning_pipe.cost.loop_time.loop_seconds` over the steps after the warm-up ones, as
the strategy measures and keeps it), and the fit's set-up prediction, which for a model with no
calibration kept is the profile's simulation plus the loop's time the fits before it kept, its
actions at the rate the fits of other models before it kept (``rate priced``,
:mod:`lightning_pipe.cost.machine_rate`; the first model has none), against the rate its own fit
measured and kept (``rate kept``). One profile cache for a round, as a user's machine keeps one; each
round starts a fresh one, and with ``--rounds`` above 1 the last table gives each model's first-fit
error in every round and their median. ``--mlp-widths 1024 2048`` adds the zoo's MLP at those widths
(``mlp:1024``): the same code, a longer step and larger weights, and so how the loop's time follows
the model rather than the step's code.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
from pathlib import Path

import auto_plan
from torch.utils.data import DataLoader
from trainer_runs import timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.cost.loop_time import loop_seconds
from lightning_pipe.cost.machine_rate import kept_rates
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.trials import WARM_UP


def _entry(model: str) -> auto_plan.Model:
    """The zoo's ``model``, or for ``mlp:W`` the zoo's MLP ``W`` wide."""
    name, _, width = model.partition(":")
    if not width:
        return auto_plan.MODELS[name]
    return auto_plan.Model(auto_plan._chain("mlp", width=int(width)), auto_plan.MODELS["mlp"].rows, auto_plan._images)


def fit(rank: int, model: str, steps: int, cache: str) -> tuple[float, float, float | None, float | None, float | None]:
    """Worker: the fit's median step, its loop time on this rank, and (rank 0) its prediction, the rate
    of the actions it was priced with (other models' fits', ``None``: none kept) and the rate it kept."""
    os.environ["LOCAL_RANK"] = str(rank)
    auto_plan._quiet()
    entry = _entry(model)
    auto_plan._warm_up(entry, argparse.Namespace(warmup=4, steps=6))
    strategy = PipelineStrategy("gpipe", microbatches=2, start_method="popen", profile_cache=cache)
    trainer, timer = timed_trainer(strategy, "loop_time_")
    trainer.fit(entry.build(), DataLoader(auto_plan._Cycled(entry, steps), batch_size=entry.rows, drop_last=True))
    step = statistics.median(b - a for a, b in itertools.pairwise(timer.ends[WARM_UP:]))
    loop = loop_seconds(strategy._step_starts[WARM_UP:], strategy._step_seconds[WARM_UP:])
    assert loop is not None
    prior = strategy.step_prices.prior
    kept = kept_rates(Path(cache), strategy.root_device, 2).entries
    own = float(kept[-1]["scale"]) if rank == 0 and kept else None  # type: ignore[arg-type]
    return step, loop, strategy.planned_step_seconds, None if prior is None else prior.scale, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(auto_plan.MODELS), default=list(auto_plan.MODELS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1, help="the models' fits again, each round a fresh cache")
    parser.add_argument(
        "--mlp-widths", type=int, nargs="*", default=[], help="then the MLP at these widths (the zoo's: 128)"
    )
    args = parser.parse_args()
    args.models += [f"mlp:{width}" for width in args.mlp_widths]
    errors: dict[str, list[float]] = {model: [] for model in args.models}
    for round_ in range(args.rounds):
        cache = tempfile.mkdtemp(prefix="loop_time_profiles_")
        print(f"\nround {round_ + 1} of {args.rounds}\n")
        print(
            "| model | step | loop, rank 0 | loop, rank 1 | loop / step | rate priced | rate kept | set-up prediction "
            "| error |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for model in args.models:
            (step, first, predicted, prior, own), (_, second, *_) = run_local(
                fit, 2, model, args.steps, cache, timeout=900
            )
            if predicted is not None:
                errors[model].append(predicted / step - 1)
            error = "-" if predicted is None else f"{predicted / step - 1:+.0%}"
            shown = "-" if predicted is None else f"{predicted * 1e3:.1f} ms"
            print(
                f"| {model} | {step * 1e3:.1f} ms | {first * 1e3:.2f} ms | {second * 1e3:.2f} ms | "
                f"{min(first, second) / step:.0%} | {'-' if prior is None else f'{prior:.2f}'} | "
                f"{'-' if own is None else f'{own:.2f}'} | {shown} | {error} |",
                flush=True,
            )
    if args.rounds > 1:
        print("\n| model | first fit's error, each round | median |\n| --- | --- | --- |")
        for model, found in errors.items():
            shown = ", ".join(f"{e:+.0%}" for e in found)
            print(f"| {model} | {shown} | {statistics.median(found):+.0%} |" if found else f"| {model} | - | - |")


if __name__ == "__main__":
    main()

"""How good is ``schedule="auto"``'s pick? Every configuration of a grid measured through the Trainer,
and the pick in the same rounds.

    python bench/auto_plan.py                                  # every model, 2 rounds (about an hour)
    python bench/auto_plan.py --models mlp --rounds 1          # one model, one round
    python bench/auto_plan.py --families 1f1b 2bw --microbatches 2 4 --no-pinning
    python bench/auto_plan.py --rounds 1 --pairs 4               # the grid once, then pick and best paired
    python bench/auto_plan.py --models mlp --against "cdp m=2" --pairs 4   # no grid: paired with one configuration

For each model of the zoo, on 2 CPU processes (gloo), the same LightningModule is trained once per
configuration of the grid — schedule family × micro-batches ``m`` × pinning — with
``PipelineStrategy(family, microbatches=m, pin_cpus=...)``, and once with ``PipelineStrategy("auto",
rule="delayed", pin_cpus="auto")``: the pick (every family may be chosen, each with its own rule; the
pinning tried during the run). Each configuration of the grid runs ``--warmup`` steps and then
as many timed ones as fill ``--seconds`` at its pace, ``--steps`` at least (the wall time between rank
0's ``on_train_batch_end`` calls; a non-flushing schedule's last batch drains and is left out; the pace
is the configuration's step in the rounds before, else the step of the fit run before it: a median of
six steps of a few milliseconds moves with the machine's jitter, and so does one of half a second: the
MLP's rows, timed over 0.5 s, came within 10% of themselves in the other round on 29 of 43 rows; over
2 s on 39 in a run of the MLP alone and on 33 in a run of the whole zoo, 2026-11-30). The pick is timed once it has
settled: after its pinning trial, calibration and the configurations it tried
(:mod:`lightning_pipe.strategy.calibrating`), from :data:`WARM_UP` steps after it built the one it went
on with, as a long run spends nearly all its steps there; the ``settled`` column says how many steps
that took (what the trials cost is theirs).
``--rounds`` rounds each run every configuration and
the pick one after the other in the same pair of processes, so a round's figures share one state of
the machine. Each pair of processes first runs an untimed fit that keeps nothing (:data:`WARM_UP_FIT`), so
that the first fit measured is not timed, nor calibrated, over steps that still load and allocate. The
first round starts with the model's first fit (:data:`FIRST_FIT`: the grid's first configuration, once
more), predicted from the profile alone and reported apart; every row of the table is then a later fit,
predicted with what earlier fits kept, as a user's fits after their first.

Models (batches of ``rows`` samples):

- ``resnet18``: torchvision's ResNet-18 (``num_classes=10``) on 3x32x32 images, as its documentation
  builds it; 32 rows;
- ``resnet18_chain``: the CIFAR ResNet-18 chain of the zoo (``build_chain("resnet18")``); 32 rows;
- ``transformer``: a 6-block ``nn.TransformerEncoder`` language model (128 wide, 4 heads, causal
  mask), 64 tokens; 16 rows;
- ``gpt2``: ``transformers``' ``GPT2LMHeadModel`` (6 blocks, 128 wide, 4 heads), its loss
  ``self(input_ids, labels=input_ids).loss``, 64 tokens; 16 rows (left out without ``transformers``;
  with micro-batches of one row its attention masks take another path, which the capture refuses to
  split);
- ``mlp``: the zoo's MLP chain (3x32x32 inputs, 128 wide); 64 rows.

Columns: ``samples/s`` (rows per step over the median step, the median over the rounds), ``of best``
(over the best configuration's, in the same round: the median over the rounds), and the prediction's
error: the step the strategy printed at set-up (the pick's: of the configuration it went on with,
priced with its run's calibration where it switched; the profile simulated with each stage's update, the
links and what the closest earlier fit of the model kept: the bench keeps its profiles and
calibrations in a fresh directory, so the first fit of each model predicts from its profile with the
loop's time and the actions' rate the models before it kept (the first model's from the profile
alone), which is printed apart, and every row from what earlier fits measured) against the measured one; for
every configuration, also the step the pick's calibration predicts for it (the pick's in-run costs:
``calibrated error``, where the pick priced the same split). ``rounds apart``: the spread of the
configuration's step over the rounds (largest - smallest, over the median): what the machine's own
noise allows a prediction. Above the table, each fit's prediction is also held against its own step,
in its round (a row's ``error`` holds the median of its rounds' predictions against the median of
their steps, which the machine's drift between rounds moves apart). The summary gives, per model, the
pick's samples/s as a fraction of the best measured configuration's: the figure of merit (goal 0.95);
and, with two rounds or more, as a fraction of the configuration a user would have run after
measuring the grid, chosen on the other rounds and timed in the same round as the pick (the fastest of
42 noisy figures is faster than its configuration runs: the noise alone puts a perfect pick below 1).

``--pairs N`` then measures the pick against the grid's best configuration (the fastest over the rounds)
``N`` times more, in pairs run back to back in one pair of processes — best then pick, then pick then
best, alternately — each timed over ``--seconds``, ``--pair-steps`` steps at least, and gives the
median of the pairs' ratios:
the machine drifts 15-26% over one fit here (``bench/step_drift.py``), so a ratio of two trainings run
seconds apart is what it moves least; with the interval of the pairs' ratios that holds their median
at 90% or more (:mod:`median_interval`: with 4 pairs, the smallest to the largest, 87.5%). Each of the
pick's trainings searches anew, so the pairs also show how often it chooses which configuration.
``--against NAME`` leaves the grid out and pairs the pick with the configuration ``NAME`` (as the grid
names it): the first pick then has only what the one fit before it kept, as a user's second fit.
Absolute figures are this machine's (both processes share its cores); the fractions carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/user_modules.py: the transformers

from median_interval import MedianInterval, median_interval
from trainer_runs import Classifier, StepTimes, timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.trials import SETTLED_BY, WARM_UP
from lightning_pipe.zoo.models import build_chain

FAMILIES = ("gpipe", "1f1b", "zb_h1", "interleaved", "ddp", "2bw", "cdp")
PICK = "auto"
FIRST_FIT = "first fit"
"""The model's first fit in the bench, before the first round: the grid's first configuration, predicted
from the profile alone (nothing kept yet), reported apart; it keeps its calibration, as a user's first
fit of a model does for the next."""


@dataclass(frozen=True)
class Model:
    """A zoo entry: the module, its batches' rows and one batch's tensors."""

    build: Callable[[], L.LightningModule]
    rows: int
    data: Callable[[int], tuple[torch.Tensor, ...]]


def _images(samples: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(samples, 3, 32, 32, generator=generator), torch.randint(10, (samples,), generator=generator)


def _tokens(samples: int) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, 1024, (samples, 65), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _resnet18() -> L.LightningModule:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return Classifier(resnet18(num_classes=10))


def _chain(name: str, **options: int) -> Callable[[], L.LightningModule]:
    """The zoo's chain ``name`` (``build_chain``'s ``options``: the MLP's ``width``, ``depth``)."""

    def build() -> L.LightningModule:
        torch.manual_seed(0)
        return Classifier(build_chain(name, num_classes=10, input_shape=(3, 32, 32), **options))

    return build


def _transformer() -> L.LightningModule:
    from tests.user_modules import EncoderLM

    torch.manual_seed(0)
    return EncoderLM(layers=6, width=128, heads=4, dropout=0.0)


def _gpt2() -> L.LightningModule:
    from tests.user_modules import HuggingFaceGPT2

    torch.manual_seed(0)
    return HuggingFaceGPT2(n_layer=6, n_embd=128, n_head=4)


def _input_ids(samples: int) -> tuple[torch.Tensor, ...]:
    return (_tokens(samples)[0],)


MODELS: dict[str, Model] = {
    "resnet18": Model(_resnet18, 32, _images),
    "resnet18_chain": Model(_chain("resnet18"), 32, _images),
    "transformer": Model(_transformer, 16, _tokens),
    "gpt2": Model(_gpt2, 16, _input_ids),
    "mlp": Model(_chain("mlp"), 64, _images),
}


def _quiet() -> None:
    """Lightning's and the strategy's set-up messages off (the table is the output)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Cycled(Dataset):
    """``batches`` batches of ``rows`` samples, cycling through a pool of 8 batches' worth: as long as a
    fit may need, in the memory of 8 batches."""

    def __init__(self, entry: Model, batches: int) -> None:
        self.pool = entry.data(entry.rows * 8)
        self.length = entry.rows * batches

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(tensor[index % len(tensor)] for tensor in self.pool)


class _Stop(L.Callback):
    """Ends the fit once ``steps`` steps are timed from ``warmup`` steps on, and from :data:`WARM_UP`
    steps after the configuration the strategy went on with was built, and one more (a non-flushing
    schedule's last batch drains and is left out). Every rank stops at the same step."""

    def __init__(self, strategy: PipelineStrategy, timer: StepTimes, warmup: int, steps: int) -> None:
        self.strategy, self.timer, self.warmup, self.steps = strategy, timer, warmup, steps
        self.start: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.start is None and self.strategy.settled:
            self.start = max(self.warmup, self.strategy.settled_step + WARM_UP)
        if self.start is not None and len(self.timer.ends) >= self.start + self.steps + 2:
            trainer.should_stop = True


def _timed_steps(steps: int, seconds: float, pace: float | None) -> int:
    """``steps`` at least, and as many as fill ``seconds`` at ``pace`` seconds a step (where known)."""
    return steps if pace is None else max(steps, math.ceil(seconds / pace))


WARM_UP_FIT: dict[str, Any] = {"schedule": "gpipe", "microbatches": 2, "profile_cache": False}
"""The fit each pair of processes runs first, to warm them, keeping nothing (no profile, no calibration)."""


def _warm_up(entry: Model, args: argparse.Namespace) -> None:
    """A fit of :data:`WARM_UP_FIT`, untimed and keeping nothing, as long as the shortest timed fit and
    10 steps more. Without it the first fit of a pair of
    processes was timed, and kept its calibration, over steps that still paid for loading, allocating
    and starting threads: the MLP's first fit was predicted 59% short of its step (2026-11-30, at
    ``383e0f0``), and priced the fits of its family after it long."""
    trainer, _ = timed_trainer(PipelineStrategy(**WARM_UP_FIT, start_method="popen"), "auto_plan_")
    data = _Cycled(entry, args.warmup + args.steps + 10)
    trainer.fit(entry.build(), DataLoader(data, batch_size=entry.rows, drop_last=True))


def _fits(
    rank: int, model: str, configs: list[dict[str, Any]], paces: list[float | None], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Worker: one training per configuration, one after the other in this pair of processes; rank 0's
    timed steps, the printed prediction, the calibrated one and the configuration that ran. Each is
    timed for ``args.steps`` steps at least and ``args.seconds`` at its pace in ``paces`` (a step's
    seconds measured before), else at the pace of the fit before (rank 0's, broadcast between fits)."""
    os.environ["LOCAL_RANK"] = str(rank)
    _quiet()
    entry = MODELS[model]
    _warm_up(entry, args)
    found: list[dict[str, Any]] = []
    for config, pace in zip(configs, paces, strict=True):
        if pace is None and found:  # each rank its own clock: rank 0's, so that every rank times as many steps
            shared = [found[-1]["step"]]
            dist.broadcast_object_list(shared, src=0)  # between fits: no step in flight
            pace = shared[0]
        steps = _timed_steps(args.steps, args.seconds, pace)
        first = SETTLED_BY if config["schedule"] == PICK else args.warmup  # the pick's: the most it may take
        strategy = PipelineStrategy(**config, start_method="popen")
        trainer, timer = timed_trainer(strategy, "auto_plan_")
        stop = _Stop(strategy, timer, args.warmup, steps)
        trainer.callbacks.append(stop)
        data = _Cycled(entry, first + WARM_UP + steps + 2)
        trainer.fit(entry.build(), DataLoader(data, batch_size=entry.rows, drop_last=True))
        start = stop.start
        if start is None or start + steps + 1 >= len(timer.ends):  # the last batch drains: left out
            raise RuntimeError(f"{config}: settled at step {strategy.settled_step}, too late for {steps} timed steps")
        intervals = [b - a for a, b in itertools.pairwise(timer.ends[start : start + steps + 1])]
        trial = strategy._pin_trial
        calibration = strategy.calibration
        priced = [] if calibration is None else strategy.candidates
        tried = [] if strategy.trials is None else strategy.trials.measured
        label = _label(strategy, trial.pinned if trial is not None else config.get("pin_cpus", False))
        found.append(
            {
                "step": statistics.median(intervals),
                "predicted": strategy.planned_step_seconds,
                "calibrated": strategy.calibrated_step_seconds,
                "label": label,
                "ran": label
                + (
                    f" (tried {', '.join(f'{t.label} {(t.seconds or 0) * 1e3:.1f} ms' for t in tried)})"
                    if tried
                    else ""
                ),
                "settled": strategy.settled_step,
                "priced_with": ""
                if strategy.step_prices.priced_with is None
                else strategy.step_prices.priced_with.measured_on,
                "rate": strategy.step_prices.scale,
                "key": (strategy.schedule_options.family, strategy.microbatches, strategy.stage_plan.bounds),
                "priced": {(c.family, c.microbatches, c.bounds): calibration.seconds(c) for c in priced},
            }
        )
    return found


def _label(strategy: PipelineStrategy, pinned: object) -> str:
    """``2bw m=4 pinned``: the configuration that ran (for the pick: the one it chose)."""
    options = strategy.schedule_options
    recompute = strategy.recompute
    again = "" if recompute is False else f" recompute {recompute}"
    return f"{options.family} m={strategy.microbatches}{again}{' pinned' if pinned else ''}"


def _configs(families: list[str], counts: list[int], pinning: bool) -> list[tuple[str, dict[str, Any]]]:
    """The grid's configurations and the pick, by name."""
    grid = [
        (f"{family} m={m}{' pinned' if pin else ''}", {"schedule": family, "microbatches": m, "pin_cpus": pin})
        for family in families
        for m in counts
        for pin in ((False, True) if pinning else (False,))
    ]
    return [*grid, (PICK, {"schedule": "auto", "rule": "delayed", "pin_cpus": "auto" if pinning else False})]


def _error(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None else predicted / measured - 1


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration of ``model`` over the rounds; the rows of its table and its summary."""
    configs = _configs(args.families, args.microbatches, not args.no_pinning)
    rows = MODELS[model].rows
    rounds: list[dict[str, dict[str, Any]]] = []
    first: dict[str, Any] = {}
    for index in range(args.rounds):
        order = configs[index % len(configs) :] + configs[: index % len(configs)]  # rotated: no fixed neighbours
        paces = [statistics.median(r[name]["step"] for r in rounds) if rounds else None for name, _ in order]
        if not rounds:  # the model's first fit: nothing kept yet, a user's first fit of it (FIRST_FIT)
            order, paces = [(FIRST_FIT, configs[0][1]), *order], [None, *paces]
        results = run_local(_fits, 2, model, [c for _, c in order], paces, args, timeout=args.timeout)[0]
        ran = {name: result for (name, _), result in zip(order, results, strict=True)}
        first = ran.pop(FIRST_FIT, first)
        rounds.append(ran)
    table = []
    for name, _ in configs:
        steps = [r[name]["step"] for r in rounds]
        best = [min(r[n]["step"] for n, _ in configs) for r in rounds]
        of_best = statistics.median(b / s for b, s in zip(best, steps, strict=True))
        step = statistics.median(steps)
        predicted = [r[name]["predicted"] for r in rounds if r[name]["predicted"] is not None]
        calibrated = [r[name]["calibrated"] for r in rounds if r[name]["calibrated"] is not None]
        if name != PICK:  # as the pick's calibration prices this configuration (its split, when priced)
            priced = [r[PICK]["priced"].get(r[name]["key"]) for r in rounds]
            calibrated = [seconds for seconds in priced if seconds is not None]
        table.append(
            {
                "configuration": name,
                "ran": rounds[-1][name]["ran"],
                "settled": rounds[-1][name]["settled"],
                "samples_per_second": rows / step,
                "of_best": of_best,
                "measured_step": step,
                "steps": steps,
                "spread": (max(steps) - min(steps)) / step,
                "predicted_step": statistics.median(predicted) if predicted else None,
                "error": _error(statistics.median(predicted), step) if predicted else None,
                "fit_errors": [_error(r[name]["predicted"], r[name]["step"]) for r in rounds],
                "calibrated_error": _error(statistics.median(calibrated), step) if calibrated else None,
            }
        )
    first_fit = {
        "configuration": configs[0][0],
        "error": _error(first["predicted"], first["step"]),
        "rate": first["rate"],
    }
    held_out = _held_out([name for name, _ in configs if name != PICK], rounds)
    return {
        "model": model,
        "rows": rows,
        "rounds": args.rounds,
        "table": table,
        "first_fit": first_fit,
        "held_out": held_out,
    }


def measure_pairs(
    model: str, best: str, args: argparse.Namespace, measured: dict[str, float] | None = None
) -> dict[str, Any]:
    """The pick against the grid's ``best`` configuration in ``args.pairs`` pairs run back to back,
    the order alternating; the median of the pairs' ratios (best's step over the pick's). Each is
    timed for ``args.pair_steps`` steps at least and ``args.seconds`` at its step in the grid
    (``measured``, by name), else at the pace of the fit before."""
    configs = dict(_configs(args.families, args.microbatches, not args.no_pinning))
    order = [name for index in range(args.pairs) for name in ((best, PICK) if index % 2 == 0 else (PICK, best))]
    paces = [(measured or {}).get(name) for name in order]
    paired = argparse.Namespace(**{**vars(args), "steps": args.pair_steps})
    results = run_local(_fits, 2, model, [configs[name] for name in order], paces, paired, timeout=args.timeout)[0]
    pairs = [dict(zip(order[i : i + 2], results[i : i + 2], strict=True)) for i in range(0, len(order), 2)]
    ratios = [pair[best]["step"] / pair[PICK]["step"] for pair in pairs]
    return {
        "best": best,
        "pick_of_best": statistics.median(ratios),
        "interval": dataclasses.asdict(median_interval(ratios)),
        "per_pair": ratios,
        "pick_ran": [pair[PICK]["label"] for pair in pairs],
        "pick_error": [_error(pair[PICK]["predicted"], pair[PICK]["step"]) for pair in pairs],
        "best_error": [_error(pair[best]["predicted"], pair[best]["step"]) for pair in pairs],
    }


def _held_out(names: list[str], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """The pick against the configuration a user would run after measuring the grid: in each round,
    the one fastest over the other rounds, timed in this round (the fastest of the same round is the
    best of many noisy figures, which noise alone makes faster than it is). ``None`` with one round."""
    if len(rounds) < 2:
        return None
    ratios, chosen = [], []
    for index, this in enumerate(rounds):
        others = [r for i, r in enumerate(rounds) if i != index]
        best = min(names, key=lambda name: statistics.median(r[name]["step"] for r in others))
        ratios.append(this[best]["step"] / this[PICK]["step"])
        chosen.append(best)
    return {"pick_of_best": statistics.median(ratios), "per_round": ratios, "chosen": chosen}


def _print(result: dict[str, Any]) -> None:
    print(f"\n### {result['model']} ({result['rows']} rows per batch, {result['rounds']} round(s))\n")
    first = result["first_fit"]
    rate = first["rate"]
    priced = "as profiled" if rate == 1.0 else f"at {rate:.2f}x the profile, the rate other models' fits kept"
    print(
        f"The first fit ({first['configuration']}, no calibration of the model kept yet, its actions priced {priced}): "
        f"set-up error {_percent(first['error'])}\n"
    )
    table = result["table"]
    within = [row for row in table if row["error"] is not None and abs(row["error"]) <= 0.1]
    steady = [row for row in table if row["spread"] <= 0.1]
    errors = [abs(row["error"]) for row in table if row["error"] is not None]
    median = f", median error {statistics.median(errors):.0%}" if errors else ""
    fits = [e for row in table for e in row["fit_errors"] if e is not None]
    own = sum(abs(e) <= 0.1 for e in fits)
    print(
        f"Set-up prediction within 10%: {len(within)} of {len(table)} rows{median}; rounds of one configuration "
        f"within 10% of each other: {len(steady)} of {len(table)} rows, and among them the prediction within 10% on "
        f"{sum(row in within for row in steady)}; each fit's prediction against its own step: within 10% on {own} "
        f"of {len(fits)} fits\n"
    )
    print("| configuration | ran | samples/s | of best | step | rounds apart | predicted | error | calibrated error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in sorted(table, key=lambda r: -r["samples_per_second"]):
        predicted = "-" if row["predicted_step"] is None else f"{row['predicted_step'] * 1e3:.1f} ms"
        print(
            f"| {row['configuration']} | {row['ran']} | {row['samples_per_second']:.1f} | {row['of_best']:.2f} | "
            f"{row['measured_step'] * 1e3:.1f} ms | {row['spread']:.0%} | {predicted} | {_percent(row['error'])} | "
            f"{_percent(row['calibrated_error'])} |"
        )


def _header(*columns: str) -> None:
    print("\n| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def _print_summary(gridded: list[dict[str, Any]]) -> None:
    """Per model: the grid's best, the pick as it ran, and the pick's fraction of the best."""
    if not gridded:
        return
    _header(
        "model",
        "best configuration",
        "its samples/s",
        "pick (as it ran)",
        "settled",
        "pick samples/s",
        "pick / best",
        "pick / best of the other rounds (each round)",
    )
    for result in gridded:
        rows = {row["configuration"]: row for row in result["table"]}
        best = max(result["table"], key=lambda r: r["samples_per_second"] if r["configuration"] != PICK else 0)
        pick = rows[PICK]
        held = result["held_out"]
        against = (
            "-"
            if held is None
            else f"{held['pick_of_best']:.2f} ("
            + ", ".join(f"{c} {r:.2f}" for c, r in zip(held["chosen"], held["per_round"], strict=True))
            + ")"
        )
        print(
            f"| {result['model']} | {best['configuration']} | {best['samples_per_second']:.1f} | {pick['ran']} | "
            f"step {pick['settled']} | {pick['samples_per_second']:.1f} | "
            f"{pick['samples_per_second'] / best['samples_per_second']:.2f} | {against} |"
        )


def _print_pairs(paired: list[dict[str, Any]]) -> None:
    """Per model: the pick paired with the best, each pair's ratio and what each ran and predicted."""
    if not paired:
        return
    _header(
        "model",
        "grid's best",
        "pick / best, paired (median)",
        "interval of the median",
        "each pair",
        "the pick ran",
        "pick's prediction",
        "best's prediction",
    )
    for result in paired:
        pairs = result["pairs"]
        print(
            f"| {result['model']} | {pairs['best']} | {pairs['pick_of_best']:.2f} | "
            f"{MedianInterval(**pairs['interval'])} | "
            + ", ".join(f"{r:.2f}" for r in pairs["per_pair"])
            + f" | {'; '.join(pairs['pick_ran'])} | "
            + ", ".join(_percent(e) for e in pairs["pick_error"])
            + " | "
            + ", ".join(_percent(e) for e in pairs["best_error"])
            + " |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--no-pinning", action="store_true", help="the grid and the pick unpinned only")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per training, at least")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="timed seconds per training, at least (at its pace measured before)"
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps before the timed ones (the pick: until settled)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=0, help="then the pick and the grid's best, paired")
    parser.add_argument("--pair-steps", type=int, default=12, help="timed steps per training of a pair, at least")
    parser.add_argument(
        "--against", help="no grid: the pick paired with this configuration of it (e.g. 'cdp m=2 pinned')"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per round of one model")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.against is not None:
        names = [name for name, _ in _configs(args.families, args.microbatches, not args.no_pinning)]
        if args.against not in names or args.against == PICK:
            parser.error(f"--against: {args.against!r} is not a configuration of the grid ({', '.join(names[:-1])})")
        if args.pairs < 1:
            parser.error("--against: give the pairs to run, e.g. --pairs 4")
    os.environ.setdefault("LIGHTNING_PIPE_CACHE", tempfile.mkdtemp(prefix="auto_plan_profiles_"))  # fresh profiles
    results = []
    for model in args.models:
        if model == "gpt2":
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("gpt2 left out: transformers is not installed")
                continue
        start = time.perf_counter()
        if args.against is not None:  # the pairs alone
            result = {"model": model, "pairs": measure_pairs(model, args.against, args)}
        else:
            result = measure(model, args)
            _print(result)
            if args.pairs:
                grid = [row for row in result["table"] if row["configuration"] != PICK]
                best = min(grid, key=lambda row: row["measured_step"])["configuration"]
                steps = {row["configuration"]: row["measured_step"] for row in result["table"]}
                result["pairs"] = measure_pairs(model, best, args, steps)
        result["seconds"] = time.perf_counter() - start
        results.append(result)
    _print_summary([result for result in results if "table" in result])
    _print_pairs([result for result in results if "pairs" in result])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

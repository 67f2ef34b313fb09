"""Training throughput of pipeline schedules against Lightning's own DDP, on two transformers.

    python bench/transformer_throughput.py                  # both models, 4 and 8 micro-batches
    python bench/transformer_throughput.py --models encoder --microbatches 4 --rows 8 --steps 3 --warmup 1 --rounds 1

(the defaults: 42 trainings, 608 s on 2 cores on 2026-11-27; each training is a fresh pair of
processes, whose start, imports and the pipeline's planning take 10-20 s before the first step).

Models (``tests/user_modules.py``), dropout off, rows of 128 tokens from a vocabulary of 1024:

- ``gpt2``: ``transformers``' ``GPT2LMHeadModel`` (12 blocks, 128 wide, 4 heads) in ``HuggingFaceGPT2``,
  with the config's default key-value cache (``use_cache=True``, as a user's GPT-2 comes: the pipeline
  captures forward with it off, since it serves generation only; under Lightning's DDP it is turned
  off too, so that both compute the same), the loss ``self(input_ids).loss``; left out, with a note,
  when ``transformers`` is not installed;
- ``encoder``: ``EncoderLM``, an embedding, a 6-block ``nn.TransformerEncoder`` (128 wide, 4 heads,
  causal mask) and a head; cross-entropy on the next tokens.

Kinds, each a training of the same module on 2 CPU processes (gloo, one thread each) with the same
``--rows`` samples per optimizer step:

- ``lightning ddp``: ``Trainer(strategy="ddp", devices=2)``, each process ``rows / 2`` rows of a step
  (Lightning's ``DistributedSampler`` splits the data), one all-reduce of the gradients per step;
- ``1f1b``: ``PipelineStrategy("1f1b")``: two stages, a flush per step, the batch of ``rows`` cut into
  ``m`` micro-batches;
- ``2bw``: ``PipelineStrategy("2bw")`` (PipeDream-2BW, no flush: two weight versions);
- ``cdp``: ``PipelineStrategy("cdp")`` (Cyclic Data Parallelism, Fournier & Oyallon 2024, in its
  pipeline form: two stages, the micro-batches started one time step apart).

Each training is timed by the wall time between rank 0's ``on_train_batch_end`` calls after
``--warmup`` batches (``--steps`` intervals; a non-flushing schedule's last batch drains the pipeline
and is slower: the median of the intervals is not moved by it). ``--rounds`` rounds each run every kind one
after the other (for each model: Lightning's DDP once, then the three schedules at each micro-batch
count), so that a round's ratios are taken under one state of the machine.

Columns, one row per model and micro-batch count ``m``:

- ``<kind> samples/s``: rows per step over the median interval, the median over the rounds
  (Lightning's DDP does not depend on ``m``: the same figure on each of a model's rows);
- ``<kind> / ddp``: the median over the rounds of the round's samples/s of the kind over Lightning's
  DDP's (paired; above 1: faster than DDP);
- ``<kind> imbalance``: the planned bottleneck stage's compute (forward + backward per micro-batch,
  ``Plan.stages[i].compute_seconds``) over the mean of the stages' (1.00: a perfect split), median
  over the rounds (each training profiles and plans anew);
- ``<kind> bubble``: the predicted idle fraction of the devices (``PipelineStrategy.prediction``'s
  ``bubble_fraction``: the schedule simulated with the profiled costs, fill and drain included).

Both processes share this machine's cores (and another load shows in every kind): absolute figures are
the machine's, the paired ratios are what carries over.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer_runs import timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import LocalRunError, run_local
from tests.user_modules import EncoderLM, HuggingFaceGPT2

DDP = "lightning ddp"
PIPELINES = ("1f1b", "2bw", "cdp")
TOKENS, VOCAB = 128, 1024
TIMEOUT = 1800.0  # seconds for one training (both processes), far above what one takes


def _no_dropout(module: nn.Module) -> nn.Module:
    """``module`` with every dropout's probability 0 (a step's work then does not depend on chance)."""
    for layer in module.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0
    return module


def _gpt2() -> L.LightningModule:
    module = HuggingFaceGPT2()
    module.model.config.use_cache = True  # GPT2Config's default (HuggingFaceGPT2 turns it off)
    return _no_dropout(module)


def _gpt2_data(samples: int, generator: torch.Generator) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (samples, TOKENS), generator=generator))


def _encoder() -> L.LightningModule:
    return _no_dropout(EncoderLM(dropout=0.0))


def _encoder_data(samples: int, generator: torch.Generator) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (samples, TOKENS + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


@dataclass(frozen=True)
class Model:
    """How to build a model (seeded by the caller) and ``samples`` rows of its data."""

    build: Callable[[], L.LightningModule]
    data: Callable[[int, torch.Generator], TensorDataset]


MODELS = {"gpt2": Model(_gpt2, _gpt2_data), "encoder": Model(_encoder, _encoder_data)}


@dataclass(frozen=True)
class Run:
    """What rank 0 reports of one training: the timed intervals between batch ends (seconds), and for a
    pipeline its planned imbalance and predicted bubble (``None``: not planned, or DDP)."""

    seconds: list[float]
    imbalance: float | None = None
    bubble: float | None = None


def _planned(strategy: PipelineStrategy) -> tuple[float | None, float | None]:
    """The plan's bottleneck stage compute over the mean stage compute, and the predicted bubble."""
    imbalance = None
    plan = strategy.stage_plan.plan if strategy.stage_plan is not None else None
    if plan is not None:
        compute = [stage.compute_seconds for stage in plan.stages]
        imbalance = max(compute) / statistics.fmean(compute)
    prediction = strategy.prediction
    return imbalance, (prediction.bubble_fraction if prediction is not None else None)


def _quiet() -> None:
    """Lightning's and the strategy's info lines (devices, the plan, the end-of-fit report), their
    warnings and ``transformers``' notes off: the table is the output."""
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric", "lightning_pipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)  # its note on GPT-2's config (loss_type) per build
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="lightning_pipe")


def _train(rank: int, kind: str, model: str, microbatches: int, rows: int, steps: int, warmup: int) -> Run | None:
    """Worker: one training of ``model`` by ``kind``; rank 0's :class:`Run` (``None`` on the other ranks)."""
    os.environ["LOCAL_RANK"] = str(rank)
    _quiet()
    spec = MODELS[model]
    batches = warmup + steps + 1  # warmup + steps + 1 batch ends: ``steps`` timed intervals
    data = spec.data(rows * batches, torch.Generator().manual_seed(0))
    if kind == DDP:
        strategy: Any = "ddp"
        batch = rows // 2  # each process its half of a step; the sampler deals the rows
    else:
        strategy = PipelineStrategy(kind, microbatches=microbatches, profile_cache=False)
        batch = rows
    torch.manual_seed(0)
    module = spec.build()
    if kind == DDP and hasattr(module, "model"):  # GPT-2: DDP computes what the pipeline does, no cache
        module.model.config.use_cache = False
    trainer, timer = timed_trainer(strategy, "transformer_throughput_", num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data, batch_size=batch, drop_last=True))
    if rank != 0:
        return None
    seconds = [b - a for a, b in zip(timer.ends[warmup:], timer.ends[warmup + 1 :], strict=False)]
    imbalance, bubble = _planned(strategy) if isinstance(strategy, PipelineStrategy) else (None, None)
    return Run(seconds, imbalance, bubble)


def _run(kind: str, model: str, microbatches: int, args: argparse.Namespace) -> Run | None:
    """One training on 2 fresh processes; ``None``, with a note, when it fails."""
    try:
        result = run_local(_train, 2, kind, model, microbatches, args.rows, args.steps, args.warmup, timeout=TIMEOUT)
    except LocalRunError as error:
        lines = str(error).splitlines()
        print(f"{model} {kind} m={microbatches}: fails: {lines[0][:300]}", flush=True)
        return None
    return result[0]


def _median(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _cell(value: float | None, form: str = "{:.2f}") -> str:
    return "-" if value is None else form.format(value)


def _available(names: list[str]) -> list[str]:
    """The models whose libraries are installed (``gpt2`` needs ``transformers``), with a note for the others."""
    kept = []
    for name in names:
        if name == "gpt2":
            try:
                import transformers  # noqa: F401
            except ModuleNotFoundError as error:
                print(f"{name}: left out, {error.name} is not installed (pip install {error.name})")
                continue
        kept.append(name)
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rows", type=int, default=16, help="samples per optimizer step, both processes together")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="of the pipelines, per step")
    parser.add_argument("--steps", type=int, default=10, help="timed intervals per training")
    parser.add_argument("--warmup", type=int, default=3, help="batches before the timed ones")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rows % 2 or any(args.rows % m for m in args.microbatches):
        parser.error("--rows must be even (DDP's halves) and a multiple of every --microbatches")
    models = _available(args.models)
    print(
        f"{os.cpu_count()} cores, torch {torch.__version__}, lightning {L.__version__}; 2 processes (gloo), "
        f"{args.rows} rows of {TOKENS} tokens per step; {args.rounds} rounds of {args.steps} timed steps "
        f"after {args.warmup}",
        flush=True,
    )
    began = time.monotonic()
    runs: dict[tuple[str, str, int], list[Run | None]] = {}
    for _ in range(args.rounds):
        for model in models:
            runs.setdefault((model, DDP, 0), []).append(_run(DDP, model, 0, args))
            for m in args.microbatches:
                for kind in PIPELINES:
                    runs.setdefault((model, kind, m), []).append(_run(kind, model, m, args))

    def rates(key: tuple[str, str, int]) -> list[float | None]:
        return [None if run is None else args.rows / statistics.median(run.seconds) for run in runs[key]]

    header = (
        ["model", "m", *(f"{kind} samples/s" for kind in (DDP, *PIPELINES))]
        + [f"{kind} / ddp" for kind in PIPELINES]
        + [f"{kind} imbalance" for kind in PIPELINES]
        + [f"{kind} bubble" for kind in PIPELINES]
    )
    print("| " + " | ".join(header) + " |")
    print("| --- " * len(header) + "|")
    for model in models:
        ddp = rates((model, DDP, 0))
        for m in args.microbatches:
            speeds = {kind: rates((model, kind, m)) for kind in PIPELINES}
            ratios = [
                _median([None if p is None or d is None else p / d for p, d in zip(speeds[kind], ddp, strict=True)])
                for kind in PIPELINES
            ]
            planned = {kind: [run for run in runs[(model, kind, m)] if run is not None] for kind in PIPELINES}
            cells = (
                [model, str(m), _cell(_median(ddp), "{:.1f}")]
                + [_cell(_median(speeds[kind]), "{:.1f}") for kind in PIPELINES]
                + [_cell(ratio) for ratio in ratios]
                + [_cell(_median([run.imbalance for run in planned[kind]])) for kind in PIPELINES]
                + [_cell(_median([run.bubble for run in planned[kind]]), "{:.0%}") for kind in PIPELINES]
            )
            print("| " + " | ".join(cells) + " |")
    print(f"{time.monotonic() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()

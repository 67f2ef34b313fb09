"""Data parallelism through the strategy against Lightning's own DDP, and CDP's dp form against it.

    python bench/data_parallel.py                       # CIFAR ResNet-18, micro-batches of 16 and 64
    python bench/data_parallel.py --model mlp --rows 32 128 --rounds 5

Three trainings of the same LightningModule on 2 CPU processes (gloo), each with the same samples per
optimizer step (``2 x rows``):

- ``lightning ddp``: ``Trainer(strategy="ddp")``, each process ``rows`` samples of a batch;
- ``pipe ddp``: ``PipelineStrategy("ddp")`` (Rahimi 2025's w(s,b,d) = (b, b)), the batch of
  ``2 x rows`` cut into two micro-batches, one per process, gradients all-reduced per stage;
- ``pipe cdp dp``: ``PipelineStrategy("cdp", form="dp")`` (Fournier & Oyallon 2024, §4.2): the
  same replicas started two time steps apart (two stages whose backwards outlast their forwards:
  the end of the second forward is the last action ending by half a pass), each stage's gradient
  reduced along the ring of processes during the step (CDP-v2).

Each is timed by the wall time between rank 0's ``on_train_batch_end`` calls after a warm-up, in
``--rounds`` rounds that run the three one after the other (paired: the machine's state is shared);
the table gives each one's median samples/s and the ratios to Lightning's DDP. Both processes share
this machine's cores, so absolute figures are the machine's; the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_runs import Classifier, timed_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.zoo.models import build_chain

KINDS = ("lightning ddp", "pipe ddp", "pipe cdp dp")
SHAPES = {"resnet18": (3, 32, 32), "mlp": (3, 32, 32)}


def _train(rank: int, kind: str, model: str, rows: int, steps: int, warmup: int) -> list[float]:
    """Worker: one training of ``kind``; the seconds of each step after the warm-up (rank 0)."""
    os.environ["LOCAL_RANK"] = str(rank)
    per_step = 2 * rows
    batch = rows if kind == "lightning ddp" else per_step  # Lightning's DDP: each process its share
    samples = per_step * (steps + warmup)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, *SHAPES[model], generator=generator), torch.randint(10, (samples,)))
    if kind == "lightning ddp":
        strategy: Any = "ddp"
    elif kind == "pipe ddp":
        strategy = PipelineStrategy("ddp", profile_cache=False)
    else:
        strategy = PipelineStrategy("cdp", form="dp", profile_cache=False)
    trainer, timer = timed_trainer(strategy, "data_parallel_")
    torch.manual_seed(0)
    net = build_chain(model, num_classes=10, input_shape=SHAPES[model])
    trainer.fit(Classifier(net), DataLoader(data, batch_size=batch, drop_last=True))
    return [b - a for a, b in zip(timer.ends[warmup:], timer.ends[warmup + 1 :], strict=False)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet18")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="samples per process and step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{args.model}, 2 processes, {args.rounds} rounds of {args.steps} timed steps after {args.warmup}")
    print(
        "| rows per process | "
        + " | ".join(f"{kind} samples/s" for kind in KINDS)
        + " | pipe ddp / lightning | cdp dp / lightning | cdp dp / pipe ddp |"
    )
    print("| --- " * (len(KINDS) + 4) + "|")
    for rows in args.rows:
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind in KINDS:
                seconds = run_local(_train, 2, kind, args.model, rows, args.steps, args.warmup, timeout=1200)[0]
                rates[kind].append(2 * rows / statistics.median(seconds))
        median = {kind: statistics.median(values) for kind, values in rates.items()}
        cells = [f"{median[kind]:.1f}" for kind in KINDS]
        ratios = (
            median["pipe ddp"] / median["lightning ddp"],
            median["pipe cdp dp"] / median["lightning ddp"],
            median["pipe cdp dp"] / median["pipe ddp"],
        )
        print(f"| {rows} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()

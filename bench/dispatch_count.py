"""Operators dispatched per training step, by where in ``lightning_pipe`` they come from: plain
Lightning against ``PipelineStrategy`` on one device (``form="single"``), through the Trainer.

On a GPU a step whose kernels are small is bound by the host: every operator dispatched costs
microseconds of Python and a launch whatever its size, so the count, not the CPU's time, says what a
pipeline adds per step on a fast device. A :class:`~torch.utils._python_dispatch.TorchDispatchMode`
counts every ATen operator of three steps after one warm-up and charges each to the innermost frame in
``lightning_pipe`` calling it ("model/torch" when none: the model's own and the optimizer's).

Run: ``python bench/dispatch_count.py [--model resnet|gpt2] [--schedule gpipe] [--microbatches 4]``
(a torchvision ResNet-50 on 16 images of 32x32, or a 4-block GPT-2 on 8 rows of 16 tokens; a minute
on 2 cores). ``--microbatches 0`` counts plain Lightning.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
from gpu_check import GPT2_TINY, Sizes, _model, _quiet
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from trainer_runs import quiet_trainer

from lightning_pipe import PipelineStrategy

WARMUP, STEPS = 2, 3
PACKAGE = "/lightning_pipe/"


class _Count(TorchDispatchMode):
    """Every operator dispatched, keyed by (the innermost ``lightning_pipe`` frame, the operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        where = "model/torch"
        for frame in reversed(traceback.extract_stack(limit=40)):
            if PACKAGE in frame.filename:
                where = f"{frame.filename.split(PACKAGE)[-1]}:{frame.lineno} {frame.name}"
                break
        self.seen[(where, str(func))] += 1
        return func(*args, **(kwargs or {}))


class _Steps(L.Callback):
    """Counts from the start of batch ``WARMUP`` to the end of batch ``WARMUP + STEPS - 1``."""

    def __init__(self) -> None:
        self.mode: _Count | None = None
        self.counted: _Count | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if index == WARMUP:
            self.mode = _Count()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.mode is not None and args[-1] == WARMUP + STEPS - 1:
            self.mode.__exit__(None, None, None)
            self.counted, self.mode = self.mode, None


def main(argv: list[str] | None = None) -> collections.Counter[tuple[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("resnet", "gpt2"), default="resnet")
    parser.add_argument("--schedule", default="gpipe", help="a synchronous family (its single-device form)")
    parser.add_argument("--microbatches", type=int, default=4, help="also the stages; 0: plain Lightning")
    parser.add_argument("--top", type=int, default=20, help="rows of each table")
    args = parser.parse_args(argv)
    _quiet()
    sizes = Sizes(32, 16, "resnet50", GPT2_TINY, 16, 8, WARMUP, STEPS, 1)
    m = args.microbatches
    strategy: Any = "auto"
    if m:
        options = {"schedule": args.schedule, "form": "single", "stages": m, "microbatches": m}
        strategy = PipelineStrategy(**options, profile_repeats=1)
    module, data, rows = _model(args.model, sizes)
    steps = _Steps()
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(root, [steps], accelerator="cpu", devices=1, strategy=strategy, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(data, batch_size=rows, drop_last=True))
    assert steps.counted is not None
    seen = steps.counted.seen
    label = "plain Lightning" if not m else f"{args.schedule}, {m} stages and micro-batches on one device"
    print(f"{args.model}, {label}: {sum(seen.values()) / STEPS:.0f} operators per step")
    by_place: collections.Counter[str] = collections.Counter()
    for (where, _), count in seen.items():
        by_place[where] += count
    print("\n| per step | where |\n| ---: | --- |")
    for where, count in by_place.most_common(args.top):
        print(f"| {count / STEPS:.0f} | {where} |")
    print("\n| per step | where | operator |\n| ---: | --- | --- |")
    for (where, op), count in seen.most_common(args.top):
        print(f"| {count / STEPS:.0f} | {where} | {op} |")
    return seen


if __name__ == "__main__":
    main()

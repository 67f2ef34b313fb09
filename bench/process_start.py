"""What starting processes costs, spawned (each imports torch and Lightning itself) against forked from
a forkserver that imported them once (:mod:`lightning_pipe.runtime.launch`), in alternating rounds:

1. ``run_local``'s start: 2 processes that import Lightning, started and joined;
2. a whole ``Trainer.fit`` of a small MLP (2 batches) on 2 processes with
   ``PipelineStrategy(start_method="spawn")`` against ``"forkserver"``, as the jobs of a Hydra
   multirun fit one after the other in one process (:mod:`lightning_pipe.strategy.launchers`).

Run: ``python bench/process_start.py [--rounds 3]``. Printed: seconds per start of the 2 processes and
per fit, median over the rounds, the forkserver's own first start apart, and the ratio spawn/forkserver.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_runs import Classifier, quiet_trainer

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime.launch import preloading_forkserver


def _fit(start_method: str, root: Path) -> float:
    """Seconds from ``Trainer.fit``'s call to its return: processes started, planned, 2 steps, joined."""
    data = DataLoader(TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,))), batch_size=32)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)]
    strategy = PipelineStrategy(start_method=start_method, profile_cache=False)
    trainer = quiet_trainer(root, [], accelerator="cpu", devices=2, strategy=strategy)
    begin = time.monotonic()
    trainer.fit(Classifier(nn.Sequential(*blocks, nn.Linear(64, 10))), data)
    return time.monotonic() - begin


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
    spawn, forkserver = mp.get_context("spawn"), preloading_forkserver()
    first = _start(forkserver)  # the server starts and imports torch, Lightning and lightning_pipe
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
    fits: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    with TemporaryDirectory() as root:
        for _ in range(args.rounds):
            for name, values in fits.items():
                values.append(_fit(name, Path(root)))
    print("\n| Trainer.fit on 2 processes (2 steps) | median s |")
    print("| --- | --- |")
    for name, values in fits.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    print(f"spawn / forkserver: {statistics.median(fits['spawn']) / statistics.median(fits['forkserver']):.1f}x")


if __name__ == "__main__":
    main()

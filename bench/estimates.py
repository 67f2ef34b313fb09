"""How far the set-up's estimates are from what they estimate, on this machine: a meta-device profile's
time (FLOPs at the measured matmul rate, :mod:`lightning_pipe.cost.flop_rate`) against the same MLP
profiled for real, and the contention of 2 processes (:func:`~lightning_pipe.runtime.contention.measure_contention`),
each round beside the load other processes put on the machine then (:mod:`lightning_pipe.cost.machine_load`).

Run: ``python bench/estimates.py [--rounds 3] [--threads 1] [--shapes 1024x4x128 4096x16x16]``. A
shape is ``WIDTHxDEPTHxROWS``: ``DEPTH`` blocks of Linear(WIDTH, WIDTH) + ReLU and a 10-class head,
micro-batches of ``ROWS``. Printed per round: the load, the matmul rate, meta / real for each shape
(1: the estimate is the measured time; below 1: too short) and the contention of 2 processes of
``--threads`` threads each.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.cost.flop_rate import flop_rate
from lightning_pipe.cost.machine_load import current_load
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.runtime.contention import measure_contention
from lightning_pipe.runtime.launch import run_local


def _mlp(width: int, depth: int) -> nn.Sequential:
    blocks = [module for _ in range(depth) for module in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def _meta_over_real(width: int, depth: int, rows: int) -> float:
    real = profile_layers(_mlp(width, depth), torch.randn(rows, width), repeats=5)
    with torch.device("meta"):
        model = _mlp(width, depth)
    estimated = profile_layers(model, torch.randn(rows, width, device="meta"), rate_device="cpu")
    return sum(layer.seconds for layer in estimated.layers) / sum(layer.seconds for layer in real.layers)


def _contention(rank: int) -> float:
    return measure_contention(dist.group.WORLD, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["1024x4x128", "4096x16x16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    for round_ in range(args.rounds):
        load = current_load(seconds=0.5)
        factors = [_meta_over_real(*shape) for shape in shapes]
        contention = run_local(_contention, 2, threads=args.threads, timeout=60)[0]
        shown = ", ".join(f"{name} {factor:.2f}" for name, factor in zip(args.shapes, factors, strict=True))
        print(
            f"round {round_}: load {load}, matmul {flop_rate('cpu') / 1e9:.0f} GFLOP/s ({args.threads} thread(s)), "
            f"meta / real: {shown}; contention of 2 processes {contention:.2f}"
        )


if __name__ == "__main__":
    main()

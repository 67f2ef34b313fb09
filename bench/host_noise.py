"""How steady this machine is: one core's matrix-multiply rate, second by second, with the other core
idle and then busy with the same work, and the copy bandwidth of one core and of two at once.

Run: ``python bench/host_noise.py [--seconds 15] [--size 512]``

The runtime benchmark (``bench/runtime_speed.py``) compares configurations run seconds apart; this
tells how much the machine itself drifts over such spans, with nothing of ours running.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def gemm_rates(seconds: float, size: int, window: float = 0.5) -> list[float]:
    """GFLOP/s of one thread multiplying two ``size`` x ``size`` matrices, per ``window`` seconds."""
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < window:
            torch.mm(a, b)
            count += 1
        rates.append(count * 2 * size**3 / (time.perf_counter() - start) / 1e9)
    return rates


def copy_bandwidth(megabytes: int = 64, repeats: int = 30) -> float:
    """GB/s read plus written by one thread copying a ``megabytes`` buffer (far beyond the caches)."""
    torch.set_num_threads(1)
    source = torch.randn(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    return 2 * source.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def _both(fn: Callable, *args: object) -> list:
    """``fn(*args)`` in two processes at once (two cores: the kernel gives each its own)."""
    with mp.get_context("spawn").Pool(2) as pool:
        return pool.starmap(fn, [args, args])


def _summary(rates: list[float]) -> str:
    low, high = min(rates), max(rates)
    middle = statistics.median(rates)
    return f"min {low:5.1f}  median {middle:5.1f}  max {high:5.1f}  (max - min) / median {(high - low) / middle:4.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    print(f"matrix multiply {args.size}x{args.size}, one thread, GFLOP/s per 0.5 s over {args.seconds:.0f} s")
    print(f"{'other core idle':>22}: {_summary(gemm_rates(args.seconds, args.size))}")
    for core, rates in enumerate(_both(gemm_rates, args.seconds, args.size)):
        print(f"{f'both busy, process {core}':>22}: {_summary(rates)}")
    alone = copy_bandwidth()
    both = _both(copy_bandwidth)
    print(f"copy bandwidth: one core {alone:.1f} GB/s; two at once {both[0]:.1f} + {both[1]:.1f} GB/s")


if __name__ == "__main__":
    main()

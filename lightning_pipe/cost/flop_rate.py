"""How many floating point operations a second a device computes, measured with one square matmul.

A model built on the meta device has shapes but no values: its layers cannot be timed, only their
FLOPs counted (:mod:`.profiler`). Their times are those FLOPs at the rate :func:`flop_rate` measures
on the device that will run them: the product of two random ``n x n`` matrices (``n`` from
:func:`matmul_size`: :data:`CPU_MATMUL_SIZE` on the CPU, :data:`ACCELERATOR_MATMUL_SIZE` on an
accelerator) in the model's dtype, run once untimed and :data:`REPEATS` times timed, the fastest
kept (the others were slowed by something else), ``2 n^3`` FLOPs over its seconds. It takes 0.1-0.2 s
on the CPU here (1024: 11 ms a product on 2 processors at 200 GFLOP/s, 22 ms on one) and is measured
once per process for each device, dtype and (on the CPU) thread count.

A matmul of that size runs near the device's best rate; smaller layers, element-wise ones (no FLOPs
counted) and the framework's own time per operation make a real model slower than its FLOPs at that
rate: ``tests/test_profiler.py`` measures the factor on an MLP.
"""

from __future__ import annotations

import functools
import time

import torch

from lightning_pipe.errors import PlanningError

__all__ = [
    "ACCELERATOR_MATMUL_SIZE",
    "CPU_MATMUL_SIZE",
    "REPEATS",
    "flop_rate",
    "matmul_seconds",
    "matmul_size",
    "synchronize",
]

CPU_MATMUL_SIZE = 1024
"""Side of the calibration matmul on the CPU: 2.1 GFLOP, 11 ms on 2 cores here."""
ACCELERATOR_MATMUL_SIZE = 4096
"""Side of the calibration matmul on an accelerator: 137 GFLOP, large enough to fill a GPU's cores."""
REPEATS = 5
"""Timed products of :func:`flop_rate`; the fastest is kept."""


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` so that a clock read after it measures them (no-op on
    the CPU and the meta device)."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


def matmul_size(device: torch.device) -> int:
    """The side of the calibration matmul on ``device``'s kind."""
    return CPU_MATMUL_SIZE if device.type == "cpu" else ACCELERATOR_MATMUL_SIZE


def matmul_seconds(device: torch.device, size: int, dtype: torch.dtype, runs: int, seconds: float = 0.0) -> list[float]:
    """The seconds of each product of two random ``size x size`` matrices of ``dtype`` on ``device``
    (the operands made once, the device synchronised around each): ``runs`` of them, and more while
    they took less than ``seconds`` together."""
    left, right = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    times: list[float] = []
    while len(times) < runs or sum(times) < seconds:
        synchronize(device)
        start = time.perf_counter()
        torch.mm(left, right)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def flop_rate(device: str | torch.device, dtype: torch.dtype = torch.float32) -> float:
    """FLOPs a second of a square matmul of ``dtype`` on ``device`` (see the module docstring),
    measured once per process for each device, dtype and thread count.

    Raises:
        PlanningError: ``device`` is the meta device (it computes nothing) or not a device.
    """
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlanningError(f"unknown device {device!r}: use e.g. 'cpu' or 'cuda:0' ({exc})") from exc
    if target.type == "meta":
        raise PlanningError(
            "the meta device computes nothing, so it has no FLOP rate: give the device the layers will run on "
            "('cpu', 'cuda')"
        )
    if target.type != "cpu" and target.index is None:
        target = torch.device(target.type, torch.accelerator.current_device_index())
    threads = torch.get_num_threads() if target.type == "cpu" else 0
    return _measured_rate(str(target), dtype, threads)


@functools.cache
def _measured_rate(device: str, dtype: torch.dtype, threads: int) -> float:
    """:func:`flop_rate`'s measurement, kept per process (``threads`` only keys the CPU's)."""
    target = torch.device(device)
    size = matmul_size(target)
    best = min(matmul_seconds(target, size, dtype, REPEATS + 1)[1:])  # the first warms the device up
    return 2 * size**3 / best

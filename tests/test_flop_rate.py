"""A model on the meta device is timed from its FLOPs at the rate a matmul reaches on the device that
will run it: the rate measured once per process, the profile's times its FLOPs at that rate, and
near the same model's profile measured for real."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_pipe.cost import profiler
from lightning_pipe.cost.flop_rate import flop_rate
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.errors import PlanningError


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread, as each process of a pipeline on this 2-processor machine: steadier timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp(width: int = 1024) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 10))


def test_the_rate_is_measured_once_per_process(one_thread: None) -> None:
    """A CPU's matmul rate lies between 100 MFLOP/s and 100 TFLOP/s; asked again, it is the kept one."""
    rate = flop_rate("cpu")
    assert 1e8 < rate < 1e14
    start = time.perf_counter()
    assert flop_rate(torch.device("cpu")) == rate
    assert time.perf_counter() - start < 0.01


@pytest.mark.parametrize(
    ("device", "message"),
    [("meta", r"^the meta device computes nothing, so it has no FLOP rate"), ("nowhere", r"^unknown device 'nowhere'")],
)
def test_a_device_without_a_rate_is_refused(device: str, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        flop_rate(device)


def test_a_meta_device_profile_is_its_flops_at_the_rate_of_the_device_that_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each layer's forward and backward seconds are its FLOPs at the rate of ``rate_device`` in the
    layers' dtype, which the profile's ``meta`` records."""
    asked = []

    def rate(device: torch.device, dtype: torch.dtype) -> float:
        asked.append((device, dtype))
        return 1e9

    monkeypatch.setattr(profiler, "flop_rate", rate)
    with torch.device("meta"):
        model = _mlp(64).double()
    costs = profile_layers(model, torch.randn(8, 64, dtype=torch.float64, device="meta"), rate_device="cpu")
    assert asked == [(torch.device("cpu"), torch.float64)]
    assert costs.meta["flops_per_second"] == 1e9 and costs.meta["rate_device"] == "cpu"
    for layer in costs.layers:
        assert layer.flops is not None
        assert layer.seconds == pytest.approx(layer.flops / 1e9)
    assert costs.layers[0].forward_seconds == pytest.approx(2 * 8 * 64 * 64 / 1e9)


@pytest.mark.parametrize(
    ("rate_device", "message"),
    [
        ("meta", r"^rate_device='meta': the meta device computes nothing; give the device the layers will run on"),
        ("nowhere", r"^rate_device: unknown device 'nowhere'"),
    ],
)
def test_a_rate_device_that_cannot_compute_is_refused(rate_device: str, message: str) -> None:
    with torch.device("meta"):
        model = _mlp(8)
    with pytest.raises(PlanningError, match=message):
        profile_layers(model, torch.randn(2, 8, device="meta"), rate_device=rate_device)


def test_a_meta_device_profile_is_near_the_real_one(one_thread: None) -> None:
    """An MLP of 1024-wide layers, 128 rows, one thread: its meta-device profile's total time is within
    3x of its profile measured on the CPU (measured here, ``bench/estimates.py``: 0.93-0.95x on the quiet
    machine, 0.62-0.98x while other work kept it busy; layers this size run near the matmul's rate,
    the ReLUs count no FLOPs)."""
    real = profile_layers(_mlp(), torch.randn(128, 1024), repeats=5)
    with torch.device("meta"):
        model = _mlp()
    estimated = profile_layers(model, torch.randn(128, 1024, device="meta"), rate_device="cpu")
    factor = sum(layer.seconds for layer in estimated.layers) / sum(layer.seconds for layer in real.layers)
    assert 1 / 3 < factor < 3, factor

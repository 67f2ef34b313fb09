"""The bytes of tensors alive and their peak, measured at the dispatcher (``cost/allocated.py``),
against the running sum of what a program allocates and frees, worked out by hand."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.allocated import AllocatedPeak

FLOAT = 4


def _alive_bytes() -> int:
    """The bytes of the storages of every tensor alive, each storage once."""
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4096)), min_size=1, max_size=30))
def test_the_peak_is_the_running_sum_of_allocations_and_frees(program: list[tuple[bool, int]]) -> None:
    """Each step allocates a tensor of the drawn floats, or frees the oldest one held: the meter's
    current and peak bytes follow the sum worked out step by step from the bytes alive on entering."""
    held: list[torch.Tensor] = []
    gc.collect()
    with AllocatedPeak("cpu") as meter:
        base = meter.current
        assert base == _alive_bytes()
        current = peak = base
        for allocate, floats in program:
            if allocate or not held:
                held.append(torch.empty(floats))
                current += floats * FLOAT
            else:
                current -= held.pop(0).numel() * FLOAT
            peak = max(peak, current)
            assert meter.current == current
        assert meter.peak == peak
        meter.reset()
        assert meter.peak == current
        held.clear()
        assert meter.current == base


def test_views_and_in_place_operators_allocate_nothing() -> None:
    x = torch.ones(1000)
    with AllocatedPeak("cpu") as meter:
        base = meter.current
        view = x[:500].view(50, 10)
        x.mul_(2)
        view.add_(1)
        assert meter.current == base == meter.peak
        y = x * 2  # a new storage
        assert meter.current == base + 1000 * FLOAT
        del y
        assert meter.current == base
        assert meter.peak == base + 1000 * FLOAT


def test_a_backward_is_followed_and_its_saved_activations_freed() -> None:
    """A layer's forward saves its input for the backward; the backward makes the weight's gradient
    and frees what was saved: after it, the gradient alone is left of all it made."""
    layer = torch.nn.Linear(64, 64, bias=False)
    inputs = torch.randn(32, 64, requires_grad=True)
    with AllocatedPeak("cpu") as meter:
        base = meter.current
        out = torch.relu(layer(inputs))
        out.sum().backward()
        del out
        gc.collect()
        weight_grad, input_grad = 64 * 64 * FLOAT, 32 * 64 * FLOAT
        assert meter.current == base + weight_grad + input_grad
        # the linear's output and the relu's (saved), the sum, its gradient and the gradients on the way
        assert meter.peak > base + weight_grad + input_grad + 2 * 32 * 64 * FLOAT


def test_other_devices_are_not_counted() -> None:
    with AllocatedPeak("meta") as meter:
        on_cpu = torch.empty(1000)
        assert meter.current == meter.peak == 0
        on_meta = torch.empty(1000, device="meta")
        assert meter.current == meter.peak == 1000 * FLOAT
        del on_cpu, on_meta
        assert meter.current == 0

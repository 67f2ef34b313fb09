"""The gradient clipping helpers (``lightning_pipe/runtime/clipping.py``, multi-tensor operations)
against the per-tensor arithmetic they replace and ``torch.nn.utils``' own clipping, on lists with
absent gradients, mixed dtypes and shapes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.runtime.clipping import clip_by_value, norm_coefficient, scale, squared_norm

shapes = st.lists(st.one_of(st.none(), st.lists(st.integers(1, 4), min_size=0, max_size=3)), max_size=6)


def _gradients(layout: list, seed: int, half: bool) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    grads: list[torch.Tensor | None] = []
    for i, shape in enumerate(layout):
        if shape is None:
            grads.append(None)
            continue
        g = torch.randn(shape, generator=generator) * 3
        grads.append(g.to(torch.bfloat16) if half and i % 2 else g)
    return grads


@settings(max_examples=60, deadline=None)
@given(layout=shapes, seed=st.integers(0, 99), half=st.booleans(), max_norm=st.floats(0.1, 10.0))
def test_norm_scale_and_clamp_equal_the_per_tensor_arithmetic(layout, seed, half, max_norm) -> None:
    grads = _gradients(layout, seed, half)
    present = [g for g in grads if g is not None]
    expected = sum((g.double().pow(2).sum() for g in present), torch.zeros((), dtype=torch.float64))
    total = squared_norm(grads)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-12)
    if present and not half:  # torch's own clip_grad_norm_ on the same gradients
        copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in present]
        for parameter, g in zip(copies, present, strict=True):
            parameter.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(copies, max_norm)
        scale(grads, norm_coefficient(float(total) ** 0.5, max_norm))
        for parameter, g in zip(copies, present, strict=True):
            torch.testing.assert_close(g, parameter.grad)
    clamped = [None if g is None else g.clone().clamp_(-0.5, 0.5) for g in grads]
    clip_by_value(grads, 0.5)
    for g, c in zip(grads, clamped, strict=True):
        assert (g is None and c is None) or torch.equal(g, c)


def test_nothing_present_is_a_zero_norm_and_no_change() -> None:
    assert float(squared_norm([None, None])) == 0.0
    scale([None], 0.5)
    clip_by_value([], 1.0)

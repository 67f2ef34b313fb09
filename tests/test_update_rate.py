"""The optimizer's update priced per stage: the rates recovered from the steps timed, and each stage's
parameters counted as its optimizer steps them."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost import update_rate as module
from lightning_pipe.cost.update_rate import LARGE, SMALL, UpdatePrices, UpdateRate, update_rate

CPU = torch.device("cpu")


class _Clock:
    """A clock that only the fake optimizer's steps advance."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def _priced_optimizer(clock: _Clock, per_tensor: float, per_byte: float) -> type[torch.optim.Optimizer]:
    class Priced(torch.optim.SGD):
        def step(self, closure: object = None) -> None:  # type: ignore[override]
            params = [p for group in self.param_groups for p in group["params"]]
            clock.now += per_tensor * len(params) + per_byte * sum(p.numel() * p.element_size() for p in params)

    return Priced


@settings(max_examples=25, deadline=None)
@given(per_tensor=st.floats(0, 1e-3), per_byte=st.floats(0, 1e-8))
def test_the_rates_are_recovered_from_the_two_sets_timed(per_tensor: float, per_byte: float) -> None:
    """An optimizer whose step takes exactly ``per_tensor`` a tensor and ``per_byte`` a byte (on a clock
    only it advances) is measured at those rates, whatever they are."""
    clock = _Clock()
    kind = _priced_optimizer(clock, per_tensor, per_byte)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.time, "perf_counter", clock)
        patch.setattr(module, "_MEASURED", {})
        rate = update_rate(kind(nn.Linear(2, 2).parameters(), lr=0.1), CPU, torch.float32)
    assert rate is not None
    assert rate.per_tensor == pytest.approx(per_tensor, rel=1e-6, abs=1e-15)
    assert rate.per_byte == pytest.approx(per_byte, rel=1e-6, abs=1e-20)


def test_the_sets_tell_the_two_rates_apart() -> None:
    """The small set is mostly tensors, the large one mostly bytes: the system they give is well posed."""
    (n1, e1), (n2, e2) = SMALL, LARGE
    assert n1 > 10 * n2 and e2 > 100 * e1


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),  # keeps a default its constructor refuses
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
    ],
)
def test_the_optimizers_users_bring_are_measured(optimizer: object) -> None:
    rate = update_rate(optimizer(nn.Linear(4, 4).parameters()), CPU, torch.float32)  # type: ignore[operator]
    assert rate is not None
    assert rate.per_tensor >= 0 and rate.per_byte >= 0 and rate.per_tensor + rate.per_byte > 0


def test_what_cannot_be_measured_is_not_priced() -> None:
    """No optimizer, the meta device, and an optimizer whose step needs a closure: no rate (free)."""
    params = list(nn.Linear(2, 2).parameters())
    assert update_rate(None, CPU, torch.float32) is None
    assert update_rate(torch.optim.SGD(params, lr=0.1), torch.device("meta"), torch.float32) is None
    assert update_rate(torch.optim.LBFGS(params), CPU, torch.float32) is None


def test_a_step_over_nothing_costs_nothing() -> None:
    assert UpdateRate(1.0, 1.0).seconds(0, 0) == 0.0
    assert UpdateRate(2.0, 0.5).seconds(3, 10) == 2.0 * 3 + 0.5 * 10


def _model() -> list[nn.Module]:
    shared = nn.Linear(3, 3)
    frozen = nn.Linear(3, 3)
    frozen.requires_grad_(False)
    return [nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 3), shared), shared, frozen, nn.Linear(3, 2, bias=False)]


@settings(max_examples=30, deadline=None)
@given(cuts=st.sets(st.integers(1, 4), max_size=4), per_tensor=st.floats(0, 1), per_byte=st.floats(0, 1))
def test_each_stage_is_priced_by_the_parameters_its_optimizer_steps(
    cuts: set[int], per_tensor: float, per_byte: float
) -> None:
    """Brute force: each stage's trainable parameters, a parameter shared by two of its layers once
    (and by layers of two stages, once in each), frozen ones not at all."""
    layers = _model()
    edges = [0, *sorted(cuts), len(layers)]
    bounds = [(a, b - 1) for a, b in itertools.pairwise(edges)]
    rate = UpdateRate(per_tensor, per_byte)
    prices = UpdatePrices.of(rate, layers)
    assert prices is not None
    for (first, last), seconds in zip(bounds, prices.stages(bounds), strict=True):
        held = {id(p): p for layer in layers[first : last + 1] for p in layer.parameters() if p.requires_grad}
        nbytes = sum(p.numel() * 4 for p in held.values())
        assert seconds == pytest.approx(rate.seconds(len(held), nbytes))
    assert UpdatePrices.of(None, layers) is None


def test_every_timed_step_finds_the_caches_emptied() -> None:
    """A run's update finds its weights, gradients and states evicted by the forwards and backwards
    since the last: each step measured (the untimed ones too) comes right after a write that empties
    the caches, and the clock runs around the step alone."""
    events: list[str] = []
    clock = _Clock()

    class Recorded(torch.optim.SGD):
        def step(self, closure: object = None) -> None:  # type: ignore[override]
            events.append("step")
            clock.now += 1.0

    def timed() -> float:
        events.append("clock")
        return clock()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "evictor", lambda device: lambda: events.append("evict"))
        patch.setattr(module.time, "perf_counter", timed)
        patch.setattr(module, "_MEASURED", {})
        assert update_rate(Recorded(nn.Linear(2, 2).parameters(), lr=0.1), CPU, torch.float32) is not None
    one_set = ["evict", "clock", "step"] * module.WARMUP + ["evict", "clock", "step", "clock"] * module.REPEATS
    assert events == one_set * 2


def test_the_caches_emptied_are_at_least_twice_the_last_level_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the L3 the C library reports, where it reports one larger than half the floor; the floor
    where it reports none."""
    assert module.evicted_bytes(CPU) >= module.EVICTED_AT_LEAST
    monkeypatch.setattr(module.os, "sysconf_names", {"SC_LEVEL3_CACHE_SIZE": 0})
    monkeypatch.setattr(module.os, "sysconf", lambda name: 96 << 20)
    assert module.evicted_bytes(CPU) == 192 << 20
    monkeypatch.setattr(module.os, "sysconf", lambda name: 0)
    assert module.evicted_bytes(CPU) == module.EVICTED_AT_LEAST


def test_the_eviction_writes_the_whole_buffer() -> None:
    """The buffer written is as large as asked, and each call writes every element."""
    evict = module.evictor(CPU)
    cells = evict.__closure__[0].cell_contents  # type: ignore[index]
    assert cells.numel() * 4 == module.evicted_bytes(CPU)
    evict()
    first = cells.clone()
    evict()
    assert torch.all(cells != first) and torch.all(cells == cells[0])

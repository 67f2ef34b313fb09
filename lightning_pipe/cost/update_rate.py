"""What a stage's optimizer step costs: measured once per optimizer and device, priced per stage.

A layer profile times forwards and backwards; the update each stage runs once per step is not in it,
yet it is part of every step (an Adam step over half of a 6-block, 128-wide transformer took 3-5 ms
of a 100 ms step on 2 CPU processes, a replicated model's twice that: ``bench/auto_plan.py``). An
optimizer step walks every parameter tensor of its groups, so its time is close to a cost per tensor
(the kernels' launches, the Python loop of a non-``foreach`` implementation) plus a cost per byte of
parameters (the element-wise arithmetic over weights, gradients and states, bound by memory
bandwidth). :func:`update_rate` measures both with the user's optimizer class and hyper-parameters
(``type(optimizer)(params, **optimizer.defaults)``) on two sets of synthetic parameters on the
device — many small tensors, then a few large ones — and solves for the two rates; a stage's update is
then :meth:`UpdateRate.seconds` of its parameter tensors and bytes, which needs no weights (a
meta-device model is priced as well). Each measurement is the median of :data:`REPEATS` steps after
:data:`WARMUP`, once per process.

Each timed step starts with the device's caches emptied (:func:`evicted_bytes` written first), as a
stage's update finds them in a run: its micro-batches' forwards and backwards ran since it last
touched its weights, gradients and states. Timed warm, step after step, the large set's 8 MiB of
weights with their gradients and states stayed in a 32 MiB last-level cache, and priced an SGD step
with momentum at 0.6-0.7 of its time: over torchvision's ResNet-18 from ``layer4`` on (32 MiB of
weights) 2.9 ms, where it took 4.4 ms cold; measured cold, 3.8 ms (``python bench/update_price.py``,
``docs/measurements.md``). The writes add about 0.05 s to a measurement on the CPU.

An optimizer that cannot be rebuilt that way (a required argument other than the parameters, a step
that needs a closure) is not priced: :func:`update_rate` returns ``None`` and the update counts 0 s,
as before it was priced.
"""

from __future__ import annotations

import inspect
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.cost.flop_rate import synchronize

__all__ = [
    "EVICTED_AT_LEAST",
    "LARGE",
    "REPEATS",
    "SMALL",
    "WARMUP",
    "UpdatePrices",
    "UpdateRate",
    "evicted_bytes",
    "evictor",
    "update_rate",
]

SMALL = (64, 1024)
"""Tensors and elements per tensor of the set that measures the cost per tensor."""
LARGE = (4, 1 << 19)
"""Tensors and elements per tensor of the set that measures the cost per byte (8 MiB of float32)."""
WARMUP = 2
"""Steps run before the timed ones (the optimizer's states are made at its first step)."""
REPEATS = 5
"""Timed steps per set; the median is kept."""
EVICTED_AT_LEAST = 64 << 20
"""Bytes written before each timed step, at least (:func:`evicted_bytes`): twice a 32 MiB last-level
cache, where the device does not tell its own."""


def evicted_bytes(device: torch.device) -> int:
    """Bytes to write on ``device`` to empty its caches: twice its last-level cache as it reports it
    (an accelerator's L2, the CPU's L3 as the C library reads it), :data:`EVICTED_AT_LEAST` at least."""
    cache = 0
    if device.type == "cuda":
        cache = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    elif device.type == "cpu" and "SC_LEVEL3_CACHE_SIZE" in os.sysconf_names:
        try:
            cache = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        except (OSError, ValueError):  # not known on this system
            cache = 0
    return max(EVICTED_AT_LEAST, 2 * max(cache, 0))


def evictor(device: torch.device) -> Callable[[], None]:
    """What empties ``device``'s caches when called: a write of :func:`evicted_bytes` (one buffer,
    allocated once)."""
    buffer = torch.empty(evicted_bytes(device) // 4, device=device)
    written = itertools.count()

    def evict() -> None:
        buffer.fill_(float(next(written)))  # written only, not read: half the traffic of an update in place

    return evict


@dataclass(frozen=True)
class UpdateRate:
    """An optimizer step's seconds: ``per_tensor`` for each parameter tensor and ``per_byte`` for each
    byte of parameters it updates."""

    per_tensor: float
    per_byte: float

    def seconds(self, tensors: int, nbytes: float) -> float:
        """One step over ``tensors`` parameter tensors of ``nbytes`` bytes in all (0 for none)."""
        return self.per_tensor * tensors + self.per_byte * nbytes if tensors else 0.0


def update_rate(optimizer: torch.optim.Optimizer | None, device: torch.device, dtype: torch.dtype) -> UpdateRate | None:
    """The :class:`UpdateRate` of ``optimizer``'s class and hyper-parameters on ``device`` for
    parameters of ``dtype`` (see the module docstring), measured once per process for each; ``None``
    where it cannot be measured (no optimizer, the meta device, an optimizer that cannot be rebuilt)."""
    if optimizer is None or device.type == "meta":
        return None
    defaults = getattr(optimizer, "defaults", None)
    if not isinstance(defaults, dict):
        return None
    kind = type(optimizer)
    key = (kind, repr(sorted(defaults.items(), key=lambda item: item[0])), str(device), dtype)
    if key not in _MEASURED:
        _MEASURED[key] = _measured(kind, _accepted(kind, defaults), device, dtype)
    return _MEASURED[key]


_MEASURED: dict[tuple[object, ...], UpdateRate | None] = {}
"""The rates measured in this process, by optimizer class, hyper-parameters (as text: their values
need not be hashable), device and dtype."""


def _accepted(kind: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``kind``'s constructor takes (AdamW keeps a
    ``decoupled_weight_decay`` default its constructor does not take)."""
    try:
        parameters = inspect.signature(kind).parameters
    except (TypeError, ValueError):
        return defaults
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return defaults
    return {k: v for k, v in defaults.items() if k in parameters}


def _measured(
    kind: type[torch.optim.Optimizer], defaults: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> UpdateRate | None:
    try:
        evict = evictor(device)
        small = _step_seconds(kind, defaults, device, dtype, *SMALL, evict)
        large = _step_seconds(kind, defaults, device, dtype, *LARGE, evict)
    except Exception:
        return None
    element = torch.empty((), dtype=dtype).element_size()
    (n1, e1), (n2, e2) = SMALL, LARGE
    b1, b2 = n1 * e1 * element, n2 * e2 * element
    # small = n1 t + b1 r, large = n2 t + b2 r
    determinant = n1 * b2 - n2 * b1
    per_byte = max((n1 * large - n2 * small) / determinant, 0.0)
    per_tensor = max((small - b1 * per_byte) / n1, 0.0)
    return UpdateRate(per_tensor, per_byte)


def _step_seconds(
    kind: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    e: int,
    evict: Callable[[], None],
) -> float:
    """The median seconds of one step of ``kind`` over ``n`` tensors of ``e`` elements, each after
    ``evict`` (the caches emptied, as a run's update finds them)."""
    params = [nn.Parameter(torch.zeros(e, device=device, dtype=dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = kind(params, **defaults)
    times = []
    for index in range(WARMUP + REPEATS):
        evict()
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class UpdatePrices:
    """Each stage's update at ``rate``, from its layers' trainable parameters: ``parameters`` holds,
    per layer, each parameter's identity and bytes (a parameter shared by two layers of one stage is
    updated once; by two stages, once on each)."""

    rate: UpdateRate
    parameters: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, rate: UpdateRate | None, layers: Sequence[nn.Module]) -> UpdatePrices | None:
        """The prices of ``layers``' stages at ``rate`` (``None`` without a rate)."""
        if rate is None:
            return None
        found = tuple(
            tuple((id(p), p.numel() * p.element_size()) for p in layer.parameters() if p.requires_grad)
            for layer in layers
        )
        return cls(rate, found)

    def stages(self, bounds: Sequence[tuple[int, int]]) -> list[float]:
        """The update seconds of each stage of ``bounds`` (first and last layer)."""
        found = []
        for first, last in bounds:
            held = dict(p for layer in self.parameters[first : last + 1] for p in layer)
            found.append(self.rate.seconds(len(held), sum(held.values())))
        return found

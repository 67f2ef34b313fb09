"""The random streams the step code draws from, replayed where the pipeline runs that code again.

Plain Lightning runs a step's code once per batch. A pipeline runs the code before ``forward`` once
per batch on every rank (to get ``forward``'s arguments), and on the last stage runs the step again
for each micro-batch with the pipeline's output (for the loss and logs), and an evaluation step
again on the whole batch. A random draw before ``forward`` (an augmentation, a random mask, mixup's
mixing of the targets the loss reads) would advance the stream on every rerun, and the draws would
differ from the first run's. So the states of the streams (torch's CPU generator, CUDA's when in
use, Python's ``random``, NumPy's global one) are taken before the first run, and those of the
streams the first run drew from are kept: every rerun starts them from there and gives them back as
it found them. The rerun draws what the first run drew, and those streams advance once per batch, as
under plain Lightning.

A stream the code before ``forward`` did not draw from is left alone: taking and setting a state
costs up to 80 us (NumPy's), three times per rerun, on the last stage's critical path. A draw the
step makes after ``forward`` from such a stream advances it as any draw does (on the last stage, once
per micro-batch); from a replayed stream it draws what it drew on the micro-batch before.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy
import torch

__all__ = ["STREAMS", "RandomStates", "replayed"]


class Stream(NamedTuple):
    """How to take, set and compare one stream's state."""

    get: Callable[[], Any]
    set: Callable[[Any], None]
    same: Callable[[Any, Any], bool]


def _cuda_state() -> list[torch.Tensor] | None:
    """Every CUDA device's generator state; ``None`` while CUDA is not initialised (nothing drawn)."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_cuda_state(states: list[torch.Tensor] | None) -> None:
    if states is not None:
        torch.cuda.set_rng_state_all(states)


def _same_tensors(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _same_numpy(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """NumPy's legacy state: (name, key array, position, has a cached Gaussian, the Gaussian)."""
    return a[0] == b[0] and numpy.array_equal(a[1], b[1]) and a[2:] == b[2:]


STREAMS: dict[str, Stream] = {
    "cpu": Stream(torch.get_rng_state, torch.set_rng_state, torch.equal),
    "cuda": Stream(_cuda_state, _set_cuda_state, _same_tensors),
    "python": Stream(random.getstate, random.setstate, operator.eq),
    "numpy": Stream(numpy.random.get_state, numpy.random.set_state, _same_numpy),
}


@dataclass(frozen=True)
class RandomStates:
    """The states of some of the streams (by name, :data:`STREAMS`) at one moment."""

    kept: dict[str, Any]

    @classmethod
    def now(cls, streams: Iterable[str] = STREAMS) -> RandomStates:
        """The states of ``streams`` (every stream by default) now."""
        return cls({name: STREAMS[name].get() for name in streams})

    def drawn_since(self) -> RandomStates:
        """These states, of only the streams drawn from since they were taken."""
        later = RandomStates.now(self.kept)
        return RandomStates(
            {name: state for name, state in self.kept.items() if not STREAMS[name].same(state, later.kept[name])}
        )

    def restore(self) -> None:
        """Set the kept streams to these states."""
        for name, state in self.kept.items():
            STREAMS[name].set(state)


@contextmanager
def replayed(states: RandomStates) -> Iterator[None]:
    """Within the block the streams ``states`` keeps start from there; after it they are as before
    it (the other streams are left alone)."""
    found = RandomStates.now(states.kept)
    states.restore()
    try:
        yield
    finally:
        found.restore()

"""The random streams the step code draws from, replayed where the pipeline runs that code again.

Plain Lightning runs a step's code once per batch. A pipeline runs the code before ``forward`` once
per batch on every rank (to get ``forward``'s arguments), and on the last stage runs the step again
for each micro-batch with the pipeline's output (for the loss and logs), and an evaluation step
again on the whole batch. A random draw there (an augmentation, a random mask) would advance the
stream on every rerun, and the draws would differ from the first run's. So the states of the
streams the step draws from (torch's CPU generator, CUDA's when in use, Python's ``random``,
NumPy's) are kept before the first run, and every rerun starts from them and gives the streams back
as it found them: the rerun draws what the first run drew, and the stream advances once per batch,
as under plain Lightning.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy
import torch

__all__ = ["RandomStates", "replayed"]


@dataclass(frozen=True)
class RandomStates:
    """The states of the streams a step draws from, at one moment."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None  # None: CUDA not initialised (nothing drawn from it)
    python: Any
    numpy: Any

    @classmethod
    def now(cls) -> RandomStates:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        numpy.random.set_state(self.numpy)


@contextmanager
def replayed(states: RandomStates) -> Iterator[None]:
    """Within the block the streams start from ``states``; after it they are as before it."""
    found = RandomStates.now()
    states.restore()
    try:
        yield
    finally:
        found.restore()

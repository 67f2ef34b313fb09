"""Batches that cannot be cut into the pipeline's micro-batches, refused before training.

A step cuts its batch into ``microbatches`` micro-batches along the rows, so every batch needs at
least that many rows. A ``DataLoader`` whose dataset is not a multiple of its batch size ends each
epoch with a smaller batch; when that batch has fewer rows than micro-batches, the epoch would train
to its end and fail there. The loaders are checked when training starts instead, with the ways out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch.utils.data import DataLoader

from lightning_pipe.errors import PlanningError

__all__ = ["check_batches"]


def check_batches(loaders: Iterable[object], microbatches: int, batches_run: float) -> None:
    """Refuse a ``DataLoader`` of ``loaders`` whose batches (the last one included, when the epoch
    reaches it: ``batches_run`` batches are run per epoch) have fewer rows than ``microbatches``.
    Loaders of unknown length or batch size are left to the step, which refuses such a batch."""
    for loader in loaders:
        if not isinstance(loader, DataLoader) or loader.batch_size is None:
            continue
        size = loader.batch_size
        if size < microbatches:
            raise PlanningError(
                f"the training DataLoader's batch_size={size} cannot be cut into {microbatches} micro-batches: use "
                f"batches of at least {microbatches} rows (a multiple of {microbatches} cuts them evenly), or fewer "
                "micro-batches"
            )
        try:
            samples = len(loader.sampler)  # this rank's share under a distributed sampler
        except TypeError:
            continue
        last = samples % size
        if loader.drop_last or last == 0 or last >= microbatches or batches_run < math.ceil(samples / size):
            continue
        raise PlanningError(
            f"the last training batch of each epoch has {last} row{'s' if last != 1 else ''} ({samples} samples in "
            f"batches of {size}), fewer than the {microbatches} micro-batches a step cuts it into: pass "
            f"drop_last=True to the DataLoader, or use a batch size that leaves at least {microbatches} rows at the end"
        )

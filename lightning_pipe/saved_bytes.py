"""Bytes autograd keeps for the backward pass, measured with saved-tensor hooks.

Used by the profiler (what a layer saves) and by the runtime (what a stage holds per micro-batch in
flight, and what recomputation saves). Saved tensors are counted once per underlying storage, whole:
a saved view keeps its whole storage alive. Storages of ``excluded`` tensors (parameters, buffers)
are model state, not activation memory, and are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["saved_bytes"]


@contextmanager
def saved_bytes(excluded: Iterable[torch.Tensor] = ()) -> Iterator[Callable[[], int]]:
    """Within the block, count what autograd saves; the yielded function returns the bytes so far."""
    skip = {t.untyped_storage().data_ptr() for t in excluded}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield lambda: sum(storages.values())

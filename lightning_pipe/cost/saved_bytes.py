"""Bytes autograd keeps for the backward pass, measured with saved-tensor hooks.

Used by the profiler (what a layer saves) and by the runtime (what a stage holds per micro-batch in
flight, and what recomputation saves). Saved tensors are counted once per underlying storage, whole:
a saved view keeps its whole storage alive. Storages of ``excluded`` tensors (parameters, buffers)
are model state, not activation memory, and are left out. On the meta device (a model not yet
materialised) a storage is told by the tensor it views.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["Saved", "is_model_state", "mark_model_state", "saved_bytes", "storage_key"]

_MODEL_STATE = "_lightning_pipe_model_state"  # the attribute mark_model_state sets


class Saved:
    """What a block saved: :attr:`storages` (storage key -> bytes); calling it gives their sum.
    On the meta device it also holds the tensors whose identities are the keys, so that no tensor
    made later in the block takes a freed one's identity (two storages counted as one: the saved
    bytes of a ResNet's blocks varied by a tensor from run to run)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.keys: list[torch.Tensor] = []

    def __call__(self) -> int:
        return sum(self.storages.values())


@contextmanager
def saved_bytes(excluded: Iterable[torch.Tensor] = ()) -> Iterator[Saved]:
    """Within the block, count what autograd saves; the yielded :class:`Saved` returns the bytes so
    far (and which storages they are: two blocks saving views of one storage hold it once)."""
    skip = {storage_key(t) for t in excluded}
    saved = Saved()
    storages = saved.storages

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in skip and not is_model_state(tensor):
            if tensor.is_meta and key not in storages:
                saved.keys.append(tensor if tensor._base is None else tensor._base)
            storages[key] = tensor.untyped_storage().nbytes()
        # kept without its autograd history: a saved output kept as itself would hold its own grad_fn,
        # a cycle through autograd's C++ graph that no garbage collection frees once a backward retained
        # the graph (the halves of a split backward do)
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def mark_model_state(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` (and so its views) as model state made during a forward, which
    :func:`saved_bytes` leaves out as it leaves out the excluded: batch norm's scratch statistics
    (:mod:`lightning_pipe.runtime.batch_norm`), which stand in for the running statistics."""
    setattr(tensor, _MODEL_STATE, True)
    return tensor


def is_model_state(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` or the tensor it is a view of was marked by :func:`mark_model_state`."""
    return getattr(tensor, _MODEL_STATE, False) or (
        tensor._base is not None and getattr(tensor._base, _MODEL_STATE, False)
    )


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies ``tensor``'s storage: its address, or on the meta device (no addresses) the
    tensor it is a view of (a parameter's transpose is the parameter's)."""
    if tensor.is_meta:
        return id(tensor._base if tensor._base is not None else tensor)
    return tensor.untyped_storage().data_ptr()

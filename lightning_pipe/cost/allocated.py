"""The bytes of tensors alive on a device and their peak, on any device: what
``torch.cuda.max_memory_allocated`` measures on a GPU, measured where no allocator counts (the CPU).

:class:`AllocatedPeak` starts from the storages alive on the device when it is entered (every tensor
the garbage collector tracks: the weights, their gradients, the optimizer's state, the batch) and
follows, at the dispatcher (:class:`~torch.utils._python_dispatch.TorchDispatchMode`), every storage
an operator's output owns without sharing it with one of the operator's inputs, each alive until
freed (a weak reference's finaliser). What a kernel allocates inside itself and frees before it
returns (a library's workspace) is not seen; a CUDA allocator's rounding of each block is not
counted. On a CPU, where torch allocates each tensor from the C library and the process's heap keeps
freed blocks, this is how the plan's memory (:mod:`lightning_pipe.cost.memory`) is checked against a
run (``bench/gpu_check.py``'s dry run, ``tests/test_allocated.py``).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocatedPeak", "storages"]


class AllocatedPeak(TorchDispatchMode):
    """Within the mode, the bytes of tensor storages alive on ``device`` (``current``) and their
    largest value since it was entered (``peak``); :meth:`reset` starts the peak again from now. Only
    the thread that entered it is followed (the autograd engine runs a CPU backward there)."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.current = 0
        self.peak = 0
        self._alive: dict[int, int] = {}  # id of a followed storage still alive -> its serial
        self._serial = 0
        self._open = False

    def __enter__(self) -> AllocatedPeak:
        self._open = True
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # not isinstance: it would read every object's __class__
                self._follow(storages(obj))
        self.peak = self.current
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._open = False
        super().__exit__(*exc)

    def reset(self) -> None:
        """The peak from now: the bytes alive now."""
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage in storages((args, kwargs))}
        self._follow(storage for storage in storages(output) if id(storage) not in inputs)
        return output

    def _follow(self, found: Any) -> None:
        for storage in found:
            key = id(storage)
            if key in self._alive or not self._on_device(storage.device):
                continue
            self._serial += 1
            self._alive[key] = self._serial
            size = storage.nbytes()
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key, self._serial, size)

    def _on_device(self, device: torch.device) -> bool:
        """Whether ``device`` is the one followed (``"cuda"`` stands for any index)."""
        return device.type == self.device.type and self.device.index in (None, device.index)

    def _freed(self, key: int, serial: int, size: int) -> None:
        if self._alive.get(key) != serial:  # an id is reused once its object is gone
            return
        del self._alive[key]
        if self._open:
            self.current -= size


def storages(values: Any) -> list[torch.UntypedStorage]:
    """The storages of the tensors among ``values`` (nested), those that have one (a sparse tensor
    has none)."""
    found = []
    for value in tree_leaves(values):
        if isinstance(value, torch.Tensor):
            try:
                found.append(value.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
    return found

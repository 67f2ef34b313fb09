"""What a layer's backward holds at its peak beyond what a plan already counts: ``backward_bytes``.

A plan counts a stage's weights, their gradients and optimizer state, and the activations each
micro-batch in flight saves (:mod:`lightning_pipe.cost.memory`). While one of its layers runs its
backward, the stage also holds the gradient of the layer's output, the gradient of its input as it
is made, and whatever the backward computes in between (a convolution's transposed products, a
normalisation's intermediate sums), less the saved activations it frees as it goes. On the CIFAR
ResNet-18 of ``bench/memory.py`` (2 processes, 128 rows a micro-batch) each rank allocated 8-18% more
than its plan without this, about four activations of the first convolutions, and 1-9% more with
it (a stage adds its largest layer's: :meth:`~lightning_pipe.cost.memory.MemoryModel.transient_bytes`).

:func:`backward_peak` measures it, the same way on every device: every storage an operator's output
owns without sharing it with one of the operator's inputs is a new allocation (seen at the dispatcher,
:class:`~torch.utils._python_dispatch.TorchDispatchMode`), alive until the storage is freed; every
storage autograd saved in the forward (seen by :class:`torch.autograd.graph.saved_tensors_hooks`)
and freed during the backward gives its bytes back. The peak of the running sum, the new gradients
of the parameters left out (the plan counts them among the parameter copies), plus the output
gradients the backward was given, is the layer's ``backward_bytes``. The peak with those gradients
counted as they are made, less all of them, is its ``first_backward_bytes``: what a step's first
backward holds beyond the gradients it leaves, where the sum peaked before they were made (the
logits' gradients of a language model's loss come and go before its LM head's gradient). What a kernel allocates inside
itself and frees before it returns (a library's workspace) is not seen.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pipe.cost.allocated import storages
from lightning_pipe.util.nested import tensors

__all__ = ["BackwardPeak", "backward_peak", "backward_roots"]


class BackwardPeak(TorchDispatchMode):
    """Within the mode, the storages operators allocate, and those watched (:meth:`saving`) freed, in
    order (:meth:`peak` reads the running sum's largest value)."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[tuple[int, int]] = []  # (storage's serial, +bytes allocated or -bytes freed)
        self._alive: dict[int, int] = {}  # id of a tracked storage still alive -> its serial
        self._serials = itertools.count()
        self._open = True

    def _track(self, storage: torch.UntypedStorage, allocated: bool) -> None:
        key = id(storage)
        if key in self._alive:
            return
        serial = self._alive[key] = next(self._serials)
        size = storage.nbytes()
        if allocated:
            self._events.append((serial, size))
        weakref.finalize(storage, self._freed, key, serial, size)

    def _freed(self, key: int, serial: int, size: int) -> None:
        if self._alive.get(key) == serial:  # an id is reused once its object is gone
            del self._alive[key]
        if self._open:
            self._events.append((serial, -size))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage in storages((args, kwargs))}
        for storage in storages(output):
            if id(storage) not in inputs:
                self._track(storage, allocated=True)
        return output

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within the block (the forward), watch every storage autograd saves for the backward: its
        bytes come back when it is freed. Only weakly: a watched storage is freed as it would be."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            for storage in storages(tensor):
                self._track(storage, allocated=False)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def close(self) -> None:
        """Stop recording frees (storages freed after the backward are not its business)."""
        self._open = False

    def peak(self, left_out: Iterable[torch.Tensor] = ()) -> int:
        """The largest bytes allocated and not yet freed at any moment, less the storages of
        ``left_out`` (what the backward made that is counted elsewhere: the parameters' gradients)."""
        skip = {self._alive.get(id(storage)) for storage in storages(list(left_out))}
        running = itertools.accumulate((size for serial, size in self._events if serial not in skip), initial=0)
        return max(running)


def backward_roots(output: Any, last: bool = False) -> list[torch.Tensor]:
    """The tensors of a layer's ``output`` a backward starts from: those that take a gradient; of the
    model's ``last`` layer returning a loss (a single number taking a gradient) beside other outputs,
    the loss alone, as the runtime differentiates the loss it reads from the last stage's outputs (a
    ``transformers`` model given labels: its logits take no gradient of their own)."""
    roots = [t for t in tensors(output) if t.requires_grad]
    losses = [t for t in roots if t.numel() == 1]
    return losses if last and losses else roots


def backward_peak(
    layer: Callable[[Any], Any], inputs: Any, parameters: Sequence[torch.Tensor], last: bool = False
) -> tuple[int, int]:
    """``backward_bytes`` and ``first_backward_bytes`` (module docstring) of ``layer`` run on
    ``inputs`` and its backward from random gradients of its outputs that take one
    (:func:`backward_roots`; ``last``: the model's last layer); the gradients the backward leaves in
    ``parameters``' ``.grad`` are left out (they should hold none before). 0 if no output takes a
    gradient."""
    tracker = BackwardPeak()
    with tracker.saving():
        output = layer(inputs)
    outputs = backward_roots(output, last)
    if not outputs:
        return 0, 0
    gradients = [torch.randn_like(t) for t in outputs]
    try:
        with tracker:
            torch.autograd.backward(outputs, gradients)
    finally:
        tracker.close()
    grads = [p.grad for p in parameters if p.grad is not None]
    given = sum(storage.nbytes() for storage in storages(gradients))
    made = sum(storage.nbytes() for storage in storages(grads))
    return tracker.peak(grads) + given, max(tracker.peak() - made, 0) + given

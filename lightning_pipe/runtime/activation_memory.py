"""Memory accounting: the bytes autograd saves for the micro-batches in flight on one worker.

With ``track_memory`` every forward runs under :func:`~lightning_pipe.cost.saved_bytes.saved_bytes`, which
finds the storages autograd saved for its backward. Each storage counts once however many forwards
in flight save it (the micro-batches of the first stage are views of one batch), from its forward
until the last backward half of every micro-batch saving it. Model state (parameters, and buffers
such as batch norm's running statistics) and the step's mini-batch are left out: every schedule
holds them. The count after every action (:attr:`ActivationMemory.timeline`) is what the simulator
predicts as a worker's activation memory (:mod:`lightning_pipe.schedule.simulate`); saved-tensor
hooks cost a little time, so nothing is counted without ``track_memory``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import torch

from lightning_pipe.cost.saved_bytes import saved_bytes
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.util.nested import tensors

__all__ = ["ActivationMemory"]


class ActivationMemory:
    """The bytes autograd saved for this worker's micro-batches in flight.

    Args:
        track: count them (``track_memory``); otherwise forwards run as they are.
        timeline_length: how many of the latest counts :attr:`timeline` keeps (``None``: all).

    Attributes:
        saved_bytes: the bytes saved now, each storage once.
        peak_saved_bytes: the most :attr:`saved_bytes` reached.
        timeline: ``(moment, saved bytes)`` after every action, which changes only in forwards (up,
            from the start of their compute) and backwards (down, at their end).
        step_data: step -> the tensors of its mini-batch on this worker, kept (alive, so no activation
            takes their addresses) while the step's micro-batches are in flight.
    """

    def __init__(self, track: bool, timeline_length: int | None) -> None:
        self.track = track
        self.saved_bytes = 0
        self.peak_saved_bytes = 0
        self.timeline: deque[tuple[float, int]] = deque(maxlen=timeline_length)
        self.step_data: dict[int, list[torch.Tensor]] = {}
        self._holders: Counter[int] = Counter()  # saved storage -> forwards in flight saving it
        self._held_bytes: dict[int, int] = {}

    def keep_data(self, step: int, inputs: Any) -> None:
        """Keep ``step``'s micro-batches of the first stage while the step is in flight, when counting."""
        if self.track:
            self.step_data[step] = list(tensors(inputs))

    def forward(
        self, weights: StageWeights, leaves: dict[str, torch.Tensor], inputs: Any, step: int, first: bool
    ) -> tuple[Any, dict[int, int]]:
        """Forward with autograd; also the storages it saved for backward when memory is tracked
        (model state excluded: the parameters, and buffers such as batch norm's running statistics;
        and ``step``'s mini-batch, the data, which the step holds whatever the schedule: the ``first``
        stage's inputs, and views of them however far they travel), counted in :attr:`saved_bytes`
        until :meth:`release`."""
        if not self.track:
            return weights.forward(leaves, inputs), {}
        data = [*self.step_data.get(step, ()), *(tensors(inputs) if first else ())]
        with saved_bytes([*leaves.values(), *weights.module.buffers(), *data]) as counted:
            result = weights.forward(leaves, inputs)
        for key, nbytes in counted.storages.items():
            if not self._holders[key]:
                self._held_bytes[key] = nbytes
                self.saved_bytes += nbytes
            self._holders[key] += 1
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
        return result, counted.storages

    def release(
        self, saved: dict[int, int], step: int, inputs: Mapping[int, Any], in_flight: Mapping[tuple[int, int, int], Any]
    ) -> None:
        """A micro-batch of ``step`` that saved ``saved`` is done; the step's data goes once the first
        stage's ``inputs`` of it are used up and no micro-batch of it is left ``in_flight``."""
        for key in saved:
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                self.saved_bytes -= self._held_bytes.pop(key)
        if step in self.step_data and step not in inputs and all(key[2] != step for key in in_flight):
            del self.step_data[step]

    def mark(self, moment: float) -> None:
        """Put the count after an action on :attr:`timeline`, at ``moment`` (on the host's clock)."""
        self.timeline.append((moment, self.saved_bytes))

"""Mini-batches split into micro-batches, and kept on a worker while their step is in flight.

The training loop hands the runtime one mini-batch per call; the worker of the first stage splits
its inputs, the worker of the last stage its targets, into the schedule's ``m`` micro-batches along
the batch dimension (GPipe's micro-batches, Huang et al. 2019, §2.2). The loss of micro-batch ``i``
is weighted by its share of the mini-batch, ``n_i / n``, so :class:`MiniBatches` keeps each step's
rows with its targets.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_pipe.errors import PipelineRuntimeError
from lightning_pipe.runtime.activation_memory import ActivationMemory
from lightning_pipe.util.nested import flatten, map_tensors, tensors, unflatten

__all__ = ["MiniBatches", "part_rows", "rows_of", "split_batch"]


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a nested batch into ``parts`` nearly equal micro-batches along dim 0 of every tensor that
    has the batch's rows (those of its first tensor with a dimension); other tensors (a 0-d scale, an
    attention mask shared by the rows) and non-tensor values go to every micro-batch as they are."""
    skeleton, found = (None, [batch]) if isinstance(batch, torch.Tensor) else flatten(batch)  # a tensor: no skeleton
    size = _rows(found)
    if size < parts:
        raise PipelineRuntimeError(f"a mini-batch of {size} samples cannot be split into {parts} micro-batches")
    chunks = [torch.tensor_split(t, parts) if t.dim() and t.shape[0] == size else (t,) * parts for t in found]
    if skeleton is None:
        return list(chunks[0])
    return [unflatten(skeleton, [c[i] for c in chunks]) for i in range(parts)]


def part_rows(rows: int, parts: int) -> list[int]:
    """The samples of each of :func:`split_batch`'s ``parts`` micro-batches of ``rows`` samples (the
    first ``rows % parts`` one more, as :func:`torch.tensor_split` cuts)."""
    size, extra = divmod(rows, parts)
    return [size + (i < extra) for i in range(parts)]


NO_BATCH_DIMENSION = "a mini-batch must hold a tensor with a batch dimension to split into micro-batches"
"""Said when a batch has no tensor with rows: by a running step, and at set-up (a planning error there)."""


def rows_of(batch: Any) -> int:
    """The samples in ``batch``: the first dimension of its first tensor that has one."""
    return _rows(tensors(batch))


def _rows(found: list[torch.Tensor]) -> int:
    first = next((t for t in found if t.dim()), None)
    if first is None:
        raise PipelineRuntimeError(NO_BATCH_DIMENSION)
    return first.shape[0]


class MiniBatches:
    """The micro-batches of the steps in flight on one worker.

    Args:
        worker: this worker (for messages).
        microbatches: the schedule's micro-batches per step.
        device: where the micro-batches go.
        needs_inputs, needs_targets: this worker runs the first stage, the last stage.
        memory: where the first stage's micro-batches are counted as data, not activations.

    Attributes:
        inputs: step -> its micro-batches' inputs, until the first stage's last forward of the step.
        targets: step -> its micro-batches' targets, until the last stage's last backward of the step.
        rows: step -> the samples of its mini-batch, as long as its targets.
    """

    def __init__(
        self,
        worker: int,
        microbatches: int,
        device: torch.device,
        needs_inputs: bool,
        needs_targets: bool,
        memory: ActivationMemory,
    ) -> None:
        self.worker, self.microbatches, self.device = worker, microbatches, device
        self.needs_inputs, self.needs_targets = needs_inputs, needs_targets
        self.memory = memory
        self.inputs: dict[int, list[Any]] = {}
        self.targets: dict[int, list[Any]] = {}
        self.rows: dict[int, int] = {}
        self._targets_left: dict[int, int] = {}  # step -> its last stage's backwards still to run

    def store(self, step: int, inputs: Any, targets: Any) -> None:
        """Split and keep mini-batch ``inputs`` / ``targets`` of ``step``, those this worker needs."""
        m = self.microbatches
        if self.needs_inputs:
            if inputs is None:
                raise PipelineRuntimeError(f"rank {self.worker} runs the first stage: step() needs the inputs")
            self.inputs[step] = split_batch(map_tensors(self._to_device, inputs), m)
            self.memory.keep_data(step, self.inputs[step])
        if self.needs_targets:
            if targets is None:
                raise PipelineRuntimeError(f"rank {self.worker} runs the last stage: step() needs the targets")
            self.targets[step] = split_batch(map_tensors(self._to_device, targets), m)
            self.rows[step] = rows_of(targets)
            self._targets_left[step] = m

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def target_used(self, step: int) -> None:
        """A backward of the last stage in ``step`` ran: after the step's last, its targets go."""
        self._targets_left[step] -= 1
        if not self._targets_left[step]:
            for store in (self.targets, self.rows, self._targets_left):
                store.pop(step, None)

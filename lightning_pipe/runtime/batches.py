"""Mini-batches split into micro-batches.

The training loop hands the runtime one mini-batch per call; the worker of the first stage splits
its inputs, the worker of the last stage its targets, into the schedule's ``m`` micro-batches along
the batch dimension (GPipe's micro-batches, Huang et al. 2019, §2.2). The loss of micro-batch ``i``
is weighted by its share of the mini-batch, ``n_i / n`` (:func:`rows_of`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_pipe.errors import PlanningError
from lightning_pipe.nested import flatten, tensors, unflatten

__all__ = ["rows_of", "split_batch"]


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a nested batch into ``parts`` nearly equal micro-batches along dim 0 of every tensor that
    has the batch's rows (those of its first tensor with a dimension); other tensors (a 0-d scale, an
    attention mask shared by the rows) and non-tensor values go to every micro-batch as they are."""
    skeleton, found = (None, [batch]) if isinstance(batch, torch.Tensor) else flatten(batch)  # a tensor: no skeleton
    size = _rows(found)
    if size < parts:
        raise PlanningError(f"a mini-batch of {size} samples cannot be split into {parts} micro-batches")
    chunks = [torch.tensor_split(t, parts) if t.dim() and t.shape[0] == size else (t,) * parts for t in found]
    if skeleton is None:
        return list(chunks[0])
    return [unflatten(skeleton, [c[i] for c in chunks]) for i in range(parts)]


def rows_of(batch: Any) -> int:
    """The samples in ``batch``: the first dimension of its first tensor that has one."""
    return _rows(tensors(batch))


def _rows(found: list[torch.Tensor]) -> int:
    first = next((t for t in found if t.dim()), None)
    if first is None:
        raise PlanningError("a mini-batch must hold a tensor with a batch dimension to split into micro-batches")
    return first.shape[0]

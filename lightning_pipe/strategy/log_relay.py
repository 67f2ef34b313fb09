"""Small per-step messages from every rank to every rank (the last stage's logs), cheaply.

``all_gather_object`` costs two collectives and makes every rank wait for the slowest at each step,
which is what a non-flushing pipeline must avoid: rank 0 should start step ``t + 1`` while the last
stage finishes step ``t``. A :class:`LogRelay` packs each rank's pickled payload into a buffer of fixed
capacity (a length header, then the bytes) and gathers the buffers in one collective, which can be
left in flight (:meth:`post`) and collected a step later (:meth:`wait`). A payload larger than the
capacity is fetched by a second, blocking gather that every rank knows to make (the lengths are in
the gathered headers), and the capacity grows to fit.

(Not to be confused with :mod:`lightning_pipe.runtime.stage_relays`, which passes a relayed stage's
whole state from worker to worker.)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LogRelay"]

_HEADER = 8  # int64 length of the pickled payload


@dataclass
class _Posted:
    payload: Any
    buffers: list[torch.Tensor]
    work: dist.Work


class LogRelay:
    """Gathers one picklable object per rank over ``group`` (a gloo group: CPU tensors).

    Args:
        group: the ranks taking part.
        on_error: turns a failed wait into the error to raise (e.g. the rank that failed).
        capacity: initial payload bytes per rank.
    """

    def __init__(
        self, group: dist.ProcessGroup, on_error: Callable[[BaseException], BaseException], capacity: int = 8192
    ):
        self.group, self.on_error, self.capacity = group, on_error, capacity
        self.size = dist.get_world_size(group)

    def post(self, payload: Any) -> _Posted:
        """Start gathering ``payload`` (every rank of the group must post, in the same order)."""
        data = pickle.dumps(payload)
        mine = torch.zeros(_HEADER + self.capacity, dtype=torch.uint8)
        mine[:_HEADER].view(torch.int64)[0] = len(data)
        if len(data) <= self.capacity:
            mine[_HEADER : _HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buffers = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(buffers, mine, group=self.group, async_op=True)
        except RuntimeError as error:
            raise self.on_error(error) from error
        return _Posted(payload, buffers, work)

    def wait(self, posted: _Posted) -> list[Any]:
        """Every rank's payload of ``posted``, in rank order."""
        try:
            posted.work.wait()
        except RuntimeError as error:
            raise self.on_error(error) from error
        lengths = [int(buffer[:_HEADER].view(torch.int64)[0]) for buffer in posted.buffers]
        if max(lengths) > self.capacity:  # every rank sees it: all fetch the payloads the long way
            self.capacity = 1 << max(lengths).bit_length()
            gathered: list[Any] = [None] * self.size
            try:
                dist.all_gather_object(gathered, posted.payload, group=self.group)
            except RuntimeError as error:
                raise self.on_error(error) from error
            return gathered
        return [
            pickle.loads(buffer[_HEADER : _HEADER + n].numpy().tobytes())
            for buffer, n in zip(posted.buffers, lengths, strict=True)
        ]

    def gather(self, payload: Any) -> list[Any]:
        """:meth:`post` and :meth:`wait` at once."""
        return self.wait(self.post(payload))

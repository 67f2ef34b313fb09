"""Small per-step messages from every rank to every rank (the last stage's logs), cheaply.

``all_gather_object`` costs two collectives and makes every rank wait for the slowest at each step,
which is what a non-flushing pipeline must avoid: rank 0 should start step ``t + 1`` while the last
stage finishes step ``t``. A :class:`LogRelay` packs each rank's pickled payload into a buffer of fixed
capacity (a length header, then the bytes) and gathers the buffers in one collective, which can be
left in flight (:meth:`post`) and collected a step later (:meth:`wait`). A payload larger than the
capacity is fetched by a second, blocking gather that every rank knows to make (the lengths are in
the gathered headers), and the capacity grows to fit.

Where every pair of ranks shares ``/dev/shm`` (one host), :func:`open_log_relay` gives a
:class:`SharedMemoryRelay` instead: each payload is written once into a ring of each peer
(:mod:`lightning_pipe.runtime.shared_memory`, the pipeline's own same-host transport), so a wait is a
read of what has arrived, not a gloo collective through loopback sockets (on 2 cores, a small MLP's
1F1B step ran 1.4-2.1 ms shorter with the gloo gather left unwaited: ``docs/measurements.md``,
"Strategy overhead", 2026-11-29). A payload the ring has no room for goes by gloo, point to point.

(Not to be confused with :mod:`lightning_pipe.runtime.stage_relays`, which passes a relayed stage's
whole state from worker to worker.)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
import torch.distributed as dist

from lightning_pipe.runtime.shared_memory import Links, open_links

__all__ = ["LogRelay", "SharedMemoryRelay", "open_log_relay"]

_HEADER = 8  # int64 length of the pickled payload
RING_BYTES = 1 << 16
"""Each shared-memory link's ring: many steps of the usual payload (a few hundred bytes of logged
numbers and signal notes); a metric's arguments recorded for replay can overflow it, and go by gloo."""


@dataclass
class _Posted:
    payload: Any
    buffers: list[torch.Tensor] = field(default_factory=list)
    work: dist.Work | None = None
    sends: list[tuple[torch.Tensor, dist.Work]] = field(default_factory=list)  # overflows sent by gloo


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
            assert posted.work is not None
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

    @property
    def ring_bytes(self) -> int:
        """Bytes of the shared-memory rings this rank maps for the relay (none over gloo)."""
        return 0

    def close(self) -> None:
        """Nothing to close: the group is the strategy's."""


class SharedMemoryRelay(LogRelay):
    """A :class:`LogRelay` over shared-memory links to every other rank of the group (all on one
    host): a payload is pickled once and written into each peer's ring; :meth:`wait` reads the
    peers' in rank order. Every rank posts in the same order, so each link carries its payloads in
    the order they are waited for.

    Args:
        group: the ranks taking part (a gloo group: a payload the ring has no room for is sent on it).
        on_error: turns a failed wait into the error to raise.
        links: this rank's links, an outbox to and an inbox from every other rank of ``group``.
        timeout: seconds a wait waits for a peer's payload before it fails.
    """

    def __init__(
        self, group: dist.ProcessGroup, on_error: Callable[[BaseException], BaseException], links: Links, timeout: float
    ):
        super().__init__(group, on_error)
        self.links, self.timeout = links, timeout
        self.me = dist.get_rank()
        self.ranks = dist.get_process_group_ranks(group)

    def post(self, payload: Any) -> _Posted:
        data = pickle.dumps(payload)
        written = numpy.frombuffer(data, dtype=numpy.uint8)
        posted = _Posted(payload)
        try:
            for peer, outbox in self.links.outboxes.items():
                reserved = outbox.reserve(len(data))
                if reserved is not None:
                    offset, room = reserved
                    room.numpy()[:] = written
                    outbox.post(offset, len(data), 0, self.timeout)
                else:  # no room: by gloo, point to point (the record says so, in its place in the order)
                    message = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    posted.sends.append((message, dist.isend(message, peer, group=self.group)))
                    outbox.post(-1, len(data), 0, self.timeout)
        except (OSError, RuntimeError) as error:  # a peer closed its end (it failed), or gloo did
            raise self.on_error(error) from error
        return posted

    def wait(self, posted: _Posted) -> list[Any]:
        gathered = []
        try:
            for rank in self.ranks:
                gathered.append(posted.payload if rank == self.me else pickle.loads(self._receive(rank)))
            for _, work in posted.sends:  # every peer has received them by now
                work.wait()
        except (OSError, RuntimeError) as error:
            raise self.on_error(error) from error
        return gathered

    def _receive(self, peer: int) -> bytes:
        inbox = self.links.inboxes.get(peer)
        if inbox is None:
            raise ConnectionError("the log relay was closed (this rank failed)")
        record = inbox.next(self.timeout)
        if record.offset >= 0:
            data = inbox.ring[record.offset : record.offset + record.nbytes].numpy().tobytes()
        else:
            message = torch.empty(record.nbytes, dtype=torch.uint8)
            dist.recv(message, peer, group=self.group)
            data = message.numpy().tobytes()
        inbox.acknowledge(record)
        return data

    @property
    def ring_bytes(self) -> int:
        return self.links.ring_bytes

    def close(self) -> None:
        """Close the links: a peer waiting on this rank fails at once."""
        self.links.close()


def open_log_relay(
    group: dist.ProcessGroup,
    on_error: Callable[[BaseException], BaseException],
    timeout: float,
    ring_bytes: int = RING_BYTES,
) -> LogRelay:
    """A :class:`SharedMemoryRelay` with rings of ``ring_bytes`` when every rank of ``group`` could link
    to every other through shared memory (one host, Linux), else a :class:`LogRelay` over gloo (and
    for ``ring_bytes`` 0: every rank must pass the same). A collective over ``group``."""
    if ring_bytes <= 0:
        return LogRelay(group, on_error)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    links = open_links({(s, r): ring_bytes for s in ranks for r in ranks if s != r}, group)
    peers = set(ranks) - {me}
    everyone: list[bool] = [False] * len(ranks)
    dist.all_gather_object(everyone, set(links.outboxes) == peers == set(links.inboxes), group=group)
    if all(everyone):
        return SharedMemoryRelay(group, on_error, links, timeout)
    links.close()
    return LogRelay(group, on_error)

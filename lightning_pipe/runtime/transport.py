"""Point-to-point transfer of nested tensor structures between pipeline workers.

A message is one byte buffer, one send: a header (whether the layout is new, the length of its
description, the bytes that follow on the overflow group), then the bytes of each tensor. A *layout*
is the structure (a skeleton of tuples, lists and dicts with tensor slots), dtypes and shapes of
what is sent. Messages belong to *streams* (``slot``, e.g. the activations of micro-batch ``i``);
the receiver posts the buffer of each message of at least ``post_ahead_bytes``, sized for the
stream's last layout, ahead of time, so data moves while both sides compute (a smaller message's
receive is posted when it is waited for: its transfer is short, and each receive posted ahead cost
gloo more here), and hands out views of the buffer (no copy). Shapes are thus
negotiated on first use and again whenever they change (an uneven split, another batch size): on a
change the sender fills the buffer the peer posted with a header saying so, then sends the new
layout's description and the data on a second process group (the *overflow* group).

Both groups see the operations of each pair of workers in the same order on both sides (what NCCL
requires; on gloo the message index is also the tag): a receiver posts a stream's message only once
the stream's previous message from that peer is in, and completes messages from a peer in order.

Between CPU workers on one host, messages go through shared memory instead
(:mod:`~lightning_pipe.runtime.shared_memory`): the sender packs a message into a ring buffer both
processes map, the receiver copies it out when it waits for it, in the same order; a message that
finds the ring full goes through the data group, and the record the receiver waits on says so.

Everything runs on the caller's thread (no helper threads competing for the cores with the compute).
A wait ends when the data is in, when the peer's connection closes (the peer died, or tore its
groups down after a failure: :meth:`Transport.abort`), or after ``timeout_seconds``; each of these
raises the failed rank's own error, or :class:`~lightning_pipe.runtime.failure.PipelineAborted` naming
the rank that died or hangs (:mod:`~lightning_pipe.runtime.failure`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import pickle
import time
from collections import defaultdict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.runtime.failure import FailureBoard
from lightning_pipe.runtime.shared_memory import Links
from lightning_pipe.util.nested import flatten, unflatten

__all__ = ["Transport", "post_ahead"]

_TAG_SPACE = 1 << 28  # a message's tag is its index per pair of ranks, modulo this
_Layout = tuple[Any, list[tuple[torch.dtype, tuple[int, ...]]]]
_PENDING = object()  # a message not received yet
_FIELDS = 24  # three int64: the layout is new, bytes of its description, bytes on the overflow group
_HEADER = 64  # the fields, padded
_ALIGN = 64  # packed tensors start where the allocator would put them: same kernels, bitwise-equal results


@dataclass
class _Incoming:
    """One expected message: its receive is posted once no earlier message of its stream is in flight."""

    sequence: int
    slot: Hashable
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    value: Any = _PENDING


def post_ahead(requested: int | None, device: torch.device) -> int:
    """The message size from which receives are posted ahead (the executor's ``post_ahead_bytes``):
    ``requested``, else 256 KiB on the CPU, where each receive gloo posts ahead cost more than a small
    transfer saves (``bench/runtime_speed.py --width 256 --batch 256 --microbatches 8``), and 0 (all
    ahead) on GPUs, where NCCL's pending sends would otherwise wait for their receives."""
    if requested is not None:
        return requested
    return 256 * 1024 if device.type == "cpu" else 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_bytes(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(_aligned(math.prod(shape) * dtype.itemsize) for dtype, shape in specs)


def _pack(
    header: tuple[int, int, int] | None, prefix: bytes, tensors: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """One byte buffer: the header (if any), ``prefix``, then each tensor's bytes, aligned."""
    start = _HEADER if header is not None else _aligned(len(prefix))
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    buffer = torch.empty(start + _packed_bytes(specs), dtype=torch.uint8, device=device)
    if header is not None:
        if any(header):  # a host-to-device copy (on CUDA, a synchronisation): only for a new layout
            buffer[:_FIELDS].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
        else:
            buffer[:_FIELDS].zero_()
    _fill(buffer, prefix, start, tensors, specs)
    return buffer


def _fill(
    buffer: torch.Tensor,
    prefix: bytes,
    start: int,
    tensors: list[torch.Tensor],
    specs: list[tuple[torch.dtype, tuple[int, ...]]],
) -> None:
    """Write ``prefix`` at the start of ``buffer`` and each tensor (of ``specs``) from byte ``start``, aligned."""
    if prefix:
        buffer[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    for tensor, view in zip(tensors, _unpack(buffer, start, specs), strict=True):
        view.copy_(tensor.detach())


def _unpack(buffer: torch.Tensor, start: int, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of ``buffer`` (no copy) holding tensors of ``specs``, packed from byte ``start``."""
    views, offset = [], start
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return views


def _placeholders(layout: _Layout | None, device: torch.device) -> list[torch.Tensor]:
    return [] if layout is None else [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in layout[1]]


class Transport:
    """Sends and receives messages of one worker.

    Args:
        rank: this worker's rank.
        device: where received tensors are placed (and headers live; NCCL needs the GPU).
        failures: where failures are recorded and read (to name the rank that failed).
        groups: the two process groups of the pipeline's traffic (data and overflow), spanning every
            worker with the default group's ranks; :meth:`abort` destroys them.
        timeout_seconds: a wait longer than this raises (a deadlock or a hung peer).
        keep_sends: sends posted during the last ``keep_sends`` calls (:meth:`next_call`) may still
            be in flight; older ones are waited for, so their buffers can be freed.
        post_ahead_bytes: receives of messages at least this large (by their stream's last layout)
            are posted as soon as they are expected; smaller ones when they are waited for.
        links: shared-memory links to peers on this host (:mod:`~lightning_pipe.runtime.shared_memory`):
            messages to and from them go through it, and through the data group when its ring is full.
    """

    def __init__(
        self,
        rank: int,
        device: torch.device,
        failures: FailureBoard,
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
        timeout_seconds: float = 300.0,
        keep_sends: int = 2,
        post_ahead_bytes: int = 0,
        links: Links | None = None,
    ) -> None:
        self.rank, self.device, self.failures = rank, device, failures
        self.links = links if links is not None else Links()
        self.post_ahead_bytes = post_ahead_bytes
        self.group, self.overflow = groups
        self.timeout = timedelta(seconds=timeout_seconds)
        self.keep_sends = keep_sends
        self._sent_count: dict[int, int] = defaultdict(int)
        self._sent_layout: dict[tuple[int, Hashable], _Layout] = {}
        self._sends: deque[tuple[int, int, list[dist.Work], list[torch.Tensor]]] = deque()
        self._call = 0
        self._expected_count: dict[int, int] = defaultdict(int)
        self._layouts: dict[tuple[int, Hashable], _Layout] = {}
        self._inbox: dict[int, deque[_Incoming]] = defaultdict(deque)
        self._announced: dict[tuple[int, int], _Incoming] = {}
        self.waited = 0.0  # seconds spent in waits so far

    # -- sending ------------------------------------------------------------------------------
    def send(self, peer: int, obj: Any, slot: Hashable = None) -> None:
        """Post the sends of one message to ``peer`` (non-blocking).

        ``slot`` names the stream the message belongs to: its previous layout is what the receiver
        expects, so both sides must name it alike.
        """
        tag = self._sent_count[peer] % _TAG_SPACE
        self._sent_count[peer] += 1
        skeleton, tensors = flatten(obj)
        layout = (skeleton, [(t.dtype, tuple(t.shape)) for t in tensors])
        previous = self._sent_layout.get((peer, slot))
        if peer in self.links.outboxes:
            self._send_by_link(peer, tag, layout, tensors, fresh=previous != layout)
            self._sent_layout[(peer, slot)] = layout
            return
        if previous == layout:
            posts = [(self.group, _pack((0, 0, 0), b"", tensors, self.device))]
        else:  # the peer posted ``previous``: fill it, then the new layout and the data on the overflow group
            described = pickle.dumps(layout)
            overflow = _pack(None, described, tensors, self.device)
            header = (1, len(described), overflow.numel())
            posts = [(self.group, _pack(header, b"", _placeholders(previous, self.device), self.device))]
            posts.append((self.overflow, overflow))
            self._sent_layout[(peer, slot)] = layout
        try:
            works = [dist.isend(t, peer, group=group, tag=tag) for group, t in posts]
        except RuntimeError as error:
            raise self._lost(peer, error) from error
        self._sends.append((self._call, peer, works, [t for _, t in posts]))

    def _send_by_link(self, peer: int, tag: int, layout: _Layout, tensors: list[torch.Tensor], fresh: bool) -> None:
        """Pack the message into the link's ring (its layout's description first when ``fresh``), or
        into a buffer sent through the data group when the ring has no room for it now."""
        described = pickle.dumps(layout) if fresh else b""
        start = _aligned(len(described))
        nbytes = start + _packed_bytes(layout[1])
        outbox = self.links.outboxes[peer]
        reserved = outbox.reserve(nbytes)
        offset, buffer = reserved if reserved is not None else (-1, torch.empty(nbytes, dtype=torch.uint8))
        _fill(buffer, described, start, tensors, layout[1])
        try:
            outbox.post(offset, nbytes, len(described), self.timeout.total_seconds())
            if reserved is None:
                self._sends.append((self._call, peer, [dist.isend(buffer, peer, group=self.group, tag=tag)], [buffer]))
        except (OSError, RuntimeError) as error:
            raise self._lost(peer, error) from error

    def next_call(self) -> None:
        """A new call of the executor starts: wait for the sends of calls older than ``keep_sends``."""
        self._call += 1
        while self._sends and self._sends[0][0] <= self._call - self.keep_sends:
            self._finish_send()

    def flush(self) -> None:
        """Wait until every posted send has completed."""
        while self._sends:
            self._finish_send()

    def _finish_send(self) -> None:
        _, peer, works, _ = self._sends.popleft()
        for work in works:
            self._wait(work, peer, "a send to")

    # -- receiving ----------------------------------------------------------------------------
    def expect(self, peer: int, slot: Hashable = None) -> int:
        """Announce the next message from ``peer`` (of stream ``slot``, as the sender names it) and post
        its receive ahead (:meth:`_post`). Returns its number for :meth:`receive`."""
        sequence = self._expected_count[peer]
        self._expected_count[peer] += 1
        incoming = _Incoming(sequence, slot)
        self._announced[(peer, sequence)] = incoming
        self._inbox[peer].append(incoming)
        self._post(peer)
        return sequence

    def _post(self, peer: int) -> None:
        """Post the receives of ``peer``'s messages ahead, in order, up to the first whose stream still
        has an earlier message in flight (its layout may change) or that is smaller than
        ``post_ahead_bytes`` (posted when it is waited for, the later ones after it)."""
        if peer in self.links.inboxes:  # nothing to post: the message is in the ring when its record is
            return
        busy: set[Hashable] = set()
        for incoming in self._inbox[peer]:
            if incoming.buffer is None:
                size = self._size(peer, incoming.slot)
                if incoming.slot in busy or size < self.post_ahead_bytes:
                    return
                self._post_one(peer, incoming, size)
            busy.add(incoming.slot)

    def _size(self, peer: int, slot: Hashable) -> int:
        """Bytes of the next message of a stream, by its last layout (a header alone before the first)."""
        layout = self._layouts.get((peer, slot))
        return _HEADER + (0 if layout is None else _packed_bytes(layout[1]))

    def _post_one(self, peer: int, incoming: _Incoming, size: int) -> None:
        incoming.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        incoming.work = self._irecv(incoming.buffer, peer, self.group, incoming.sequence % _TAG_SPACE)

    def _irecv(self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
        try:
            return dist.irecv(tensor, peer, group=group, tag=tag)
        except RuntimeError as error:
            raise self._lost(peer, error) from error

    def receive(self, peer: int, sequence: int) -> Any:
        """Wait for message ``sequence`` from ``peer`` (announced by :meth:`expect`) and return it;
        earlier messages from ``peer`` are completed first (they were sent first)."""
        incoming = self._announced.pop((peer, sequence))
        while incoming.value is _PENDING:
            self._complete_next(peer)
        return incoming.value

    def _complete_next(self, peer: int) -> None:
        incoming = self._inbox[peer][0]
        if peer in self.links.inboxes:
            self._complete_by_link(peer, incoming)
            return
        if incoming.buffer is None:
            self._post_one(peer, incoming, self._size(peer, incoming.slot))
        self._wait(incoming.work, peer, "a message from")
        fresh, described, overflow_bytes = incoming.buffer[:_FIELDS].view(torch.int64).tolist()
        if fresh:
            overflow = torch.empty(overflow_bytes, dtype=torch.uint8, device=self.device)
            self._wait(
                self._irecv(overflow, peer, self.overflow, incoming.sequence % _TAG_SPACE), peer, "a message from"
            )
            layout = pickle.loads(overflow[:described].cpu().numpy().tobytes())
            self._layouts[(peer, incoming.slot)] = layout
            incoming.value = unflatten(layout[0], _unpack(overflow, _aligned(described), layout[1]))
        else:
            layout = self._layouts[(peer, incoming.slot)]
            incoming.value = unflatten(layout[0], _unpack(incoming.buffer, _HEADER, layout[1]))
        incoming.buffer = incoming.work = None
        self._inbox[peer].popleft()
        self._post(peer)

    def _complete_by_link(self, peer: int, incoming: _Incoming) -> None:
        inbox = self.links.inboxes[peer]
        start = time.perf_counter()
        try:
            record = inbox.next(self.timeout.total_seconds())
        except TimeoutError as error:
            self.failures.report(self._stalled("a message from", peer))
            raise self._lost(peer, error) from error
        except OSError as error:
            raise self._lost(peer, error) from error
        finally:
            self.waited += time.perf_counter() - start
        if record.offset >= 0:
            buffer = inbox.take(record)
        else:  # the ring was full: the message came through the data group
            buffer = torch.empty(record.nbytes, dtype=torch.uint8)
            self._wait(self._irecv(buffer, peer, self.group, incoming.sequence % _TAG_SPACE), peer, "a message from")
        key = (peer, incoming.slot)
        if record.described:
            self._layouts[key] = pickle.loads(buffer[: record.described].numpy().tobytes())
        layout = self._layouts[key]
        incoming.value = unflatten(layout[0], _unpack(buffer, _aligned(record.described), layout[1]))
        self._inbox[peer].popleft()

    # -- failures -------------------------------------------------------------------------------
    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        """Wait for ``work``. On gloo the wait blocks the caller for at most the timeout; on NCCL it
        only orders the current stream after the transfer (its watchdog enforces the group's timeout)."""
        start = time.perf_counter()
        try:
            if self.device.type == "cpu":
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                self.failures.report(self._stalled(what, peer))
            raise self._lost(peer, error) from error
        finally:
            self.waited += time.perf_counter() - start

    def _stalled(self, what: str, peer: int) -> str:
        return (
            f"rank {self.rank} waited {self.timeout.total_seconds():.0f} s for {what} rank {peer}: the schedule "
            "deadlocks or that rank hangs"
        )

    def _lost(self, peer: int, error: BaseException) -> BaseException:
        """The error to raise when the connection to ``peer`` failed: the failure the job's store
        records, else ``peer``'s death (recorded, so ranks further along name the same rank)."""
        self.failures.report(f"rank {peer} died (its connection to rank {self.rank} closed: {error})")
        return self.failures.aborted()

    def abort(self) -> None:
        """Tear the pipeline's groups down: peers waiting on this worker fail at once (their
        connections close) and stop in turn. The transport is unusable afterwards."""
        self.links.close()  # first: peers waiting on a link fail at once
        self._sends.clear()
        self._inbox.clear()
        self._announced.clear()
        for group in (self.group, self.overflow):
            if group is None:  # aborted before: None would name the default group
                continue
            with contextlib.suppress(RuntimeError, ValueError):  # already gone
                dist.destroy_process_group(group)
        self.group = self.overflow = None
        gc.collect()  # the last references go: the groups' connections close

"""Messages between CPU workers on one host through shared memory instead of gloo's sockets.

Over gloo, each message between two processes on one machine goes through a loopback TCP socket:
copies into and out of the kernel, and the work of gloo's own threads on both sides, competing with
the compute for the cores. Measured inside a 2-stage pipeline of ``bench/runtime_speed.py``'s MLP
(64 KiB messages, pinned): an ``isend`` took 50 us in the median and up to 4.5 ms in its slowest
1%, 1.3-3.3 ms per step of 16 micro-batches, before the receiver's side.

A *link* carries the messages of one direction between two processes of one host:

- a ring buffer in a file of ``/dev/shm`` that both processes map (the sender writes each message
  there, once, as it packs it; the receiver copies it out, once);
- a FIFO of *records*, one per message in the order sent (where in the ring it is, or that it went
  by gloo because the ring was full), which the receiver waits on: a blocking read with a timeout,
  that returns at once with end-of-file when the sender's process closes its end (it died, or it
  tore the pipeline down after a failure);
- a FIFO of *acknowledgements* back to the sender: how far into the ring the receiver has read, so
  the sender can reuse that space. Every byte of the ring is handed over by a write and a read of a
  pipe, system calls that order the memory accesses around them on any processor.

The files are unlinked as soon as both sides have them open, so nothing is left behind in
``/dev/shm`` whatever happens to the processes; a forked child (a data-loader worker) closes its
copies of the pipes at once, so it never keeps a dead process's link open.

A link is only made between processes that can open each other's files (the same host and the same
``/dev/shm``: containers that do not share it stay on gloo) and when ``/dev/shm`` has room for the
ring (the space is reserved up front, so a full ``/dev/shm`` is found at start, not by a crash in the
middle of a write). Elsewhere than Linux, every message goes by gloo.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Inbox", "Links", "Outbox", "Record", "open_links"]

_RECORD = struct.Struct("<qqqq")  # offset (-1: sent by gloo), bytes, end, bytes of the layout's description
_ACK = struct.Struct("<q")  # the end of the last message read
_ALIGN = 64
_SHM = "/dev/shm"


@dataclass(frozen=True)
class Record:
    """Where a message is: ``nbytes`` at ``offset`` of the ring (``offset`` -1: sent through gloo
    instead); ``end`` is the sender's write position after it (what the receiver acknowledges);
    ``described``: bytes of the new layout's description at its start (0: the stream's last layout)."""

    offset: int
    nbytes: int
    end: int
    described: int


class Outbox:
    """The sending end of a link: reserves room in the ring and posts records."""

    def __init__(self, ring: torch.Tensor, records: int, acks: int) -> None:
        self.ring, self.records, self.acks = ring, records, acks
        self.capacity = ring.numel()
        self.written = 0  # bytes of the ring handed out so far (padding at the wrap included)
        self.read = 0  # how far the receiver acknowledged reading
        self.overflows = 0  # messages that found no room in the ring (they went by gloo)

    def reserve(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """Room for a message of ``nbytes``: its offset and a view of the ring to fill (then
        :meth:`post` it), or ``None`` when the ring has no room for it now."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self.capacity:
            self.overflows += 1
            return None
        self._take_acks()
        position = self.written % self.capacity
        if self.read == self.written and position:  # nothing unread: start again at the front, on the
            self.written += self.capacity - position  # pages used already (the process stays small)
            self.read, position = self.written, 0
        padding = self.capacity - position if position + size > self.capacity else 0
        if self.written + padding + size - self.read > self.capacity:
            self.overflows += 1
            return None
        offset = (position + padding) % self.capacity
        self.written += padding + size
        return offset, self.ring[offset : offset + nbytes]

    def post(self, offset: int, nbytes: int, described: int, timeout: float) -> None:
        """Tell the receiver the next message is in the ring (``offset`` -1: it goes by gloo).
        Raises :class:`TimeoutError` if the records' pipe stays full for ``timeout`` seconds and
        :class:`BrokenPipeError` if the receiver closed its end."""
        record = _RECORD.pack(offset, nbytes, self.written, described)
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.write(self.records, record)  # smaller than a pipe's atomic write: all or nothing
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the receiver read no message for {timeout:.0f} s") from None
                _wait_for(self.records, select.POLLOUT, left)

    def _take_acks(self) -> None:
        try:
            data = os.read(self.acks, 1 << 16)
        except BlockingIOError:
            return
        if len(data) >= _ACK.size:  # acknowledgements are cumulative: the last one says it all
            whole = len(data) - len(data) % _ACK.size
            self.read = max(self.read, _ACK.unpack_from(data, whole - _ACK.size)[0])

    def close(self) -> None:
        for fd in (self.records, self.acks):
            with contextlib.suppress(OSError):
                os.close(fd)


class Inbox:
    """The receiving end of a link: waits for records and copies messages out of the ring."""

    def __init__(self, ring: torch.Tensor, records: int, acks: int) -> None:
        self.ring, self.records, self.acks = ring, records, acks
        self._unacknowledged: int | None = None
        self._pending = b""

    def next(self, timeout: float) -> Record:
        """The next record; raises :class:`TimeoutError` after ``timeout`` seconds and
        :class:`ConnectionError` when the sender's end closed (its process died or aborted)."""
        deadline = time.monotonic() + timeout
        while len(self._pending) < _RECORD.size:
            try:
                data = os.read(self.records, _RECORD.size - len(self._pending))
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no message within {timeout:.0f} s") from None
                _wait_for(self.records, select.POLLIN, left)  # something to read (or end of file), or the deadline
                continue
            if not data:
                raise ConnectionError("the sending process closed its end of the shared-memory link")
            self._pending += data
        record = Record(*_RECORD.unpack(self._pending))
        self._pending = b""
        return record

    def take(self, record: Record) -> torch.Tensor:
        """A copy of the message ``record`` names, its room in the ring handed back to the sender."""
        message = self.ring[record.offset : record.offset + record.nbytes].clone()
        self.acknowledge(record)
        return message

    def acknowledge(self, record: Record) -> None:
        """The sender may reuse the ring up to ``record.end`` (a message sent by gloo ends where the
        one before it did). A sender that closed its end no longer needs to know."""
        value = record.end if self._unacknowledged is None else max(record.end, self._unacknowledged)
        try:
            os.write(self.acks, _ACK.pack(value))
            self._unacknowledged = None
        except BlockingIOError:  # the sender has not read the earlier ones yet: say it with the next
            self._unacknowledged = value
        except BrokenPipeError:
            pass

    def close(self) -> None:
        for fd in (self.records, self.acks):
            with contextlib.suppress(OSError):
                os.close(fd)


class Links:
    """This process's links: ``outboxes[peer]`` and ``inboxes[peer]``, by global rank."""

    def __init__(self, outboxes: dict[int, Outbox] | None = None, inboxes: dict[int, Inbox] | None = None) -> None:
        self.outboxes = outboxes or {}
        self.inboxes = inboxes or {}
        _OPEN.add(self)

    @property
    def ring_bytes(self) -> int:
        """Bytes of the rings this process maps (its outboxes' and inboxes'), all resident in it
        (:func:`open_links` maps every page)."""
        ends = [*self.outboxes.values(), *self.inboxes.values()]
        return sum(end.ring.numel() * end.ring.element_size() for end in ends)

    def close(self) -> None:
        """Close every end: peers waiting on this process fail at once."""
        for end in [*self.outboxes.values(), *self.inboxes.values()]:
            end.close()
        self.outboxes, self.inboxes = {}, {}


_OPEN: weakref.WeakSet[Links] = weakref.WeakSet()


def _close_in_child() -> None:
    """A forked child (a data-loader worker) closes its copies of the pipes: while it held the writing
    end of a link, the receiver would not see end-of-file when this process dies."""
    for links in list(_OPEN):
        links.close()


os.register_at_fork(after_in_child=_close_in_child)


def open_links(capacities: Mapping[tuple[int, int], int], group: dist.ProcessGroup) -> Links:
    """Open a link for every ``(sender, receiver)`` pair of global ranks in ``capacities`` whose
    processes share ``/dev/shm`` (the others keep using gloo), its ring of the pair's bytes (none
    for 0). A collective over ``group``: every rank of it calls, with the same pairs.

    Both processes map every page of a ring at once (:func:`_map_every_page`): each holds the whole
    ring resident from the start, as much as it will ever hold of it, so the memory a plan counts
    for the rings is what the process holds however far the messages reach in them."""
    me = dist.get_rank()
    hosts = _gather({me: _host()}, group)
    wanted = sorted(
        (s, r)
        for (s, r), capacity in capacities.items()
        if capacity > 0 and s != r and me in (s, r) and hosts.get(s) == hosts.get(r)
    )
    # 1. the sender makes the ring and the FIFOs, and opens the acknowledgements' reading end
    made: dict[tuple[int, int], tuple[str, bytes, torch.Tensor, int]] = {}
    problems: list[str] = []
    supported = os.path.isdir(_SHM) and hasattr(os, "posix_fallocate") and hasattr(os, "mkfifo")  # Linux
    for sender, receiver in wanted:
        if sender == me and supported:
            try:
                made[(sender, receiver)] = _make(capacities[(sender, receiver)])
            except OSError as error:
                problems.append(f"rank {me} -> {receiver}: {error}")
    offers = _gather({key: (path, token, ring.numel()) for key, (path, token, ring, _) in made.items()}, group)
    # 2. the receiver maps the ring and checks it is the sender's, opens the records' reading end
    #    and the acknowledgements' writing end
    received: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}
    for (sender, receiver), (path, token, capacity) in offers.items():
        if receiver == me:
            try:
                received[(sender, receiver)] = _join(path, token, capacity)
            except OSError as error:
                problems.append(f"rank {sender} -> {me}: {error}")
    joined = _gather({key: True for key in received}, group)
    # 3. the sender opens the records' writing end; then every file goes (both sides have them open)
    outboxes: dict[int, Outbox] = {}
    for key, (path, _, ring, acks) in made.items():
        if key in joined:
            records = os.open(os.path.join(path, "records"), os.O_WRONLY | os.O_NONBLOCK)
            outboxes[key[1]] = Outbox(ring, records, acks)
        else:
            os.close(acks)
    dist.barrier(group=group)
    for path, _, _, _ in made.values():
        shutil.rmtree(path, ignore_errors=True)
    inboxes = {sender: Inbox(*ends) for (sender, _), ends in received.items()}
    if problems:
        warnings.warn(
            "lightning_pipe: some pipeline messages go through gloo instead of shared memory: " + "; ".join(problems),
            stacklevel=2,
        )
    return Links(outboxes, inboxes)


def _wait_for(fd: int, event: int, seconds: float) -> None:
    """Block until ``fd`` is ready for ``event`` (or hung up) or ``seconds`` pass. ``poll``, not
    ``select``: a process that opened many files (process groups, data loaders) has descriptors
    above ``select``'s limit of 1024."""
    poller = select.poll()
    poller.register(fd, event)
    poller.poll(math.ceil(seconds * 1000))


def _host() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as boot:
        return f"{socket.gethostname()}/{boot.read().strip()}"
    return socket.gethostname()


def _gather(mine: dict, group: dist.ProcessGroup) -> dict:
    """Every rank's ``mine`` merged."""
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return {key: value for part in gathered for key, value in (part or {}).items()}


def _make(capacity: int) -> tuple[str, bytes, torch.Tensor, int]:
    path = tempfile.mkdtemp(prefix="lightning_pipe-", dir=_SHM)
    try:
        ring_file = os.path.join(path, "ring")
        fd = os.open(ring_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)  # room reserved now: no SIGBUS on a full /dev/shm later
        finally:
            os.close(fd)
        ring = torch.from_file(ring_file, shared=True, size=capacity, dtype=torch.uint8)
        _map_every_page(ring)
        token = secrets.token_bytes(16)
        ring[: len(token)].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        for name in ("records", "acks"):
            os.mkfifo(os.path.join(path, name), 0o600)
        acks = os.open(os.path.join(path, "acks"), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, token, ring, acks


def _map_every_page(ring: torch.Tensor) -> None:
    """Read one byte of every page of ``ring``: the pages (allocated by ``posix_fallocate``) are
    mapped into this process now, resident in it for as long as the ring is."""
    int(ring[:: mmap.PAGESIZE].sum())


def _join(path: str, token: bytes, capacity: int) -> tuple[torch.Tensor, int, int]:
    ring_file = os.path.join(path, "ring")
    if not os.path.exists(ring_file):
        raise OSError(errno.ENOENT, f"{ring_file} is not visible here (another host, or another /dev/shm)")
    ring = torch.from_file(ring_file, shared=True, size=capacity, dtype=torch.uint8)
    if bytes(ring[: len(token)].tolist()) != token:
        raise OSError(errno.EINVAL, f"{ring_file} is not the sender's ring (another /dev/shm)")
    _map_every_page(ring)
    records = os.open(os.path.join(path, "records"), os.O_RDONLY | os.O_NONBLOCK)
    acks = os.open(os.path.join(path, "acks"), os.O_WRONLY | os.O_NONBLOCK)
    return ring, records, acks

"""Point-to-point transfer of nested tensor structures between pipeline workers.

Each message from one worker to another is a fixed-size header (two int64: whether the layout is
new, and the length of its description), the tensors, and, when the layout — structure (a skeleton
of tuples, lists and dicts with tensor slots), dtypes and shapes — differs from the previous message
of the same stream (e.g. the activations of micro-batch ``i``), the pickled layout. Shapes are thus
negotiated on first use and again whenever they change (an uneven split, a different batch size).

The receiver posts the header and the tensor receives in the stream's last layout at once, so data
moves as soon as it is sent; on a layout change the sender first fills those receives with
placeholders, then sends the new layout and the data under a third tag. Receives are announced ahead
(:meth:`Transport.expect`) and completed by background threads, so transfers overlap compute.

Messages between two workers are matched in the order the sender sends them (what NCCL requires);
on gloo the per-channel message index is also the tag. Every wait polls the
:class:`~lightning_pipe.runtime.failure.Watchdog`.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.nested import flatten, unflatten
from lightning_pipe.runtime.failure import PipelineAborted, Watchdog

__all__ = ["Transport"]

_TAG_SPACE = 1 << 28  # a message uses tags 3k (header, metadata), 3k + 1 and 3k + 2 (data)


@dataclass
class _Incoming:
    """One message being received; ``done`` is set once it arrived (or failed)."""

    peer: int
    sequence: int
    slot: Hashable = None
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class Transport:
    """Sends and receives messages of one worker.

    gloo completes a point-to-point request only inside ``wait()``, so one receiver thread per peer
    walks that peer's expected messages in order (header, metadata, tensors) and blocks there, and a
    sender thread waits for posted sends to finish; the worker itself only waits on events, polling
    the watchdog meanwhile.

    Args:
        rank: this worker's rank in ``group``.
        device: where received tensors are placed (and headers live; NCCL needs the GPU).
        watchdog: failure detection polled by every wait.
        group: the process group (default: the default group).
        timeout_seconds: a wait longer than this raises (a deadlock or a lost peer).
    """

    def __init__(
        self,
        rank: int,
        device: torch.device,
        watchdog: Watchdog,
        group: dist.ProcessGroup | None = None,
        timeout_seconds: float = 300.0,
    ) -> None:
        self.rank, self.device, self.watchdog, self.group = rank, device, watchdog, group
        self.timeout = timeout_seconds
        self._sent_count: dict[int, int] = defaultdict(int)
        self._expected_count: dict[int, int] = defaultdict(int)
        self._sent_layout: dict[tuple[int, Hashable], tuple[Any, list[tuple[torch.dtype, tuple[int, ...]]]]] = {}
        self._received: dict[tuple[int, int], _Incoming] = {}
        self._queues: dict[int, queue.Queue[_Incoming | None]] = {}
        self._threads: list[threading.Thread] = []
        self._sends: queue.Queue[tuple[list[dist.Work], list[torch.Tensor]] | None] = queue.Queue()
        self._send_error: BaseException | None = None
        self._sends_pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._start(self._send_loop, "send")

    def _start(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"lightning_pipe-{name}-{self.rank}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- sending ------------------------------------------------------------------------------
    def send(self, peer: int, obj: Any, slot: Hashable = None) -> None:
        """Post the sends of one message to ``peer`` (non-blocking).

        ``slot`` names the stream the message belongs to (e.g. activations of micro-batch ``i``):
        its previous layout is what the receiver expects, so both sides must name it alike.
        """
        if self._send_error is not None:
            raise PipelineAborted(f"rank {self.rank}: an earlier send failed ({self._send_error})")
        base = 3 * (self._sent_count[peer] % _TAG_SPACE)
        self._sent_count[peer] += 1
        skeleton, tensors = flatten(obj)
        tensors = [t.detach().contiguous() for t in tensors]
        specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        previous = self._sent_layout.get((peer, slot))
        fresh = previous is None or previous[0] != (skeleton, specs)
        layout = pickle.dumps((skeleton, specs)) if fresh else b""
        posts = [(torch.tensor([int(fresh), len(layout)], dtype=torch.int64, device=self.device), base)]
        if fresh:
            if previous is not None:  # the receiver posted receives for the old layout: fill them
                posts += [
                    (torch.empty(shape, dtype=dtype, device=self.device), base + 1) for dtype, shape in previous[1]
                ]
            posts.append((torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(self.device), base))
            self._sent_layout[(peer, slot)] = ((skeleton, specs), specs)
        posts += [(t, base + (2 if fresh else 1)) for t in tensors]
        works = [dist.isend(t, peer, group=self.group, tag=tag) for t, tag in posts]
        with self._lock:
            self._sends_pending += 1
        self._sends.put((works, [t for t, _ in posts]))

    def _send_loop(self) -> None:
        while (item := self._sends.get()) is not None:
            works, _payload = item
            try:
                for work in works:
                    work.wait()
            except BaseException as error:
                self._send_error = error
            with self._lock:
                self._sends_pending -= 1
                self._idle.notify_all()

    def flush(self) -> None:
        """Wait until every posted send has completed."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while self._sends_pending:
                self._idle.wait(timeout=0.02)
                self._lock.release()
                try:
                    self.watchdog.check()
                finally:
                    self._lock.acquire()
                if time.monotonic() > deadline:
                    raise PipelineAborted(f"rank {self.rank}: sends did not complete within {self.timeout:.0f} s")
        if self._send_error is not None:
            raise PipelineAborted(f"rank {self.rank}: a send failed ({self._send_error}); the peer probably died")

    # -- receiving ----------------------------------------------------------------------------
    def expect(self, peer: int, slot: Hashable = None) -> int:
        """Announce the next message from ``peer`` (of stream ``slot``, as the sender names it); its
        receiver thread posts the receives as soon as the previous message from ``peer`` is in.
        Returns its sequence number for :meth:`receive`."""
        if peer not in self._queues:
            self._queues[peer] = queue.Queue()
            self._start(self._receive_loop, f"recv{peer}", peer)
        sequence = self._expected_count[peer]
        self._expected_count[peer] += 1
        incoming = _Incoming(peer, sequence, slot)
        self._received[(peer, sequence)] = incoming
        self._queues[peer].put(incoming)
        return sequence

    def _receive_loop(self, peer: int) -> None:
        layouts: dict[Hashable, tuple[Any, list[tuple[torch.dtype, tuple[int, ...]]]]] = {}
        while (incoming := self._queues[peer].get()) is not None:
            try:
                incoming.value = self._receive_one(incoming, layouts)
            except BaseException as error:
                incoming.error = error
            incoming.done.set()

    def _irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, peer, group=self.group, tag=tag)

    def _receive_one(self, incoming: _Incoming, layouts: dict[Hashable, Any]) -> Any:
        """Header, then the tensors in the slot's last layout, posted at once; a new layout costs a
        detour (the sender fills the old-layout receives, then sends metadata and the data)."""
        peer, base = incoming.peer, 3 * (incoming.sequence % _TAG_SPACE)
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        header_work = self._irecv(header, peer, base)
        predicted = layouts.get(incoming.slot)
        guesses = [] if predicted is None else [torch.empty(s, dtype=d, device=self.device) for d, s in predicted[1]]
        guess_works = [self._irecv(t, peer, base + 1) for t in guesses]
        header_work.wait()
        fresh, length = header.tolist()
        for work in guess_works:
            work.wait()
        if not fresh:
            return unflatten(predicted[0], guesses)
        metadata = torch.empty(length, dtype=torch.uint8, device=self.device)
        self._irecv(metadata, peer, base).wait()
        skeleton, specs = pickle.loads(metadata.cpu().numpy().tobytes())
        layouts[incoming.slot] = (skeleton, specs)
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]
        for work in [self._irecv(t, peer, base + 2) for t in tensors]:
            work.wait()
        return unflatten(skeleton, tensors)

    def receive(self, peer: int, sequence: int) -> Any:
        """Wait for message ``sequence`` from ``peer`` (announced by :meth:`expect`) and return it."""
        incoming = self._received.pop((peer, sequence))
        deadline = time.monotonic() + self.timeout
        while not incoming.done.wait(timeout=0.02):
            self.watchdog.check()
            if time.monotonic() > deadline:
                raise PipelineAborted(
                    f"rank {self.rank} waited {self.timeout:.0f} s for message {sequence} from rank {peer}: the "
                    "schedule deadlocks or the peer hangs"
                )
        if incoming.error is not None:
            self.watchdog.check(force=True)
            raise PipelineAborted(
                f"rank {self.rank}: receiving from rank {peer} failed ({incoming.error}); the peer probably died"
            ) from incoming.error
        return incoming.value

    def close(self) -> None:
        """Stop the helper threads; call after :meth:`flush`, before the process group goes away."""
        for pending in self._queues.values():
            pending.put(None)
        self._sends.put(None)
        for thread in self._threads:
            thread.join(timeout=self.timeout)

"""Messages between processes of one host through shared-memory links
(:mod:`lightning_pipe.runtime.shared_memory`): every message arrives whole and in order whether it
went through the ring, wrapped around its end or found it full and went by gloo; nothing is left in
``/dev/shm``; a pair that cannot share memory stays on gloo, with a warning."""

from __future__ import annotations

import errno
import glob
import itertools
import os
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.runtime import shared_memory
from lightning_pipe.runtime.failure import FailureBoard, PipelineAborted
from lightning_pipe.runtime.launch import LocalRunError, run_local
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.util.nested import map_tensors

_LEFTOVERS = "/dev/shm/lightning_pipe-*"


def _messages(seed: int, count: int) -> list[tuple[str, object]]:
    """``count`` messages on three streams: float and integer tensors of random sizes (empty ones
    included), nested in tuples and dicts, whose layouts change from one message to the next."""
    generator = random.Random(seed)
    result = []
    for index in range(count):
        rows = generator.choice([0, 1, 3, 7, 20, 60, 120])
        kind = generator.choice(["tensor", "tuple", "dict"])
        values = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + index
        if kind == "tensor":
            result.append(("a", values))
        elif kind == "tuple":
            result.append(("b", (values, torch.full((rows,), index, dtype=torch.int64))))
        else:
            result.append(("c", {"x": values.double(), "skip": [values[:1], torch.tensor(index)]}))
    return result


def _transport(rank: int, links: shared_memory.Links, timeout: float = 30.0) -> Transport:
    board = FailureBoard(dist.distributed_c10d._get_default_store(), rank)
    return Transport(rank, torch.device("cpu"), board, (dist.new_group(), dist.new_group()), timeout, links=links)


def _exchange(rank: int, capacity: int, fail: str | None = None) -> dict:
    """Rank 1 sends 80 messages to rank 0 in bursts of 1-12, rank 0 receives each burst after it,
    and rank 0 sends every one back; returns what each side received, and how the sender posted its
    messages (ring offsets, -1 for gloo). ``fail="crowded"``: each process holds 1100 open files
    first, so the links' descriptors are above 1024 (where ``select`` gives up)."""
    before = set(glob.glob(_LEFTOVERS))
    crowd = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)] if fail == "crowded" else []
    if fail == "no room" and rank == 1:
        shared_memory.os.posix_fallocate = _no_room
    if fail == "not visible" and rank == 0:
        shared_memory._join = _not_visible
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        links = shared_memory.open_links({(0, 1): capacity, (1, 0): capacity}, dist.group.WORLD)
    transport = _transport(rank, links)
    offsets: list[int] = []
    for outbox in links.outboxes.values():
        post = outbox.post
        outbox.post = lambda offset, *rest, post=post: (offsets.append(offset), post(offset, *rest))[1]
    messages = _messages(seed=0, count=80)
    generator = random.Random(1)
    received, echoed = [], []
    start = 0
    while start < len(messages):
        burst = messages[start : start + generator.randint(1, 12)]
        start += len(burst)
        if rank == 1:
            for slot, message in burst:
                transport.send(0, message, slot)
            echoed += [transport.receive(0, transport.expect(0, slot)) for slot, _ in burst]
        else:
            received += [transport.receive(1, transport.expect(1, slot)) for slot, _ in burst]
            for (slot, _), message in zip(burst, received[-len(burst) :], strict=True):
                transport.send(1, message, slot)
    transport.flush()
    dist.barrier()
    leftovers = set(glob.glob(_LEFTOVERS)) - before
    ends = (sorted(links.outboxes), sorted(links.inboxes))
    lowest = min(end.records for end in [*links.outboxes.values(), *links.inboxes.values()])
    transport.abort()
    for fd in crowd:
        os.close(fd)
    return {
        "received": map_tensors(torch.Tensor.clone, received if rank == 0 else echoed),  # views of one buffer
        "offsets": offsets,
        "links": ends,
        "warnings": [str(w.message) for w in caught],
        "leftovers": leftovers,
        "lowest": lowest,
    }


def _no_room(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _not_visible(path: str, token: bytes, capacity: int) -> None:
    raise OSError(errno.ENOENT, f"{path}/ring is not visible here")


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.timeout(120)
def test_a_small_ring_wraps_and_overflows_to_gloo_in_order() -> None:
    """A ring of 4 KiB: messages of 0-4 KiB come back to its front, and those that find it full (or
    are larger than it) go by gloo; both directions get every message, equal in dtype, shape and
    value, in the order sent."""
    expected = [message for _, message in _messages(seed=0, count=80)]
    for result in run_local(_exchange, 2, 4096, timeout=90):
        assert len(result["received"]) == len(expected)
        assert all(_same(got, sent) for got, sent in zip(result["received"], expected, strict=True))
        offsets = result["offsets"]
        assert -1 in offsets, "no message found the ring full"
        ring = [o for o in offsets if o >= 0]
        assert any(b < a for a, b in itertools.pairwise(ring)), "no message came back to the front"
        assert len(ring) > len(offsets) // 2
        assert result["warnings"] == [] and result["leftovers"] == set()


@pytest.mark.timeout(120)
def test_large_ring_carries_every_message() -> None:
    """With the default size, nothing goes by gloo."""
    for result in run_local(_exchange, 2, 64 * 1024 * 1024, timeout=90):
        assert min(result["offsets"]) >= 0
        assert result["leftovers"] == set()


@pytest.mark.timeout(120)
def test_links_work_in_a_process_with_many_open_files() -> None:
    """Descriptors above 1024 (a long run's process groups and data loaders): waits still work."""
    expected = [message for _, message in _messages(seed=0, count=80)]
    for result in run_local(_exchange, 2, 1 << 20, "crowded", timeout=90):
        assert result["lowest"] > 1024
        assert all(_same(got, sent) for got, sent in zip(result["received"], expected, strict=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fail", "sender", "reason"),
    [("no room", 1, "No space left on device"), ("not visible", 1, "is not visible here")],
)
def test_a_pair_that_cannot_share_memory_stays_on_gloo(fail: str, sender: int, reason: str) -> None:
    """No room in ``/dev/shm`` on the sender, or a receiver that cannot see the sender's file
    (another host or container): that direction goes by gloo, said in a warning on the rank that
    found out; the other direction keeps its link; every message arrives."""
    expected = [message for _, message in _messages(seed=0, count=80)]
    results = run_local(_exchange, 2, 1 << 20, fail, timeout=90)
    receiver = 1 - sender
    assert results[sender]["links"] == ([], [receiver])
    assert results[receiver]["links"] == ([sender], [])
    noticed = results[1 if fail == "no room" else 0]["warnings"]
    assert any("go through gloo instead of shared memory" in w and reason in w for w in noticed)
    for result in results:
        assert all(_same(got, sent) for got, sent in zip(result["received"], expected, strict=True))
        assert result["leftovers"] == set()


def _shared_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def _open_uneven(rank: int) -> tuple[int, list[int], list[int]]:
    """Rings of 1 MiB from 0 to 1 and 3 MiB back (none from 1 to 2, a pair of size 0): the KiB of
    shared memory this process gained by opening them, and its rings' sizes (outboxes, inboxes)."""
    before = _shared_kib()
    links = shared_memory.open_links({(0, 1): 1 << 20, (1, 0): 3 << 20, (1, 2): 0}, dist.group.WORLD)
    gained = _shared_kib() - before
    sizes = ([o.ring.numel() for o in links.outboxes.values()], [i.ring.numel() for i in links.inboxes.values()])
    links.close()
    return gained, *sizes


@pytest.mark.timeout(60)
def test_each_link_has_its_size_and_its_pages_are_resident_from_the_start() -> None:
    """Each direction's ring has the bytes asked for it; both processes hold every page of both rings
    as soon as the links are open (what the plan counts), before any message."""
    (gained0, out0, in0), (gained1, out1, in1) = run_local(_open_uneven, 2, timeout=45)
    assert (out0, in0, out1, in1) == ([1 << 20], [3 << 20], [3 << 20], [1 << 20])
    for gained in (gained0, gained1):
        assert 4096 <= gained < 4096 + 256, gained


def _wait_for_nothing(rank: int, how: str) -> str:
    """Rank 0 waits for a message rank 1 never sends: rank 1 dies (after forking a child that outlives
    it: a data-loader worker's copy of the pipe must not keep the link open), or aborts, or just
    waits."""
    links = shared_memory.open_links({(1, 0): 1 << 20}, dist.group.WORLD)
    transport = _transport(rank, links, timeout=2.0 if how == "is silent" else 20.0)
    dist.barrier()
    if rank == 1:
        if how == "dies":
            if os.fork() == 0:  # the child lives on for longer than rank 0's timeout
                time.sleep(25)
                os._exit(0)
            os._exit(3)
        if how == "aborts":
            transport.abort()
        else:
            dist.barrier()
        return ""
    try:
        transport.receive(1, transport.expect(1, "a"))
    except PipelineAborted as error:
        if how == "dies":
            raise
        if how == "is silent":
            dist.barrier()
        return str(error)
    return "received"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["dies", "aborts", "is silent"])
def test_a_receiver_waiting_on_a_link_stops(how: str) -> None:
    """The receiver's wait ends at once with an error naming rank 1 when rank 1's process dies (a
    child it forked living on) or tears its links down, and after the timeout when rank 1 lives on
    without sending."""
    if how == "dies":
        with pytest.raises(LocalRunError) as caught:
            run_local(_wait_for_nothing, 2, how, timeout=60)
        message = caught.value.errors[0]
    else:
        message = run_local(_wait_for_nothing, 2, how, timeout=60)[0]
    assert "rank 1" in message
    if how == "is silent":
        assert "rank 0 waited 2 s for a message from rank 1" in message
    else:
        assert "waited" not in message


@settings(max_examples=200, deadline=None)
@given(
    operations=st.lists(
        st.one_of(st.integers(1, 700).map(lambda n: ("send", n)), st.just(("read", 0))), min_size=1, max_size=80
    )
)
def test_the_ring_never_hands_out_bytes_still_unread(operations: list[tuple[str, int]]) -> None:
    """One process plays both ends of a 1 KiB ring: the sender fills each message it reserves with its
    own byte and posts it (or posts that it went elsewhere when the ring had no room), the receiver
    reads them in order. Every message read has its bytes intact (nothing later overwrote it), lies
    inside the ring, and a sender whose messages were all read always finds room."""
    records_read, records_write = os.pipe()
    acks_read, acks_write = os.pipe()
    for fd in (records_read, acks_read):
        os.set_blocking(fd, False)
    ring = torch.zeros(1024, dtype=torch.uint8)
    outbox = shared_memory.Outbox(ring, records_write, acks_read)
    inbox = shared_memory.Inbox(ring, records_read, acks_write)
    unread: list[tuple[int, int, int]] = []  # offset (-1: elsewhere), bytes, fill
    try:
        for index, (operation, nbytes) in enumerate(operations):
            if operation == "send":
                fill = index % 251 + 1
                reserved = outbox.reserve(nbytes)
                if not unread:
                    assert reserved is not None, "an empty ring refused a message that fits"
                if reserved is None:
                    outbox.post(-1, nbytes, 0, timeout=1.0)
                    unread.append((-1, nbytes, fill))
                    continue
                offset, view = reserved
                assert offset >= 0 and offset + nbytes <= ring.numel() and view.numel() == nbytes
                view.fill_(fill)
                outbox.post(offset, nbytes, 0, timeout=1.0)
                unread.append((offset, nbytes, fill))
            elif unread:
                offset, nbytes, fill = unread.pop(0)
                record = inbox.next(timeout=1.0)
                assert (record.offset, record.nbytes) == (offset, nbytes)
                if offset >= 0:
                    assert bool((inbox.take(record) == fill).all()), "a message was overwritten before it was read"
    finally:
        outbox.close()
        inbox.close()

"""How many bytes each shared-memory ring between two workers gets.

A ring is resident in both its processes for the whole run (:func:`~lightning_pipe.runtime.shared_memory.open_links`),
so it should be no larger than its link needs: the most bytes the schedule can leave on the link
sent but not yet taken (:func:`~lightning_pipe.schedule.backlog.link_loads`: GPipe's ``m``
messages, 1F1B's ``P - s`` on the links of stage ``s``), or an evaluation's forwards (the first
stage may send every micro-batch before the next takes one), whichever is more, plus one message
more for the room lost where a message does not fit before the ring's end and starts again at its
front. Never more than the size asked for (a message that finds the ring full goes by gloo), 64 MiB
unless asked otherwise; no rings at all on GPUs, whose messages NCCL carries.

(These rings are buffers of bytes; the rings of workers along which Cyclic Data Parallelism reduces
gradients are :mod:`~lightning_pipe.runtime.gradient_rings`'.)
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Iterable, Sequence

import torch

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.borrowing import Lending
from lightning_pipe.runtime.routing import Placement
from lightning_pipe.schedule.backlog import LinkLoad, link_loads
from lightning_pipe.schedule.ir import Action, Schedule

__all__ = ["DEFAULT_SHARED_MEMORY_BYTES", "MESSAGE_OVERHEAD", "link_sizes", "ring_sizes", "shared_memory_capacity"]

DEFAULT_SHARED_MEMORY_BYTES = 64 * 1024 * 1024
"""Each shared-memory ring between CPU workers of one host (``shared_memory_bytes``)."""

MESSAGE_OVERHEAD = 4096
"""Bytes a message takes besides its tensors' own: the description of its layout (with the first
message of a stream) and the alignment of each tensor."""


def ring_sizes(
    schedule: Schedule,
    pairs: Iterable[tuple[int, int]],
    requested: int,
    message_bytes: Sequence[float] | None,
) -> dict[tuple[int, int], int]:
    """The ring of every ``(sender, receiver)`` pair of workers of ``schedule`` (enough steps of it
    to reach its steady state): ``requested`` bytes at most, or exactly that without
    ``message_bytes`` (the bytes of one micro-batch's activation leaving each stage but the last,
    and of the gradient coming back)."""
    pairs = list(pairs)
    if message_bytes is None:
        return dict.fromkeys(pairs, requested)

    def size(producer: Action, consumer: Action) -> float:
        return message_bytes[min(producer.stage, consumer.stage)] + MESSAGE_OVERHEAD

    loads = link_loads(schedule, size)
    evaluation: dict[tuple[int, int], LinkLoad] = {}  # evaluate() runs each stage on its first owner
    first = schedule.first_owners
    for stage, (sender, receiver) in enumerate(itertools.pairwise(first)):
        if sender != receiver:
            message = message_bytes[stage] + MESSAGE_OVERHEAD
            known = evaluation.get((sender, receiver), LinkLoad(0.0, 0.0))
            evaluation[(sender, receiver)] = LinkLoad(
                known.backlog + schedule.microbatches * message, max(known.largest, message)
            )
    sizes = {}
    for pair in pairs:
        found = [load for load in (loads.get(pair), evaluation.get(pair)) if load is not None]
        if not found:  # no activation or gradient goes this way (lent weights do): as asked
            sizes[pair] = requested
            continue
        need = max(load.backlog for load in found) + max(load.largest for load in found)
        sizes[pair] = min(requested, _whole_pages(need))
    return sizes


def _whole_pages(nbytes: float) -> int:
    return -(-int(nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE


def shared_memory_capacity(requested: int | None, device: torch.device) -> int:
    """Bytes of each shared-memory ring (see ``shared_memory_bytes``); 0: no rings."""
    if device.type != "cpu":
        return 0
    return DEFAULT_SHARED_MEMORY_BYTES if requested is None else requested


def link_sizes(
    schedule: Schedule,
    placement: Placement,
    worker: int,
    ranks: Sequence[int],
    capacity: int,
    message_bytes: Sequence[float] | None,
) -> dict[tuple[int, int], int]:
    """The bytes of the ring of every pair of global ranks (``ranks``: the workers') that exchange
    messages with ``worker`` (:meth:`Placement.message_pairs`; :func:`ring_sizes` of ``capacity`` at
    most, or as asked when stages lend their weights or reduce their gradients point to point: the
    messages are weights or gradients then)."""
    if message_bytes is not None and len(message_bytes) != schedule.stages - 1:
        raise PlanningError(
            f"message_bytes gives {len(message_bytes)} sizes; the schedule has {schedule.stages} stages, "
            f"so {schedule.stages - 1} boundaries"
        )
    lends = any(Lending.of(schedule, w).lenders for w in range(schedule.workers))
    sized = message_bytes if not lends and not schedule.rings else None  # weights or gradients: as asked
    pairs = placement.message_pairs(schedule, worker, Lending.of(schedule, worker))
    sizes = ring_sizes(placement.generated, pairs, capacity, sized)
    return {(ranks[a], ranks[b]): size for (a, b), size in sizes.items()}

"""When receives are posted: messages of at least ``post_ahead_bytes`` (by their stream's last layout)
as soon as they are expected, smaller ones only when they are waited for, and always in the order the
peer sends them (a late message holds back the ones after it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.runtime.failure import FailureBoard
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.runtime.transport import _HEADER, Transport

_BIG, _SMALL = torch.ones(64), torch.ones(4)  # 256 and 16 bytes of data
_THRESHOLD = _HEADER + 100  # between the two messages' sizes (header included)


def _exchange(rank: int) -> list[list[bool]]:
    """Rank 1 sends two rounds of (big on stream "a", small on stream "b", big on stream "c"); rank 0
    records, after expecting each round, which of its receives are posted."""
    transport = Transport(
        rank,
        torch.device("cpu"),
        FailureBoard(dist.distributed_c10d._get_default_store(), rank),
        (dist.new_group(), dist.new_group()),
        timeout_seconds=30,
        post_ahead_bytes=_THRESHOLD,
    )
    posted = []
    for round_ in range(2):
        if rank == 1:
            for slot, tensor in (("a", _BIG), ("b", _SMALL), ("c", _BIG)):
                transport.send(0, tensor * round_, slot)
        else:
            sequences = [transport.expect(1, slot) for slot in ("a", "b", "c")]
            posted.append([incoming.buffer is not None for incoming in transport._inbox[1]])
            received = [transport.receive(1, sequence) for sequence in sequences]
            assert [r.tolist() for r in received] == [(t * round_).tolist() for t in (_BIG, _SMALL, _BIG)]
    transport.flush()
    dist.barrier()
    transport.abort()
    return posted


@pytest.mark.timeout(120)
def test_small_receives_are_posted_when_needed_and_in_order() -> None:
    posted, _ = run_local(_exchange, 2, timeout=90)
    # round 0: no layout known, each message looks like a header alone (too small): nothing ahead;
    # round 1: stream "a" is big, posted ahead; "b" is small and holds back "c" behind it
    assert posted == [[False, False, False], [True, False, False]]

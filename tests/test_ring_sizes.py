"""Shared-memory rings sized to what their link can hold unread: small, and no message finds one full."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.runtime.shared_memory_sizes import DEFAULT_SHARED_MEMORY_BYTES, MESSAGE_OVERHEAD, ring_sizes
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages

MiB = 1 << 20
PAGE = 4096


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def test_1f1b_rings_hold_the_warm_up_and_an_evaluation() -> None:
    """1F1B over 4 stages, 8 micro-batches: the gradients' links hold P - s messages and one more
    (the room lost at the ring's end); the activations' links hold an evaluation's 8 forwards (the
    first stage may send them all before the next takes one) and one more; never more than asked."""
    schedule = make_schedule("1f1b", 4, 8, 3)
    sizes = [MiB, MiB // 2, MiB // 4]
    pairs = {(s, s + 1) for s in range(3)} | {(s + 1, s) for s in range(3)}
    rings = ring_sizes(schedule, pairs, 64 * MiB, sizes)
    for s, message in enumerate(sizes):
        assert rings[(s, s + 1)] == _pages(9 * (message + MESSAGE_OVERHEAD))
        assert rings[(s + 1, s)] == _pages((4 - s + 1) * (message + MESSAGE_OVERHEAD))
    assert ring_sizes(schedule, pairs, 2 * MiB, sizes)[(0, 1)] == 2 * MiB  # capped by the size asked
    assert ring_sizes(schedule, pairs, 64 * MiB, None) == dict.fromkeys(pairs, 64 * MiB)  # no sizes: as asked


def test_a_pair_without_activations_or_gradients_gets_the_size_asked() -> None:
    schedule = make_schedule("1f1b", 2, 2)
    assert ring_sizes(schedule, {(0, 1), (1, 0), (0, 2)}, 3 * MiB, [100.0])[(0, 2)] == 3 * MiB


def _train_and_evaluate(rank: int, family: str, stages: int, options: dict, microbatches: int) -> dict:
    """Trains 5 steps with rings sized from the messages' true bytes, drains, evaluates once; returns
    this rank's rings and how many messages found one full."""
    width, rows = 96, 4 * microbatches
    executor = PipelineExecutor(
        lambda k: make_schedule(family, stages, microbatches, k, **options),
        build_stages(stages, width=width),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        message_bytes=[rows // microbatches * width * 4] * (stages - 1),
    )
    for inputs, targets in batches(5, rows=rows):
        executor.step(inputs, targets)
    executor.drain()
    executor.evaluate(batches(1, rows=rows)[0][0], microbatches, lambda index, output: None)
    links = executor.transport.links
    result = {
        "outboxes": {peer: (box.capacity, box.overflows) for peer, box in links.outboxes.items()},
        "inboxes": {peer: box.ring.numel() for peer, box in links.inboxes.items()},
        "ring_bytes": links.ring_bytes,
    }
    executor.close()
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("family", "stages", "options", "microbatches"),
    [  # the most backlog, two stages' messages per link, steps that overlap (the others: test_schedule_backlog)
        ("gpipe", 3, {}, 4),
        ("interleaved", 4, {"virtual_stages": 2}, 4),
        ("2bw", 3, {}, 3),
    ],
)
def test_sized_rings_carry_every_message_of_training_and_evaluation(
    family: str, stages: int, options: dict, microbatches: int
) -> None:
    workers = make_schedule(family, stages, microbatches, **options).workers
    results = run_local(_train_and_evaluate, workers, family, stages, options, microbatches, timeout=200)
    boundaries = stages // workers  # a link carries this many stages' messages (interleaved: 2)
    most = _pages((boundaries * microbatches + 1) * (4 * 96 * 4 + MESSAGE_OVERHEAD))
    for rank, result in enumerate(results):
        assert result["outboxes"], rank
        for peer, (capacity, overflows) in result["outboxes"].items():
            assert overflows == 0, (rank, peer, capacity)
            assert capacity <= most < DEFAULT_SHARED_MEMORY_BYTES
            assert results[peer]["inboxes"][rank] == capacity  # both ends map the same ring
        mapped = sum(c for c, _ in result["outboxes"].values()) + sum(result["inboxes"].values())
        assert result["ring_bytes"] == mapped

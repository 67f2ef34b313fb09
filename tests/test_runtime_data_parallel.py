"""Data parallelism over whole pipelines (``PipelineExecutor(pipelines=...)``): each pipeline trains
on its own mini-batches and every stage's gradient is averaged over the pipelines.

Oracle: the single-process reference trained on the pipelines' mini-batches of each step put
together (the mean gradient of equal-sized mini-batches is the gradient of their union's mean), for
rules whose weight version does not depend on the micro-batch (sync, 2BW).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime import weights
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages, one_step_late, reference, sync

PIPELINES = [[0, 1], [2, 3]]
STEPS = 4


def _worker(rank: int, family: str, bucket_bytes: int = weights.BUCKET_BYTES) -> dict[int, list[torch.Tensor]]:
    weights.BUCKET_BYTES = bucket_bytes
    pipeline = next(p for p, ranks in enumerate(PIPELINES) if rank in ranks)
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, 2, k),
        build_stages(2),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        pipelines=PIPELINES,
    )
    for inputs, targets in batches(STEPS, seed=1 + pipeline):
        executor.step(inputs, targets)
    executor.drain()
    executor.close()
    return {s: [p.detach().clone() for p in w.params] for s, w in executor.weights.items()}


def _union() -> list[tuple[torch.Tensor, torch.Tensor]]:
    per_pipeline = [batches(STEPS, seed=1 + p) for p in range(len(PIPELINES))]
    return [
        (torch.cat([b[t][0] for b in per_pipeline]), torch.cat([b[t][1] for b in per_pipeline])) for t in range(STEPS)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("family", "rule", "bucket_bytes"),
    [
        ("1f1b", sync, weights.BUCKET_BYTES),
        ("2bw", one_step_late, weights.BUCKET_BYTES),
        ("1f1b", sync, 1),
        ("1f1b", sync, 300),
    ],
)
def test_pipelines_average_their_gradients(family: str, rule, bucket_bytes: int) -> None:
    """Two 2-stage pipelines on 4 processes end with the reference's parameters on every rank, and
    not with what one pipeline alone would train (the averaging is real); with every gradient summed
    where it lies (``bucket_bytes=1``), or packed a few at a time (300), as with all packed in one."""
    results = run_local(_worker, 4, family, bucket_bytes, timeout=100)
    expected = reference(build_stages(2), _union(), 4, rule, "sgd")
    alone = reference(build_stages(2), batches(STEPS, seed=1), 2, rule, "sgd")
    for rank, result in enumerate(results):
        (stage,) = result
        for got, want in zip(result[stage], expected[stage], strict=True):
            assert torch.allclose(got, want, atol=1e-6), (rank, (got - want).abs().max())
        assert any((g - a).abs().max() > 1e-4 for g, a in zip(result[stage], alone[stage], strict=True))


def _bad_pipelines_worker(rank: int) -> str:
    try:
        PipelineExecutor(
            make_schedule("1f1b", 2, 2),
            build_stages(2),
            nn.functional.cross_entropy,
            OPTIMIZERS["sgd"],
            pipelines=[[0, 1], [1, 2]],
        )
    except PlanningError as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(60)
def test_pipelines_must_partition_the_ranks() -> None:
    for message in run_local(_bad_pipelines_worker, 3, timeout=50):
        assert "pipelines [[0, 1], [1, 2]] must hold every rank 0..2 exactly once" in message


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(1, 600), max_size=30), st.integers(4, 2000))
def test_buckets_keep_every_gradient_once_in_order_within_the_size(sizes: list[int], bucket_bytes: int) -> None:
    """Every gradient once: one of at least the bucket size alone, the others packed in order (past
    the large ones between them), a pack closed only when the next small gradient would take it
    over the size."""
    grads = [torch.zeros(n) for n in sizes]
    buckets = weights._buckets(grads, bucket_bytes)

    def nbytes(grad: torch.Tensor) -> int:
        return grad.numel() * grad.element_size()

    def ids(kept: list[torch.Tensor]) -> list[int]:
        return [id(g) for g in kept]

    flat = [g for bucket in buckets for g in bucket]
    assert sorted(ids(flat)) == sorted(ids(grads))
    for large in (True, False):
        assert ids([g for g in flat if (nbytes(g) >= bucket_bytes) is large]) == ids(
            [g for g in grads if (nbytes(g) >= bucket_bytes) is large]
        )
    packs = []
    for bucket in buckets:
        sizes_in = [g.numel() * g.element_size() for g in bucket]
        if sizes_in[0] >= bucket_bytes:
            assert len(bucket) == 1
        else:
            assert max(sizes_in) < bucket_bytes and sum(sizes_in) <= bucket_bytes
        packs.append(None if sizes_in[0] >= bucket_bytes else sum(sizes_in))
    packed = [(total, bucket) for total, bucket in zip(packs, buckets, strict=True) if total is not None]
    for (total, _), (_, bucket) in itertools.pairwise(packed):
        assert total + nbytes(bucket[0]) > bucket_bytes


def _summed_worker(rank: int, bucket_bytes: int, dtype: torch.dtype) -> tuple[list[torch.Tensor | None], int]:
    """Rank ``r`` holds gradients ``r + 1`` for some of a module's weights, none for the others; one
    rank alone has one for the last bias. The sum over both, and the all-reduces it took."""
    weights.BUCKET_BYTES = bucket_bytes
    module = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4), nn.Linear(4, 4)).to(dtype)
    stage = weights.StageWeights(module, None, snapshots=False, group=dist.group.WORLD)
    grads = [torch.full_like(p, rank + 1.0) for p in stage.params]
    grads[3] = None  # no replica has one: stays None
    grads[5] = grads[5] if rank == 0 else None  # one replica has one: its own, summed with zeros
    calls = []
    reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(args[0].numel()) or reduce(*args, **kwargs)
    try:
        stage.add(0, grads)
        return stage.summed_gradients(0), len(calls)
    finally:
        dist.all_reduce = reduce


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bucket_bytes", "dtype", "reduces"),
    [
        (weights.BUCKET_BYTES, torch.float32, 1),  # everything packed, the counts with it
        (1 << 10, torch.float32, 3),  # the two weights of 1 KiB or more alone, the rest in one pack with the counts
        (1, torch.float32, 7),  # every gradient alone, the counts in an all-reduce of their own
        (weights.BUCKET_BYTES, torch.float16, 2),  # not carried in a half-precision bucket
    ],
)
def test_the_presence_counts_ride_in_the_last_packed_bucket(
    bucket_bytes: int, dtype: torch.dtype, reduces: int
) -> None:
    """Every all-reduce costs more than its bytes (five small ones in a row took 4-5 ms on 2 gloo
    processes here, one 0.2-0.4 ms): how many replicas had each gradient rides at the end of a
    float32 bucket that is packed anyway. The sums are the same either way: 1 + 2 where both had
    one, a lone replica's own, ``None`` where none had one."""
    results = run_local(_summed_worker, 2, bucket_bytes, dtype, timeout=40)
    for summed, calls in results:
        assert calls == reduces
        assert summed[3] is None
        assert torch.equal(summed[5], torch.full((4,), 1.0, dtype=dtype))
        for index in (0, 1, 2, 4):
            assert torch.equal(summed[index], torch.full_like(summed[index], 3.0))

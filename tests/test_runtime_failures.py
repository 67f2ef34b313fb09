"""A failing or killed rank stops every other rank within seconds, with an error that names it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.failure import add_note, raised_elsewhere
from lightning_pipe.runtime.launch import LocalRunError, run_local
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages

HANG_SECONDS = 8.0
SURVIVOR_TIMEOUT = 30.0  # far above how long a failure takes to reach the other ranks


def _after(error: str) -> float:
    """The seconds from the start of the failed step to the error, as :func:`_train` notes them."""
    return float(error.rsplit("[after ", 1)[1].split(" s]")[0])


class Trap(nn.Module):
    """Passes its input through; at call ``when`` it raises or kills its process."""

    def __init__(self, inner: nn.Module, when: int, how: str) -> None:
        super().__init__()
        self.inner, self.when, self.how, self.calls = inner, when, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when:
            if self.how == "raise":
                raise ValueError("the loss exploded")
            if self.how == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if self.how == "hang":
                time.sleep(HANG_SECONDS)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)


def _train(
    rank: int,
    victim: int,
    how: str,
    family: str,
    world: int,
    timeout_seconds: float = 300.0,
    shared_memory_bytes: int | None = None,
) -> float:
    stages = build_stages(world)
    if rank == victim:
        stages[victim] = Trap(stages[victim], when=5, how=how)
    executor = PipelineExecutor(
        lambda k: make_schedule(family, world, 2, k),
        stages,
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        timeout_seconds=timeout_seconds,
        shared_memory_bytes=shared_memory_bytes,
    )
    start = time.monotonic()
    try:
        for inputs, targets in batches(6):
            start = time.monotonic()
            executor.step(inputs, targets)
    except Exception as error:
        if raised_elsewhere(error):
            add_note(error, f"[after {time.monotonic() - start:.1f} s]")
        raise
    return 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "how", "family", "world", "shared_memory_bytes"),
    [
        (1, "raise", "1f1b", 2, None),
        (1, "oom", "1f1b", 2, None),
        (0, "raise", "2bw", 2, None),
        (1, "kill", "1f1b", 2, None),
        (0, "kill", "2bw", 2, None),
        (2, "raise", "1f1b", 3, None),  # rank 0 waits on rank 1, which waits on rank 2: the stop travels
        (1, "kill", "2bw", 3, None),
        # gloo instead of shared memory: what workers on other hosts use
        (1, "kill", "1f1b", 2, 0),
        (2, "raise", "1f1b", 3, 0),
    ],
)
def test_every_rank_stops_naming_the_failed_one(
    victim: int, how: str, family: str, world: int, shared_memory_bytes: int | None
) -> None:
    """The survivors stop because the failure reached them, not by their own 30 s timeout: their
    error names the failed rank, and the step they were in (timed from its start, not from the spawn
    of the processes) ended before the timeout."""
    with pytest.raises(LocalRunError) as caught:
        run_local(_train, world, victim, how, family, world, SURVIVOR_TIMEOUT, shared_memory_bytes, timeout=90)
    for rank, survivor in ((r, caught.value.errors[r]) for r in range(world) if r != victim):
        if how == "raise":  # the victim's own error, with its type and message, and where it was raised
            assert survivor.startswith("ValueError: the loss exploded")
            assert f"raised in the forward of stage {victim} (rank {victim}) on " in survivor
            assert f"raised on rank {victim}; rank {rank} stopped because of it" in survivor
        elif how == "oom":  # an out-of-memory error stays one on every rank
            assert survivor.startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
            assert f"raised on rank {victim}; rank {rank} stopped because of it" in survivor
        else:  # by its closed connection (or, for rank 0, as the store's host)
            assert survivor.startswith("PipelineAborted")
            assert f"rank {victim}" in survivor
        assert "s for a message from" not in survivor  # not stopped by the timeout
        assert _after(survivor) < SURVIVOR_TIMEOUT
    if how == "raise":
        assert "ValueError: the loss exploded" in caught.value.errors[victim]
    elif how == "oom":
        assert caught.value.errors[victim].startswith("OutOfMemoryError: CUDA out of memory")
    else:
        assert caught.value.errors[victim].startswith("died with exit code")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared_memory_bytes", [None, 0])
def test_a_rank_that_hangs_stops_the_others_after_the_timeout(shared_memory_bytes: int | None) -> None:
    """Rank 1 hangs for 8 s; rank 0, with a 2 s timeout, stops by its timeout, after at least 2 s and
    before the hang would have ended (timed from the start of its step), over shared memory and gloo."""
    with pytest.raises(LocalRunError) as caught:
        run_local(_train, 2, 1, "hang", "1f1b", 2, 2.0, shared_memory_bytes, timeout=60)
    survivor = caught.value.errors[0]
    assert survivor.startswith("PipelineAborted")
    assert "rank 0 waited 2 s for a message from rank 1" in survivor
    assert 2.0 <= _after(survivor) < HANG_SECONDS


def _forget_inputs(rank: int) -> None:
    executor = PipelineExecutor(
        make_schedule("1f1b", 2, 2),
        build_stages(2),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        timeout_seconds=SURVIVOR_TIMEOUT,
    )
    for index, (inputs, targets) in enumerate(batches(4)):
        start = time.monotonic()
        try:
            executor.step(None if index == 2 else inputs, targets)
        except Exception as error:
            if raised_elsewhere(error):
                add_note(error, f"[after {time.monotonic() - start:.1f} s]")
            raise


@pytest.mark.timeout(120)
def test_a_bad_call_on_one_rank_stops_the_others() -> None:
    """Rank 0 is called without its inputs; rank 1 stops with rank 0's error, before its own timeout."""
    with pytest.raises(LocalRunError) as caught:
        run_local(_forget_inputs, 2, timeout=90)
    assert "rank 0 runs the first stage: step() needs the inputs" in caught.value.errors[0]
    assert caught.value.errors[1].startswith("PipelineRuntimeError: rank 0 runs the first stage")
    assert "raised on rank 0; rank 1 stopped because of it" in caught.value.errors[1]
    assert _after(caught.value.errors[1]) < SURVIVOR_TIMEOUT

"""``run_local``'s processes come from a forkserver started once: each must still see the caller's
environment and working directory as they are at the call, as spawned processes would."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.launch import has_forkserver


def _seen(rank: int, name: str) -> tuple[str | None, str, int]:
    return os.environ.get(name), os.getcwd(), dist.get_world_size()


@pytest.mark.timeout(120)
def test_each_run_sees_the_environment_and_directory_of_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value in ("first", "second"):  # the second run's processes come from the same server
        directory = tmp_path / value
        directory.mkdir()
        monkeypatch.chdir(directory)
        monkeypatch.setenv("LIGHTNING_PIPE_TEST_VALUE", value)
        assert run_local(_seen, 2, "LIGHTNING_PIPE_TEST_VALUE", timeout=60) == [(value, str(directory), 2)] * 2
    monkeypatch.delenv("LIGHTNING_PIPE_TEST_VALUE")
    assert run_local(_seen, 2, "LIGHTNING_PIPE_TEST_VALUE", timeout=60)[0][0] is None  # removed: gone there too


def _frozen(rank: int) -> int:
    return gc.get_freeze_count()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not has_forkserver(), reason="no forkserver on this platform: each process is spawned")
def test_forked_processes_start_with_the_imports_frozen() -> None:
    """The forkserver froze what its imports made before forking: the processes never walk those
    objects in a collection (``frozen_preload``)."""
    assert all(count > 100_000 for count in run_local(_frozen, 2, timeout=60))

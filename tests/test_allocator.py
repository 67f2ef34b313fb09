"""Freed memory goes back to the system with ``release_memory``: resident memory follows allocations."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_pipe import PipelineStrategy
from lightning_pipe.errors import PlanningError
from lightning_pipe.strategy import strategy as strategy_module

_ONE_PROCESS = """
import sys
import torch
from lightning_pipe.runtime.allocator import mallinfo, release_freed_memory

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024

if sys.argv[1] == "release":
    assert release_freed_memory()
for step in range(3):  # a step's activations: 4, 8 and 16 MiB, freed at its end
    mapped = mallinfo().hblks
    blocks = [torch.ones(1 << 20 + (i % 3)) for i in range(6)]
    mapped = mallinfo().hblks - mapped
    before_free = resident()
    del blocks
    print(step, mapped, before_free - resident())
"""
_BLOCKS = sum(4 << 20 + (i % 3) for i in range(6))  # bytes


def _steps(mode: str) -> list[tuple[int, int]]:
    """Per step: the blocks glibc mapped on their own, and the resident bytes freeing them gave back."""
    done = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return [(int(mapped), int(given)) for _, mapped, given in (line.split() for line in done.stdout.splitlines())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.timeout(150)
def test_freed_blocks_go_back_to_the_system_only_when_released() -> None:
    """glibc's default maps the first step's blocks on their own, then raises its threshold to the
    largest freed: from the second step the blocks come from its heap, which may keep them when freed.
    Released, every block is mapped on its own at every step and freeing them gives their memory back."""
    default, released = _steps("default"), _steps("release")
    assert default[0][0] == 6 and all(mapped < 6 for mapped, _ in default[1:])
    assert [mapped for mapped, _ in released] == [6, 6, 6]
    assert all(given > _BLOCKS * 0.95 for _, given in released)


_SETTLE = """
import sys
import torch
from lightning_pipe.runtime.allocator import mallinfo, settle_heap

if sys.argv[1] == "settle":
    assert settle_heap()
for mib in (4, 9, 16, 30):
    mapped = mallinfo().hblks
    block = torch.ones(mib << 18)
    print(mallinfo().hblks - mapped)
    del block
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's dynamic mmap threshold")
@pytest.mark.timeout(150)
def test_a_settled_heap_serves_blocks_below_32_mib_from_itself() -> None:
    """A fresh process maps each new largest block on its own (and faults its pages in at each use
    until the threshold has risen past it); settled, every block below 31 MiB comes from the heap."""
    runs = {}
    for mode in ("default", "settle"):
        done = subprocess.run(
            [sys.executable, "-c", _SETTLE, mode], capture_output=True, text=True, timeout=120, check=True
        )
        runs[mode] = [int(line) for line in done.stdout.split()]
    assert runs == {"default": [1, 1, 1, 1], "settle": [0, 0, 0, 0]}


def test_the_strategy_releases_freed_memory_when_asked_or_within_a_memory_limit(monkeypatch) -> None:
    """Released, or else settled (the steps run in the state the profile was measured in); never both."""
    calls: list[str] = []
    monkeypatch.setattr(strategy_module, "release_freed_memory", lambda: calls.append("released") or True)
    monkeypatch.setattr(strategy_module, "settle_heap", lambda: calls.append("settled") or True)
    cpu = [torch.device("cpu")]
    cases = [({}, False), ({"memory_limit": "1GB"}, True), ({"memory_limit": "1GB", "release_memory": False}, False)]
    cases.append(({"release_memory": True}, True))
    for options, expected in cases:
        calls.clear()
        PipelineStrategy(parallel_devices=cpu, **options)._set_up_heap()
        assert calls == (["released"] if expected else ["settled"]), options


def test_release_memory_must_be_a_bool_or_none() -> None:
    with pytest.raises(PlanningError, match=r"release_memory must be True, False or None .* got 'yes'"):
        PipelineStrategy(release_memory="yes")

"""Each process's threads on cores of its own (lightning_pipe/runtime/affinity.py)."""

from __future__ import annotations

import itertools
import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.affinity import cores_of, pin_threads
from tests.lightning_cases import placements


@given(allowed=st.sets(st.integers(0, 63), min_size=1, max_size=16), data=st.data())
def test_shares_are_equal_disjoint_and_allowed(allowed: set[int], data: st.DataObject) -> None:
    """Guards against shares that overlap, leave a process without a core, differ in size, or use a
    core the process may not run on; the shares go in core order."""
    processes = data.draw(st.integers(1, len(allowed)))
    shares = [cores_of(rank, processes, allowed) for rank in range(processes)]
    assert all(len(share) == len(allowed) // processes for share in shares)
    assert set().union(*shares) <= allowed and sum(map(len, shares)) == len(set().union(*shares))
    assert all(max(a) < min(b) for a, b in itertools.pairwise(shares))


def test_more_processes_than_cores_is_refused() -> None:
    refusal = r"cannot give each of 3 processes a core of its own: .* 2 core\(s\) \(\[4, 7\]\); run fewer"
    with pytest.raises(PlanningError, match=refusal):
        cores_of(0, 3, {7, 4})


def _placements_after_pinning(rank: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """This process's threads' placements as ``run_local(pin_cpus=True)`` left them, and those of a
    thread started afterwards."""
    seen: list[tuple[int, ...]] = []
    later = threading.Thread(target=lambda: seen.append(tuple(sorted(os.sched_getaffinity(0)))))
    later.start()
    later.join()
    return placements(), seen


@pytest.mark.timeout(120)
def test_run_local_pins_every_thread_of_each_rank() -> None:
    """With ``pin_cpus``, every thread of each rank (gloo's included) and every thread it starts later
    runs on the rank's own share of the cores. Guards against pinning only the calling thread (the
    transport's threads would still move) and against both ranks on the same core."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        with pytest.raises(PlanningError, match="cannot give each of 2 processes a core"):
            pin_threads(0, 2)
        return
    results = run_local(_placements_after_pinning, 2, pin_cpus=True, timeout=90)
    for rank, (threads, later) in enumerate(results):
        share = (tuple(sorted(cores_of(rank, 2, allowed))),)
        assert threads == list(share) and later == list(share)

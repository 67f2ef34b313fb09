"""Garbage collection aligned across ranks: automatic collection off while an executor runs, full
collections at the same calls on every rank and on a drain, Python's collector given back on
close."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.garbage import AlignedCollection
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import make_schedule
from tests.reference import batches, build_stages


class _Cycle:
    """Garbage only the cyclic collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    assert AlignedCollection._holders == 0, "a test left an AlignedCollection open"
    if enabled:
        gc.enable()


def _collections() -> tuple[list[int], object]:
    """A list filled with the generation of every collection from now on, and its callback."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    return seen, record


@settings(max_examples=25, deadline=None)
@given(every=st.integers(1, 6), calls=st.integers(0, 20))
def test_collects_every_n_calls_and_nothing_else(every: int, calls: int) -> None:
    gc.enable()
    collection = AlignedCollection(every)
    assert not gc.isenabled()
    seen, record = _collections()
    try:
        for _ in range(calls):
            collection.call()
            [_Cycle() for _ in range(2000)]  # enough allocations to start automatic collections
    finally:
        gc.callbacks.remove(record)
        collection.close()
    assert seen == [2] * (calls // every)
    assert gc.isenabled()


def test_cycles_are_freed_at_the_aligned_call_not_before_however_old() -> None:
    collection = AlignedCollection(3)
    try:
        collection.call()
        young, old = _Cycle(), _Cycle()
        gc.collect(1)  # ``old`` survives into the oldest generation, where young collections never look
        young_alive, old_alive = weakref.ref(young), weakref.ref(old)
        del young, old
        collection.call()
        assert young_alive() is not None and old_alive() is not None  # no automatic collection
        collection.call()
        assert young_alive() is None and old_alive() is None
    finally:
        collection.close()


def test_full_collection_and_none_leaves_python_alone() -> None:
    gc.enable()
    untouched = AlignedCollection(None)
    assert gc.isenabled()
    seen, record = _collections()
    try:
        untouched.call()
        untouched.full()
        assert seen == []
        collection = AlignedCollection(100)
        seen.clear()
        collection.full()
        assert seen == [2]
        collection.close()
    finally:
        gc.callbacks.remove(record)
        untouched.close()


def test_collection_comes_back_when_the_last_holder_closes() -> None:
    gc.enable()
    first, second = AlignedCollection(5), AlignedCollection(7)
    first.close()
    assert not gc.isenabled()
    first.close()  # closing twice lets go once
    assert not gc.isenabled()
    second.close()
    assert gc.isenabled()
    gc.disable()  # a process that had it off keeps it off
    AlignedCollection(2).close()
    assert not gc.isenabled()


def _assert_full_frees_a_new_cycle(collection: AlignedCollection) -> None:
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    del cycle
    collection.full()
    assert alive() is None


def test_the_heap_alive_at_the_start_is_frozen_out_of_later_collections() -> None:
    """Objects alive when collection is taken over (imports, the model) are frozen: a full
    collection no longer walks them (it costs only what was made since), while a cycle made
    afterwards is still freed by it. Guards against the freeze being dropped, which would bring back
    0.1 s pauses at every aligned collection (``bench/gc_pause.py``)."""
    gc.enable()
    gc.unfreeze()
    old = [[] for _ in range(1000)]  # long-lived objects, alive before the executor starts
    tracked = len(gc.get_objects())
    collection = AlignedCollection(3)
    try:
        assert gc.get_freeze_count() >= 0.9 * tracked  # the heap of the moment, less its garbage
        assert not any(item is old for item in gc.get_objects())  # no generation holds it any more
        _assert_full_frees_a_new_cycle(collection)
    finally:
        collection.close()
        gc.unfreeze()


def test_a_heap_frozen_before_is_left_as_it_is() -> None:
    """Objects frozen before the executor (a forkserver's imports: ``frozen_preload``) stay frozen
    through it and after it, and nothing is added to them; a cycle made meanwhile is still freed by
    the aligned collection. The frozen count may fall meanwhile: a frozen object is still freed when
    its last reference goes, as the test runner's own threads let some go (2 of 863428 in one run)."""
    gc.unfreeze()
    kept = [[] for _ in range(100)]  # alive before the executor starts
    gc.freeze()
    frozen = gc.get_freeze_count()

    def left_as_it_is() -> None:
        assert gc.get_freeze_count() <= frozen  # nothing added
        assert not any(item is kept for item in gc.get_objects())  # still frozen: in no generation

    try:
        collection = AlignedCollection(3)
        try:
            left_as_it_is()
            _assert_full_frees_a_new_cycle(collection)
        finally:
            collection.close()
        left_as_it_is()
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("every", [0, -3, True, 2.5, "10"])
def test_bad_interval_is_refused(every: object) -> None:
    with pytest.raises(PlanningError, match=r"gc_every must be a whole number of calls >= 1, or None; got"):
        AlignedCollection(every)


def _train_recording(rank: int, family: str, every: int | None) -> tuple[list[tuple[int, int]], bool, bool]:
    """Train 7 steps and a drain; the (call, generation) of every collection seen, whether automatic
    collection was on during training and after close."""
    seen: list[tuple[int, int]] = []
    call = [0]
    gc.callbacks.append(lambda phase, info: seen.append((call[0], info["generation"])) if phase == "start" else None)
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, 2, k),
        build_stages(2),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
        gc_every=every,
    )
    seen.clear()
    during = gc.isenabled()
    for call[0], (x, y) in enumerate(batches(7), start=1):
        executor.step(x, y)
        [_Cycle() for _ in range(3000)]
    call[0] = "drain"
    executor.drain()
    call[0] = "close"  # tearing the process groups down collects them (transport)
    executor.close()
    return [entry for entry in seen if entry[0] != "close"], during, gc.isenabled()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["1f1b", "2bw"])
def test_ranks_collect_at_the_same_calls(family: str) -> None:
    results = run_local(_train_recording, 2, family, 3, timeout=90)
    expected = [(3, 2), (6, 2), ("drain", 2)]
    for seen, during, after in results:
        assert seen == expected
        assert not during and after


@pytest.mark.timeout(120)
def test_none_keeps_automatic_collection() -> None:
    for seen, during, after in run_local(_train_recording, 2, "1f1b", None, timeout=90):
        assert during and after
        assert any(generation == 0 for _, generation in seen)  # Python collected by itself


def test_the_last_executor_to_close_unfreezes_what_a_fit_left() -> None:
    """A cycle alive when the executor froze the heap (a fit's strategy, model, optimizer, process
    groups) is freed once dropped after the last executor closes: fit after fit, a sweep in one
    process does not keep its predecessors."""
    gc.unfreeze()
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    first, second = AlignedCollection(3), AlignedCollection(3)
    del cycle
    first.close()
    gc.collect()
    assert alive() is not None  # frozen while an executor still holds collection
    second.close()
    gc.collect()
    assert alive() is None

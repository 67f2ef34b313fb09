"""The random streams a rerun of the step code replays (:mod:`lightning_pipe.strategy.random_states`):
exactly the streams the first run drew from, each restarted where the first run started it, and every
stream as it was found after the rerun, the others left alone."""

from __future__ import annotations

import random

import numpy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.strategy.random_states import RandomStates, replayed

HOST = ("cpu", "python", "numpy")  # the streams of a machine without CUDA


def _draw(stream: str) -> float:
    if stream == "cpu":
        return float(torch.rand(()))
    if stream == "python":
        return random.random()
    return float(numpy.random.rand())


def _draws() -> dict[str, float]:
    return {stream: _draw(stream) for stream in HOST}


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


@settings(max_examples=40, deadline=None)
@given(st.sets(st.sampled_from(HOST)), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_kept_are_the_streams_drawn_from(drawn: set[str], times: int, seed: int) -> None:
    """``drawn_since`` keeps a stream if and only if it was drawn from, with its state from before."""
    _seed(seed)
    before = RandomStates.now()
    for stream in sorted(drawn):
        for _ in range(times + 1):
            _draw(stream)
    kept = before.drawn_since()
    assert set(kept.kept) == drawn
    for stream in drawn:  # the state from before the draws: restored, the same first draw again
        assert kept.kept[stream] is before.kept[stream]


@settings(max_examples=40, deadline=None)
@given(st.sets(st.sampled_from(HOST)), st.integers(0, 2**31 - 1))
def test_a_rerun_draws_the_first_runs_draws_and_leaves_the_streams_as_found(drawn: set[str], seed: int) -> None:
    """The oracle: the same draws made in one process from seeded streams. A rerun under
    :func:`replayed` draws from a kept stream what the first run drew; a stream it does not keep
    advances; after the block the kept streams are where they were before it, the others where the
    rerun's draws left them."""
    _seed(seed)
    start = RandomStates.now()
    first = {stream: _draw(stream) for stream in sorted(drawn)}
    kept = start.drawn_since()
    _draws()  # the layers' own draws between the first run and the rerun
    found = RandomStates.now()
    with replayed(kept):
        again = _draws()
    after = _draws()
    for stream in drawn:
        assert again[stream] == first[stream]
    # the oracle: from the states found before the rerun, a stream it does not keep drew live, and
    # every stream then draws as if only those live draws had happened
    found.restore()
    for stream in HOST:
        if stream not in drawn:
            assert _draw(stream) == again[stream]
        assert _draw(stream) == after[stream]


def test_nothing_drawn_keeps_nothing() -> None:
    """A first run that draws nothing keeps nothing, and its rerun sets no stream."""
    kept = RandomStates.now().drawn_since()
    assert kept.kept == {}
    before = _draws()
    _seed(0)
    reference = _draws()
    _seed(0)
    with replayed(kept):
        inside = _draws()
    assert inside == reference != before

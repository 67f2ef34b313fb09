"""Nested tensor structures survive flatten/unflatten and pickling of their skeleton."""

from __future__ import annotations

import pickle
from collections import namedtuple

import torch

from lightning_pipe.nested import flatten, map_tensors, nbytes, tensors, unflatten

Pair = namedtuple("Pair", ["features", "skip"])


def test_round_trip_keeps_structure_and_constants() -> None:
    obj = {"pair": Pair(torch.ones(2, 3), torch.zeros(2)), "list": [torch.arange(4), 7, None], "name": "x"}
    skeleton, found = flatten(obj)
    again = unflatten(pickle.loads(pickle.dumps(skeleton)), found)
    assert isinstance(again["pair"], Pair) and torch.equal(again["pair"].features, torch.ones(2, 3))
    assert again["list"][1:] == [7, None] and again["name"] == "x"
    assert [t.shape for t in tensors(obj)] == [(2, 3), (2,), (4,)]
    assert nbytes(obj) == 2 * 3 * 4 + 2 * 4 + 4 * 8
    doubled = map_tensors(lambda t: t * 2, obj)
    assert torch.equal(doubled["list"][0], torch.arange(4) * 2) and isinstance(doubled["pair"], Pair)

"""Nested tensor structures survive flatten/unflatten and pickling of their skeleton; the shortcuts for a
bare tensor and the split of a mini-batch into micro-batches agree with the general path; micro-batches'
outputs joined back (``concatenate``) are the batch's, in their own types."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import pickle
import weakref
from collections import UserDict, namedtuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.errors import PipelineRuntimeError
from lightning_pipe.runtime.batches import part_rows, split_batch
from lightning_pipe.util.nested import concatenate, flatten, map_tensors, nbytes, tensors, unflatten

Pair = namedtuple("Pair", ["features", "skip"])


@dataclasses.dataclass
class Output:
    """A model's output class, as ``transformers``' ``ModelOutput`` (a dataclass that is also a dict)."""

    logits: object
    hidden: object = None


class Encoding(UserDict):
    """A mapping that is not a dict, as a ``transformers`` tokenizer's or collator's ``BatchEncoding``."""


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


def _nested(rows: int) -> st.SearchStrategy:
    """Batches of ``rows`` samples: a bare tensor, or tuples, named tuples, lists, dicts and other
    mappings holding tensors (the first one of them at least) and constants."""
    leaf = st.builds(lambda width: torch.randn(rows, width), st.integers(1, 3))
    constant = st.sampled_from([None, 7, "x"])
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.tuples(children, st.lists(st.one_of(children, constant), max_size=2)).map(lambda p: [p[0], *p[1]]),
            st.tuples(children, st.one_of(children, constant)),
            st.builds(Pair, children, st.one_of(children, constant)),
            st.dictionaries(st.sampled_from(["a", "b"]), children, min_size=1, max_size=2),
            st.dictionaries(st.sampled_from(["a", "b"]), children, min_size=1, max_size=2).map(Encoding),
        ),
        max_leaves=5,
    )


def _same(left: object, right: object) -> bool:
    """Same structure, same constants, equal tensors."""
    skeleton, found = flatten(left)
    other_skeleton, other = flatten(right)
    return skeleton == other_skeleton and all(torch.equal(a, b) for a, b in zip(found, other, strict=True))


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(2, 9).flatmap(_nested), parts=st.integers(1, 4))
def test_shortcuts_and_split_agree_with_the_general_path(batch: object, parts: int) -> None:
    """``tensors`` and ``map_tensors`` (which take a bare tensor without building a skeleton) give what
    flatten/unflatten give; ``split_batch`` cuts every tensor into the parts ``torch.tensor_split``
    makes, each part keeping the batch's structure and constants, and the parts put back together
    are the batch. Guards the bare-tensor shortcuts against drifting from the nested path."""
    skeleton, found = flatten(batch)
    assert [id(t) for t in tensors(batch)] == [id(t) for t in found]
    assert _same(map_tensors(lambda t: t + 1, batch), unflatten(skeleton, [t + 1 for t in found]))
    rows = found[0].shape[0]
    if rows < parts:
        with pytest.raises(PipelineRuntimeError, match=f"a mini-batch of {rows} samples cannot be split into {parts}"):
            split_batch(batch, parts)
        return
    pieces = split_batch(batch, parts)
    assert len(pieces) == parts
    for index, piece in enumerate(pieces):
        expected = unflatten(skeleton, [torch.tensor_split(t, parts)[index] for t in found])
        assert _same(piece, expected)
    joined = [torch.cat(column) for column in zip(*(tensors(piece) for piece in pieces), strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(joined, found, strict=True))


def test_a_batch_without_tensors_cannot_be_split() -> None:
    with pytest.raises(PipelineRuntimeError, match="a mini-batch must hold a tensor with a batch dimension"):
        split_batch({"labels": [1, 2, 3]}, 2)
    with pytest.raises(PipelineRuntimeError, match="a mini-batch must hold a tensor with a batch dimension"):
        split_batch((torch.tensor(1.0),), 2)


@settings(deadline=None, max_examples=60)
@given(rows=st.integers(2, 9), other=st.integers(1, 9), parts=st.integers(1, 4), scalar_first=st.booleans())
def test_tensors_without_the_batch_rows_go_to_every_part(rows: int, other: int, parts: int, scalar_first: bool) -> None:
    """The batch's rows are those of its first tensor with a dimension (a leading 0-d tensor does not
    count); a tensor of other rows (a mask shared by the samples) and a 0-d tensor go whole to every
    micro-batch, the others are cut as torch.tensor_split cuts them."""
    x, mask, scale = torch.randn(rows, 3), torch.randn(other, other), torch.tensor(2.0)
    batch = (scale, x, mask) if scalar_first else (x, mask, scale)
    if rows < parts:
        with pytest.raises(PipelineRuntimeError, match=f"a mini-batch of {rows} samples cannot be split"):
            split_batch(batch, parts)
        return
    pieces = split_batch(batch, parts)
    for index, piece in enumerate(pieces):
        got = dict(zip(("scale", "x", "mask") if scalar_first else ("x", "mask", "scale"), piece, strict=True))
        assert torch.equal(got["x"], torch.tensor_split(x, parts)[index])
        assert got["scale"] is scale
        assert (
            got["mask"] is mask if other != rows else torch.equal(got["mask"], torch.tensor_split(mask, parts)[index])
        )


def test_flatten_keeps_no_tensor_alive_once_its_results_are_dropped() -> None:
    """Every message the runtime sends or receives goes through ``flatten``: its tensors must be freed
    when the caller drops them, not when the cyclic garbage collector next runs (a recursive closure
    kept the messages of every step alive until then)."""
    gc.disable()
    try:
        message = {"activations": (torch.ones(4, 3), [torch.zeros(2)]), "rows": 4}
        refs = [weakref.ref(t) for t in tensors(message)]
        skeleton, found = flatten(message)
        assert len(found) == 2 and skeleton
        del message, found, skeleton
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


def _outputs(rows: int) -> st.SearchStrategy:
    """A model's outputs for ``rows`` samples: a tensor, or tuples, named tuples, dicts and dataclasses
    holding tensors of those rows (the first field at least) and constants, or lists of such tensors
    (a backbone's feature maps, one per level)."""
    leaf = st.builds(lambda width: torch.randn(rows, width), st.integers(1, 3))
    constant = st.sampled_from([None, 7, "x"])
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.tuples(children, st.one_of(children, constant)),
            st.builds(Pair, children, st.one_of(children, constant)),
            st.builds(Output, children, st.one_of(children, constant)),
            st.dictionaries(st.sampled_from(["a", "b"]), children, min_size=1, max_size=2),
            st.dictionaries(st.sampled_from(["a", "b"]), children, min_size=1, max_size=2).map(Encoding),
            st.lists(leaf, min_size=1, max_size=3),
        ),
        max_leaves=5,
    )


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(output=st.integers(2, 9).flatmap(_outputs), parts=st.integers(1, 4))
def test_micro_batches_outputs_join_into_the_batchs(output: object, parts: int) -> None:
    """What the last stage's micro-batches computed, joined for the step that reads the whole batch's
    output (validation, prediction), is the batch's output: its tensors' rows in order, its constants
    once, its containers of their own types (a ``transformers`` output keeps its ``.loss``)."""
    rows = tensors(output)[0].shape[0]
    if rows < parts:
        return
    joined = concatenate(split_batch(output, parts), part_rows(rows, parts))
    assert _same(joined, output)
    assert type(joined) is type(output)


_PREDICTION = st.one_of(  # one sample's: a label, or a detector's boxes (as many as it found) and score
    st.sampled_from(["cat", "dog"]),
    st.builds(lambda boxes: {"boxes": torch.randn(boxes, 4), "score": torch.rand(())}, st.integers(0, 4)),
)


@settings(deadline=None, max_examples=60)
@given(predictions=st.lists(_PREDICTION, min_size=1, max_size=9), parts=st.integers(1, 4))
def test_predictions_per_sample_are_chained(predictions: list[object], parts: int) -> None:
    """A list with one prediction per sample, made per micro-batch, joins into the batch's list in
    order, whatever its items hold."""
    if len(predictions) < parts:
        return
    rows = part_rows(len(predictions), parts)
    cuts = [sum(rows[:i]) for i in range(parts + 1)]
    joined = concatenate([predictions[a:b] for a, b in itertools.pairwise(cuts)], rows)
    assert _same(joined, predictions)


def test_joining_keeps_scalars_per_part_and_chains_lists() -> None:
    """One part is the batch's as it is; a 0-d tensor per part (a micro-batch's mean) becomes one value
    per part, lists (a prediction per sample) are chained, lists of maps with the parts' rows are
    joined map by map, and constants that differ are listed."""
    one = Output(torch.ones(2, 3), hidden=torch.tensor(1.5))
    assert concatenate([one], [2]) is one
    two = concatenate([one, Output(torch.zeros(1, 3), hidden=torch.tensor(2.5))], [2, 1])
    assert torch.equal(two.hidden, torch.tensor([1.5, 2.5])) and two.logits.shape == (3, 3)
    assert concatenate([["cat", "dog"], ["owl"]], [2, 1]) == ["cat", "dog", "owl"]
    levels = concatenate([[torch.ones(2, 8), torch.ones(2, 4)], [torch.zeros(2, 8), torch.zeros(2, 4)]], [2, 2])
    assert [level.shape for level in levels] == [(4, 8), (4, 4)]
    assert concatenate([{"n": 2, "x": torch.ones(1)}, {"n": 1, "x": torch.ones(1)}], [1, 1])["n"] == [2, 1]

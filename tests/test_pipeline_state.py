"""The pipeline's checkpoint entry (``optimizer_states[0]["pipeline"]``) as a typed record: its plain
layout, its round trip, and the refusal of a malformed entry."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.errors import CheckpointError
from lightning_pipe.planning import StagePlan
from lightning_pipe.schedule import FAMILIES
from lightning_pipe.strategy.pipeline_state import KEY, PipelineState, SavedPlan, StageSummary


@st.composite
def _records(draw: st.DrawFn) -> PipelineState:
    """A record of a split of 1-12 layers into consecutive stages, with any step counts, summaries
    and carried state (or none: a sharded checkpoint's meta.pt)."""
    layers = draw(st.integers(1, 12))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), max_size=layers - 1))) if layers > 1 else []
    starts, ends = [0, *cuts], [*cuts, layers]
    bounds = tuple((first, end - 1) for first, end in zip(starts, ends, strict=True))
    replicas = draw(st.none() | st.lists(st.integers(1, 4), min_size=len(bounds), max_size=len(bounds)).map(tuple))
    stages = {
        s: StageSummary(draw(st.integers(0, 10**6)), draw(st.booleans()))
        for s in draw(st.sets(st.integers(0, len(bounds) - 1), min_size=1))
    }
    carried = {str(s): {"version": summary.version, "versions": {}, "gradients": {}} for s, summary in stages.items()}
    names = draw(st.none() | st.permutations([f"layer{i}" for i in range(layers)]).map(tuple))
    return PipelineState(
        plan=SavedPlan(bounds, replicas, layers, names),
        schedule=draw(st.sampled_from(sorted(FAMILIES))),
        calls=draw(st.integers(0, 10**6)),
        origin=draw(st.integers(0, 10**9)),
        stages=stages,
        carried=draw(st.none() | st.just(carried)),
    )


def _through_torch(value: Any) -> Any:
    """``value`` saved with ``torch.save`` and read back with ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@settings(deadline=None, max_examples=150)
@given(record=_records())
def test_the_record_round_trips_through_its_plain_layout(record: PipelineState) -> None:
    """to_dict then from_dict gives the record back, also through torch.save and a weights_only
    load (plain values only: the layout every version reads); read/write put it under its key.
    Guards against a field the record holds but the checkpoint loses, or a value type torch.load
    refuses."""
    entry = record.to_dict()
    assert PipelineState.from_dict(entry) == record
    assert PipelineState.from_dict(_through_torch(entry)) == record
    assert ("carried" in entry) == (record.carried is not None)
    state: dict[str, Any] = {"state": {}, "param_groups": []}
    record.write(state)
    assert state[KEY] == entry and PipelineState.read(state) == record
    assert record.with_carried(None).with_carried(record.carried) == record


def test_the_layout_is_the_checkpoints_own() -> None:
    """The keys and value types checkpoints have always held (lists, an int per stage summary, a
    string per stage's carried state), so that older and newer versions read each other's."""
    versions = {4: {"weight": torch.ones(2)}}
    record = PipelineState(
        plan=SavedPlan.of(StagePlan(((0, 3), (4, 6)), replicas=(2, 1))),
        schedule="2bw",
        calls=3,
        origin=8,
        stages={0: StageSummary.of({"version": 5, "versions": versions, "gradients": {}}), 1: StageSummary(5, False)},
        carried={"0": {"version": 5, "versions": versions, "gradients": {}}, "1": {"version": 5}},
    )
    entry = record.to_dict()
    assert entry == {
        "plan": {"bounds": [[0, 3], [4, 6]], "replicas": [2, 1], "layers": 7},
        "schedule": "2bw",
        "calls": 3,
        "origin": 8,
        "stages": {0: {"version": 5, "in_flight": True}, 1: {"version": 5, "in_flight": False}},
        "carried": record.carried,
    }
    loaded = PipelineState.from_dict(_through_torch(entry), "saved.ckpt")
    assert loaded.with_carried(None) == record.with_carried(None)
    assert torch.equal(loaded.carried["0"]["versions"][4]["weight"], torch.ones(2))
    assert PipelineState.stage_states(loaded.carried) == {
        0: {"version": 5, "versions": loaded.carried["0"]["versions"], "gradients": {}},
        1: {"version": 5, "versions": {}, "gradients": {}},
    }
    assert loaded.same_split([[0, 3], [4, 6]], "2bw") and loaded.same_split(((0, 3), (4, 6)), "2bw")
    assert not loaded.same_split([[0, 2], [3, 6]], "2bw") and not loaded.same_split([[0, 3], [4, 6]], "1f1b")
    assert loaded.settled_version() is None  # stage 0 keeps a weight version
    assert PipelineState.read({"state": {}}) is None  # plain Lightning's or DDP's optimizer state


def test_the_layers_order_is_kept_and_a_split_in_another_order_is_not_the_same() -> None:
    """Branching layers may run in another order than forward records them: a checkpoint keeps the
    order its split was of, and the same bounds over layers in another order are another split."""
    names = ("a1", "b1", "a2", "head")
    record = PipelineState(
        SavedPlan.of(StagePlan(((0, 1), (2, 3)), names=names)), "2bw", 2, 0, {0: StageSummary(2, True)}
    )
    entry = record.to_dict()
    assert entry["plan"]["names"] == list(names)
    loaded = PipelineState.from_dict(_through_torch(entry))
    assert loaded.plan.names == names
    assert loaded.same_split([[0, 1], [2, 3]], "2bw", names) and loaded.same_split([[0, 1], [2, 3]], "2bw")
    assert not loaded.same_split([[0, 1], [2, 3]], "2bw", ("a1", "a2", "b1", "head"))
    del entry["plan"]["names"]  # a checkpoint written before layers were ever reordered
    assert PipelineState.from_dict(entry).plan.names is None
    assert PipelineState.from_dict(entry).same_split([[0, 1], [2, 3]], "2bw", ("a1", "a2", "b1", "head"))
    entry["plan"]["names"] = [1, 2]
    with pytest.raises(CheckpointError, match=r"plan\.names"):
        PipelineState.from_dict(entry)


def _entry() -> dict[str, Any]:
    return PipelineState(SavedPlan(((0, 1), (2, 3)), None, 4), "1f1b", 2, 0, {0: StageSummary(2, False)}).to_dict()


def _without(path: str) -> dict[str, Any]:
    entry = _entry()
    *parents, last = path.split(".")
    node = entry
    for key in parents:
        node = node[key]
    del node[last]
    return entry


@pytest.mark.parametrize("missing", ["plan", "plan.bounds", "plan.replicas", "plan.layers", "schedule", "calls"])
def test_a_missing_field_is_named(missing: str) -> None:
    """An entry without one of its fields is refused as a CheckpointError naming the checkpoint and
    the field, not a KeyError deep in the resume."""
    with pytest.raises(CheckpointError, match=rf"^run\.ckpt holds a malformed pipeline entry .*it has no {missing} "):
        PipelineState.read({KEY: _without(missing)}, "run.ckpt")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda e: e.update(calls="2"), r"pipeline\.calls is '2', not a whole number"),
        (lambda e: e.update(origin=-1), r"pipeline\.origin is -1, not a whole number"),
        (lambda e: e.update(schedule=None), r"pipeline\.schedule is None, not a schedule family's name"),
        (lambda e: e["plan"].update(bounds=[]), r"pipeline\.plan\.bounds is \[\], not a list of \[first, last\]"),
        (lambda e: e["plan"].update(bounds=[[0, 1, 2]]), r"pipeline\.plan\.bounds\[0\] is \[0, 1, 2\], not a \[fir"),
        (lambda e: e["plan"].update(replicas=[1, True]), r"pipeline\.plan\.replicas\[1\] is True, not a whole"),
        (lambda e: e["stages"][0].update(in_flight=0), r"pipeline\.stages\[0\]\.in_flight is 0, not True or False"),
        (lambda e: e["stages"][0].pop("version"), r"it has no stages\[0\]\.version "),
        (lambda e: e.update(stages={"0": {"version": 1, "in_flight": False}}), r"stages \(key '0'\) is '0', not a"),
        (lambda e: e.update(carried=[1]), r"pipeline\.carried is \[1\], not a dictionary"),
    ],
)
def test_a_malformed_field_is_named(change: Any, named: str) -> None:
    entry = _entry()
    change(entry)
    with pytest.raises(CheckpointError, match=named):
        PipelineState.from_dict(entry, "run.ckpt")


def test_an_entry_that_is_not_a_dictionary_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"^run\.ckpt holds a malformed pipeline entry .*: pipeline is 'yes'"):
        PipelineState.read({KEY: "yes"}, "run.ckpt")

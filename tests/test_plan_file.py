"""Plan files and saved profiles given to the strategy: every broken file is refused with its path and
what is wrong, and a plan or profile made for another model with what it describes, what this model
has and what to do; a plan the strategy wrote is run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe import planning
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profile_file import save_profile
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.plan_file import load_plan
from lightning_pipe.planning import PlanOptions, plan_stages

NAMES = ("net.0", "net.1", "net.2", "net.3", "net.4")
CPU = torch.device("cpu")


def _plan(tmp_path: Path, document: object, *, raw: bool = False) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(document if raw else json.dumps(document))
    return path


def _planned(options: PlanOptions, names: tuple[str, ...] | None = NAMES, workers: int = 2) -> planning.StagePlan:
    """The split of five Linear(4, 4) layers named ``names`` on ``workers`` workers."""
    layers = [nn.Linear(4, 4) for _ in range(5)]
    return plan_stages(layers, torch.randn(2, 4), workers, options, MemoryModel(), CPU, names=names)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{ not json", r"invalid JSON at line 1: .* \(a plan file is JSON\)$"),
        ("[1, 2]", r'is not a plan: a plan is a JSON object with a "stages" list \(.*\); got a JSON list$'),
        ('"stages"', r"is not a plan: .*; got a JSON string$"),
        ("{}", r'has no "stages": a plan lists its stages, each with "layers": \[first, last\]'),
        ('{"stages": 3}', r'has a number for its "stages": a plan lists its stages'),
        ('{"stages": []}', r'has a list for its "stages": a plan lists its stages'),
        ('{"stages": [3]}', r'stages\[0\] must be an object with "layers": \[first, last\]; got a JSON number$'),
        ('{"stages": [{"replicas": 1}]}', r'stages\[0\] lacks "layers", the \[first, last\] indices of its layers$'),
        ('{"stages": [{"layers": "0-4"}]}', r'stages\[0\]\["layers"\] must be the \[first, last\] .*; got \'0-4\'$'),
        ('{"stages": [{"layers": [0, -1]}]}', r'stages\[0\]\["layers"\] must be .*; got \[0, -1\]$'),
        ('{"stages": [{"layers": [0, 4], "replicas": 0}]}', r'stages\[0\]\["replicas"\] must be a whole number of'),
        ('{"stages": [{"layers": [0, 4]}], "contiguous": "yes"}', r'"contiguous" must be true or false; got \'yes\''),
        ('{"stages": [{"layers": [0, 4]}], "layers": 2.5}', r'"layers" \(the layer count of the model it was made'),
        (
            '{"stages": [{"layers": [0, 4]}], "layer_names": ["a"]}',
            r'"layer_names" must list the names of its 5 layers as strings; got \[\'a\'\]$',
        ),
    ],
)
def test_a_broken_plan_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    """The issue's plan that is a list, or whose stage lacks "layers" (a bare AttributeError and
    KeyError before), and every other wrong shape: the file, where and what it should be. The
    strategy meets each the same way."""
    path = _plan(tmp_path, text, raw=True)
    with pytest.raises(PlanningError, match=rf"^{re.escape(str(path))}:? {message}"):
        load_plan(path)
    with pytest.raises(PlanningError, match=rf"^{re.escape(str(path))}:? {message}"):
        _planned(PlanOptions(plan=str(path)))


def test_a_missing_plan_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlanningError, match=r"^cannot read the plan .*none.json: No such file or directory$"):
        load_plan(tmp_path / "none.json")


_ANEW = re.escape(
    "Plan this model anew (leave plan= out; Hydra: pipeline.plan=null), or give the plan.json of a run of this model"
)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"stages": [{"layers": [0, 1]}, {"layers": [2, 3]}]},
            r"is a plan of another model: it describes 4 layers, this model has 5 layers \(net.0 .. net.4\)",
        ),
        (
            {"layers": 6, "stages": [{"layers": [0, 1]}, {"layers": [2, 4]}]},
            r"is a plan of another model: it describes 6 layers, this model has 5 layers \(net.0 .. net.4\)",
        ),
        (
            {"layer_names": ["a", "b", "c", "d", "e"], "stages": [{"layers": [0, 1]}, {"layers": [2, 4]}]},
            r"is a plan of another model: it describes 5 layers \(a .. e\), this model has 5 layers "
            r"\(net.0 .. net.4\); layer 0 is a there, net.0 here",
        ),
        (
            {"stages": [{"layers": [0, 1]}, {"layers": [2, 2]}, {"layers": [3, 4]}]},
            r"holds 3 stages on 3 devices \(contiguous ones needed\); this run has 2 workers, one stage each",
        ),
        (
            {"stages": [{"layers": [0, 1]}, {"layers": [3, 4]}]},
            r"does not split the 5 layers of this model into consecutive stages",
        ),
    ],
)
def test_a_plan_of_another_model_says_what_each_has(tmp_path: Path, document: object, message: str) -> None:
    path = _plan(tmp_path, document)
    with pytest.raises(PlanningError, match=rf"^{re.escape(str(path))} {message}. {_ANEW}$"):
        _planned(PlanOptions(plan=str(path)))


@settings(max_examples=20, deadline=None)
@given(cut=st.integers(0, 3), names=st.sampled_from([NAMES, None]))
def test_a_plan_the_strategy_wrote_runs_as_written(tmp_path_factory: pytest.TempPathFactory, cut: int, names) -> None:
    """``plan.json`` of a run (``StagePlan.to_dict``: the layers' count and names beside the stages),
    given back, splits the same model where it said."""
    first = _planned(PlanOptions(balance=[cut + 1, 4 - cut]), names)
    path = _plan(tmp_path_factory.mktemp("plan"), first.to_dict())
    assert load_plan(path).names == names
    again = _planned(PlanOptions(plan=str(path)), names)
    assert again.bounds == first.bounds == ((0, cut), (cut + 1, 4))


def test_a_planned_split_written_and_read_back_is_the_same(tmp_path: Path) -> None:
    """The plan a run prints and writes (profiled, partitioned) is a plan file of this model."""
    profile = ChainCosts.from_lists([1.0, 3.0, 1.0, 1.0, 2.0])
    with mock.patch.object(planning, "profile_layers", lambda *_, **__: profile):
        planned = _planned(PlanOptions(cache=None))
    document = planned.to_dict()
    assert (document["layers"], document["layer_names"]) == (5, list(NAMES))
    assert _planned(PlanOptions(plan=str(_plan(tmp_path, document)))).bounds == planned.bounds


def test_a_profile_of_another_model_says_what_each_has(tmp_path: Path) -> None:
    """A profile of other layers (another count, or, for a profile measured from captured layers,
    other names) is refused; a profile of the same layers plans."""
    anew = re.escape(
        "Profile this model anew (leave profile= out; Hydra: pipeline.profile=null), or give a profile of this model "
        "(lightning-pipe plan --model ... --save-profile FILE)"
    )
    path = tmp_path / "profile.json"
    save_profile(ChainCosts.from_lists([1.0] * 4, name="other"), path)
    with pytest.raises(
        PlanningError,
        match=rf"^{re.escape(str(path))} is a profile of another model: it describes 4 layers, this model has 5 "
        rf"layers \(net.0 .. net.4\). {anew}$",
    ):
        _planned(PlanOptions(profile=str(path)))
    measured = profile_layers([nn.Linear(4, 4) for _ in range(5)], torch.randn(2, 4), repeats=1, layer_names=NAMES)
    save_profile(measured, path)
    assert _planned(PlanOptions(profile=str(path))).costs is not None
    with pytest.raises(PlanningError, match=r"describes 5 layers \(net.0 .. net.4\), this model has 5 layers \(x.0"):
        _planned(PlanOptions(profile=str(path)), names=tuple(f"x.{i}" for i in range(5)))
    with mock.patch.object(planning, "profile_layers", side_effect=AssertionError("profiled")):
        assert _planned(PlanOptions(profile=str(path)), names=None).costs is not None  # names unknown: count only

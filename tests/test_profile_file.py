"""Profiles: JSON round trip, PipeDream graph.txt (real files and hand-made DAGs), malformed input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.pipedream_graph import parse_pipedream_graph
from lightning_pipe.cost.profile_file import load_profile, profile_from_dict, profile_to_dict, save_profile
from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError

EXPECTED_LAYERS = {
    "alexnet": 22,
    "densenet121": 428,
    "gnmt": 45,
    "inception_v3": 325,
    "resnet101": 346,
    "resnet18": 70,
    "resnet50": 176,
    "vgg16": 40,
}


def _line(node: str, desc: str, fwd: float, bwd: float, act: float | str, params: float) -> str:
    return (
        f"{node} -- {desc} -- forward_compute_time={fwd}, backward_compute_time={bwd}, "
        f"activation_size={act}, parameter_size={params}"
    )


@pytest.mark.parametrize("model", sorted(EXPECTED_LAYERS))
def test_every_pipedream_profile_loads(pipedream_profiles: Path, model: str) -> None:
    costs = load_profile(pipedream_profiles / model / "graph.txt")
    assert costs.name == model
    assert len(costs) == EXPECTED_LAYERS[model]
    assert all(math.isfinite(layer.seconds) and layer.seconds >= 0 for layer in costs.layers)
    assert any("ms to s" in note for note in costs.notes)
    assert any("topological order" in note for note in costs.notes)  # all eight are DAGs
    assert len(costs.boundary_bytes) == len(costs) - 1
    # a cut carries at least the activation of the layer before it
    for layer, crossing in zip(costs.layers, costs.boundary_bytes, strict=False):
        assert crossing >= layer.activation_bytes


def test_vgg16_first_layer_converted_from_milliseconds(pipedream_profiles: Path) -> None:
    costs = load_profile(pipedream_profiles / "vgg16" / "graph.txt")
    first = costs.layers[0]
    assert first.name.startswith("node2:Conv2d(3, 64")
    text = (pipedream_profiles / "vgg16" / "graph.txt").read_text()
    line = next(line for line in text.splitlines() if line.startswith("node2 -- "))
    fields = dict(item.split("=") for item in line.split(" -- ")[2].split(", "))
    assert first.forward_seconds == pytest.approx(float(fields["forward_compute_time"]) / 1e3)
    assert first.backward_seconds == pytest.approx(float(fields["backward_compute_time"]) / 1e3)
    assert first.param_bytes == float(fields["parameter_size"])


def test_dag_is_linearised_with_skip_bytes() -> None:
    # input -> a -> b -> c(add a, b) -> d ; a's output jumps over b
    text = "\n".join(
        [
            _line("node1", "Input", 5, 0, 100, 0),
            _line("node2", "Conv2d(a)", 1, 2, 10, 4),
            _line("node3", "ReLU(b)", 1, 1, 20, 0),
            _line("node4", "Add(c)", 0.5, 0.5, 30, 0),
            _line("node5", "Linear(d)", 2, 2, 3, 8),
            "\tnode1 -- node2",
            "\tnode2 -- node3",
            "\tnode2 -- node4",
            "\tnode3 -- node4",
            "\tnode4 -- node5",
        ]
    )
    costs = parse_pipedream_graph(text, source="toy/graph.txt")
    assert [layer.name.split(":")[0] for layer in costs.layers] == ["node2", "node3", "node4", "node5"]
    assert costs.boundary_bytes == (10.0, 30.0, 30.0)  # the cut after b carries a's and b's outputs
    assert costs.layers[0].forward_seconds == pytest.approx(1e-3)
    assert any("DAG" in note for note in costs.notes)
    assert any("dropped 1 Input" in note for note in costs.notes)


def test_pure_chain_has_no_dag_note_and_list_activations_sum() -> None:
    text = "\n".join(
        [
            _line("node1", "LSTM(2, 2)", 1, 1, "[6.0; 1.0; 1.0]", 4),
            _line("node2", "Linear", 1, 1, 2, 4),
            "\tnode1 -- node2",
        ]
    )
    costs = parse_pipedream_graph(text)
    assert costs.layers[0].activation_bytes == 8.0
    assert not any("DAG" in note for note in costs.notes)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("this is not a profile", "not a PipeDream profile line"),
        (_line("node1", "Input", 1, 0, 1, 0), "no layers"),
        (_line("node2", "Conv", 1, 1, 1, 1) + "\n\tnode2 -- node9", "unknown node node9"),
        (_line("node2", "Conv", "x", 1, 1, 1), "forward_compute_time='x' is not a number"),
        (_line("node2", "Conv", -1, 1, 1, 1), "forward_seconds must be a finite number >= 0"),
        (_line("node2", "Conv", "nan", 1, 1, 1), "must be a finite number >= 0"),
        (
            _line("node2", "A", 1, 1, 1, 1)
            + "\n"
            + _line("node3", "B", 1, 1, 1, 1)
            + "\n\tnode2 -- node3\n\tnode3 -- node2",
            "cycle",
        ),
        ("node2 -- Conv -- forward_compute_time=1, backward_compute_time=1", "lacks activation_size"),
    ],
)
def test_malformed_pipedream_profiles_are_explained(text: str, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        parse_pipedream_graph(text)


layer_costs = st.builds(
    LayerCost,
    name=st.text(min_size=1, max_size=8),
    forward_seconds=st.floats(0, 10),
    backward_seconds=st.floats(0, 10),
    activation_bytes=st.integers(0, 2**40),
    saved_bytes=st.integers(0, 2**40),
    param_bytes=st.integers(0, 2**40),
    flops=st.one_of(st.none(), st.integers(0, 2**50)),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(layer_costs, min_size=1, max_size=6))
def test_json_round_trip(tmp_path_factory: pytest.TempPathFactory, layers: list[LayerCost]) -> None:
    costs = ChainCosts(tuple(layers), name="m", notes=("n",), meta={"batch_size": 4})
    path = tmp_path_factory.mktemp("p") / "profile.json"
    save_profile(costs, path)
    loaded = load_profile(path)
    assert loaded == costs
    assert loaded.meta == {"batch_size": 4}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("format"), "not a lightning_pipe profile"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(layers="x"), "must be a list"),
        (lambda d: d.update(layers=[]), "no layers"),
        (lambda d: d["layers"][0].pop("param_bytes"), r"layers\[0\] lacks param_bytes"),
        (lambda d: d["layers"][0].update(saved_bytes=-1), r"layers\[0\].*saved_bytes must be"),
        (lambda d: d.update(boundary_bytes=[1, 2, 3]), "boundary_bytes has 3 entries"),
    ],
)
def test_malformed_json_profiles_are_explained(mutate, message: str) -> None:
    document = profile_to_dict(ChainCosts.from_lists([1.0, 2.0], [1.0, 1.0], params=[3, 4]))
    mutate(document)
    with pytest.raises(PlanningError, match=message):
        profile_from_dict(json.loads(json.dumps(document)), source="bad.json")


def test_unreadable_and_invalid_json_files(tmp_path: Path) -> None:
    with pytest.raises(PlanningError, match=r"^cannot read the profile .*missing.json: No such file or directory$"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(PlanningError, match=r"^cannot read the profile .*: Is a directory$"):
        load_profile(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    with pytest.raises(PlanningError, match=r"broken.json: invalid JSON at line 1: .* \(a profile file is JSON\)$"):
        load_profile(broken)


_GOOD = profile_to_dict(ChainCosts.from_lists([1.0, 2.0], [1.0, 1.0], params=[3, 4]))


def _with_layer(**change: object) -> dict[str, object]:
    return {**_GOOD, "layers": [{**_GOOD["layers"][0], **change}, _GOOD["layers"][1]]}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([1, 2], r"not a lightning_pipe profile: a profile is a JSON object .*, got a JSON list$"),
        (3, r"not a lightning_pipe profile: .* got a JSON number$"),
        ({**_GOOD, "layers": {"a": 1}}, r'"layers" must be a list of layer objects, got object$'),
        ({**_GOOD, "layers": [1]}, r"layers\[0\] must be an object, got number 1$"),
        (_with_layer(forward_seconds="x"), r"layers\[0\]: layer 'layer0': forward_seconds must be a finite number"),
        (_with_layer(backward_seconds=True), r"layers\[0\]: .* backward_seconds must be a finite number .*got True$"),
        (_with_layer(name=5), r"layers\[0\] name must be a string, got number 5$"),
        ({**_GOOD, "boundary_bytes": 5}, r'"boundary_bytes" must be a JSON list, got number 5$'),
        ({**_GOOD, "notes": "checked"}, r'"notes" must be a JSON list, got string \'checked\'$'),
        ({**_GOOD, "meta": [1]}, r'"meta" must be a JSON object, got list \[1\]$'),
        ({**_GOOD, "name": {"a": 1}}, r'"name" must be a JSON string, got object'),
    ],
)
def test_a_json_profile_of_the_wrong_shape_is_named(tmp_path: Path, document: object, message: str) -> None:
    """Any JSON (a list, a number, ...) is read as a JSON profile, not as a PipeDream graph, and each
    wrong type is refused with the file's name and where it is."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(document))
    with pytest.raises(PlanningError, match=rf"^{re.escape(str(path))}: {message}"):
        load_profile(path)

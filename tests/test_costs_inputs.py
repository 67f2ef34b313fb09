"""The planner's input records: LayerCost / ChainCosts validation, from_lists defaults and column()."""

from __future__ import annotations

import math

import pytest

from lightning_pipe.cost.records import ChainCosts, LayerCost
from lightning_pipe.errors import PlanningError

FIELDS = ["forward_seconds", "backward_seconds", "activation_bytes", "saved_bytes", "param_bytes", "flops"]


def _layer(**values: object) -> LayerCost:
    base: dict[str, object] = {
        "forward_seconds": 1.0,
        "backward_seconds": 2.0,
        "activation_bytes": 3.0,
        "saved_bytes": 4.0,
        "param_bytes": 5.0,
        "flops": 6.0,
    }
    base.update(values)
    return LayerCost("conv", **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "7"])
def test_each_layer_number_must_be_finite_and_not_negative(field: str, bad: object) -> None:
    """Every field (flops included when given) is checked, and the message names it. Guards against a
    field escaping the check, a misspelt key in the message, and ``and`` for ``or`` in the test."""
    with pytest.raises(PlanningError, match=rf"^layer 'conv': {field} must be a finite number >= 0, got "):
        _layer(**{field: bad})


def test_zero_fractions_and_missing_flops_are_valid() -> None:
    """Zero costs and sub-unit values are legal; flops may be unknown. Guards against ``<= 0`` or
    ``< 1`` bounds, and against a missing (None) flops being checked as a number."""
    zero = LayerCost("relu", 0, 0.0, 0, 0, 0)
    assert zero.flops is None and zero.seconds == 0
    half = _layer(forward_seconds=0.5, flops=0.25)
    assert half.flops == 0.25 and half.seconds == 2.5


def test_empty_chain_is_refused_with_its_name() -> None:
    """Guards against the emptiness test being inverted and against a wrong fallback name."""
    with pytest.raises(
        PlanningError,
        match=r"^the model has no layers: nothing to partition "
        r"\(give an nn\.Sequential or a non-empty list of modules\)$",
    ):
        ChainCosts(())
    with pytest.raises(PlanningError, match=r"^resnet has no layers"):
        ChainCosts((), name="resnet")


def test_lists_are_frozen_into_tuples() -> None:
    """layers, boundary_bytes and notes given as lists are stored as tuples (the dataclass is frozen
    and hashed). Guards against one of the conversions being lost or stored under a wrong name."""
    layers = [_layer(), _layer(activation_bytes=9.0)]
    costs = ChainCosts(layers, boundary_bytes=[7.0], notes=["a DAG as a chain"])  # type: ignore[arg-type]
    assert type(costs.layers) is tuple and costs.layers == tuple(layers)
    assert type(costs.boundary_bytes) is tuple and costs.boundary_bytes == (7.0,)
    assert type(costs.notes) is tuple and costs.notes == ("a DAG as a chain",)
    assert hash(costs) == hash(ChainCosts(tuple(layers), (7.0,), notes=("a DAG as a chain",)))


def test_boundary_bytes_default_to_each_layer_output_but_the_last() -> None:
    """Cut i carries layer i's activation; the last layer's output crosses no cut. Guards against an
    explicit boundary being overwritten and against off-by-one slices."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0], activation=[5, 6, 7])
    assert costs.boundary_bytes == (5, 6)
    dag = ChainCosts(costs.layers, boundary_bytes=(8, 9))
    assert dag.boundary_bytes == (8, 9)
    assert ChainCosts.from_lists([1.0]).boundary_bytes == ()


def test_boundary_bytes_need_one_entry_per_cut() -> None:
    """Guards against the length check being inverted or off by one, and its message."""
    layers = ChainCosts.from_lists([1.0, 1.0, 1.0]).layers
    with pytest.raises(
        PlanningError, match=r"^boundary_bytes has 1 entries, expected 2 \(one per cut between 3 layers\)$"
    ):
        ChainCosts(layers, boundary_bytes=(1.0,))
    with pytest.raises(PlanningError, match=r"^boundary_bytes has 3 entries, expected 2 "):
        ChainCosts(layers, boundary_bytes=(1.0, 2.0, 3.0))


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "7"])
def test_boundary_bytes_must_be_finite_and_not_negative(bad: object) -> None:
    """Guards against a bad cut size slipping through and against the index in the message."""
    layers = ChainCosts.from_lists([1.0, 1.0, 1.0]).layers
    with pytest.raises(PlanningError, match=r"^boundary_bytes\[1\] must be a finite number >= 0, got "):
        ChainCosts(layers, boundary_bytes=(0.0, bad))  # type: ignore[arg-type]


def test_zero_and_fractional_boundary_bytes_are_valid() -> None:
    """Guards against ``<= 0`` or ``< 1`` bounds on cut sizes."""
    layers = ChainCosts.from_lists([1.0, 1.0, 1.0]).layers
    assert ChainCosts(layers, boundary_bytes=(0.0, 0.5)).boundary_bytes == (0.0, 0.5)


def test_from_lists_defaults() -> None:
    """Missing lists are zeros, saved defaults to activation, flops to unknown, names to layer<i> and
    the chain to "chain". Guards against wrong defaults (ones, None) and lost names."""
    costs = ChainCosts.from_lists([1.5, 2.5], activation=[3, 4])
    assert costs.name == "chain"
    assert [layer.name for layer in costs.layers] == ["layer0", "layer1"]
    assert costs.layers[0] == LayerCost("layer0", 1.5, 0.0, 3, 3, 0.0, None)
    assert costs.layers[1] == LayerCost("layer1", 2.5, 0.0, 4, 4, 0.0, None)
    bare = ChainCosts.from_lists([1.0], name="mlp")
    assert bare.name == "mlp"
    assert bare.layers[0] == LayerCost("layer0", 1.0, 0.0, 0.0, 0.0, 0.0, None)


def test_from_lists_passes_every_list_through() -> None:
    """Guards against a given list being replaced by its default (zeros, activation, None)."""
    costs = ChainCosts.from_lists(
        [1, 2], [3, 4], activation=[5, 6], saved=[7, 8], params=[9, 10], flops=[11, 12], name="net"
    )
    assert costs.layers == (LayerCost("layer0", 1, 3, 5, 7, 9, 11), LayerCost("layer1", 2, 4, 6, 8, 10, 12))
    assert costs.boundary_bytes == (5,)


@pytest.mark.parametrize("label", ["backward", "activation", "saved", "params", "flops"])
def test_from_lists_length_mismatch_names_the_list(label: str) -> None:
    """Guards against a mismatched list being accepted (or cut short) and a wrong label."""
    with pytest.raises(PlanningError, match=rf"^{label} has 1 entries, forward has 2$"):
        ChainCosts.from_lists([1.0, 1.0], **{label: [1.0]})  # type: ignore[arg-type]


def test_column_values() -> None:
    """seconds is forward + backward; every column is a list of floats in layer order. Guards
    against the flops guard firing on other columns or on complete FLOP counts."""
    costs = ChainCosts.from_lists([1, 2], [3, 4], params=[5, 6])
    seconds = costs.column("seconds")
    assert seconds == [4.0, 6.0] and all(type(value) is float for value in seconds)
    assert costs.column("param_bytes") == [5.0, 6.0]
    with_flops = ChainCosts.from_lists([1, 2], flops=[7, 8])
    assert with_flops.column("flops") == [7.0, 8.0]


def test_missing_flops_are_explained() -> None:
    """Guards against a missing FLOP count turning into a TypeError instead of advice, and the
    fallback name of an unnamed profile."""
    with pytest.raises(
        PlanningError,
        match=r"^chain has no FLOP counts: profile the model with lightning_pipe "
        r"\(torch\.utils\.flop_counter\) or balance by 'time' or 'params'$",
    ):
        ChainCosts.from_lists([1.0, 2.0]).column("flops")
    unnamed = ChainCosts((LayerCost("a", 1, 1, 1, 1, 1, flops=3), LayerCost("b", 1, 1, 1, 1, 1)))
    with pytest.raises(PlanningError, match=r"^this profile has no FLOP counts"):
        unnamed.column("flops")

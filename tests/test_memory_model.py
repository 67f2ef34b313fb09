"""MemoryModel by hand: its validation, the in-flight count and weight versions per schedule, and the
per-replica bytes (Beaumont §3.2 with PipeDream's NOAM ⌈k/r⌉; docs/planning.md "Cost model")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.errors import PlanningError


def test_every_schedule_is_accepted_with_the_smallest_whole_microbatch_count() -> None:
    """Guards against valid schedules being refused (inverted membership test) and against the
    micro-batch minimum drifting from 1 to 2 (m = 1 is a valid, if useless, pipeline)."""
    for schedule in ("1f1b", "gpipe", "pipedream", "2bw"):
        assert MemoryModel(schedule, 1).microbatches == 1
    for schedule in ("1f1b", "pipedream", "2bw"):
        assert MemoryModel(schedule).microbatches is None  # unbounded steady state


def test_unknown_schedule_names_the_choices() -> None:
    """Guards against a wrong or garbled list of choices in the error."""
    with pytest.raises(
        PlanningError,
        match=r"^unknown schedule 'zigzag' for memory planning; choose one of 1f1b, gpipe, pipedream, 2bw$",
    ):
        MemoryModel("zigzag")


@pytest.mark.parametrize("microbatches", [0, -3, 2.0, True, "4"])
def test_microbatches_must_be_a_whole_number_of_at_least_one(microbatches: object) -> None:
    """Guards against the microbatches check being dropped or naming another field."""
    with pytest.raises(PlanningError, match=r"^microbatches must be a whole number >= 1, or None; got "):
        MemoryModel("1f1b", microbatches)  # type: ignore[arg-type]


def test_gpipe_needs_the_microbatch_count_and_only_gpipe_does() -> None:
    """GPipe keeps all m micro-batches, so m is required for it, and only for it. Guards against the
    condition being widened (``or``, ``!=``) or inverted (``is not None``)."""
    with pytest.raises(
        PlanningError, match=r"^gpipe keeps all m micro-batches in flight: give the number of microbatches$"
    ):
        MemoryModel("gpipe")
    assert MemoryModel("gpipe", 6).microbatches == 6


@pytest.mark.parametrize("extra", [-1.0, -0.5, math.inf, math.nan])
def test_extra_copies_must_be_finite_and_not_negative(extra: float) -> None:
    """Guards against negative, infinite or NaN optimizer copies slipping through (``and`` for ``or``)."""
    with pytest.raises(PlanningError, match=r"^extra_copies must be a finite number >= 0, got "):
        MemoryModel(extra_copies=extra)


def test_zero_and_fractional_extra_copies_are_allowed() -> None:
    """0 (weights only) and fractions (e.g. a half-precision master copy) are valid. Guards against the
    bound becoming ``<= 0`` or ``< 1``."""
    assert MemoryModel(extra_copies=0).extra_copies == 0
    assert MemoryModel(extra_copies=0.5).extra_copies == 0.5


# (schedule, m, k downstream, r replicas) -> (in flight, weight versions), by the closed forms of memory.py:
# gpipe m; 1f1b min(ceil(k/r), m); pipedream ceil(k/r) and as many versions; 2bw ceil(k/r) and 2 versions.
HAND = [
    ("gpipe", 6, 2, 1, 6, 1),  # every micro-batch, whatever the place in the pipeline
    ("gpipe", 3, 9, 2, 3, 1),
    ("1f1b", None, 3, 1, 3, 1),  # k
    ("1f1b", None, 5, 2, 3, 1),  # ceil(5/2) = 3, not 2 (floor) nor 2.5
    ("1f1b", 2, 5, 1, 2, 1),  # capped by m
    ("1f1b", 8, 5, 2, 3, 1),  # cap not reached
    ("pipedream", 2, 5, 1, 5, 5),  # m does not cap an asynchronous pipeline
    ("pipedream", None, 5, 2, 3, 3),
    ("2bw", 2, 7, 3, 3, 2),  # ceil(7/3) = 3, not capped by m = 2
    ("2bw", None, 1, 1, 1, 2),
]


@pytest.mark.parametrize(("schedule", "m", "k", "r", "flight", "versions"), HAND)
def test_in_flight_and_weight_versions_by_hand(
    schedule: str, m: int | None, k: int, r: int, flight: int, versions: int
) -> None:
    """Guards against floor instead of ceiling in ⌈k/r⌉, the 1F1B cap applied to other schedules or
    dropped, GPipe not keeping m, and wrong weight-version counts (stashing, 2BW's two, one otherwise)."""
    model = MemoryModel(schedule, m)
    assert model.in_flight(k, r) == flight
    assert isinstance(model.in_flight(k, r), int)
    assert model.weight_versions(k, r) == versions


def test_replicas_default_to_one() -> None:
    """Without ``replicas`` a stage is not replicated: k in flight (and k versions when stashing).
    Guards against a default of 2, which would halve the in-flight count."""
    assert MemoryModel("1f1b").in_flight(4) == 4
    assert MemoryModel("pipedream").weight_versions(4) == 4
    assert MemoryModel("1f1b", extra_copies=1).coefficients(4) == (2, 4.0)
    assert MemoryModel("1f1b", extra_copies=3).stage_bytes(100, 10, 4) == (1 + 3) * 100 + 4 * 10


def test_coefficients_and_stage_bytes_by_hand() -> None:
    """alpha = weight versions + extra copies, beta = in flight; bytes = alpha·params + beta·saved.
    Guards against a subtracted optimizer term, swapped or mis-passed arguments, and / for *."""
    adam = MemoryModel("1f1b", None, extra_copies=3)
    # k = 4, r = 2: ceil(4/2) = 2 in flight, one version: (1 + 3) * 100 + 2 * 10 = 420
    assert adam.coefficients(4, 2) == (4, 2.0)
    assert adam.stage_bytes(100, 10, 4, 2) == 420
    stash = MemoryModel("pipedream", None, extra_copies=2)
    # k = 5, r = 2: 3 in flight and 3 versions: (3 + 2) * 8 + 3 * 7 = 61
    assert stash.coefficients(5, 2) == (5, 3.0)
    assert stash.stage_bytes(8, 7, 5, 2) == 61
    two_bw = MemoryModel("2bw", 4, extra_copies=1)
    # k = 3, r = 1: 3 in flight, 2 versions: (2 + 1) * 10 + 3 * 1 = 33
    assert two_bw.stage_bytes(10, 1, 3, 1) == 33
    gpipe = MemoryModel("gpipe", 5, extra_copies=0)
    assert gpipe.stage_bytes(10, 2, 1, 1) == 10 + 5 * 2


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["1f1b", "gpipe", "pipedream", "2bw"]),
    st.integers(1, 8),
    st.integers(1, 12),
    st.integers(1, 6),
    st.integers(0, 1000),
    st.integers(0, 1000),
)
def test_stage_bytes_is_linear_in_params_and_saved(
    schedule: str, m: int, k: int, r: int, params: int, saved: int
) -> None:
    """stage_bytes must be ``α·params + β·saved`` with (α, β) from coefficients, and β equals the
    in-flight count. Guards against the two disagreeing (the planner uses one, the docs the other)."""
    model = MemoryModel(schedule, m, extra_copies=2)
    alpha, beta = model.coefficients(k, r)
    assert beta == model.in_flight(k, r)
    assert alpha == model.weight_versions(k, r) + 2
    assert model.stage_bytes(params, saved, k, r) == alpha * params + beta * saved


def test_a_split_backwards_kept_gradients_count_once_on_stages_after_the_first() -> None:
    """A flushing schedule splits each cool-down backward of a stage ``s > 0`` (one at a time) when
    its cool-down has at most ``P - s`` backwards (:mod:`lightning_pipe.schedule.early`): always under
    1F1B, under GPipe only when ``m <= P - s``. The first stage's input takes no gradient: never."""
    one_f_one_b = MemoryModel("1f1b", 4, extra_copies=1, split_backward=True)
    assert one_f_one_b.stage_bytes(10, 2, 3, kept_bytes=5) == 2 * 10 + 3 * 2 + 5
    assert one_f_one_b.stage_bytes(10, 2, 4, kept_bytes=5, first=True) == 2 * 10 + 4 * 2
    gpipe = MemoryModel("gpipe", 3, extra_copies=1, split_backward=True)
    assert [gpipe.kept_coefficient(k, first=False) for k in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert MemoryModel("1f1b", 4).kept_coefficient(1, first=False) == 0  # not split (non-flushing, or off)


def test_an_accumulated_gradient_counts_the_largest_layer_with_more_than_one_micro_batch() -> None:
    """One micro-batch's gradient of a layer exists beside the one it is added to (``grad += new``)."""
    assert MemoryModel("1f1b", 4, accumulation=True).accumulating_bytes(64.0) == 64.0
    assert MemoryModel("1f1b", None, accumulation=True).accumulating_bytes(64.0) == 64.0  # a long run's steps
    assert MemoryModel("1f1b", 1, accumulation=True).accumulating_bytes(64.0) == 0.0  # nothing to add to
    assert MemoryModel("1f1b", 4).accumulating_bytes(64.0) == 0.0  # Beaumont et al.'s model alone

"""The contiguous-chain planner (``ChainProblem``) worked out by hand: prefix sums, stage times with
all-reduce, bottlenecks, peak memory with replicas, the greedy ``cover`` under time bounds and memory
limits, the bisection's precision and termination, and the infeasible-limit hint of a straight split."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.contiguous import ChainProblem, _bisect, _prefix

ONE_F_ONE_B = MemoryModel("1f1b", None, extra_copies=0)


class _WalkChecked(ChainProblem):
    """``cover`` whose plan walk first checks that every worker count on the way was really reached
    (a choice of at least one replica), so a broken table fails the test instead of looping forever."""

    @staticmethod
    def _spans(start: np.ndarray, choice: np.ndarray, k: int) -> list[tuple[int, int, int]]:
        count = k
        while count > 0:
            assert choice[count] >= 1, f"plan for {k} workers goes through {count} workers, never reached"
            count -= int(choice[count])
        assert count == 0
        return ChainProblem._spans(start, choice, k)


def _chain(
    seconds: list[float],
    *,
    devices: int,
    replicate: bool = True,
    cuts: list[float] | None = None,
    params: list[float] | None = None,
    saved: list[float] | None = None,
    network: Network | None = None,
    memory: MemoryModel = ONE_F_ONE_B,
    memory_limit: float | None = None,
) -> ChainProblem:
    n = len(seconds)
    return _WalkChecked(
        seconds=np.asarray(seconds, dtype=np.float64),
        cut_seconds=np.asarray(cuts if cuts is not None else [0.0] * (n - 1), dtype=np.float64),
        param_bytes=np.asarray(params if params is not None else [0.0] * n, dtype=np.float64),
        saved_bytes=np.asarray(saved if saved is not None else [0.0] * n, dtype=np.float64),
        devices=devices,
        replicate=replicate,
        network=network or Network(),
        memory=memory,
        memory_limit=memory_limit,
    )


def test_prefix_sums_accumulate_in_float64() -> None:
    """In float32, 2**24 + 1 rounds back to 2**24; in int64, 2**62 + 2**62 wraps to -2**63. The prefix
    sums must be exact float64 whatever the input dtype, so a one-layer stage right after a huge layer
    still costs its own second. Guards against summing in the input's dtype."""
    assert _prefix(np.array([2**24, 1, 1], dtype=np.float32)).tolist() == [0.0, 2.0**24, 2.0**24 + 1, 2.0**24 + 2]
    assert _prefix(np.array([2**62, 2**62], dtype=np.int64)).tolist() == [0.0, 2.0**62, 2.0**63]
    problem = ChainProblem(
        seconds=np.array([2**24, 1, 1], dtype=np.float32),
        cut_seconds=np.zeros(2),
        param_bytes=np.zeros(3),
        saved_bytes=np.zeros(3),
        devices=2,
        replicate=False,
        network=Network(),
        memory=ONE_F_ONE_B,
    )
    assert problem.stage_seconds(1, 2, 1) == 2.0


def test_stage_seconds_prices_the_allreduce_of_the_stage_own_weights() -> None:
    """Layers of 1 s with weights (100, 200, 300) B on 8 B/s links. Stage {1, 2} twice: compute 2 s,
    ring all-reduce of its 500 B among 2: 2(2-1)/2 * 500 / 8 = 62.5 s, so max(2, 62.5) / 2 = 31.25 s.
    Stage {0, 1, 2} three times: 2(3-1)/3 * 600 / 8 = 100 s -> 100/3 s. Layer 0 alone has no sync: 1 s.
    Guards against the weights of the stage summed with the wrong sign or the wrong last layer."""
    problem = _chain([1.0, 1.0, 1.0], devices=3, params=[100.0, 200.0, 300.0], network=Network(8.0))
    assert problem.stage_seconds(1, 2, 2) == 31.25
    assert problem.stage_seconds(0, 2, 3) == pytest.approx(100.0 / 3)
    assert problem.stage_seconds(0, 0, 1) == 1.0


def test_bottleneck_counts_every_cut_between_stages() -> None:
    """Layers of 1 s, cuts (1, 9) s after layers 0 and 1. Three single-layer stages cross both cuts:
    9 s. Stages {0, 1}, {2} cross the 9 s cut; {0}, {1, 2} only the 1 s one, so their 2 s stage wins.
    Guards against dropping the cut in front of the last stage."""
    problem = _chain([1.0, 1.0, 1.0], devices=3, cuts=[1.0, 9.0])
    assert problem.bottleneck([(0, 0, 1), (1, 1, 1), (2, 2, 1)]) == 9.0
    assert problem.bottleneck([(0, 1, 1), (2, 2, 1)]) == 9.0
    assert problem.bottleneck([(0, 0, 1), (1, 2, 1)]) == 2.0


def test_peak_memory_of_hand_plans_with_replicas() -> None:
    """Weights (40, 30, 20, 10) B, saved (8, 4, 2, 1) B, 1F1B with unbounded micro-batches and one
    extra copy: a stage needs 2 * weights + ceil(k / r) * saved, k = workers from it to the end.
    - {0, 1} x2, {2}, {3}: k = 4 for the first stage: 2*70 + ceil(4/2)*12 = 164 (then 2*20 + 2*2 = 44,
      2*10 + 1 = 21): 164.
    - four single layers: 2*40 + 4*8 = 112, 2*30 + 3*4 = 72, 44, 21: 112.
    - {0}, {1, 2, 3}: 2*40 + 2*8 = 96 and 2*60 + 1*7 = 127: 127.
    Guards against counting k from 1 or per stage, ignoring the replicas, or off-by-one and
    wrong-sign layer ranges of weights and saved bytes."""
    problem = _chain(
        [1.0] * 4,
        devices=4,
        params=[40.0, 30.0, 20.0, 10.0],
        saved=[8.0, 4.0, 2.0, 1.0],
        memory=MemoryModel("1f1b", None, extra_copies=1),
    )
    assert problem.peak_memory([(0, 1, 2), (2, 2, 1), (3, 3, 1)]) == 164.0
    assert problem.peak_memory([(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1)]) == 112.0
    assert problem.peak_memory([(0, 0, 1), (1, 3, 1)]) == 127.0


def test_layers_without_memory_fit_any_limit() -> None:
    """Layers of (1, 2, 1) s that neither hold weights nor save activations, 2 devices, bound 2 s.
    Greedy from the end: one worker takes {2} (the chain's 4 s exceed 2 s); two workers either put {1}
    in front of it (3 s for {0, 1} is too long) or replicate the whole chain, 4/2 = 2 s: exactly the
    bound. A 0.5 B limit must change nothing, and the plan needs 0 B. Guards against a peak memory
    starting above 0 and memory rows laid out overlapping when every row is 0."""
    limited = _chain([1.0, 2.0, 1.0], devices=2)
    assert limited.cover(2.0, 0.5) == {2: [(0, 2, 2)]}
    assert _chain([1.0, 2.0, 1.0], devices=2).cover(2.0, math.inf) == {2: [(0, 2, 2)]}
    assert limited.peak_memory([(0, 2, 2)]) == 0.0
    three = _chain([1.0, 2.0, 1.0], devices=3)
    # three workers: {0, 1} twice (3/2 s) in front of {2}
    assert three.cover(2.0, 0.5) == {2: [(0, 2, 2)], 3: [(0, 1, 2), (2, 2, 1)]}


def test_cover_of_a_straight_chain_by_hand() -> None:
    """Two layers of 1 s. One device holds both (2 s) within 2 s. Under 1 s, two devices split at the
    cut, which costs exactly 1 s and is allowed; a 1.5 s cut is not. One layer on three devices of a
    straight pipeline: only one worker is usable. Guards against ``<`` for a cut at the bound, the
    first worker count starting from the wrong table entry, and unreached worker counts taken as
    reached."""
    assert _chain([1.0, 1.0], devices=1, replicate=False).cover(2.0, math.inf) == {1: [(0, 1, 1)]}
    at_bound = _chain([1.0, 1.0], devices=2, replicate=False, cuts=[1.0])
    assert at_bound.cover(1.0, math.inf) == {2: [(0, 0, 1), (1, 1, 1)]}
    over = _chain([1.0, 1.0], devices=2, replicate=False, cuts=[1.5])
    assert over.cover(1.0, math.inf) == {}
    assert _chain([1.0], devices=3, replicate=False).cover(math.inf, math.inf) == {1: [(0, 0, 1)]}
    assert _chain([1.0], devices=3).cover(math.inf, math.inf) == {1: [(0, 0, 1)], 2: [(0, 0, 2)], 3: [(0, 0, 3)]}


def test_replication_makes_a_slow_layer_fit_the_bound() -> None:
    """Layers of (4, 1) s under a 2 s bound. One worker: {1} (the chain's 5 s is too long). Two: {0}
    alone is 4 s and {0, 1} twice 2.5 s, so the furthest reach is {1} twice. Three: {0} twice (4/2 =
    2 s, exactly the bound) in front of {1}. Four: {0} twice in front of the two-worker {1} twice. A
    straight pipeline never fits. Guards the replica range and the choice among candidates (an
    invalid candidate must never win a tie)."""
    assert _chain([4.0, 1.0], devices=4).cover(2.0, math.inf) == {
        3: [(0, 0, 2), (1, 1, 1)],
        4: [(0, 0, 2), (1, 1, 2)],
    }
    assert _chain([4.0, 1.0], devices=3, replicate=False).cover(2.0, math.inf) == {}


def test_weight_sync_can_keep_a_slow_layer_from_fitting() -> None:
    """As above, but layer 0 holds 80 B of weights on 8 B/s links: twice, the ring all-reduce takes
    2(2-1)/2 * 80 / 8 = 10 s, per replica 5 s > 2 s; three times 2(3-1)/3 * 80 / 8 = 40/3 s, per replica
    4.4 s; alone 4 s. So nothing fits on 3 devices. Guards against skipping the sync bound."""
    problem = _chain([4.0, 1.0], devices=3, params=[80.0, 0.0], network=Network(8.0))
    assert problem.cover(2.0, math.inf) == {}


def test_instant_layers_fit_a_zero_bound() -> None:
    """Two layers of 0 s on a free network fit a 0 s bound on one worker or replicated on two. Guards
    against treating a stage without all-reduce as syncing (a 0/0 allowance)."""
    assert _chain([0.0, 0.0], devices=2).cover(0.0, math.inf) == {1: [(0, 1, 1)], 2: [(0, 1, 2)]}


def test_best_prefers_the_fastest_then_the_most_workers() -> None:
    """Layers of (1, 1) s: the two-worker split (1 s) beats one worker (2 s). Layers of (2, 0) s: both
    take 2 s, and the plan with more workers wins the tie. Guards against picking by worker count
    alone or preferring fewer workers."""
    split = [(0, 0, 1), (1, 1, 1)]
    assert _chain([1.0, 1.0], devices=2).best({1: [(0, 1, 1)], 2: split}) == split
    assert _chain([2.0, 0.0], devices=2).best({1: [(0, 1, 1)], 2: split}) == split


def test_cover_under_a_memory_limit_with_many_memory_rows() -> None:
    """Weights (6, 1) B, saved (3, 9) B, 1F1B unbounded, no extra copy, up to 5 devices: a stage needs
    weights + ceil(k / r) * saved. The whole chain on r replicas (k = r, one in flight) needs
    7 + 12 = 19 B: at a 19 B limit every count of 1..5 workers fits as one replicated stage. At 10 B,
    {1} alone fits (1 + 9) but {0} always has another worker behind it, so at least 2 in flight:
    6 + 2*3 = 12 B; no plan. Every in-flight count 1..5 is a memory row here, and the last layer
    dominates the totals. Guards the spacing of the rows laid end to end (a row's end must not reach
    into the next row)."""
    memory = dict(params=[6.0, 1.0], saved=[3.0, 9.0], devices=5)
    assert _chain([1.0, 1.0], **memory).cover(math.inf, 10.0) == {}
    assert _chain([1.0, 1.0], **memory).cover(math.inf, 19.0) == {k: [(0, 1, k)] for k in range(1, 6)}


def _bisect_search(low: float, start: float, optimum: float) -> tuple[float, int]:
    """Bisect a continuum of plans: ``cover(x)`` offers a plan worth exactly ``x`` once ``x >= optimum``."""
    calls = []

    def cover(bound: float) -> dict[int, list[float]]:
        calls.append(bound)
        assert len(calls) <= 200, "the bisection does not end"
        return {1: [bound]} if bound >= optimum else {}

    plan = _bisect(low, [start], lambda plan: plan[0], cover, lambda found: found[1])
    return plan[0], len(calls)


def test_bisection_reaches_the_documented_precision_in_forty_steps() -> None:
    """Between 1 and 2 with the optimum at 1.5, each test halves the interval (a success's plan is
    worth the midpoint); the search may stop once the width is within 1e-12 of the upper end, at the
    latest when 2**-n <= 1.5e-12, n = 40. Guards against a stopping rule that never triggers (going on
    to the last bit) and against stopping short of the precision."""
    value, calls = _bisect_search(1.0, 2.0, 1.5)
    assert 1.5 <= value <= 1.5 / (1 - 1e-12)
    assert calls <= 40


@pytest.mark.parametrize(("low", "start"), [(0.0, 5e-324), (5e-324, 1e-323)])
def test_bisection_of_a_subnormal_optimum_ends(low: float, start: float) -> None:
    """With the optimum at the smallest subnormal floats, 1e-12 of it underflows to 0, so the
    precision test alone never stops; between 0 and 5e-324 the midpoint rounds to 0 (the low end),
    between 5e-324 and 1e-323 to 1e-323 (the high end). The search must end at once with the plan it
    was given. Guards against retrying a midpoint equal to either end (an endless loop) and against
    returning nothing."""
    assert _bisect_search(low, start, start) == (start, 0)


def _skewed(replicate: bool, limit: float) -> ChainProblem:
    return _chain(
        [1.0] * 4,
        devices=3,
        replicate=replicate,
        params=[5.0, 6.0, 4.0, 2.0],
        saved=[2.0, 0.0, 0.0, 0.0],
        memory=MemoryModel("2bw", None, extra_copies=0),
        memory_limit=limit,
    )


def _refusal(problem: ChainProblem) -> str:
    with pytest.raises(PlanningError) as refused:
        problem.solve()
    return str(refused.value).split(": ", 1)[1]


def test_a_straight_request_is_not_told_a_device_count_only_replication_reaches() -> None:
    """Weights (5, 6, 4, 2) B, saved (2, 0, 0, 0) B, 2BW (two weight versions), limit 15 B, straight
    pipeline on 3 devices. With P stages the first one holds layer 0 and keeps P in flight: alone it
    needs 2*5 + 2P B, 14 B only for P = 2, and then {1, 2, 3} needs 2*12 = 24 B; so no straight split
    on any count fits, although every layer alone with one micro-batch in flight would (layer 0: 12 B).
    The best 3-device plan {0}, {1}, {2, 3} needs 2*5 + 3*2 = 16 B. Guards against offering a count
    only replication reaches, and against blaming a layer that fits alone."""
    assert _refusal(_skewed(False, 15.0)) == (
        "the smallest limit that fits 3 device(s) is 16 B; no straight pipeline on any device count fits 15 B"
    )


def test_a_replicating_request_is_told_the_count_replication_reaches() -> None:
    """The same chain with replication allowed: no 3-device plan fits 15 B (replicating layer 0 on 2
    workers leaves one worker for 12 B of weights, 24 B with two versions), but 4 devices do: {0} on
    2 replicas keeps ⌈4/2⌉ = 2 in flight, 2*5 + 2*2 = 14 B; {1} keeps 2 and needs 12 B; {2, 3} 12 B.
    Guards against searching the hint's device counts without replication, or only up to the layer
    count's straight pipelines."""
    assert _refusal(_skewed(True, 15.0)) == (
        "the smallest limit that fits 3 device(s) is 16 B; 15 B fits on 4 devices with replicated stages"
    )


def test_a_replicating_search_names_how_far_it_looked() -> None:
    """Limit 13 B: layer 0 alone with one micro-batch in flight needs 12 B, but in front of any other
    stage it keeps at least 2 in flight (``⌈(r + later)/r⌉ >= 2``): 14 B; only one worker holding all
    layers (2*17 + 2 = 36 B) would keep one. No count fits; the search stops at max(4 layers, 4·3
    devices) = 12. Guards the search bound in the message."""
    assert _refusal(_skewed(True, 13.0)) == (
        "the smallest limit that fits 3 device(s) is 16 B; no plan on up to 12 devices fits 13 B"
    )

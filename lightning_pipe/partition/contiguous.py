"""Optimal contiguous partitioning of a chain, with stage replication and memory limits.

This solves the problem of PipeDream's dynamic program ``A(j, m)`` (Narayanan et al. 2019 §3.1;
Black, GPipe partitioning slides): minimise the slowest
stage ``max(A(i, m'), 2·C_i, T(i+1→j, m - m'))`` over contiguous stages with replication, plus the
Black GPipe memory filter, but with the memory of a stage depending on its place in the pipeline as
the schedule dictates (1F1B keeps ``min(P - s, m)`` activations on stage ``s``, GPipe ``m``), the
piece the Black GPipe slides list as missing.

Instead of the ``O(N²M²)`` table we binary-search the bottleneck ``B`` and decide each candidate
with a greedy cover built from the *end* of the chain (the end is where a stage's place in the
pipeline is known: ``k`` workers from it to the end fix its in-flight count):

    start[k] = the smallest first layer of a suffix coverable by exactly ``k`` workers.

A stage's feasibility (time ``≤ B``, all-reduce ``≤ B``, memory ``≤ limit``, the cut before it
``2·C ≤ B``) is monotone in its length, so extending the last placed stage as far as possible is
optimal, and ``start[k] = min_r first(start[k - r], r, k)`` is exact. Each test costs ``O(M²)``
binary searches on prefix sums (``O(M²·N)`` with a memory limit and replication), vectorised with
numpy; 40-odd tests reach a relative precision of 1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.units import format_bytes

__all__ = ["ChainProblem", "StageSpan"]

StageSpan = tuple[int, int, int]
"""``(first layer, last layer, replicas)`` of a contiguous stage, layers inclusive."""

_RELATIVE_PRECISION = 1e-12


def _bisect(
    low: float,
    plan: list[StageSpan],
    value: Callable[[list[StageSpan]], float],
    cover: Callable[[float], dict[int, list[StageSpan]]],
    best: Callable[[dict[int, list[StageSpan]]], list[StageSpan]],
) -> list[StageSpan]:
    """Binary search for the smallest ``value`` of a plan.

    ``cover(x)`` returns the plans whose value is ``<= x``; none exist at ``low``, and ``plan`` is
    feasible. After each success the upper end drops to the value the plan found really reaches.
    """
    high = value(plan)
    while high - low > _RELATIVE_PRECISION * high:
        middle = 0.5 * (low + high)
        if not low < middle < high:
            break
        found = cover(middle)
        if found:
            plan = best(found)
            high = min(middle, value(plan))
        else:
            low = middle
    return plan


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))


def _range_maxima(values: np.ndarray) -> np.ndarray:
    """A sparse table: row ``j`` holds at ``i`` the largest of ``values[i : i + 2**j]`` (0 where the
    range would run past the end), so the largest of any range is the larger of two entries."""
    rows = [values]
    while 2 ** len(rows) <= len(values):
        previous, half = rows[-1], 2 ** (len(rows) - 1)
        row = np.zeros_like(values)
        row[: len(values) - 2 * half + 1] = np.maximum(
            previous[: len(values) - 2 * half + 1], previous[half:][: len(values) - 2 * half + 1]
        )
        rows.append(row)
    return np.vstack(rows)


@dataclass
class ChainProblem:
    """One contiguous partitioning instance.

    Attributes:
        seconds: per-layer time being balanced (measured ``u_F + u_B``, or a proxy such as FLOPs).
        cut_seconds: ``2·C_i`` for each of the ``L - 1`` cuts.
        param_bytes, saved_bytes: per-layer parameter and saved-activation bytes.
        shared_bytes: of ``saved_bytes``, what each layer saves that the one before it saves too
            (``LayerCost.shared_saved_bytes``): a stage counts it once, for every layer but its first;
            zeros when not given.
        kept_bytes: per-layer gradients a split backward keeps (counted for stages after the first
            when ``memory.split_backward``); zeros when not given.
        backward_bytes: per-layer bytes a backward holds at its peak (``LayerCost.backward_bytes``):
            a stage holds its largest layer's :meth:`~lightning_pipe.cost.memory.MemoryModel.transient_bytes`;
            zeros when not given.
        accumulated_bytes: per-layer bytes a backward adding into a gradient holds for a moment
            (``LayerCost.accumulated_bytes``); ``param_bytes`` when not given.
        proxy: a per-layer quantity free of timing noise (FLOPs) that decides, with a tolerance, among
            the fastest plans of equal memory (:meth:`solve`); ``None``: no such choice.
        devices: workers available (at most this many are used).
        replicate: allow data-parallel replicas of a stage (PipeDream); else a straight pipeline.
        network: prices the all-reduce among replicas.
        memory: schedule-dependent memory model; ``memory_limit`` (bytes per worker) or ``None``.
        tolerance: a plan whose bottleneck is within this fraction of the minimum counts as a tie of
            the fastest (:meth:`solve`).
    """

    seconds: np.ndarray
    cut_seconds: np.ndarray
    param_bytes: np.ndarray
    saved_bytes: np.ndarray
    devices: int
    replicate: bool
    network: Network
    memory: MemoryModel
    memory_limit: float | None = None
    tolerance: float = 0.0
    kept_bytes: np.ndarray | None = None
    proxy: np.ndarray | None = None
    shared_bytes: np.ndarray | None = None
    backward_bytes: np.ndarray | None = None
    accumulated_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.memory.recompute:  # its memory falls with the first layer, which a run's input breaks
            raise PlanningError(
                "the contiguous partitioners plan without recomputation: evaluate a recomputing split with "
                "partition.evaluate (lightning_pipe.auto.search does)"
            )
        self.layers = len(self.seconds)
        self._time = _prefix(self.seconds)
        self._params = _prefix(self.param_bytes)
        shared = np.zeros(self.layers) if self.shared_bytes is None else np.asarray(self.shared_bytes, dtype=np.float64)
        # a stage's saved bytes S(a..e) = Q(a..e) + shared[a], Q the prefix of saved - shared
        self._saved = _prefix(np.asarray(self.saved_bytes, dtype=np.float64) - shared)
        self._shared = np.append(shared, 0.0)
        self._kept = _prefix(np.zeros(self.layers) if self.kept_bytes is None else self.kept_bytes)
        self._proxy = _prefix(np.zeros(self.layers) if self.proxy is None else self.proxy)
        self._factor_table = np.zeros(0)
        self._row_of: dict[tuple[float, float, float], int] = {}
        backward = np.zeros(self.layers) if self.backward_bytes is None else self.backward_bytes
        accumulated = self.param_bytes if self.accumulated_bytes is None else self.accumulated_bytes
        pairs = zip(accumulated, backward, strict=True)
        self._transient = np.array([self.memory.transient_bytes(p, b) for p, b in pairs], dtype=np.float64)
        self._largest = _range_maxima(self._transient)

    # -- evaluation -------------------------------------------------------------------------
    def stage_seconds(self, first: int, last: int, replicas: int) -> float:
        """PipeDream's ``T(first→last, replicas)``."""
        compute = self._time[last + 1] - self._time[first]
        sync = self.network.allreduce_seconds(self._params[last + 1] - self._params[first], replicas)
        return max(compute, sync) / replicas

    def bottleneck(self, spans: list[StageSpan]) -> float:
        """Slowest stage or cut of a plan."""
        stages = [self.stage_seconds(*span) for span in spans]
        cuts = [float(self.cut_seconds[last]) for _, last, _ in spans[:-1]]
        return max(stages + cuts)

    def proxy_bottleneck(self, spans: list[StageSpan]) -> float:
        """Largest per-replica ``proxy`` of a plan's stages."""
        return max((self._proxy[last + 1] - self._proxy[first]) / replicas for first, last, replicas in spans)

    def peak_memory(self, spans: list[StageSpan]) -> float:
        """Largest per-replica memory of a plan."""
        peak, downstream = 0.0, 0
        for first, last, replicas in reversed(spans):
            downstream += replicas
            stage = self.memory.stage_bytes(
                self._params[last + 1] - self._params[first],
                self._saved[last + 1] - self._saved[first] + self._shared[first],
                downstream,
                replicas,
                self._kept[last + 1] - self._kept[first],
                first=first == 0,
            )
            stage += float(np.max(self._transient[first : last + 1]))
            peak = max(peak, stage)
        return peak

    # -- decision procedure -------------------------------------------------------------------
    def cover(
        self, bound: float, memory_limit: float, devices: int | None = None, proxy_bound: float = math.inf
    ) -> dict[int, list[StageSpan]]:
        """Worker counts ``k <= devices`` whose greedy cover ends exactly at layer 0, with its plan.

        From the last layer back, each stage (of each replica count) reaches as far toward the front
        as taking at most ``bound`` seconds (cuts included) and ``memory_limit`` bytes per replica
        allows. The chain fits in at most ``devices`` workers exactly when the result is not empty;
        a count is not listed when fewer workers already cover the chain (the greedy never leaves a
        worker idle), so a tie-break between counts sees only those listed. ``proxy_bound`` also
        bounds each replica's share of ``proxy``.
        """
        devices = self.devices if devices is None else devices
        n = self.layers
        allowed = np.ones(n + 1, dtype=bool)
        allowed[1:n] = self.cut_seconds <= bound
        index = np.where(allowed, np.arange(n + 1), n + 1)
        next_allowed = np.minimum.accumulate(index[::-1])[::-1]
        start = np.full(devices + 1, -1, dtype=np.int64)
        choice = np.zeros(devices + 1, dtype=np.int64)
        start[0] = n
        for k in range(1, devices + 1):
            replicas = np.arange(1, k + 1) if self.replicate else np.ones(1, dtype=np.int64)
            ends = start[k - replicas]
            usable = ends > 0
            if not usable.any():
                continue
            ends, replicas = ends[usable], replicas[usable]
            first = self._first_within(ends, replicas, k, bound, memory_limit, proxy_bound)
            first = next_allowed[first]
            valid = first < ends
            if valid.any():
                best = int(np.argmin(np.where(valid, first, n + 1)))
                start[k], choice[k] = first[best], replicas[best]
        return {k: self._spans(start, choice, k) for k in range(1, devices + 1) if start[k] == 0}

    def _first_within(
        self, ends: np.ndarray, replicas: np.ndarray, k: int, bound: float, memory_limit: float, proxy_bound: float
    ) -> np.ndarray:
        """Smallest first layer of a stage ending before ``ends`` that meets time, sync, memory and
        the proxy's bound."""
        first = np.searchsorted(self._time, self._time[ends] - replicas * bound, side="left")
        if math.isfinite(proxy_bound):
            within = np.searchsorted(self._proxy, self._proxy[ends] - replicas * proxy_bound, side="left")
            first = np.maximum(first, within)
        factors = self._allreduce_factors(int(replicas.max()) + 1)[replicas]
        syncing = factors > 0
        if syncing.any():
            allowance = replicas[syncing] * bound / factors[syncing]
            limit = self._params[ends[syncing]] - allowance
            first[syncing] = np.maximum(first[syncing], np.searchsorted(self._params, limit, side="left"))
        if math.isfinite(memory_limit):
            within, whole = self._first_within_memory(ends, replicas, k, memory_limit)
            first = np.where((first == 0) & whole, 0, np.maximum(first, within))
        return np.minimum(first, self.layers)

    def _allreduce_factors(self, count: int) -> np.ndarray:
        if len(self._factor_table) < count:
            self._factor_table = np.array([self.network.allreduce_factor(r) for r in range(count)])
        return self._factor_table

    def _first_within_memory(
        self, ends: np.ndarray, replicas: np.ndarray, k: int, limit: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each ``(end, replicas)``: the smallest first layer ``a > 0`` with memory
        ``α·P(a..e) + β·S(a..e) + γ·K(a..e) <= limit``, and whether a stage from layer 0 fits (its
        ``γ`` is 0: its input takes no gradient). The stages that fit are thus those from that
        first layer on, and layer 0 when it fits: not one interval, so the caller combines them
        with its other bounds.

        ``(α, β, γ)`` depends on ``(k, r)`` only through the in-flight count, so there are few
        distinct rows ``C = α·prefix(P) + β·prefix(Q) + γ·prefix(K)`` (``Q``: saved less what a layer
        shares with the one before it); the memory of layers ``a .. e-1`` is ``C[e] - (C[a] -
        β·shared[a])``, and the rows ``C - β·shared`` (non-decreasing: what a layer shares with the
        next it saves itself) are laid end to end, each shifted above the previous one, so that one
        ``searchsorted`` answers every query.
        """
        rows = np.array([self._memory_row(k, int(r)) for r in replicas])
        width = self.layers + 1
        lowest = rows * self._row_shift + self._combined[rows, ends] - limit
        found = np.clip(np.searchsorted(self._laid_out, lowest, side="left") - rows * width, 0, self.layers)
        pairs = np.array([self.memory.coefficients(k, int(r)) for r in replicas])
        whole = pairs[:, 0] * self._params[ends] + pairs[:, 1] * self._saved[ends]
        if not self._transient.any():
            return found, whole <= limit
        whole = whole + self._largest_between(np.zeros_like(ends), ends) <= limit
        return self._first_with_largest(np.minimum(found, ends), ends, rows, limit), whole

    def _first_with_largest(self, found: np.ndarray, ends: np.ndarray, rows: np.ndarray, limit: float) -> np.ndarray:
        """From ``found`` (where the stage fits without it) on, the smallest first layer whose stage
        also fits with its largest layer's transient (``MemoryModel.transient_bytes``): the
        memory still falls as the first layer moves toward the end, so a bisection over every
        query at once (an empty stage, ``first == end``, fits)."""
        low, high = found.copy(), ends.copy()
        to_end = self._combined[rows, ends]
        while (open_ := low < high).any():
            middle = (low + high) // 2
            fits = to_end - self._lowered[rows, middle] + self._largest_between(middle, ends) <= limit
            high = np.where(open_ & fits, middle, high)
            low = np.where(open_ & ~fits, middle + 1, low)
        return low

    def _largest_between(self, firsts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The largest transient of layers ``firsts .. ends - 1`` (0 for an empty range), from
        the sparse table of :func:`_range_maxima`."""
        length = ends - firsts
        level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
        span = np.left_shift(1, level)
        last = np.maximum(ends - span, 0)
        largest = np.maximum(self._largest[level, np.minimum(firsts, self.layers - 1)], self._largest[level, last])
        return np.where(length > 0, largest, 0.0)

    def _memory_row(self, k: int, replicas: int) -> int:
        key = (*self.memory.coefficients(k, replicas), self.memory.kept_coefficient(k, first=False))
        row = self._row_of.get(key)
        if row is None:
            row = self._row_of[key] = len(self._row_of)
            combined = key[0] * self._params + key[1] * self._saved + key[2] * self._kept
            lowered = combined - key[1] * self._shared
            self._combined = np.vstack([self._combined, combined]) if row else combined[None, :]
            self._lowered = np.vstack([self._lowered, lowered]) if row else lowered[None, :]
            self._row_shift = 2.0 * float(self._combined[:, -1].max()) + 1.0
            self._laid_out = (self._lowered + self._row_shift * np.arange(row + 1)[:, None]).ravel()
        return row

    @staticmethod
    def _spans(start: np.ndarray, choice: np.ndarray, k: int) -> list[StageSpan]:
        spans = []
        while k > 0:
            replicas = int(choice[k])
            spans.append((int(start[k]), int(start[k - replicas]) - 1, replicas))
            k -= replicas
        return spans

    # -- optimisation -------------------------------------------------------------------------
    def best(self, plans: dict[int, list[StageSpan]]) -> list[StageSpan]:
        """The fastest of several feasible plans, then the one using the most workers."""
        return min(plans.items(), key=lambda item: (self.bottleneck(item[1]), -item[0]))[1]

    def solve(self) -> list[StageSpan]:
        """Minimum bottleneck, then minimum peak memory among the fastest plans: those within
        ``tolerance`` of the minimum bottleneck (near-ties of measured times decided by memory), then,
        with a tolerance and a ``proxy``, the smallest largest stage share of the proxy among those:
        measured times jitter, memory and FLOPs do not, so the choice among near-ties does not
        follow the jitter (Stable plans: the same model gets the same split)."""
        limit = math.inf if self.memory_limit is None else self.memory_limit
        plans = self.cover(math.inf, limit)
        if not plans:
            raise self.infeasible()
        plan = self.best(plans)
        low = float(self._time[-1]) / self.devices  # no plan beats the average load
        if 0 < low < self.bottleneck(plan) and (at_low := self.cover(low, limit)):
            plan = self.best(at_low)
        else:
            plan = _bisect(low, plan, self.bottleneck, lambda bound: self.cover(bound, limit), self.best)
        bound = self.bottleneck(plan) * (1 + self.tolerance)
        plan = self.least_memory(plan, bound)
        if self.proxy is None or not self.tolerance:
            return plan
        memory = self.peak_memory(plan) * (1 + 1e-12)
        return _bisect(
            0.0, plan, self.proxy_bottleneck, lambda most: self.cover(bound, memory, proxy_bound=most), self.best
        )

    def least_memory(self, plan: list[StageSpan], bound: float) -> list[StageSpan]:
        """Among plans with bottleneck ``<= bound``, one with the smallest peak memory."""
        return _bisect(0.0, plan, self.peak_memory, lambda limit: self.cover(bound, limit), self.best)

    # -- explaining infeasibility ---------------------------------------------------------------
    def infeasible(self) -> PlanningError:
        """Why no plan fits the memory limit, and which limit or device count would.

        The device-count hint searches up to ``layers`` workers for a straight pipeline (it has at most
        one stage per layer) and up to ``max(layers, 4·devices)`` with replication, where more replicas
        of a stage keep fewer micro-batches in flight per replica (``⌈k/r⌉``) and the count that fits
        can grow without bound.
        """
        limit = float(self.memory_limit)  # only a memory limit can make cover(inf) fail
        smallest = self.least_memory(self.best(self.cover(math.inf, math.inf)), math.inf)
        hint = f"the smallest limit that fits {self.devices} device(s) is {format_bytes(self.peak_memory(smallest))}"
        alone = max(range(self.layers), key=lambda layer: self.peak_memory([(layer, layer, 1)]))
        need = self.peak_memory([(alone, alone, 1)])  # the least any plan can give a layer: one in flight
        most = max(self.layers, 4 * self.devices) if self.replicate else self.layers
        counts = self.memory.counts  # a schedule's own, for this many stages: other counts keep others
        if need > limit:
            hint += f"; no device count fits {format_bytes(limit)}: layer {alone} alone needs {format_bytes(need)}"
        elif counts is not None:
            hint += (
                f"; more devices would keep fewer layers each (the schedule's in-flight counts here: {list(counts)})"
            )
        elif enough := self.cover(math.inf, limit, devices=most):
            count = min(enough)
            replicated = " with replicated stages" if any(r > 1 for _, _, r in enough[count]) else ""
            hint += f"; {format_bytes(limit)} fits on {count} devices{replicated}"
        elif self.replicate:
            hint += f"; no plan on up to {most} devices fits {format_bytes(limit)}"
        else:
            hint += f"; no straight pipeline on any device count fits {format_bytes(limit)}"
        micro = "" if self.memory.microbatches is None else f", {self.memory.microbatches} micro-batches"
        under = self.memory.schedule if counts is None else "the schedule's activations in flight"
        return PlanningError(
            f"no partition on {self.devices} device(s) fits the memory limit of {format_bytes(limit)} per device "
            f"under {under}{micro}: {hint}"
        )

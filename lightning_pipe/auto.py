"""The search behind ``schedule="auto"``: which pipeline to run.

:func:`search` takes a profiled chain of layers, the workers and the per-device memory limit, and
prices every configuration of a small space, contiguous split × schedule family × micro-batches ×
recomputation, with the pieces the strategy plans with: each split's memory by
:func:`~lightning_pipe.partition.evaluate` under the family's
:class:`~lightning_pipe.cost.memory.MemoryModel`, its time by
:func:`~lightning_pipe.schedule.simulate` of the family's schedule (as
:func:`~lightning_pipe.planning.predict` does). Candidates over the limit are dropped; the rest are
ranked by predicted seconds per mini-batch, and :func:`ranking_table` prints the best and why the
winner won. Nothing here runs a model; the strategy does not call it yet, nor re-ranks with the
costs measured in a run.

The assumptions, all of them the simulator's or stated here:

- **A fixed mini-batch** split into ``m`` micro-batches. The profile prices one micro-batch of the
  mini-batch split into ``profile_microbatches`` (1: the whole mini-batch); ``m`` micro-batches are
  priced as the profile scaled by ``profile_microbatches / m`` (:meth:`ChainCosts.scaled
  <lightning_pipe.cost.records.ChainCosts.scaled>`: times and activations grow with the rows,
  parameters do not), plus ``action_seconds`` per forward and per backward, the fixed cost of a
  micro-batch that linear scaling leaves out (0 unless given). Every candidate computes the same
  samples per step, so their step times compare fairly whatever their ``m``.
- **Recomputation** (GPipe's re-materialisation, Huang et al. 2019, §2.3): a stage's backward runs
  its forward again first (backward + forward seconds) and keeps only its input per micro-batch in
  flight (``MemoryModel.recompute``); every stage or none.
- **Update rules**: the flushing families (GPipe; 1F1B, Narayanan et al. 2021's PipeDream-Flush;
  zero bubble's ZB-H1, Qi et al. 2024) run ``sync``; the non-flushing ones delay weights (PipeDream's
  stashing, Narayanan et al. 2019 §3.3; PipeDream-2BW, Narayanan et al. 2021 §3; CDP, Fournier &
  Oyallon 2024 §3) and are searched only with ``allow_delayed=True``: the search never changes the
  update rule silently. A non-flushing family's time is its steady step (steps overlap).
- **Splits**: every contiguous split into one stage per worker when there are at most ``max_splits``
  (the ranking is then exact over the space, which the tests check by brute force); otherwise the
  ``partitioner``'s split and every split one cut away from it (a heuristic). Stage replication
  (PipeDream §3.1) and interleaved stages are not searched yet: each candidate has one worker per stage.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from lightning_pipe.cost.memory import EXTRA_COPIES, MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError, check_positive, check_whole
from lightning_pipe.partition import Plan, PlanRequest, evaluate, partition
from lightning_pipe.planning import PREDICTED_STEPS, every_worker_a_stage, memory_model
from lightning_pipe.schedule import (
    NON_FLUSHING_FAMILIES,
    StageCosts,
    build_schedule,
    rules_of,
    simulate,
)
from lightning_pipe.schedule.graph import Graph
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.util.units import format_bytes, format_seconds

__all__ = ["DELAYED_FAMILIES", "FLUSHING_FAMILIES", "STEPS", "Candidate", "ranking_table", "search"]

FLUSHING_FAMILIES: tuple[str, ...] = ("gpipe", "1f1b", "zb_h1")
"""The families searched whatever the update rule allows: they flush every step (rule ``sync``)."""
DELAYED_FAMILIES: tuple[str, ...] = NON_FLUSHING_FAMILIES
"""The families searched only with ``allow_delayed=True``: their updates use delayed weights."""
STEPS = PREDICTED_STEPS
"""Steps simulated per candidate, as many as the strategy's prediction
(:data:`~lightning_pipe.planning.PREDICTED_STEPS`)."""
DEFAULT_MAX_SPLITS = 200
"""Most contiguous splits enumerated one by one; beyond, the partitioner's and its neighbours'."""


@dataclass(frozen=True)
class Candidate:
    """One configuration of the pipeline and what the simulator and the memory model predict for it.

    Attributes:
        family: the schedule family (a key of :data:`~lightning_pipe.schedule.FAMILIES`), run with its
            own (first) update rule.
        microbatches: ``m``: the fixed mini-batch split into ``m`` micro-batches.
        recompute: every stage recomputes its forward in its backward (Huang et al. 2019, §2.3).
        bounds: each stage's first and last layer; one stage per worker.
        replicas: workers per stage (all 1: replication, PipeDream §3.1, is not searched yet).
        step_seconds: predicted seconds per mini-batch (the steady step of :data:`STEPS` simulated
            steps), the ranking's key: every candidate computes the same mini-batch.
        bubble_fraction: idle time / (workers × makespan) of the simulated steps.
        memory_bytes: each worker's memory by the memory model (one stage each).
        memory_limit: the per-device limit it was checked against (``None``: none).
        why: its place in the ranking, in a few words.
        plan: the evaluated plan (scaled to ``m``'s micro-batches), for building it.
    """

    family: str
    microbatches: int
    recompute: bool
    bounds: tuple[tuple[int, int], ...]
    replicas: tuple[int, ...]
    step_seconds: float
    bubble_fraction: float
    memory_bytes: tuple[float, ...]
    memory_limit: float | None = None
    why: str = ""
    plan: Plan | None = field(default=None, compare=False, repr=False)

    @property
    def peak_memory_bytes(self) -> float:
        """The most memory any worker needs."""
        return max(self.memory_bytes)

    @property
    def rule(self) -> str:
        """The update rule it runs: its family's own."""
        return rules_of(self.family)[0]

    @property
    def label(self) -> str:
        """``1f1b m=8`` or ``gpipe m=4 recompute``."""
        return f"{self.family} m={self.microbatches}" + (" recompute" if self.recompute else "")

    def seconds_per_sample(self, batch_size: int) -> float:
        """Predicted seconds per sample of a ``batch_size``-row mini-batch."""
        check_whole("batch_size", batch_size, 1)
        return self.step_seconds / batch_size

    def schedule_options(self) -> ScheduleOptions:
        """The schedule it runs, as the strategy takes it."""
        return ScheduleOptions(self.family, self.microbatches)


def _families(families: Iterable[str] | None, allow_delayed: bool) -> tuple[str, ...]:
    """The families searched: the flushing ones, and the delayed ones when allowed; a family asked
    for by name and not allowed is refused, not dropped."""
    if families is None:
        return FLUSHING_FAMILIES + (DELAYED_FAMILIES if allow_delayed else ())
    chosen = tuple(dict.fromkeys(families))
    searched = FLUSHING_FAMILIES + DELAYED_FAMILIES
    unknown = [name for name in chosen if name not in searched]
    if unknown or not chosen:
        raise PlanningError(f"the search prices {', '.join(searched)}; got {list(chosen)}")
    delayed = [name for name in chosen if name in DELAYED_FAMILIES]
    if delayed and not allow_delayed:
        raise PlanningError(
            f"{', '.join(delayed)} update with delayed weights, which the search never chooses without leave: "
            "pass allow_delayed=True (an update rule that allows them), or leave them out"
        )
    return chosen


def _groups(cuts: Sequence[int], layers: int) -> list[list[int]]:
    """Stage layer lists of the split starting new stages at ``cuts``."""
    edges = [0, *cuts, layers]
    return [list(range(a, b)) for a, b in itertools.pairwise(edges)]


def _all_cuts(layers: int, workers: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(1, layers), workers - 1))


def _near_cuts(
    costs: ChainCosts, workers: int, memory: MemoryModel, network: Network, partitioner: str
) -> list[tuple[int, ...]]:
    """The ``partitioner``'s straight split (no memory limit, so that the splits tried do not depend on
    it) cut to one stage per worker, and every split one cut away from it."""
    request = PlanRequest(
        costs, devices=workers, memory=replace(memory, recompute=False), network=network, straight=True
    )
    plan = partition(request, partitioner)
    if not plan.contiguous:
        raise PlanningError(f"the search splits layers contiguously; the {partitioner} partitioner does not")
    if len(plan.stages) < workers:
        plan = every_worker_a_stage(request, plan, costs.column("seconds"))
    seed = tuple(stage.layers[0] for stage in plan.stages[1:])
    found = {seed}
    for index, step in itertools.product(range(len(seed)), (-1, 1)):
        moved = (*seed[:index], seed[index] + step, *seed[index + 1 :])
        if all(a < b for a, b in itertools.pairwise((0, *moved, len(costs)))):
            found.add(moved)
    return sorted(found)


def _graph(family: str, workers: int, microbatches: int) -> Graph | None:
    """The validated schedule of ``family`` on ``workers`` stages; ``None`` where it cannot run ``m``."""
    try:
        return build_schedule(family, workers, microbatches, STEPS)
    except PlanningError:
        return None


def _stage_costs(plan: Plan, recompute: bool, action_seconds: float, contention: float) -> StageCosts:
    """The plan's per-stage costs (as :func:`~lightning_pipe.planning.predict` takes them), with the
    fixed cost per action and, recomputing, the forward again in the backward."""
    costs = StageCosts.from_plan(plan.to_dict())
    forward = [f + action_seconds for f in costs.forward]
    backward = [b + action_seconds + (f if recompute else 0.0) for f, b in zip(forward, costs.backward, strict=True)]
    return replace(costs, forward=forward, backward=backward, contention=contention)


def search(
    costs: ChainCosts,
    workers: int,
    *,
    memory_limit: float | None = None,
    allow_delayed: bool = False,
    microbatches: Sequence[int] = (2, 4, 8),
    recompute: Sequence[bool] = (False, True),
    families: Iterable[str] | None = None,
    partitioner: str = "time",
    profile_microbatches: int = 1,
    action_seconds: float = 0.0,
    extra_copies: float = EXTRA_COPIES["momentum"],
    network: Network | None = None,
    contention: float = 1.0,
    max_splits: int = DEFAULT_MAX_SPLITS,
) -> list[Candidate]:
    """Every configuration that fits, ranked best first (module docstring).

    Args:
        costs: the profile: one micro-batch of the mini-batch split into ``profile_microbatches``.
        workers: devices of one pipeline, one stage each.
        memory_limit: bytes per device (``None``: no limit).
        allow_delayed: also search the non-flushing families (delayed weights).
        microbatches, recompute, families: the values searched (``families``: default the flushing
            ones, and the delayed ones when allowed).
        partitioner: the split tried when there are more than ``max_splits`` (with its neighbours).
        action_seconds: fixed seconds per forward and per backward of a micro-batch.
        extra_copies, network, contention: the memory model's optimizer copies, the network of
            :func:`~lightning_pipe.partition.evaluate` and the simulator's contention.

    Raises:
        PlanningError: when nothing fits ``memory_limit``, naming the smallest limit that would
            (``memory_limit=<bytes>``), or when no family can run the micro-batch counts given.
    """
    check_whole("workers", workers, 1)
    check_whole("profile_microbatches", profile_microbatches, 1)
    check_positive("memory_limit", memory_limit, "bytes", optional=True)
    if not math.isfinite(action_seconds) or action_seconds < 0:
        raise PlanningError(f"action_seconds must be a finite number >= 0, got {action_seconds!r}")
    if workers > len(costs):
        raise PlanningError(f"{workers} workers but {len(costs)} layers: a stage holds at least one layer")
    chosen = _families(families, allow_delayed)
    network = network or Network()
    every = _all_cuts(len(costs), workers) if math.comb(len(costs) - 1, workers - 1) <= max_splits else None
    found: list[Candidate] = []
    smallest = math.inf
    for m in dict.fromkeys(microbatches):
        check_whole("every microbatches entry", m, 1)
        scaled = costs.scaled(profile_microbatches / m)
        for family in chosen:
            graph = _graph(family, workers, m)
            if graph is None:
                continue
            for again in dict.fromkeys(recompute):
                memory = memory_model(family, m, extra_copies, recompute=bool(again))
                cuts = every if every is not None else _near_cuts(scaled, workers, memory, network, partitioner)
                for cut in cuts:
                    plan = evaluate(
                        scaled,
                        _groups(cut, len(costs)),
                        partitioner="auto",
                        devices=workers,
                        network=network,
                        memory=memory,
                        memory_limit=memory_limit,
                    )
                    smallest = min(smallest, plan.peak_memory_bytes)
                    if memory_limit is not None and plan.peak_memory_bytes > memory_limit:
                        continue
                    simulation = simulate(
                        graph.schedule, _stage_costs(plan, bool(again), action_seconds, contention), graph, True
                    )
                    found.append(
                        Candidate(
                            family=family,
                            microbatches=m,
                            recompute=bool(again),
                            bounds=tuple((s.layers[0], s.layers[-1]) for s in plan.stages),
                            replicas=tuple(s.replicas for s in plan.stages),
                            step_seconds=simulation.steady_step,
                            bubble_fraction=simulation.bubble_fraction,
                            memory_bytes=tuple(s.memory_bytes for s in plan.stages),
                            memory_limit=memory_limit,
                            plan=plan,
                        )
                    )
    if not found:
        if math.isinf(smallest):
            raise PlanningError(
                f"none of {', '.join(chosen)} runs {workers} stages with {list(microbatches)} micro-batches"
            )
        need = math.ceil(smallest)
        raise PlanningError(
            f"no configuration of {', '.join(chosen)} with {list(microbatches)} micro-batches fits "
            f"{format_bytes(memory_limit)} per device; the smallest limit that fits is {format_bytes(need)} "
            f"(memory_limit={need})"
        )
    order = {family: index for index, family in enumerate(chosen)}
    found.sort(key=lambda c: (c.step_seconds, c.peak_memory_bytes, order[c.family], c.microbatches, c.recompute))
    return [replace(c, why=_why(c, found)) for c in found]


def _faster(best: Candidate, other: Candidate) -> str:
    """``12% less time per step than gpipe m=8``."""
    saved = 1 - best.step_seconds / other.step_seconds if other.step_seconds > 0 else 0.0
    return f"{saved:.0%} less time per step than {other.label}"


def _why(candidate: Candidate, ranked: Sequence[Candidate]) -> str:
    """Its place in ``ranked``: the winner against the best other configuration, any other against
    the winner; and its memory against the limit."""
    winner = ranked[0]
    fits = format_bytes(candidate.peak_memory_bytes) + (
        "" if candidate.memory_limit is None else f" of {format_bytes(candidate.memory_limit)}"
    )
    if candidate is not winner:
        slower = candidate.step_seconds / winner.step_seconds - 1 if winner.step_seconds > 0 else 0.0
        return f"{slower:.0%} slower than {winner.label}; peak {fits}"
    other = next((c for c in ranked if c.label != winner.label), None)
    if other is None:
        return f"the only configuration; peak {fits}"
    return f"{_faster(winner, other)} (bubble {winner.bubble_fraction:.0%} vs {other.bubble_fraction:.0%}), fits {fits}"


def ranking_table(candidates: Sequence[Candidate], top: int = 5) -> str:
    """The ``top`` candidates (predicted step time, bubble, peak memory per device, split) and one
    line saying why the winner won."""
    if not candidates:
        return "no candidate"
    rows = [
        "| # | schedule | m | recompute | stages (layers) | step | bubble | peak memory/device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, c in enumerate(candidates[:top], 1):
        stages = ", ".join(f"{a}-{b}" for a, b in c.bounds)
        rows.append(
            f"| {rank} | {c.family} | {c.microbatches} | {'yes' if c.recompute else 'no'} | {stages} | "
            f"{format_seconds(c.step_seconds)} | {c.bubble_fraction:.0%} | {format_bytes(c.peak_memory_bytes)} |"
        )
    rows.append(f"{candidates[0].label} wins: {candidates[0].why}")
    return "\n".join(rows)

"""The search behind ``schedule="auto"``: which pipeline to run.

:func:`search` takes a profiled chain of layers, the workers of one pipeline and the per-device
memory limit, and prices every configuration of a space — split × schedule family (with its update
rule) × micro-batches × per-stage recomputation × stage replication and data-parallel degree — with
the pieces the strategy plans with: each stage's memory by :func:`~lightning_pipe.partition.evaluate`
under the family's :func:`~lightning_pipe.planning.memory_model` (the activations its schedule
keeps in flight), a worker's the weights of the stages it computes in the family's schedule and the
activations, gradients and transients its actions hold at their peak
(:class:`~lightning_pipe.worker_memory.WorkerMemory`: an interleaved worker's two stages, or a
replica's whole model, do not hold their peaks at once);
its time by :func:`~lightning_pipe.planning.predict`, the
strategy's own prediction. Candidates over the limit are dropped; the rest are ranked by predicted
seconds per mini-batch, and :func:`ranking_table` prints the best and why the winner won.

The space and its assumptions, all of them the simulator's or stated here:

- **A fixed mini-batch** split into ``m`` micro-batches. The profile prices one micro-batch of the
  mini-batch split into ``profile_microbatches`` (1: the whole mini-batch); ``m`` micro-batches are
  priced as the profile scaled by ``profile_microbatches / m`` (:meth:`ChainCosts.scaled
  <lightning_pipe.cost.records.ChainCosts.scaled>`: times and activations grow with the rows,
  parameters do not); given a second profile on a smaller micro-batch (``small``), each layer's
  times follow the line through the two in the rows instead, which keeps what a layer costs
  whatever its rows (small micro-batches are dominated by it on a CPU); each action at ``scale`` × its
  profile plus ``action_seconds`` (the rate and the runtime's own time per action a run measured:
  :class:`~lightning_pipe.cost.calibrated.Calibration`), and each stage's optimizer update priced
  from its parameters (``update``: :class:`~lightning_pipe.cost.update_rate.UpdatePrices`). Every candidate computes the
  same samples per step, so their step times compare fairly whatever their ``m``, and none changes
  the global batch.
- **Families and rules** (:func:`searched_families`): the flushing families run ``sync`` — GPipe
  (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021), ZB-H1 (Qi et al. 2024), the
  interleaved 1F1B of Megatron-LM (Narayanan et al. 2021 §2.2, two stages per worker), PipeDream's
  1F1B-RR with the stages its dynamic program replicates (Narayanan et al. 2019 §3.1), and Rahimi's
  ``ddp`` (each worker the whole model on its micro-batches: the data-parallel degree, Rahimi 2025
  §3). The non-flushing ones delay weights (PipeDream's stashing, Narayanan et al. 2019 §3.3;
  PipeDream-2BW, Narayanan et al. 2021 §3; CDP, Fournier & Oyallon 2024 §3) and are searched only
  when the update rule allows it: the search never changes the update rule silently. A non-flushing
  family's time is its steady step (steps overlap).
- **Recomputation** (GPipe's re-materialisation, Huang et al. 2019, §2.3): a recomputing stage's
  backward runs its forward again first and keeps only its input per micro-batch in flight
  (``MemoryModel.recompute``). ``recompute=None`` chooses per stage: none recomputes when every
  worker fits; else every assignment of recomputation to the stages of the workers over the limit
  is priced (at most :data:`MAX_RECOMPUTED` of them, beyond which those workers recompute all their
  stages), and those that fit are ranked with the rest. A worker's peak is not a sum over its stages
  (their activations, gradients and transients peak at different times:
  :class:`~lightning_pipe.worker_memory.WorkerMemory`), so recomputing fewer of its stages can fit
  where it would not with its stages apart, and costs less time (the tests check the ranking against
  every assignment).
- **Splits**: every contiguous split into the family's stage count when there are at most
  ``max_splits`` (the ranking is then exact over the space, which the tests check by brute force);
  otherwise the ``partitioner``'s split and every split one cut away from it (a heuristic). ``ddp``
  runs the partitioner's split (every worker computes every stage: the split does not change its
  time), ``1f1b_rr`` PipeDream's replicated plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.memory import EXTRA_COPIES
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.cost.update_rate import UpdatePrices
from lightning_pipe.errors import PlanningError, check_positive, check_whole
from lightning_pipe.partition import Plan, PlanRequest, evaluate, partition
from lightning_pipe.planning import (
    PREDICTED_STEPS,
    StagePlan,
    every_worker_a_stage,
    in_flight_counts,
    memory_model,
    predict,
    schedule_of,
)
from lightning_pipe.schedule import RULES, rules_of
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.util.units import format_bytes, format_seconds
from lightning_pipe.worker_memory import WorkerMemory

__all__ = [
    "ANY_RULE",
    "DELAYED_FAMILIES",
    "FLUSHING_FAMILIES",
    "STEPS",
    "Candidate",
    "microbatch_costs",
    "ranking_table",
    "search",
    "searched_families",
]

FLUSHING_FAMILIES: tuple[str, ...] = ("gpipe", "1f1b", "zb_h1", "interleaved", "1f1b_rr", "ddp")
"""The families searched whatever the update rule allows: they flush every step (rule ``sync``)."""
DELAYED_FAMILIES: tuple[str, ...] = ("2bw", "cdp", "pipedream")
"""The families searched only when the rule allows delayed weights (:data:`NON_FLUSHING_FAMILIES
<lightning_pipe.schedule.NON_FLUSHING_FAMILIES>`), in the order ties go: 2BW and CDP keep two weight
versions, PipeDream's stashing one per micro-batch in flight, whose copying the simulator does not
price (on torchvision's ResNet-18 it ran 0.84x as fast as 2BW at the same predicted step,
``bench/auto_plan.py``)."""
ANY_RULE = "delayed"
"""``rule=`` of ``schedule="auto"`` allowing every family, each with its own update rule."""
STEPS = PREDICTED_STEPS
"""Steps simulated per candidate, as many as the strategy's prediction
(:data:`~lightning_pipe.planning.PREDICTED_STEPS`)."""
DEFAULT_MAX_SPLITS = 200
"""Most contiguous splits enumerated one by one; beyond, the partitioner's and its neighbours'."""
MAX_RECOMPUTED = 6
"""The most stages whose recomputation ``recompute=None`` chooses one by one (2**6 assignments)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration of the pipeline and what the simulator and the memory model predict for it.

    Attributes:
        schedule: the family, its micro-batches ``m`` and update rule, on the search's workers.
        recompute: per stage, whether it recomputes its forward in the backward.
        stage_plan: the stages' layers (and replicas, for ``1f1b_rr``) with the plan evaluated on
            ``m``'s micro-batches and that profile: what the strategy runs.
        step_seconds: predicted seconds per mini-batch (the steady step of :data:`STEPS` simulated
            steps), the ranking's key: every candidate computes the same mini-batch.
        bubble_fraction: idle time / (workers × makespan) of the simulated steps.
        busiest_seconds: the busiest worker's seconds of actions per step.
        memory_bytes: each worker's memory by the memory model (the stages it computes).
        memory_limit: the per-device limit it was checked against (``None``: none).
        why: its place in the ranking, in a few words.
    """

    schedule: ScheduleOptions
    recompute: tuple[bool, ...]
    stage_plan: StagePlan = field(repr=False)
    step_seconds: float
    bubble_fraction: float
    busiest_seconds: float
    memory_bytes: tuple[float, ...]
    memory_limit: float | None = None
    why: str = ""

    @property
    def family(self) -> str:
        return self.schedule.family

    @property
    def microbatches(self) -> int:
        assert self.schedule.microbatches is not None
        return self.schedule.microbatches

    @property
    def flushes(self) -> bool:
        """Whether its steps end with the pipeline empty (every family but the delayed ones)."""
        return self.family not in DELAYED_FAMILIES

    @property
    def rule(self) -> str:
        """The update rule it runs."""
        return self.schedule.rule or rules_of(self.family)[0]

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Each stage's first and last layer."""
        return self.stage_plan.bounds

    @property
    def replicas(self) -> tuple[int, ...]:
        """Workers per stage (1 but for ``1f1b_rr``)."""
        return self.stage_plan.replicas or (1,) * len(self.bounds)

    @property
    def plan(self) -> Plan:
        assert self.stage_plan.plan is not None
        return self.stage_plan.plan

    @property
    def peak_memory_bytes(self) -> float:
        """The most memory any worker needs."""
        return max(self.memory_bytes)

    @property
    def recomputed(self) -> str:
        """``no``, ``all`` or the recomputing stages (``1, 3``)."""
        if not any(self.recompute):
            return "no"
        if all(self.recompute):
            return "all"
        return ", ".join(str(s) for s, again in enumerate(self.recompute) if again)

    @property
    def label(self) -> str:
        """``1f1b m=8``, ``2bw (stash) m=4`` or ``gpipe m=4 recompute all``."""
        rule = "" if self.rule == rules_of(self.family)[0] else f" ({self.rule})"
        again = "" if self.recomputed == "no" else f" recompute {self.recomputed}"
        return f"{self.family}{rule} m={self.microbatches}{again}"


def searched_families(
    rule: str | None = None, families: Iterable[str] | None = None
) -> tuple[tuple[str, str | None], ...]:
    """The ``(family, rule)`` pairs ``rule`` allows (``None`` for a family's own rule): ``None`` or
    ``sync``, the flushing families; :data:`ANY_RULE`, every family with its own rule; a delayed rule
    (``2bw``, ``stash``, ...), the flushing families and the delayed ones running it. ``families``
    narrows them; one asked for by name and not allowed is refused, not dropped."""
    if rule is not None and rule != ANY_RULE and rule not in RULES:
        raise PlanningError(f"rule={rule!r} is no update rule: use one of {', '.join(RULES)}, or {ANY_RULE!r}")
    allowed: list[tuple[str, str | None]] = [(family, None) for family in FLUSHING_FAMILIES]
    if rule == ANY_RULE:
        allowed += [(family, None) for family in DELAYED_FAMILIES]
    elif rule not in (None, "sync"):
        allowed += [(family, rule) for family in DELAYED_FAMILIES if rule in rules_of(family)]
    if families is None:
        return tuple(allowed)
    chosen = tuple(dict.fromkeys(families))
    searched = FLUSHING_FAMILIES + DELAYED_FAMILIES
    unknown = [name for name in chosen if name not in searched]
    if unknown or not chosen:
        raise PlanningError(f"the search prices {', '.join(searched)}; got {list(chosen)}")
    refused = [name for name in chosen if name not in {family for family, _ in allowed}]
    if refused:
        raise PlanningError(
            f"{', '.join(refused)} update with delayed weights, which rule={rule!r} does not allow and the search "
            f"never chooses without leave: give rule={ANY_RULE!r} (or a rule they run), or leave them out"
        )
    return tuple(pair for pair in allowed if pair[0] in chosen)


def _groups(cuts: Sequence[int], layers: int) -> list[list[int]]:
    """Stage layer lists of the split starting new stages at ``cuts``."""
    edges = [0, *cuts, layers]
    return [list(range(a, b)) for a, b in itertools.pairwise(edges)]


def _seed(costs: ChainCosts, stages: int, network: Network, partitioner: str) -> tuple[int, ...]:
    """The cuts of the ``partitioner``'s straight split into ``stages`` stages (no memory limit, so
    that the splits tried do not depend on it)."""
    request = PlanRequest(costs, devices=stages, network=network, straight=True)
    plan = partition(request, partitioner)
    if not plan.contiguous:
        raise PlanningError(f"the search splits layers contiguously; the {partitioner} partitioner does not")
    if len(plan.stages) < stages:
        plan = every_worker_a_stage(request, plan, costs.column("seconds"))
    return tuple(stage.layers[0] for stage in plan.stages[1:])


def _splits(
    costs: ChainCosts, family: str, stages: int, network: Network, partitioner: str, max_splits: int
) -> list[tuple[list[list[int]], tuple[int, ...] | None]]:
    """The splits searched for ``family``: ``(stage layer lists, replicas or None)``."""
    layers = len(costs)
    if family == "1f1b_rr":  # PipeDream's dynamic program decides the replication
        plan = partition(PlanRequest(costs, devices=stages, network=network, straight=False), "pipedream")
        replicas = tuple(stage.replicas for stage in plan.stages)
        if max(replicas) == 1 or sum(replicas) != stages:  # 1f1b's split, or workers left idle
            return []
        return [([list(stage.layers) for stage in plan.stages], replicas)]
    if stages > layers:
        return []
    every = math.comb(layers - 1, stages - 1) <= max_splits
    if every and family != "ddp":
        return [(_groups(cut, layers), None) for cut in itertools.combinations(range(1, layers), stages - 1)]
    seed = _seed(costs, stages, network, partitioner)
    if family == "ddp":  # every worker computes every stage
        return [(_groups(seed, layers), None)]
    found = {seed}
    for index, step in itertools.product(range(len(seed)), (-1, 1)):
        moved = (*seed[:index], seed[index] + step, *seed[index + 1 :])
        if all(a < b for a, b in itertools.pairwise((0, *moved, layers))):
            found.add(moved)
    return [(_groups(cut, layers), None) for cut in sorted(found)]


def microbatch_costs(costs: ChainCosts, parts: float, small: tuple[ChainCosts, float] | None, m: int) -> ChainCosts:
    """The profile of one of ``m`` micro-batches of the mini-batch: ``costs`` (one of ``parts``)
    scaled; with ``small`` (the same layers profiled on one of ``small_parts``), each layer's times
    follow the line through both profiles in the rows, so that what a layer costs whatever its rows
    (the call, the kernel launches) is not scaled away."""
    scaled = costs.scaled(parts / m)
    if small is None:
        return scaled
    few, few_parts = small
    if len(few) != len(costs):
        raise PlanningError(f"the second profile has {len(few)} layers, the first {len(costs)}")
    x, x_small, x_large = 1 / m, 1 / few_parts, 1 / parts

    def line(large: float, little: float) -> float:
        return max(little + (large - little) * (x - x_small) / (x_large - x_small), 0.0)

    layers = tuple(
        replace(
            layer,
            forward_seconds=line(big.forward_seconds, tiny.forward_seconds),
            backward_seconds=line(big.backward_seconds, tiny.backward_seconds),
        )
        for layer, big, tiny in zip(scaled.layers, costs.layers, few.layers, strict=True)
    )
    return replace(scaled, layers=layers)


def _recomputing(
    held: WorkerMemory, needs: Sequence[float], limit: float | None, recompute: bool | None
) -> list[tuple[bool, ...]]:
    """The assignments of recomputation to price: all stages or none as asked; with ``None``, none,
    and every choice among the stages of the workers whose ``needs`` without it are over ``limit``
    (where more than :data:`MAX_RECOMPUTED`, all of them)."""
    stages = len(held.saved)
    if recompute is not None:
        return [(recompute,) * stages]
    over = [w for w, need in enumerate(needs) if limit is not None and need > limit]
    chosen = [s for s in range(stages) if any(s in held.owned[w] for w in over)]
    if len(chosen) > MAX_RECOMPUTED:
        return [tuple(s in chosen for s in range(stages))]
    return [
        tuple(s in subset for s in range(stages))
        for size in range(len(chosen) + 1)
        for subset in itertools.combinations(chosen, size)
    ]


def _mixed(plain: Plan, again: Plan, recompute: tuple[bool, ...]) -> Plan:
    """``plain`` with the recomputing stages' memory taken from ``again`` (the same split, recomputing)."""
    if not any(recompute):
        return plain
    if all(recompute):
        return again
    stages = tuple(a if r else p for p, a, r in zip(plain.stages, again.stages, recompute, strict=True))
    note = "stages " + ", ".join(str(s) for s, r in enumerate(recompute) if r) + " recompute their forward"
    return replace(plain, stages=stages, notes=(*plain.notes, note))


def search(
    costs: ChainCosts,
    workers: int,
    *,
    memory_limit: float | None = None,
    rule: str | None = None,
    families: Iterable[str] | None = None,
    microbatches: Sequence[int] = (2, 4, 8),
    recompute: bool | None = None,
    partitioner: str = "time",
    profile_microbatches: float = 1,
    small: tuple[ChainCosts, float] | None = None,
    action_seconds: float = 0.0,
    scale: float = 1.0,
    calibrations: Callable[[str, int], Calibration | None] | None = None,
    update: UpdatePrices | None = None,
    extra_copies: float = EXTRA_COPIES["momentum"],
    network: Network | None = None,
    contention: float = 1.0,
    reduce_overlap: float = 1.0,
    max_splits: int = DEFAULT_MAX_SPLITS,
    names: Sequence[str] | None = None,
    base: ScheduleOptions | None = None,
) -> list[Candidate]:
    """Every configuration that fits, ranked best first (module docstring).

    Args:
        costs: the profile: one micro-batch of the mini-batch split into ``profile_microbatches``.
        small: the same layers profiled on a smaller micro-batch, and its count per mini-batch: the
            layers' times are then a line in the rows through both profiles (module docstring).
        workers: devices of one pipeline.
        memory_limit: bytes per device (``None``: no limit).
        rule: the update rules allowed (:func:`searched_families`); ``families`` narrows the families.
        microbatches: the micro-batch counts searched.
        recompute: ``True`` every stage recomputes, ``False`` none, ``None`` each as it needs to fit.
        partitioner: the split tried when there are more than ``max_splits`` (with its neighbours).
        action_seconds: fixed seconds per forward and per backward of a micro-batch.
        scale: each forward and backward takes ``scale`` × its profile (+ ``action_seconds``): what a
            run measured (:class:`~lightning_pipe.cost.calibrated.Calibration`); the candidates'
            stage plans keep the profile's costs.
        calibrations: what an earlier run measured, for each family and micro-batch count (the
            calibration kept closest to it, ``None``: none): its rate and fixed seconds per action
            price that family's candidates on that count in place of ``scale`` and ``action_seconds``,
            and with no ``contention`` (a run measured it with the others computing).
        update: each stage's optimizer step (none: free).
        extra_copies, network, contention: the memory model's optimizer copies, the network of
            :func:`~lightning_pipe.partition.evaluate` and the simulator's contention (where no
            calibration prices the candidate).
        reduce_overlap: the share of replicas' all-reduce that runs beside the compute
            (``StageCosts.reduce_overlap``), where no calibration of a replicating family prices the
            candidate (:meth:`~lightning_pipe.cost.calibrated.Calibration.reduce_overlap`).
        names: the layers' names, kept in each candidate's stage plan.
        base: the options every family is searched with besides its family, ``m`` and rule (slack,
            virtual stages, CDP's form, ...); a family they do not fit on ``workers`` is left out.

    Raises:
        PlanningError: when nothing fits ``memory_limit``, naming the smallest limit that would
            (``memory_limit=<bytes>``), or when no family can run the micro-batch counts given.
    """
    check_whole("workers", workers, 1)
    check_positive("profile_microbatches", profile_microbatches)
    check_positive("memory_limit", memory_limit, "bytes", optional=True)
    if recompute not in (None, True, False):
        raise PlanningError(f"recompute must be True, False or None (each stage as it needs), got {recompute!r}")
    if not math.isfinite(action_seconds) or action_seconds < 0:
        raise PlanningError(f"action_seconds must be a finite number >= 0, got {action_seconds!r}")
    check_positive("scale", scale)
    if workers > len(costs):
        raise PlanningError(f"{workers} workers but {len(costs)} layers: a stage holds at least one layer")
    chosen = searched_families(rule, families)
    network = network or Network()
    known = None if names is None else tuple(names)
    found: list[Candidate] = []
    smallest = math.inf
    for m in dict.fromkeys(microbatches):
        check_whole("every microbatches entry", m, 1)
        scaled = microbatch_costs(costs, profile_microbatches, small, m)
        for family, family_rule in chosen:
            try:
                options = replace(base or ScheduleOptions(), family=family, microbatches=m, rule=family_rule)
                options = options.on_workers(workers)
                stages = options.stages_for(workers)
            except PlanningError:  # e.g. CDP's dp form, which takes one micro-batch per worker
                continue
            try:
                counts = in_flight_counts(options, stages, m)
            except PlanningError:  # the family cannot run m micro-batches on this many stages
                continue
            models = [memory_model(family, m, extra_copies, r, counts) for r in (False, True)]
            for groups, replicas in _splits(scaled, family, stages, network, partitioner, max_splits):
                bounds = tuple((group[0], group[-1]) for group in groups)
                shape = StagePlan(bounds, replicas=replicas)
                try:
                    schedule = schedule_of(shape, options, m)(STEPS)
                except PlanningError:  # the family cannot run m micro-batches on these stages
                    continue
                held = WorkerMemory.of(schedule, scaled, bounds)
                priced = [
                    evaluate(scaled, groups, replicas, partitioner="auto", devices=workers, network=network, memory=mm)
                    for mm in (models if recompute is not False else models[:1])  # no recomputing plan when off
                ]
                plain, again = priced[0], priced[-1]
                keeping = held.bytes_under(plain, (False,) * len(bounds))  # no stage recomputing
                updates = None if update is None else update.stages(bounds)
                kept = None if calibrations is None else calibrations(family, m)
                rate, fixed = (scale, action_seconds) if kept is None else (kept.scale, kept.fixed)
                overlap = Calibration.reduce_overlap(kept, reduce_overlap)
                running = contention if kept is None else 1.0  # a calibration was measured running
                fastest: Candidate | None = None  # of the assignments of recomputation that fit
                for flags in _recomputing(held, keeping, memory_limit, recompute):
                    plan = replace(_mixed(plain, again, flags), memory_limit=memory_limit)
                    per_worker = held.bytes_under(plan, flags)
                    smallest = min(smallest, max(per_worker))
                    if memory_limit is not None and max(per_worker) > memory_limit:
                        continue
                    stage_plan = StagePlan(bounds, plan, scaled, replicas, known)
                    simulation = predict(
                        stage_plan, options, m, running, flags, fixed, updates, rate, reduce_overlap=overlap
                    )
                    assert simulation is not None
                    candidate = Candidate(
                        schedule=options,
                        recompute=flags,
                        stage_plan=stage_plan,
                        step_seconds=simulation.steady_step,
                        bubble_fraction=simulation.bubble_fraction,
                        busiest_seconds=max(simulation.busy) / STEPS,
                        memory_bytes=per_worker,
                        memory_limit=memory_limit,
                    )
                    if fastest is None or _rank(candidate) < _rank(fastest):
                        fastest = candidate
                if fastest is not None:
                    found.append(fastest)
    if not found:
        listed = ", ".join(family for family, _ in chosen)
        if math.isinf(smallest):
            raise PlanningError(f"none of {listed} runs {workers} workers with {list(microbatches)} micro-batches")
        need = math.ceil(smallest)
        raise PlanningError(
            f"no configuration of {listed} with {list(microbatches)} micro-batches fits "
            f"{format_bytes(memory_limit)} per device; the smallest limit that fits is {format_bytes(need)} "
            f"(memory_limit={need})"
        )
    order = {family: index for index, (family, _) in enumerate(chosen)}
    found.sort(key=lambda c: (*_rank(c)[:2], order[c.family], c.microbatches, sum(c.recompute)))
    return [replace(c, why=_why(c, found)) for c in found]


TIE = 0.005
"""Step times this close are a tie, which the ranking breaks by peak memory."""


def _rank(candidate: Candidate) -> tuple[float, float, int]:
    """How the ranking orders candidates of one family and micro-batch count: step time, then peak
    memory, then the fewest stages recomputing."""
    return candidate.step_seconds, candidate.peak_memory_bytes, sum(candidate.recompute)


def _faster(best: Candidate, other: Candidate) -> str:
    """``12% less time per step than gpipe m=8``."""
    saved = 1 - best.step_seconds / other.step_seconds if other.step_seconds > 0 else 0.0
    return f"{saved:.0%} less time per step than {other.label}"


def _why(candidate: Candidate, ranked: Sequence[Candidate]) -> str:
    """Its place in ``ranked``: the winner against the best configuration of another family, any
    other against the winner; and its memory against the limit."""
    winner = ranked[0]
    fits = format_bytes(candidate.peak_memory_bytes) + (
        "" if candidate.memory_limit is None else f" of {format_bytes(candidate.memory_limit)}"
    )
    if candidate is not winner:
        slower = candidate.step_seconds / winner.step_seconds - 1 if winner.step_seconds > 0 else 0.0
        return f"{slower:.0%} slower than {winner.label}; peak {fits}"
    other = next((c for c in ranked if c.family != winner.family), None)
    other = other or next((c for c in ranked if c.label != winner.label), None)
    if other is None:
        return f"the only configuration; peak {fits}"
    if other.step_seconds <= winner.step_seconds * (1 + TIE):
        return (
            f"as fast as {other.label} (within {TIE:.1%}) with {format_bytes(winner.peak_memory_bytes)} at peak "
            f"against {format_bytes(other.peak_memory_bytes)}, fits {fits}"
        )
    return f"{_faster(winner, other)} (bubble {winner.bubble_fraction:.0%} vs {other.bubble_fraction:.0%}), fits {fits}"


def ranking_table(
    candidates: Sequence[Candidate], top: int = 5, seconds: Callable[[Candidate], float] | None = None
) -> str:
    """The ``top`` candidates (predicted step time, bubble, peak memory per device, split) and one
    line saying why the winner won; with ``seconds``, each step is that (a calibration's prediction,
    what the run adds beyond the actions included: the order the candidates were ranked in)."""
    if not candidates:
        return "no candidate"
    step = seconds or (lambda candidate: candidate.step_seconds)
    rows = [
        "| # | schedule | rule | m | recompute | stages (layers ×replicas) | step | bubble | peak memory/device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, c in enumerate(candidates[:top], 1):
        stages = ", ".join(
            f"{a}-{b}" + (f"×{r}" if r > 1 else "") for (a, b), r in zip(c.bounds, c.replicas, strict=True)
        )
        rows.append(
            f"| {rank} | {c.family} | {c.rule} | {c.microbatches} | {c.recomputed} | {stages} | "
            f"{format_seconds(step(c))} | {c.bubble_fraction:.0%} | {format_bytes(c.peak_memory_bytes)} |"
        )
    winner = candidates[0]
    if seconds is None:
        rows.append(f"{winner.label} wins: {winner.why}")
        return "\n".join(rows)
    other = next((c for c in candidates if c.family != winner.family), None)
    against = "" if other is None else f", {1 - step(winner) / step(other):.0%} less than {other.label}"
    rows.append(
        f"{winner.label} wins: {format_seconds(step(winner))} per step with what runs measured beyond the "
        f"actions{against}; peak {format_bytes(winner.peak_memory_bytes)}"
    )
    return "\n".join(rows)

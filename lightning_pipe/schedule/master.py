"""Rahimi's unified master schedule: a placement ``w(s, b, d)`` and a priority ``n(s, b, d)``.

``w(s, b, d) = (w_weights, w_compute)`` says which worker holds the source of truth of stage ``s``'s
weights and which computes stage ``s`` of micro-batch ``b`` in direction ``d`` (Rahimi 2025, "Formal
definitions of distributed schedules"). With ``W = G·R`` workers in ``G`` groups of ``R`` and
``h(s, b) = (R·b mod W) + (s mod R)``:

- DDP ``(b, b)``, FSDP ``(s, b)``, GPipe ``(s, s)``;
- LPP ``(h(s, b), h(s, b))``: each group a looped pipeline, micro-batches dealt over groups;
- FSLPP: compute on ``h(s, b)``, weights on ``h(s, s)`` (the text's definition; the formula in the
  paper lists the pair the other way round).

Each step is list-scheduled greedily (:mod:`lightning_pipe.schedule.greedy`) and ends with a flush
and the update of every stage on the workers that hold its weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.schedule.greedy import list_schedule
from lightning_pipe.schedule.ir import Action, Kind, Schedule
from lightning_pipe.schedule.pipeline import check_sizes

__all__ = ["PRIORITIES", "ddp", "fsdp", "fslpp", "lpp", "master", "pipeline_parallel", "replicated"]

Placement = Callable[[int, int, Kind], tuple[int, int]]
"""``w(stage, microbatch, direction) -> (weight owner, compute worker)``."""


def _backward_first(action: Action) -> tuple:
    """1F1B's tie break: backwards first (oldest micro-batch first), then forwards."""
    return (0 if action.kind is not Kind.F else 1, action.microbatch, -action.stage)


def _forward_first(action: Action) -> tuple:
    """GPipe's tie break (breadth first): forwards of earlier micro-batches first."""
    return (0 if action.kind is Kind.F else 1, action.microbatch, action.stage)


def _depth_first(action: Action) -> tuple:
    """Whichever micro-batch entered first, deepest stage first."""
    return (action.microbatch, 0 if action.kind is not Kind.F else 1, -action.stage)


PRIORITIES: dict[str, Callable[[Action], tuple]] = {
    "backward_first": _backward_first,
    "forward_first": _forward_first,
    "depth_first": _depth_first,
}


def master(
    family: str,
    stages: int,
    microbatches: int,
    workers: int,
    placement: Placement,
    *,
    steps: int = 1,
    priority: str | Callable[[Action], tuple] = "backward_first",
    forward: float = 1.0,
    backward: float = 2.0,
    in_flight: Callable[[int], int] | None = None,
) -> Schedule:
    """The schedule of ``placement`` under ``priority`` (greedy, with ``forward``/``backward`` job
    durations), one flush per step; ``in_flight(stage)`` optionally caps the micro-batches a worker
    has in flight on a stage (forward done, backward not)."""
    check_sizes(family, stages, microbatches, steps)
    rank = PRIORITIES.get(priority, priority) if isinstance(priority, str) else priority
    if isinstance(rank, str):
        raise PlanningError(f"{family}: unknown priority {priority!r}; choose one of {', '.join(PRIORITIES)}")
    owners: dict[int, set[int]] = {s: set() for s in range(stages)}
    for s in range(stages):
        for b in range(microbatches):
            for d in (Kind.F, Kind.B):
                owner, compute = placement(s, b, d)
                for w in (owner, compute):
                    if not 0 <= w < workers:
                        raise PlanningError(
                            f"{family}: w({s}, {b}, {d.value}) = {(owner, compute)} names a worker outside "
                            f"0..{workers - 1}"
                        )
                owners[s].add(owner)
    orders: list[list[Action]] = [[] for _ in range(workers)]
    for t in range(steps):
        jobs = [Action(d, s, b, t) for b in range(microbatches) for s in range(stages) for d in (Kind.F, Kind.B)]
        step_orders = list_schedule(
            jobs,
            workers,
            worker_of=lambda a: placement(a.stage, a.microbatch, a.kind)[1],
            duration=lambda a: forward if a.kind is Kind.F else backward,
            priority=rank,
            last_stage=stages - 1,
            admissible=None if in_flight is None else lambda a, started: _room(a, started, in_flight),
        )
        for w in range(workers):
            orders[w] += step_orders[w]
            orders[w] += [Action(Kind.UPDATE, s, None, t) for s in range(stages) if w in owners[s]]
    return Schedule(
        family=family,
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        orders=orders,
        owners=[sorted(owners[s]) for s in range(stages)],
        params={"workers": workers, "priority": priority if isinstance(priority, str) else "custom"},
    )


def _room(action: Action, started: Counter, in_flight: Callable[[int], int]) -> bool:
    if action.kind is not Kind.F:
        return True
    return started[(Kind.F, action.stage)] - started[(Kind.B, action.stage)] < in_flight(action.stage)


def replicated(stage_replicas: Sequence[int], microbatches: int, steps: int = 1, **options: object) -> Schedule:
    """1F1B-RR (PipeDream §3.2): stage ``s`` runs on ``r_s`` workers that deal its micro-batches round
    robin (``i mod r_s``) and reduce its gradient; each replica keeps at most PipeDream's NOAM
    ``⌈k/r_s⌉`` micro-batches in flight, ``k`` the workers from it to the end."""
    replicas = list(stage_replicas)
    if not replicas or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in replicas):
        raise PlanningError(f"1f1b_rr: stage_replicas must be whole numbers >= 1 per stage, got {stage_replicas!r}")
    if microbatches < max(replicas):
        raise PlanningError(
            f"1f1b_rr: a stage replicated {max(replicas)} times needs at least {max(replicas)} micro-batches per "
            f"step (one per replica), got {microbatches}"
        )
    first = [sum(replicas[:s]) for s in range(len(replicas))]
    downstream = [sum(replicas[s:]) for s in range(len(replicas))]
    noam = MemoryModel("1f1b")  # PipeDream's NOAM, the cap 1F1B-RR keeps per replica

    def placement(s: int, b: int, d: Kind) -> tuple[int, int]:
        worker = first[s] + b % replicas[s]
        return worker, worker

    schedule = master(
        "1f1b_rr",
        len(replicas),
        microbatches,
        sum(replicas),
        placement,
        steps=steps,
        in_flight=lambda s: noam.in_flight(downstream[s], replicas[s]),
        **options,
    )
    return replace(schedule, params={**schedule.params, "stage_replicas": replicas})


def _data_workers(family: str, microbatches: int, workers: int | None) -> int:
    """``W`` of DDP and FSDP: one worker per micro-batch unless given (micro-batch ``b`` then runs on
    worker ``b mod W``, each worker accumulating ``m / W`` of them)."""
    if workers is None:
        return microbatches
    check_whole(f"{family}: workers", workers, 1)
    if microbatches < workers:
        raise PlanningError(
            f"{family}: {workers} workers need at least {workers} micro-batches per step (one each), got {microbatches}"
        )
    return workers


def ddp(stages: int, microbatches: int, steps: int = 1, workers: int | None = None, **options: object) -> Schedule:
    """``w = (b, b)``: micro-batch ``b`` on worker ``b mod W``, every worker holds every stage."""
    count = _data_workers("ddp", microbatches, workers)
    return master("ddp", stages, microbatches, count, lambda s, b, d: (b % count, b % count), steps=steps, **options)


def fsdp(stages: int, microbatches: int, steps: int = 1, workers: int | None = None, **options: object) -> Schedule:
    """``w = (s, b)``: micro-batch ``b`` computed on worker ``b mod W``, stage ``s``'s weights sharded
    to worker ``s mod W``."""
    count = _data_workers("fsdp", microbatches, workers)
    return master("fsdp", stages, microbatches, count, lambda s, b, d: (s % count, b % count), steps=steps, **options)


def pipeline_parallel(stages: int, microbatches: int, steps: int = 1, **options: object) -> Schedule:
    """``w = (s, s)``: GPipe as an instance of the master schedule."""
    return master("pp", stages, microbatches, stages, lambda s, b, d: (s, s), steps=steps, **options)


def _looped(family: str, stages: int, groups: int, replicas: int) -> tuple[int, Callable[[int, int], int]]:
    """``W = G·R`` and Rahimi's ``h(s, b) = (R·b mod W) + (s mod R)``."""
    for name, value in (("groups", groups), ("replicas", replicas)):
        check_whole(f"{family}: {name}", value, 1)
    if stages % replicas:
        raise PlanningError(
            f"{family}: each group of {replicas} workers loops over the {stages} stages, so stages must be a "
            f"multiple of replicas (R); try replicas in {[r for r in range(1, stages + 1) if stages % r == 0]}"
        )
    workers = groups * replicas

    def h(s: int, b: int) -> int:
        return (replicas * b) % workers + s % replicas

    return workers, h


def lpp(
    stages: int, microbatches: int, steps: int = 1, groups: int = 2, replicas: int = 2, **options: object
) -> Schedule:
    """Looped pipeline parallelism: ``W = G·R``, ``w = (h(s, b), h(s, b))``."""
    workers, h = _looped("lpp", stages, groups, replicas)
    return master("lpp", stages, microbatches, workers, lambda s, b, d: (h(s, b), h(s, b)), steps=steps, **options)


def fslpp(
    stages: int, microbatches: int, steps: int = 1, groups: int = 2, replicas: int = 2, **options: object
) -> Schedule:
    """Fully sharded LPP: compute on ``h(s, b)``, weights on ``h(s, s)``."""
    workers, h = _looped("fslpp", stages, groups, replicas)
    return master("fslpp", stages, microbatches, workers, lambda s, b, d: (h(s, s), h(s, b)), steps=steps, **options)

"""Memory-aware periodic schedules of Beaumont, Eyraud-Dubois & Shilova (Euro-Par 2021) §5.

- ``1f1b_star(T)`` (Algorithm 1): groups are built greedily from the last stage, adding stages while
  the group's total cost ``Σ U(s)`` stays within the period ``T``; inside a group the stages form an
  Equal Shift Pattern, so a stage of group ``g`` (group 1 holds the last stage) keeps ``g``
  activations — the fewest any 1-periodic pattern of period ``T`` can keep (Theorem 3). In a
  1-periodic pattern a stage alternates one forward and one backward, so the pattern is a 1F1B order
  with a warm-up of ``g - 1`` forwards; the timing follows from the dependencies.
- ``kperiodic(k)`` (Theorem 4): unroll the 1F1B pattern and drop every ``(k + 1)``-th batch: the
  dropped slots lower every stage's activations in flight (``NCA_1 = k`` when ``P = k + 1``) at the
  price of a normalized period ``2(1 + 1/k)`` for unit costs — a knob from throughput to memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.schedule.ir import Action, Schedule
from lightning_pipe.schedule.pipeline import Job, build, check_sizes, one_f_one_b_order, warmup_1f1b

__all__ = ["groups_1f1b_star", "kperiodic", "one_f_one_b_star"]


def groups_1f1b_star(stage_seconds: Sequence[float], period: float) -> list[int]:
    """Group number of each stage (1 = the group of the last stage), Algorithm 1 phase 1."""
    worst = max(stage_seconds)
    if period < worst:
        raise PlanningError(
            f"1f1b_star: the period {period:g} is shorter than the slowest stage ({worst:g}, forward + backward): "
            f"no pattern can repeat every {period:g}; use a period >= {worst:g}"
        )
    groups = [0] * len(stage_seconds)
    group, load = 1, 0.0
    for s in range(len(stage_seconds) - 1, -1, -1):
        if load + stage_seconds[s] > period:
            group, load = group + 1, 0.0
        groups[s] = group
        load += stage_seconds[s]
    return groups


def one_f_one_b_star(
    stages: int,
    microbatches: int,
    steps: int = 1,
    *,
    period: float,
    stage_seconds: Sequence[float] | None = None,
) -> Schedule:
    """1F1B*(T): warm-up ``g(s) - 1`` on stage ``s`` of group ``g(s)``; ``stage_seconds`` are the
    ``U(s) = u_F + u_B`` (default: 1 each)."""
    check_sizes("1f1b_star", stages, microbatches, steps)
    seconds = list(stage_seconds) if stage_seconds is not None else [1.0] * stages
    if len(seconds) != stages:
        raise PlanningError(f"1f1b_star: {len(seconds)} stage costs for {stages} stages")
    groups = groups_1f1b_star(seconds, period)
    return build(
        "1f1b_star",
        stages,
        microbatches,
        steps,
        lambda s, jobs: one_f_one_b_order(s, jobs, groups[s] - 1),
        params={"period": period, "groups": groups},
    )


def _with_holes(jobs: list[Job], k: int) -> list[Job | None]:
    """The stream with an empty slot after every ``k`` micro-batches."""
    slots: list[Job | None] = []
    for index, job in enumerate(jobs):
        slots.append(job)
        if (index + 1) % k == 0 and index + 1 < len(jobs):
            slots.append(None)
    return slots


def _kperiodic_order(stage: int, jobs: list[Job], warmup: int, k: int) -> list[Action]:
    slots = _with_holes(jobs, k)
    marked = [job if job is not None else (-1, index) for index, job in enumerate(slots)]
    return [a for a in one_f_one_b_order(stage, marked, warmup) if a.step >= 0]


def kperiodic(stages: int, microbatches: int, steps: int = 1, *, k: int) -> Schedule:
    """1F1B unrolled with every ``(k + 1)``-th slot dropped."""
    check_sizes("kperiodic", stages, microbatches, steps)
    check_whole("kperiodic: k", k, 1)
    return build(
        "kperiodic",
        stages,
        microbatches,
        steps,
        lambda s, jobs: _kperiodic_order(s, jobs, warmup_1f1b(stages, s), k),
        params={"k": k},
    )

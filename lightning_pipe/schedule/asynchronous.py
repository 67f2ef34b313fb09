"""Non-flushing pipelines: PipeDream (asynchronous 1F1B) and PipeDream-2BW.

Both run 1F1B over the stream of all micro-batches with no flush between steps (Narayanan et al.
2019 §3.2; 2021 §3): stage ``s`` warms up with ``P - s - 1`` forwards (``(P - s - 1)(1 + k)`` with
slack ``k``, :mod:`~lightning_pipe.schedule.pipeline`) and then alternates, and it updates its
weights right after the last backward of each step (every ``m`` micro-batches; ``m = 1`` is the
original PipeDream, which updates after every micro-batch).

- ``pipedream``: weight stashing (a micro-batch's backward uses the version its forward used, the
  newest when the forward ran; a stage keeps as many versions as it has micro-batches in flight),
  or vertical sync (``rule="vertical"``: every stage of a micro-batch uses the version its first
  stage used).
- ``2bw``: double-buffered weights, ``θ_{t+1} = θ_t − γ/N Σ ∇f_i(θ_{t−1})``: every micro-batch of
  step ``t`` uses version ``t − 1`` while version ``t`` is being finished, so two versions suffice. The
  forwards of step ``t`` must not outrun the update of step ``t − 2`` on any stage, which needs
  ``m`` at least the first stage's warm-up: ``m >= P - 1``, ``m >= (P - 1)(1 + k)`` with slack.
"""

from __future__ import annotations

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Schedule
from lightning_pipe.schedule.pipeline import build_1f1b, check_sizes, check_slack, warmup_1f1b

__all__ = ["pipedream", "two_bw"]


def pipedream(stages: int, microbatches: int = 1, steps: int = 4, rule: str = "stash", slack: int = 0) -> Schedule:
    """PipeDream's asynchronous 1F1B with weight stashing (or ``rule="vertical"``); ``slack``: extra
    warm-up forwards per link (:mod:`~lightning_pipe.schedule.pipeline`), so more micro-batches, and
    with them versions, in flight."""
    if rule not in ("stash", "vertical"):
        raise PlanningError(f"pipedream: rule must be 'stash' or 'vertical', got {rule!r}")
    return build_1f1b("pipedream", stages, microbatches, steps, slack, flush=False, rule=rule)


def two_bw(stages: int, microbatches: int, steps: int = 4, rule: str = "2bw", slack: int = 0) -> Schedule:
    """PipeDream-2BW: 1F1B without flush, an update every ``m`` micro-batches, two weight versions.

    ``rule="2bw"`` is the paper's update formula (every micro-batch of step ``t`` at ``θ_{t-1}``);
    ``rule="stash"`` is how its implementation picks versions: a forward takes the newest version its
    stage has, so on stage ``j`` micro-batch ``i`` already sees ``θ_t`` when ``i + j >= P - 1`` (these
    are exactly CDP-v2's versions), still never more than two versions. ``slack``: extra warm-up
    forwards per link (:mod:`~lightning_pipe.schedule.pipeline`); the first stage's warm-up
    ``(P - 1)(1 + slack)`` must fit in a step.
    """
    if rule not in ("2bw", "stash"):
        raise PlanningError(f"2bw: rule must be '2bw' or 'stash', got {rule!r}")
    check_sizes("2bw", stages, microbatches, steps)
    check_slack("2bw", slack)  # before the warm-up is computed from it
    warmup = warmup_1f1b(stages, 0, slack)
    if microbatches < warmup:
        needed = f"m >= (P - 1)(1 + slack) = {warmup}" if slack else f"m >= P - 1 = {warmup}"
        fewer = f", or less slack (at most {microbatches // (stages - 1) - 1})" if microbatches >= stages - 1 else ""
        raise PlanningError(
            f"2bw: with {microbatches} micro-batches per step the first stage would need version t-1 before "
            f"its update of step t-2 is done; 2BW needs {needed} micro-batches per step{fewer} "
            "(Narayanan et al. 2021 use m >= P)"
        )
    return build_1f1b("2bw", stages, microbatches, steps, slack, flush=False, rule=rule)

"""Schedules: one IR for every pipeline family, a validator, a simulator and pictures.

:func:`make_schedule` builds a family by name, assigns the weight versions of its update rule and
validates it (:func:`build_schedule` also returns the validated dependency graph);
:func:`~lightning_pipe.schedule.simulate.simulate` predicts it. Its modules, by what they do:

- **the IR**: :mod:`.ir` (each worker's ordered actions), :mod:`.options` (a schedule's options),
  :mod:`.graph` (who waits for whom), :mod:`.validate`, :mod:`.versions` (the weight version each
  action uses, by update rule), :mod:`.lower` (the messages spelt out);
- **the families**: :mod:`.pipeline` (GPipe, 1F1B, interleaved and looped), :mod:`.zero_bubble`,
  :mod:`.early` (backwards that send their input gradient first), :mod:`.asynchronous` (PipeDream,
  2BW), :mod:`.beaumont` (1F1B* and k-periodic), :mod:`.cyclic` (CDP), :mod:`.master` (Rahimi's
  ``w(s, b, d)``, made into orders by :mod:`.greedy`), :mod:`.one_device` (every stage on one device),
  :mod:`.tied_updates` (a one-worker program whose stages sharing a parameter update together);
- **prediction**: :mod:`.stage_costs` (what each action costs), :mod:`.simulate` and
  :mod:`.simulation` (the replay and what it predicts), :mod:`.traffic` and :mod:`.backlog` (its
  messages), :mod:`.in_flight` and :mod:`.peak_memory` (its memory), :mod:`.draw` (the pictures).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import asynchronous, beaumont, cyclic, master, one_device, pipeline, zero_bubble
from lightning_pipe.schedule.graph import Graph
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.simulation import Simulation
from lightning_pipe.schedule.stage_costs import StageCosts
from lightning_pipe.schedule.validate import validate
from lightning_pipe.schedule.versions import RULES, assign_versions

__all__ = [
    "COMPUTE",
    "FAMILIES",
    "FAMILY_RULES",
    "MEMORY_SCHEDULES",
    "NON_FLUSHING_FAMILIES",
    "RULES",
    "SLACK_FAMILIES",
    "SPLIT_BACKWARD_FAMILIES",
    "SUGGESTED_FLUSHING",
    "Action",
    "Kind",
    "Schedule",
    "Simulation",
    "StageCosts",
    "assign_versions",
    "build_schedule",
    "check_form",
    "make_schedule",
    "memory_schedule",
    "simulate",
    "validate",
]

FAMILIES: dict[str, str] = {
    "gpipe": "fill-drain, flush every step (Huang et al. 2019)",
    "1f1b": "one forward one backward, flush every step (PipeDream-Flush)",
    "interleaved": "interleaved 1F1B over virtual stages (Megatron-LM)",
    "looped_bfs": "breadth-first looped pipeline (Lamy-Poirier 2023)",
    "1f1b_star": "memory-optimal 1-periodic pattern for a period T (Beaumont et al. 2021, Alg. 1)",
    "kperiodic": "1F1B with every (k+1)-th slot dropped (Beaumont et al. 2021, Thm 4)",
    "pipedream": "asynchronous 1F1B with weight stashing or vertical sync (PipeDream)",
    "2bw": "1F1B without flush, double-buffered weights (PipeDream-2BW)",
    "cdp": "Cyclic Data Parallelism: pipeline, pyramid, single-device, dp or ZeRO form (Fournier & Oyallon 2024)",
    "zb_h1": "zero bubble with 1F1B's memory (Qi et al. 2024)",
    "ddp": "w(s,b,d) = (b, b) (Rahimi 2025)",
    "fsdp": "w(s,b,d) = (s, b) (Rahimi 2025)",
    "pp": "w(s,b,d) = (s, s): GPipe through the master schedule (Rahimi 2025)",
    "lpp": "looped pipeline parallel, G groups of R workers (Rahimi 2025)",
    "1f1b_rr": "1F1B with replicated stages, micro-batches round robin (PipeDream 1F1B-RR)",
    "fslpp": "fully sharded looped pipeline parallel (Rahimi 2025)",
}
SLACK_FAMILIES: tuple[str, ...] = ("1f1b", "pipedream", "2bw")
NON_FLUSHING_FAMILIES: tuple[str, ...] = ("pipedream", "2bw", "cdp")  # steps overlap: updates are delayed
SPLIT_BACKWARD_FAMILIES: tuple[str, ...] = ("zb_h1",)
"""The families that run every backward as two actions, the input half then the weight half (Qi et al.
2024 §2)."""
SUGGESTED_FLUSHING: str = "gpipe, 1f1b, interleaved, zb_h1"
"""The flushing families a refusal of a non-flushing one suggests instead."""
MEMORY_SCHEDULES: dict[str, str] = {"gpipe": "gpipe", "pipedream": "pipedream", "2bw": "2bw", "cdp": "2bw"}
"""The memory model (:data:`lightning_pipe.cost.memory.SCHEDULES`) of a family that keeps other than
1F1B's activations in flight and one weight version; every other family is modelled as ``1f1b``."""
FAMILY_RULES: dict[str, tuple[str, ...]] = {
    "pipedream": ("stash", "vertical"),
    "2bw": ("2bw", "stash"),
    "cdp": ("cdp_v2", "cdp_v1"),
}
"""The update rules a family runs (its default first); every other family runs ``sync``."""


def memory_schedule(family: str) -> str:
    """The memory model's schedule closest to ``family`` (activations in flight, weight versions)."""
    return MEMORY_SCHEDULES.get(family, "1f1b")


def rules_of(family: str) -> tuple[str, ...]:
    """The update rules ``family`` runs, its default first."""
    return FAMILY_RULES.get(family, ("sync",))


def check_rule(family: str, rule: str | None) -> None:
    """Refuse an update rule ``family`` does not run, naming the families that run it."""
    if rule is None or rule in rules_of(family):
        return
    runners = [name for name in FAMILIES if rule in rules_of(name)]
    raise PlanningError(
        f"{family} runs the {' or '.join(map(repr, rules_of(family)))} update rule, not {rule!r}; {rule!r} runs on "
        + ", ".join(runners)
    )


def check_form(family: str, form: str) -> None:
    """Refuse a ``form`` that is none of :data:`~lightning_pipe.schedule.cyclic.FORMS`, and ``single``
    (every stage on one device, :mod:`~lightning_pipe.schedule.one_device`) for a non-flushing family
    but CDP. CDP's other forms are its own settings, which the other families leave aside (a
    ``schedule="auto"`` search carries the form given for CDP to every family it prices)."""
    if form not in cyclic.FORMS:
        raise PlanningError(f"form must be one of {', '.join(map(repr, cyclic.FORMS))}; got {form!r}")
    if form == "single" and family != "cdp" and family in NON_FLUSHING_FAMILIES:
        raise PlanningError(
            f"{family} has no single-device form: on one device, a delayed-weight rule runs as cdp's single form "
            "(schedule='cdp', form='single'); the synchronous families take form='single'"
        )


def _generate(
    family: str,
    stages: int,
    microbatches: int,
    steps: int,
    *,
    virtual_stages: int,
    period: float | None,
    stage_seconds: Sequence[float] | None,
    k: int | None,
    rule: str | None,
    form: str,
    groups: int,
    replicas: int,
    workers: int | None,
    priority: str,
    forward: float,
    backward: float,
    stage_replicas: Sequence[int] | None,
    slack: int,
    stage_durations: cyclic.Durations | None,
) -> Schedule:
    if slack and family in FAMILIES and family not in SLACK_FAMILIES:
        raise PlanningError(
            f"{family} takes no slack: slack (extra warm-up forwards per link) applies to {', '.join(SLACK_FAMILIES)}"
        )
    if family == "gpipe":
        return pipeline.gpipe(stages, microbatches, steps)
    if family == "1f1b":
        return pipeline.one_f_one_b(stages, microbatches, steps, slack)
    if family == "interleaved":
        return pipeline.interleaved(stages, microbatches, steps, virtual_stages)
    if family == "looped_bfs":
        return pipeline.looped_bfs(stages, microbatches, steps, virtual_stages)
    if family == "1f1b_star":
        if period is None:
            raise PlanningError("1f1b_star needs a period T (--period), e.g. the slowest stage's forward + backward")
        seconds = stage_seconds if stage_seconds is not None else [forward + backward] * stages
        return beaumont.one_f_one_b_star(stages, microbatches, steps, period=period, stage_seconds=seconds)
    if family == "kperiodic":
        if k is None:
            raise PlanningError("kperiodic needs k (--k): keep k of every k + 1 slots of 1F1B")
        return beaumont.kperiodic(stages, microbatches, steps, k=k)
    if family == "pipedream":
        return asynchronous.pipedream(stages, microbatches, steps, rule=rule or "stash", slack=slack)
    if family == "2bw":
        return asynchronous.two_bw(stages, microbatches, steps, rule=rule or "2bw", slack=slack)
    if family == "cdp":
        return cyclic.cdp(stages, microbatches, steps, form=form, rule=rule or "cdp_v2", durations=stage_durations)
    if family == "zb_h1":
        return zero_bubble.zb_h1(
            stages, microbatches, steps, forward=forward, input_grad=backward / 2, weight_grad=backward / 2
        )
    options = {"priority": priority, "forward": forward, "backward": backward}
    if family == "ddp":
        return master.ddp(stages, microbatches, steps, workers, **options)
    if family == "fsdp":
        return master.fsdp(stages, microbatches, steps, workers, **options)
    if family == "pp":
        return master.pipeline_parallel(stages, microbatches, steps, **options)
    if family == "lpp":
        return master.lpp(stages, microbatches, steps, groups=groups, replicas=replicas, **options)
    if family == "fslpp":
        return master.fslpp(stages, microbatches, steps, groups=groups, replicas=replicas, **options)
    if family == "1f1b_rr":
        counts = list(stage_replicas) if stage_replicas is not None else [1] * stages
        if len(counts) != stages:
            raise PlanningError(f"1f1b_rr: {len(counts)} replica counts for {stages} stages")
        return master.replicated(counts, microbatches, steps, **options)
    raise PlanningError(f"unknown schedule {family!r}; choose one of {', '.join(FAMILIES)}")


def build_schedule(
    family: str,
    stages: int,
    microbatches: int,
    steps: int = 1,
    *,
    virtual_stages: int = 2,
    period: float | None = None,
    stage_seconds: Sequence[float] | None = None,
    k: int | None = None,
    rule: str | None = None,
    form: str = "pipeline",
    groups: int = 2,
    replicas: int = 2,
    workers: int | None = None,
    priority: str = "backward_first",
    forward: float = 1.0,
    backward: float = 2.0,
    stage_replicas: Sequence[int] | None = None,
    slack: int = 0,
    stage_durations: cyclic.Durations | None = None,
) -> Graph:
    """Build, version and validate the schedule ``family``; returns its dependency graph (the
    schedule is ``.schedule``), so a simulation need not validate it again.

    Args:
        family: a key of :data:`FAMILIES`.
        stages, microbatches, steps: ``P``, ``m`` per step, and optimizer steps to cover.
        virtual_stages: stages per worker for ``interleaved`` and ``looped_bfs``.
        period, stage_seconds: ``T`` and the stages' ``u_F + u_B`` for ``1f1b_star`` (default:
            ``forward + backward`` each).
        k: for ``kperiodic``.
        rule: ``stash``/``vertical`` for ``pipedream``, ``2bw``/``stash`` for ``2bw``,
            ``cdp_v1``/``cdp_v2`` for ``cdp``.
        form: ``pipeline``, ``pyramid``, ``single``, ``dp`` or ``zero`` for ``cdp``
            (:data:`~lightning_pipe.schedule.cyclic.FORMS`); ``single`` for another family: every
            stage on one worker (:func:`~lightning_pipe.schedule.one_device.on_one_worker`).
        groups, replicas: ``G`` and ``R`` for ``lpp``/``fslpp``.
        workers: ``W`` of ``ddp``/``fsdp`` (default: one per micro-batch).
        priority, forward, backward: tie break and job durations of the greedy families
            (``ddp``, ``fsdp``, ``pp``, ``lpp``, ``fslpp``, ``1f1b_rr``; ``zb_h1`` splits ``backward`` in halves).
        stage_replicas: workers per stage for ``1f1b_rr`` (e.g. a pipedream plan's replicas).
        slack: extra warm-up forwards per link for ``1f1b``, ``pipedream`` and ``2bw``, so messages cross
            while the sender computes (:mod:`~lightning_pipe.schedule.pipeline`; 0: plain 1F1B).
        stage_durations: each stage's forward and backward seconds, where ``cdp``'s dp form starts
            each replica: 1/N of a pass after the previous (default: two time steps, the paper's
            delay when every action takes one; :func:`~lightning_pipe.schedule.cyclic.cue_after`).
    """
    check_rule(family, rule)
    check_form(family, form)
    schedule = _generate(
        family,
        stages,
        microbatches,
        steps,
        virtual_stages=virtual_stages,
        period=period,
        stage_seconds=stage_seconds,
        k=k,
        rule=rule,
        form=form,
        groups=groups,
        replicas=replicas,
        workers=workers,
        priority=priority,
        forward=forward,
        backward=backward,
        stage_replicas=stage_replicas,
        slack=slack,
        stage_durations=stage_durations,
    )
    versioned = assign_versions(schedule, schedule.rule)
    if form == "single" and family != "cdp":  # cdp generates its own single form
        versioned = one_device.on_one_worker(versioned)
    return validate(versioned)


def make_schedule(family: str, stages: int, microbatches: int, steps: int = 1, **options: object) -> Schedule:
    """Build, version and validate the schedule ``family`` (the options of :func:`build_schedule`)."""
    return build_schedule(family, stages, microbatches, steps, **options).schedule

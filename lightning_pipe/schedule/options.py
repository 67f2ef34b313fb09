"""The options of a schedule, declared once (docs/design.md: one options object per layer).

:class:`ScheduleOptions` is what :func:`~lightning_pipe.schedule.build_schedule` takes besides the
stage count and the steps; the strategy's constructor and the Hydra configuration build one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from lightning_pipe.errors import PlanningError, check_positive, check_whole
from lightning_pipe.schedule import FAMILIES, check_form, check_rule, make_schedule
from lightning_pipe.schedule.ir import Schedule

__all__ = ["LOOPED_FAMILIES", "PLACED_FAMILIES", "ScheduleOptions"]

PLACED_FAMILIES: tuple[str, ...] = ("ddp", "fsdp", "lpp", "fslpp")
"""Rahimi's families whose placement ``w(s, b, d)`` puts stages on workers, whatever their number."""
LOOPED_FAMILIES: tuple[str, ...] = ("interleaved", "looped_bfs")
"""The families that put ``virtual_stages`` stages on each worker, looping the micro-batches through it."""


@dataclass(frozen=True)
class ScheduleOptions:
    """A schedule family and its options (see :func:`~lightning_pipe.schedule.build_schedule`).

    Attributes:
        family: a key of :data:`~lightning_pipe.schedule.FAMILIES`.
        microbatches: ``m`` micro-batches per step (``None``: decided by the user of the options,
            e.g. the strategy takes the number of stages).
        rule: update rule where a family has a choice (``stash``/``vertical``, ``2bw``/``stash``,
            ``cdp_v1``/``cdp_v2``); ``None``: the family's own.
        slack: extra warm-up forwards per link (``1f1b``, ``pipedream``, ``2bw``).
        virtual_stages: stages per worker (``interleaved``, ``looped_bfs``).
        form: ``cdp``'s setting: ``pipeline``, ``pyramid``, ``single`` (one device), ``dp`` (a
            replica per worker, gradients reduced along a ring) or ``zero`` (each stage's state on one
            worker at a time); :data:`~lightning_pipe.schedule.cyclic.FORMS`. Every synchronous family
            takes ``single`` too: its stages on one device (:mod:`~lightning_pipe.schedule.one_device`).
        period: ``T`` of ``1f1b_star``; k: of ``kperiodic``.
        groups, replicas, priority: of the master-schedule families (``lpp``, ``fslpp``, ...);
            ``replicas`` (workers per group) ``None``: the workers divided by ``groups``
            (:meth:`on_workers`).
        workers: ``W`` of ``ddp`` and ``fsdp`` (``None``: one per micro-batch, or the devices).
    """

    family: str = "1f1b"
    microbatches: int | None = None
    rule: str | None = None
    slack: int = 0
    virtual_stages: int = 2
    form: str = "pipeline"
    period: float | None = None
    k: int | None = None
    groups: int = 2
    replicas: int | None = None
    priority: str = "backward_first"
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise PlanningError(f"unknown schedule {self.family!r}; choose one of {', '.join(FAMILIES)}")
        check_rule(self.family, self.rule)
        check_whole("microbatches", self.microbatches, 1, optional=True)
        check_whole("slack", self.slack, 0)
        check_whole("virtual_stages", self.virtual_stages, 1)
        check_form(self.family, self.form)
        check_positive("period", self.period, optional=True)
        check_whole("k", self.k, 1, optional=True)
        check_whole("groups", self.groups, 1)
        check_whole("replicas", self.replicas, 1, optional=True)
        check_whole("workers", self.workers, 1, optional=True)

    def on_workers(self, workers: int) -> ScheduleOptions:
        """These options with what follows from running on ``workers`` workers: ``W`` for ``ddp`` and
        ``fsdp``, ``R = W / G`` for ``lpp`` and ``fslpp``."""
        if self.family == "cdp" and self.form in ("dp", "zero") and self.microbatches not in (None, workers):
            raise PlanningError(
                f"cdp's {self.form} form computes one micro-batch per worker and step: microbatches must be the "
                f"{workers} workers, not {self.microbatches}"
            )
        if self.family in ("ddp", "fsdp"):
            return replace(self, workers=workers)
        if self.family not in ("lpp", "fslpp"):
            return self
        replicas = self.replicas if self.replicas is not None else workers // self.groups
        if self.groups * replicas != workers:
            raise PlanningError(
                f"{self.family} runs groups × replicas = {self.groups} × {self.replicas or replicas} workers, not "
                f"{workers}: choose groups among {[g for g in range(1, workers + 1) if workers % g == 0]} (replicas "
                "then follows from the devices)"
            )
        return replace(self, replicas=replicas)

    @property
    def any_stage_count(self) -> bool:
        """Whether the stage count is free of the workers: Rahimi's families, every family on one
        device, and CDP in its dp and ZeRO forms (the stages the rule sees)."""
        cdp_replicas = self.family == "cdp" and self.form in ("dp", "zero")
        return self.family in PLACED_FAMILIES or self.form == "single" or cdp_replicas

    @property
    def one_device(self) -> bool:
        """The single-device form (CDP's, or a synchronous family's stages on one device): one worker,
        whatever the stages."""
        return self.form == "single"

    def stages_for(self, workers: int) -> int:
        """The stage count that puts this family on ``workers`` workers, when it follows from them
        (Rahimi's families and CDP's dp forms: one stage per worker, by default; CDP on one device:
        one per micro-batch, the paper's ``N = P``)."""
        if self.one_device:
            if self.microbatches is None:
                raise PlanningError(
                    "form='single' runs every stage on one device: give stages= (P) or microbatches= (N; P = N by "
                    "default)"
                )
            return self.microbatches
        if self.family in LOOPED_FAMILIES:
            return workers * self.virtual_stages
        if self.family == "cdp" and self.form == "pyramid":
            stages = int(((8 * workers + 1) ** 0.5 - 1) / 2)
            if stages * (stages + 1) // 2 != workers:
                raise PlanningError(
                    f"cdp's pyramid form runs P stages on P(P+1)/2 workers; {workers} is no such number "
                    "(3, 6, 10, ... work): change the devices or use form='pipeline'"
                )
            return stages
        return workers

    def workers_for(self, stages: int) -> int | None:
        """The workers one pipeline of ``stages`` stages of this family runs on (``None``: any number:
        Rahimi's families placing stages by ``w(s, b, d)``, CDP's dp forms)."""
        if self.one_device:
            return 1
        if self.any_stage_count:
            return None
        if self.family in LOOPED_FAMILIES:
            if stages % self.virtual_stages:
                raise PlanningError(
                    f"{self.family} puts {self.virtual_stages} stages on each worker: {stages} stages is not a multiple"
                )
            return stages // self.virtual_stages
        if self.family == "cdp" and self.form == "pyramid":
            return stages * (stages + 1) // 2
        return stages

    def make(self, stages: int, microbatches: int, **extra: object) -> Callable[[int], Schedule]:
        """``steps -> schedule`` of this family on ``stages`` stages (what the executor takes)."""
        options = {k: v for k, v in asdict(self).items() if k not in ("family", "microbatches")}
        options = {k: v for k, v in options.items() if v is not None or k not in ("replicas", "workers")}
        options.update(extra)
        return lambda steps: make_schedule(self.family, stages, microbatches, steps, **options)

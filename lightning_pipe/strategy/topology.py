"""Where a pipeline sits among the job's ranks: its copies, workers, stages and micro-batches, and
the data each rank reads.

:class:`Topology` is the shape, worked out once from the options and the world Lightning gives the
strategy (in ``setup_environment``, once the ranks are known). :class:`TopologyHooks` is the part of
:class:`~lightning_pipe.strategy.PipelineStrategy` that reads it (one of the parts the strategy's class
is assembled from, each a module of its own): the properties Lightning asks for and the data each rank
reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.options import ScheduleOptions

__all__ = ["Topology", "TopologyHooks"]


@dataclass(frozen=True)
class Topology:
    """The pipeline's shape on the job's ranks: ``data_parallel`` copies of a pipeline of ``workers``
    consecutive ranks; ``options`` the schedule's options on those workers; ``stages`` before any plan
    says otherwise (a saved plan or a resumed one may)."""

    data_parallel: int
    workers: int
    global_rank: int
    options: ScheduleOptions
    stages: int

    @classmethod
    def of(
        cls,
        schedule: ScheduleOptions,
        world_size: int,
        global_rank: int,
        stages: int | None = None,
        data_parallel: int | None = None,
        balance: list[int] | None = None,
    ) -> Topology:
        """The shape of ``world_size`` ranks under the strategy's options (``stages`` and
        ``data_parallel`` as given to it, ``balance`` its layers per stage)."""
        copies = _copies(schedule, world_size, stages, data_parallel)
        if world_size % copies:
            raise PlanningError(
                f"{world_size} devices cannot hold {copies} equal pipeline copies: use a multiple of {copies} devices"
            )
        workers = world_size // copies
        if stages is None:  # a balance says how many where the family takes any count
            stages = len(balance) if balance is not None and schedule.any_stage_count else schedule.stages_for(workers)
        return cls(copies, workers, global_rank, schedule.on_workers(workers), stages)

    @property
    def pipelines(self) -> list[list[int]]:
        """The global ranks of each pipeline copy."""
        return [[p * self.workers + w for w in range(self.workers)] for p in range(self.data_parallel)]

    @property
    def pipeline_index(self) -> int:
        """The copy this rank belongs to."""
        return self.global_rank // self.workers

    @property
    def worker(self) -> int:
        """This rank's worker in its pipeline."""
        return self.global_rank % self.workers


def _copies(schedule: ScheduleOptions, world_size: int, stages: int | None, data_parallel: int | None) -> int:
    """Copies of the pipeline (each a group of consecutive ranks)."""
    if data_parallel is not None:
        return data_parallel
    if stages is None:  # each device a copy of CDP on one device, or one pipeline
        return world_size if schedule.one_device else 1
    workers = schedule.workers_for(stages)
    if workers is None:  # Rahimi's families place the stages on however many workers there are
        return 1
    if world_size % workers:
        raise PlanningError(
            f"{world_size} devices are not a multiple of the {workers} workers a pipeline of "
            f"{stages} {schedule.family} stages needs: use a multiple of {workers} devices"
        )
    return world_size // workers


class TopologyHooks:
    """The topology's face on :class:`~lightning_pipe.strategy.PipelineStrategy`: the properties
    Lightning and the other parts read, from the :class:`Topology` built in ``setup_environment``."""

    _topology: Topology | None

    @property
    def topology(self) -> Topology:
        """The shape of this job; before the processes are set up, of the world as it stands."""
        if self._topology is not None:
            return self._topology
        return self._shape()

    def _shape(self, data_parallel: int | None = None) -> Topology:
        """The topology of the strategy's options; ``data_parallel``: with that many pipeline copies,
        whatever the options give (``schedule="auto"``'s pick keeps the copies its search priced on)."""
        return Topology.of(
            self.schedule_options,
            self.world_size,
            self.global_rank,
            self._stages_option,
            self._data_parallel_option if data_parallel is None else data_parallel,
            self.plan_options.balance,
        )

    @property
    def data_parallel(self) -> int:
        """Copies of the pipeline (each a group of consecutive ranks)."""
        return self.topology.data_parallel

    @property
    def workers(self) -> int:
        """Workers (devices) of one pipeline."""
        return self.topology.workers

    @property
    def options(self) -> ScheduleOptions:
        """The schedule's options on this strategy's workers (:meth:`ScheduleOptions.on_workers`)."""
        return self.topology.options

    @property
    def pipelines(self) -> list[list[int]]:
        """The global ranks of each pipeline copy."""
        return self.topology.pipelines

    @property
    def pipeline_index(self) -> int:
        return self.topology.pipeline_index

    @property
    def is_distributed(self) -> bool:
        """With pipeline copies, Lightning puts a distributed sampler over the copies (every stage of
        one copy reads the same shard); with one pipeline every rank reads the same batches (the
        ranks' random samplers share a seed instead, :meth:`process_dataloader`)."""
        return self.data_parallel > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel, "rank": self.pipeline_index}

    def process_dataloader(self, dataloader: object) -> object:
        """A random sampler without a generator of its own draws its order from each process's global
        generator, which the stages consume differently (dropout): give it one seeded alike on every
        rank, so all stages read the same batches."""
        sampler = getattr(dataloader, "sampler", None)
        if (
            self.data_parallel == 1
            and sampler is not None
            and hasattr(sampler, "generator")
            and sampler.generator is None
        ):
            seed = self.broadcast(int(torch.randint(2**62, ()).item()) if self.global_rank == 0 else None)
            sampler.generator = torch.Generator().manual_seed(seed)
        return dataloader

    @property
    def stages(self) -> int:
        """Pipeline stages: one per worker (several for interleaved and looped schedules; those the
        plan replicates over the workers for ``1f1b_rr``)."""
        if self.stage_plan is not None:
            return len(self.stage_plan.bounds)
        return self.topology.stages

    @property
    def _replicated(self) -> bool:
        """``1f1b_rr``: the plan replicates stages over the workers."""
        return self.schedule_options.family == "1f1b_rr"

    @property
    def microbatches(self) -> int:
        """Micro-batches per batch: as given, else one per stage on one device (CDP's single form),
        else what the family puts on the workers (one per stage, or one per worker)."""
        options = self.schedule_options
        if options.microbatches is not None:
            return options.microbatches
        return self.stages if options.one_device else options.stages_for(self.workers)

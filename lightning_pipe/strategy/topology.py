"""Where a pipeline sits among the job's ranks: its copies, workers, stages and micro-batches, and
the data each rank reads.

:class:`Topology` holds these as methods of :class:`~lightning_pipe.strategy.PipelineStrategy` (one
of the parts the strategy's class is assembled from, each a module of its own), computed from the
options the strategy's constructor keeps and the world size Lightning gives it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.options import ScheduleOptions

__all__ = ["Topology"]


class Topology:
    """The pipeline's shape on the job's ranks: copies, workers, stages, micro-batches (methods of
    :class:`~lightning_pipe.strategy.PipelineStrategy`, which holds the options they read)."""

    @property
    def data_parallel(self) -> int:
        """Copies of the pipeline (each a group of consecutive ranks)."""
        if self._data_parallel_option is not None:
            return self._data_parallel_option
        if self._stages_option is None:  # each device a copy of CDP on one device, or one pipeline
            return self.world_size if self.schedule_options.one_device else 1
        workers = self.schedule_options.workers_for(self._stages_option)
        if workers is None:  # Rahimi's families place the stages on however many workers there are
            return 1
        if self.world_size % workers:
            raise PlanningError(
                f"{self.world_size} devices are not a multiple of the {workers} workers a pipeline of "
                f"{self._stages_option} {self.schedule_options.family} stages needs: use a multiple of {workers} "
                "devices"
            )
        return self.world_size // workers

    @property
    def workers(self) -> int:
        """Workers (devices) of one pipeline."""
        if self.world_size % self.data_parallel:
            raise PlanningError(
                f"{self.world_size} devices cannot hold {self.data_parallel} equal pipeline copies: use a multiple of "
                f"{self.data_parallel} devices"
            )
        return self.world_size // self.data_parallel

    @property
    def options(self) -> ScheduleOptions:
        """The schedule's options on this strategy's workers (:meth:`ScheduleOptions.on_workers`)."""
        return self.schedule_options.on_workers(self.workers)

    @property
    def pipelines(self) -> list[list[int]]:
        """The global ranks of each pipeline copy."""
        return [[p * self.workers + w for w in range(self.workers)] for p in range(self.data_parallel)]

    @property
    def pipeline_index(self) -> int:
        return self.global_rank // self.workers

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
        if self._stages_option is not None:
            return self._stages_option
        balance = self.plan_options.balance
        if balance is not None and self.schedule_options.any_stage_count:  # the split says how many
            return len(balance)
        return self.schedule_options.stages_for(self.workers)

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

"""The strategy's collectives, meaning what they mean under DDP: a pipeline copy is one
data-parallel replica, and every rank of one pipeline holds the same step values (its last stage's).

:class:`Collectives` holds them as methods of :class:`~lightning_pipe.strategy.PipelineStrategy`
(one of the parts the strategy's class is assembled from, each a module of its own).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _sync_ddp_if_available,
)
from torch import Tensor

from lightning_pipe.runtime.failure import raised_elsewhere

__all__ = ["Collectives", "close_process_groups", "open_strategy_groups"]

_OPEN: list[Any] = []
"""The groups the last fit's strategy opened (its own, beside the pipeline's)."""


def open_strategy_groups(groups: list[Any]) -> None:
    """Record the groups a fit's strategy opens, first closing those an earlier fit in this process
    left open: they outlive its ``teardown`` (a checkpoint saved after ``fit`` gathers over them), so
    without this every fit of a sweep run in one process would keep three gloo groups — connections
    and threads — to the end (their threads stop once the earlier strategy is collected). An earlier
    strategy cannot save once a later one has set up."""
    for group in _OPEN:
        with contextlib.suppress(RuntimeError, ValueError):  # already gone (a failure closed it)
            dist.destroy_process_group(group)
    _OPEN[:] = [group for group in groups if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER]


class Collectives:
    """Lightning's collectives of :class:`~lightning_pipe.strategy.PipelineStrategy`, as DDP's for a pipeline."""

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of this pipeline, pickled over a CPU group; a rank that failed
        meanwhile is named."""
        gathered: list[Any] = [None] * self.workers
        try:
            dist.all_gather_object(gathered, obj, group=self._pipeline_objects)
        except RuntimeError as error:
            raise self._failures.aborted() from error
        return gathered

    def on_exception(self, exception: BaseException) -> None:
        """Stop the other ranks within seconds: record the failure and close this rank's pipeline and
        process groups, so every rank waiting on it fails with this error instead of hanging."""
        if not self._connected or self.world_size == 1:
            return  # no other rank to stop: failed alike on every rank before they connected, or alone
        if not raised_elsewhere(exception):
            self._failures.fail(exception)
        if self.executor is not None:
            self.executor.transport.abort()
        if self._log_relay is not None:
            self._log_relay.close()  # a rank waiting for this one's logs fails at once
        for group in (self._objects, self._pipeline_objects, self._copies, None):  # None: the default group
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

    def _between_steps(self) -> None:
        """Before a collective of every rank that Lightning or a callback makes between steps
        (``ModelCheckpoint``, ``EarlyStopping``, ``Timer``): finish the steps in flight where this
        pipeline sums a tied weight's gradients across ranks. A rank may still be inside its last
        call, in that sum, which the others make only in their next call: a collective now would
        wait for it, and it for them (CDP and PipeDream on a GPT saving a checkpoint mid-epoch hung
        so). Without ties across ranks the calls hold no collective and keep running on."""
        executor = self.executor
        if executor is not None and executor.calls and any(tie.group is not None for tie in executor.ties):
            self.drain()

    def barrier(self, name: str | None = None) -> None:
        """Lightning's barrier; a rank that failed meanwhile is named (its error raised here)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        self._between_steps()
        try:
            dist.barrier()
        except RuntimeError as error:
            if not hasattr(self, "_failures"):
                raise
            raise self._failures.aborted() from error

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        self._between_steps()
        box = [obj]
        try:
            dist.broadcast_object_list(box, src)
        except RuntimeError as error:  # the source failed (its groups closed): raise its error
            if not hasattr(self, "_failures"):
                raise
            raise self._failures.aborted() from error
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``sync_dist``: every rank of a pipeline logs the same values (its last stage's), so the
        reduction runs over the pipeline copies only, between the ranks at the same position."""
        if not isinstance(tensor, Tensor) or self.data_parallel == 1:
            return tensor
        return _sync_ddp_if_available(tensor, group or self._copies, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """One entry per pipeline copy, as DDP gives one per process (a copy is one data-parallel
        replica: every rank of a pipeline holds the same step values, its last stage's), gathered
        between the ranks at the same position of every copy."""
        return _all_gather_ddp_if_available(tensor, group=group or self._copies, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's vote counts, as under DDP (``ModelCheckpoint``, ``EarlyStopping``): all of them
        (``all``) or any."""
        if not (dist.is_available() and dist.is_initialized()):
            return decision
        self._between_steps()
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)


def close_process_groups() -> None:
    """At interpreter exit, close every process group, the default one last, while Python still runs:
    left to the interpreter's finalisation, the strategy's several gloo groups were destroyed in no set
    order, and a worker thread still joinable aborted the finished process now and then ("terminate
    called without an active exception", exit status -6)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

"""A stage's update: tied gradients summed, loss scale undone, gradients clipped, then the optimizer's step.

- At its ``UPDATE`` action a stage sums its tied parameters' gradients with the other sharing stages'
  (:mod:`~lightning_pipe.runtime.ties`), clips its gradient by its own norm (each tie's part and the
  rest apart, so the copies of a tied parameter are clipped alike) and by value
  (:mod:`~lightning_pipe.runtime.clipping`), sets the step's hyper-parameters (``before_update``) and
  steps its optimizer, keeping the weight versions still in use
  (:class:`~lightning_pipe.runtime.weights.StageWeights`).
- A flushing schedule with global-norm clipping, float16 loss scaling or ties holds its updates back
  to the end of the call (*deferring*), when every stage's gradient of the step exists: every worker
  unscales its stages' gradients, their squared norms are summed over all workers in one all-reduce,
  every gradient is scaled by the unsplit model's clipping factor, and a step whose sum is not finite
  (an overflow) is skipped on every stage (Micikevicius et al. 2018, §3.2:
  :mod:`~lightning_pipe.runtime.loss_scaling`).
- *Holding* (flushing schedules, :attr:`Updates.hold`): the deferred updates wait past the end of the
  call, until :meth:`Updates.apply_deferred` is called, so that Lightning's ``on_after_backward`` and
  ``on_before_optimizer_step`` run in between and see the step's gradients
  (:meth:`Updates.gradients_shown`), as plain Lightning calls them before the optimizer steps.
- A call that only accumulates (gradient accumulation over steps, flushing schedules) *carries* each
  stage's gradient into the next step at its ``UPDATE`` instead (:meth:`Updates.carry`): ties,
  replicas, clipping and the loss scale wait for the update that applies the sum, which they treat as
  one step's gradient.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.batch_norm import DeferredNorms
from lightning_pipe.runtime.clipping import clip_by_value, norm_coefficient, scale, squared_norm
from lightning_pipe.runtime.loss_scaling import LossScale, refuse_without_flush
from lightning_pipe.runtime.ties import Tie, sum_ties
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import Action, Schedule

__all__ = ["Updates"]


class Updates:
    """The updates of this worker's stages.

    Args:
        schedule: the schedule (one step of it).
        weights: the stages this worker owns.
        ties: the parameters its stages share (with their groups and positions).
        norms: each stage's batch norm statistics, committed at its update.
        device, group: where this worker computes, and the process group of its pipeline.
        clip_grad_norm, clip_grad_value, before_update, loss_scale: as the executor's.

    Attributes:
        hold: a flushing schedule's updates wait past the end of the call for :meth:`apply_deferred`.
        deferred: the updates held back in the running call (or, holding, in the last one).
    """

    def __init__(
        self,
        schedule: Schedule,
        weights: Mapping[int, StageWeights],
        ties: list[Tie],
        norms: Mapping[int, DeferredNorms],
        device: torch.device,
        group: dist.ProcessGroup,
        *,
        clip_grad_norm: float | None,
        clip_grad_value: float | None,
        before_update: Callable[[int, int, torch.optim.Optimizer | None], None] | None,
        loss_scale: LossScale | None,
    ) -> None:
        for name, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise PlanningError(f"{name} must be a positive number or None; got {value!r}")
        if loss_scale is not None:
            refuse_without_flush(schedule.family, schedule.flush)
        self.owners = schedule.owners
        self.weights, self.ties, self.norms = weights, ties, norms
        self.device, self.group = device, group
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self.before_update, self.loss_scale = before_update, loss_scale
        self.flush = schedule.flush
        self._needs_all = clip_grad_norm is not None or loss_scale is not None or any(t.group is not None for t in ties)
        self.hold = False
        self.deferred: list[Action] = []
        self._prepared = False  # the deferred gradients' ties summed and loss scale undone

    @property
    def deferring(self) -> bool:
        """Whether a call's updates wait for the end of the call, when every stage's gradient of the
        step exists (:meth:`apply_deferred`)."""
        return self.flush and (self._needs_all or self.hold)

    def apply(self, action: Action, versions_kept: Callable[[int], set[int]]) -> None:
        """A stage's update at its ``UPDATE`` action, clipped by its own norm. ``versions_kept(stage)``:
        the versions of ``stage`` still in use, asked at the update; given with each call, not kept,
        so that no part of the executor refers back to it (an executor dropped is freed at once, and
        its connections with it)."""
        self._update(action, self.clip_grad_norm, versions_kept)

    def carry(self, action: Action) -> None:
        """A stage's ``UPDATE`` in a call that only accumulates: its gradient is kept as the start of
        the next step's (:meth:`StageWeights.carry`), nothing summed, clipped or stepped; batch norm's
        running statistics still move by the step's rows, as plain training moves them every batch."""
        self.weights[action.stage].carry(action.step)
        self.norms[action.stage].commit(action.step)

    def _update(
        self, action: Action, stage_norm: float | None, versions_kept: Callable[[int], set[int]], skip: bool = False
    ) -> None:
        """Apply a stage's step: clip (by ``stage_norm`` over its own gradient, and by value), set the
        step's hyper-parameters, step the optimizer (``skip``: drop the gradient, the version still
        advances), keeping the versions still in use."""
        weights = self.weights[action.stage]
        if not self.deferring:
            sum_ties(self.ties, [action], self.weights, self.owners)

        def prepare(grads: list[torch.Tensor | None]) -> None:
            if stage_norm is not None:
                for part in self._clipping_parts(action.stage, grads):
                    scale(part, norm_coefficient(float(squared_norm(part)) ** 0.5, stage_norm))
            if self.clip_grad_value is not None:
                clip_by_value(grads, self.clip_grad_value)
            if self.before_update is not None:
                self.before_update(action.stage, action.step, weights.optimizer)

        kept = versions_kept(action.stage) if weights.snapshots else set()
        weights.update(action.step, kept, prepare, skip=skip)
        self.norms[action.stage].commit(action.step)

    def _clipping_parts(self, stage: int, grads: list[torch.Tensor | None]) -> list[list[torch.Tensor | None]]:
        """The groups of a stage's gradients clipped by their own norm when each stage clips alone
        (non-flushing schedules): each tie's, then the rest; so the copies of a tied parameter on
        different stages are clipped alike."""
        tied = [tie.positions[stage] for tie in self.ties if stage in tie.positions]
        taken = {i for indices in tied for i in indices}
        rest = [g for i, g in enumerate(grads) if i not in taken]
        return [[grads[i] for i in indices] for indices in tied] + [rest]

    def apply_deferred(self, versions_kept: Callable[[int], set[int]]) -> None:
        """The updates held back to the end of a flushing call (or, holding, to this call): every
        worker sums its tied gradients and unscales its stages' gradients; under global-norm clipping
        or loss scaling it sums their squared norms (a stage's replicas each count ``1/r`` of it) in
        one all-reduce over all workers, scales its gradients by the unsplit model's clipping factor,
        then updates, or skips every update if the sum is not finite (an overflow, under loss
        scaling). Every worker takes part at the end of every call, with or without updates.
        ``versions_kept``: as :meth:`apply`'s."""
        grads = self.prepare()
        overflowed = False
        if self.clip_grad_norm is not None or self.loss_scale is not None:
            total = torch.zeros((), dtype=torch.float64)
            for action, stage_grads in zip(self.deferred, grads, strict=True):
                total += self._own_squared_norm(action.stage, stage_grads).cpu() / len(self.owners[action.stage])
            total = total.to(self.device)
            dist.all_reduce(total, group=self.group)
            overflowed = self.loss_scale is not None and not math.isfinite(float(total))
            if self.clip_grad_norm is not None and not overflowed:
                coefficient = norm_coefficient(float(total) ** 0.5, self.clip_grad_norm)
                for stage_grads in grads:
                    scale(stage_grads, coefficient)
        for action in self.deferred:
            self._update(action, None, versions_kept, skip=overflowed)
        if self.loss_scale is not None and self.deferred:
            self.loss_scale.update(overflowed)
        self.deferred.clear()
        self._prepared = False

    def prepare(self) -> list[list[torch.Tensor | None]]:
        """The deferred updates' gradients, their tied parts summed and the loss scale undone (once per
        step: ties sum over workers, so every worker prepares at the same point). Taken back from the
        parameters they were lent to: held past the call, they must not be there when Lightning's
        closure calls ``optimizer.zero_grad()``."""
        grads = [self.weights[a.stage].summed_gradients(a.step) for a in self.deferred]
        if not self._prepared:
            sum_ties(self.ties, self.deferred, self.weights, self.owners)
            if self.loss_scale is not None:
                for stage_grads in grads:
                    scale(stage_grads, self.loss_scale.inverse)
            self._prepared = True
        return grads

    @contextlib.contextmanager
    def gradients_shown(self) -> Iterator[None]:
        """The held step's gradients (summed over micro-batches, replicas and ties, unscaled) as the
        ``.grad`` of this worker's live parameters for the duration (Lightning's gradient hooks run
        inside); what the hooks change in them, in place or by assigning ``.grad`` (``None``: zero),
        is what the update applies. Every worker enters it at the same point of the step."""
        shown: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for action, grads in zip(self.deferred, self.prepare(), strict=True):
            weights = self.weights[action.stage]
            for param, grad in zip(weights.params, grads, strict=True):
                if grad is not None and id(param) not in weights.shared:
                    param.grad = grad
                    shown.append((param, grad))
        try:
            yield
        finally:
            for param, grad in shown:
                changed = param.grad
                if changed is None:
                    grad.zero_()
                elif changed is not grad:
                    grad.copy_(changed)
                param.grad = None

    def _own_squared_norm(self, stage: int, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """``Σ ‖g‖²`` of a stage's gradients, a tied parameter counting ``1/h`` on each of its ``h``
        sharing stages (once in the sum over all stages)."""
        total = squared_norm(grads)
        for tie in self.ties:
            if stage in tie.positions:
                tied = squared_norm([grads[i] for i in tie.positions[stage]])
                total = total - tied * (1 - 1 / len(tie.stages))
        return total

"""One micro-batch's forward and backward on one stage: what the executor runs for ``F``, ``B``, ``I``
and ``W``.

A forward takes its stage's input (the micro-batch of the data on the first stage, the stage before's
output otherwise), computes with the weight version its action names
(:class:`~lightning_pipe.runtime.weights.StageWeights`) and sends its output on, detached; on the last
stage it computes the loss, weighted by the micro-batch's share of the mini-batch, ``n_i / n``, so
that the accumulated gradient is the mini-batch mean ``1/N Σ ∇f_i`` of the update rules even when the
last micro-batch is smaller (and, for the backward, divided by the data-parallel pipelines and by the
steps one update accumulates: the mean over them). The micro-batch stays in flight, with what its
backward needs, until its last backward half:

- ``B`` differentiates the weights the forward used and sends the input gradient back; ``I`` computes
  the input gradient only and ``W`` the weight gradients later, nothing computed twice (zero bubble's
  split, Qi et al. 2024 §2: :class:`~lightning_pipe.runtime.split_backward.SplitBackward`). In a
  flushing schedule's cool-down a ``B`` runs as ``I``, sends, then ``W``
  (:mod:`~lightning_pipe.schedule.early`).
- With ``recompute`` a forward runs without autograd and keeps its input and random state; the
  backward runs it again with autograd first (GPipe's re-materialisation, Huang et al. 2019, §2.3).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from lightning_pipe.errors import PipelineRuntimeError
from lightning_pipe.runtime.activation_memory import ActivationMemory
from lightning_pipe.runtime.batch_norm import running_forward
from lightning_pipe.runtime.batches import MiniBatches, rows_of
from lightning_pipe.runtime.failure import add_note
from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.runtime.routing import Router
from lightning_pipe.runtime.split_backward import SplitBackward
from lightning_pipe.runtime.step_output import StepOutput
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import Action, Kind
from lightning_pipe.util.nested import flatten, map_tensors, tensors, unflatten

__all__ = ["ForwardBackward", "InFlight", "as_received"]

_T = TypeVar("_T")
_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


@dataclass
class InFlight:
    """A forward waiting for its backward (and, after an ``I``, for its ``W``)."""

    inputs: Any
    version: int
    leaves: dict[str, torch.Tensor]
    outputs: Any = None
    loss: torch.Tensor | None = None
    saved: dict[int, int] = field(default_factory=dict)  # storages autograd saved (key -> bytes), when tracked
    rng: tuple[torch.Tensor, ...] | None = None
    roots: list[torch.Tensor] = field(default_factory=list)
    root_grads: list[torch.Tensor] | None = None
    split: SplitBackward | None = None


def _sent_forward(outputs: Any, differentiated: bool) -> tuple[Any, tuple[bool, ...] | None]:
    """A stage's outputs as sent to the next stage: detached, with which of them require grad
    (``None`` after a forward without autograd, recomputed in the backward: every floating one will)."""
    flags = tuple(t.requires_grad for t in tensors(outputs)) if differentiated else None
    return map_tensors(torch.Tensor.detach, outputs), flags


def _received_forward(message: tuple[Any, tuple[bool, ...] | None]) -> Any:
    """The inputs of a stage: leaves that require grad where the sender's outputs did (a tensor
    computed from constants, such as an attention mask, stays without grad: attention kernels choose
    their algorithm by it, and no gradient is wasted on it)."""
    outputs, flags = message
    found = iter(flags) if flags is not None else None
    return map_tensors(
        lambda t: t.detach().requires_grad_((found is None or next(found)) and t.is_floating_point()), outputs
    )


def as_received(outputs: Any) -> Any:
    """A stage's ``outputs`` (computed with autograd) as the next stage receives them: detached leaves
    that take a gradient where the outputs did (:func:`_sent_forward`, :func:`_received_forward`). The
    profiler feeds each layer the previous one's output so (:mod:`lightning_pipe.cost.profiler`)."""
    return _received_forward(_sent_forward(outputs, differentiated=True))


class ForwardBackward:
    """The forwards and backwards of this worker's micro-batches.

    Args:
        stages, microbatches: the schedule's stages and micro-batches per step.
        worker: this worker (for messages).
        weights, borrowed: the stages this worker owns, and those it computes with a lender's weights.
        recompute: stage -> whether its backward recomputes the forward.
        batches: the micro-batches of the data and targets.
        router: where messages come from and go.
        transport: the pipeline's transport (its waits time a split backward's halves).
        memory: the bytes autograd saves, when counted.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        pipelines: the data-parallel pipelines, whose mean gradient the losses make.
        loss_scale: float16's loss scale, multiplying the last stage's losses in the backward.
        device: where this worker computes.

    Attributes:
        in_flight: (stage, micro-batch, step) -> the forwards waiting for their backward.
        copies_inputs: stages whose first layer works in place on the received input.
        loss_key: the (step, micro-batch) whose loss ``loss_fn`` is computing, for callers that log.
        sent_early: when the running backward's input gradient left (and the waits until then), if
            it ran as ``I`` then ``W``.
        accumulation: the steps whose gradients one update applies (set per call by the executor:
            gradient accumulation over calls), whose mean the losses make.
    """

    def __init__(
        self,
        *,
        stages: int,
        microbatches: int,
        worker: int,
        weights: Mapping[int, StageWeights],
        borrowed: Mapping[int, StageWeights],
        recompute: Mapping[int, bool],
        batches: MiniBatches,
        router: Router,
        transport: Transport,
        memory: ActivationMemory,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        pipelines: int,
        loss_scale: LossScale | None,
        device: torch.device,
    ) -> None:
        self.last, self.microbatches, self.worker = stages - 1, microbatches, worker
        self.weights, self.borrowed, self.recompute = weights, borrowed, recompute
        self.batches, self.router, self.transport, self.memory = batches, router, transport, memory
        self.loss_fn, self.pipelines, self.loss_scale, self.device = loss_fn, pipelines, loss_scale, device
        self.in_flight: dict[tuple[int, int, int], InFlight] = {}
        self.copies_inputs: set[int] = set()
        self.loss_key: tuple[int, int] | None = None
        self.sent_early: tuple[float, float] | None = None
        self.accumulation = 1

    def _computing(self, stage: int) -> StageWeights:
        """The weights this worker computes ``stage`` with: its own, or borrowed."""
        return self.weights[stage] if stage in self.weights else self.borrowed[stage]

    def forward(self, action: Action, output: StepOutput, return_outputs: bool) -> None:
        """``F``: the loss, or the output sent on; the micro-batch goes in flight."""
        s, mb, t = action.stage, action.microbatch, action.step
        inputs = self.batches.inputs[t][mb] if s == 0 else _received_forward(self.router.incoming(("F", s, mb, t)))
        weights = self._computing(s)
        state = InFlight(inputs=inputs, version=action.version, leaves=weights.leaves(action.version))
        try:
            with running_forward(t, mb):  # batch norm's statistics count once per step (.batch_norm)
                if self.recompute[s]:
                    state.rng = self._rng_state()
                    with torch.no_grad():  # on a copy: a first layer working in place would change the input kept
                        state.outputs = weights.forward(state.leaves, map_tensors(torch.Tensor.clone, inputs))
                else:
                    self._autograd_forward(action, weights, state)
        except Exception as error:
            add_note(error, self._where(action, inputs))
            raise
        if s == self.last:
            loss = self._last_loss(action, state, differentiated=not self.recompute[s])
            output.microbatch_losses[(t, mb)] = loss.detach()  # a float at the call's end: no sync here
            if return_outputs:
                output.outputs[(t, mb)] = map_tensors(torch.Tensor.detach, state.outputs)
        else:
            self.router.deliver(action, _sent_forward(state.outputs, not self.recompute[s]))
        self.in_flight[(s, mb, t)] = state
        if s == 0 and mb == self.microbatches - 1:
            self.batches.inputs.pop(t, None)

    def _where(self, action: Action, inputs: Any) -> str:
        """Where a forward failed: the stage, this rank, and the input's source and shapes (a stage
        that fails on the output of the stage before it points at the split)."""
        s = action.stage
        shapes = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors(inputs)]
        if s == 0:
            source = "the micro-batch of the data"
        else:
            producer = self.router.worker_of(Kind.F, s - 1, action.microbatch, action.step)
            source = f"the output of stage {s - 1} (rank {producer})"
        return f"raised in the forward of stage {s} (rank {self.worker}) on {source}, tensors {shapes}"

    def _in_place_safe(self, stage: int, inputs: Any, forward: Callable[[Any], _T]) -> _T:
        """``forward(inputs)``, or ``forward`` of a copy of them for a stage whose first layer works in
        place on its input (``ReLU(inplace=True)`` after a cut, common in torchvision models): a
        received input is a leaf that requires grad, on which autograd forbids in-place operations.
        A stage is found out by that error on its first forward and gets copies from then on."""
        if stage in self.copies_inputs:
            return forward(map_tensors(torch.Tensor.clone, inputs))
        try:
            return forward(inputs)
        except RuntimeError as error:
            if stage == 0 or _IN_PLACE_ON_LEAF not in str(error):
                raise
        self.copies_inputs.add(stage)
        return forward(map_tensors(torch.Tensor.clone, inputs))

    def _autograd_forward(self, action: Action, weights: StageWeights, state: InFlight) -> None:
        """The stage's forward of ``state.inputs`` with autograd, as a forward runs it or a backward
        recomputes it: its outputs and the storages autograd saved go into ``state``."""
        s = action.stage
        state.outputs, state.saved = self._in_place_safe(
            s, state.inputs, lambda x: self.memory.forward(weights, state.leaves, x, action.step, s == 0)
        )

    def _last_loss(self, action: Action, state: InFlight, differentiated: bool) -> torch.Tensor:
        """The last stage's loss of the micro-batch (``state.outputs``), weighted by its share of the
        mini-batch's rows. ``differentiated`` (the outputs carry autograd's graph): what it contributes
        to the gradient (:meth:`_gradient_share`) goes into ``state.loss``, for the backward."""
        t, mb = action.step, action.microbatch
        target = self.batches.targets[t][mb]
        self.loss_key = (t, mb)  # which micro-batch loss_fn is computing, for callers that log
        loss = self.loss_fn(state.outputs, target) * (rows_of(target) / self.batches.rows[t])
        if differentiated:
            state.loss = self._gradient_share(loss)
        return loss

    def _gradient_share(self, loss: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's loss contributes to the gradient an update applies: summed over the
        data-parallel pipelines and the steps accumulated into it, their mean; with one pipeline and
        no accumulation the loss itself, no division (one autograd node less per micro-batch)."""
        parts = self.pipelines * self.accumulation
        return loss if parts == 1 else loss / parts

    def _rng_state(self) -> tuple[torch.Tensor, ...]:
        """The random state a forward starts from (CPU, and the GPU's when computing there)."""
        if self.device.type == "cuda":
            return torch.get_rng_state(), torch.cuda.get_rng_state(self.device)
        return (torch.get_rng_state(),)

    def _recompute(self, action: Action, state: InFlight) -> None:
        """GPipe rematerialisation: the forward again, with autograd, under the forward's RNG state (same
        dropout masks), leaving the module's buffers as they were (batch norm's running statistics are
        updated once per micro-batch, by the first forward)."""
        weights = self._computing(action.stage)
        accelerated = [self.device] if self.device.type == "cuda" else []
        buffers = [(buffer, buffer.clone()) for buffer in weights.module.buffers()]
        with torch.random.fork_rng(devices=accelerated):
            torch.set_rng_state(state.rng[0])
            if accelerated:
                torch.cuda.set_rng_state(state.rng[1], self.device)
            self._autograd_forward(action, weights, state)
        for buffer, before in buffers:
            # through .data: batch norm's backward node holds the running statistics it was given and
            # checks their version, though training mode's gradient does not read them
            buffer.data.copy_(before)
        if action.stage == self.last:
            self._last_loss(action, state, differentiated=True)

    def _roots(self, action: Action, state: InFlight) -> None:
        """The tensors to differentiate and their incoming gradients (none for the scalar loss)."""
        s, mb, t = action.stage, action.microbatch, action.step
        if self.recompute[s]:
            self._recompute(action, state)
        if s == self.last:
            loss = state.loss if self.loss_scale is None else state.loss * self.loss_scale.scale
            state.roots, state.root_grads = [loss], None
            return
        grads = tensors(self.router.incoming(("B", s, mb, t)))
        outputs = tensors(state.outputs)
        if [(o.shape, o.dtype) for o in outputs] != [(g.shape, g.dtype) for g in grads]:
            producer = self.router.backward_worker(s + 1, mb, t)
            raise PipelineRuntimeError(
                f"stage {s + 1} (rank {producer}) sent gradients {[(tuple(g.shape), g.dtype) for g in grads]} for "
                f"stage {s}'s outputs {[(tuple(o.shape), o.dtype) for o in outputs]} (rank {self.worker})"
            )
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        state.roots, state.root_grads = [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, action: Action, weights_too: bool, early: bool = False) -> None:
        """``B`` (input and weight gradients), or ``I``: input gradients now, the weights' at ``W``
        (:class:`~lightning_pipe.runtime.split_backward.SplitBackward`, nothing computed twice). An
        ``early`` ``B`` runs as ``I``, sends, then ``W``."""
        s, mb, t = action.stage, action.microbatch, action.step
        state = self.in_flight[(s, mb, t)]
        self._roots(action, state)
        inputs = [x for x in tensors(state.inputs) if x.requires_grad] if s > 0 else []
        split = not weights_too or (early and bool(inputs))
        if split:
            state.split = SplitBackward(
                state.roots, state.root_grads, inputs, self._computing(s).differentiable(state.leaves)
            )
            grads = state.split.input_gradients()
        else:
            grads = self._computing(s).backward(t, state.leaves, state.roots, state.root_grads, inputs)
        if s > 0:
            self._send_input_grads(action, state, grads)
        if weights_too and split:
            self.sent_early = (time.perf_counter(), self.transport.waited)
            self.weight_gradient(action)
        elif weights_too:
            self._release(action)

    def weight_gradient(self, action: Action) -> None:
        """``W``: the weight gradients of a micro-batch whose ``I`` ran."""
        state = self.in_flight[(action.stage, action.microbatch, action.step)]
        state.split.weight_gradients(self._computing(action.stage).accumulator(action.step))
        self._release(action)

    def _send_input_grads(self, action: Action, state: InFlight, grads: list[torch.Tensor | None]) -> None:
        skeleton, sent = flatten(state.inputs)
        computed = iter(grads)
        full = []
        for tensor in sent:
            grad = next(computed) if tensor.requires_grad else None
            full.append(torch.zeros_like(tensor) if grad is None else grad)
        self.router.deliver(action, unflatten(skeleton, full))

    def _release(self, action: Action) -> None:
        """Forget a micro-batch once its last backward half ran."""
        s, t = action.stage, action.step
        state = self.in_flight.pop((s, action.microbatch, t))
        self.memory.release(state.saved, t, self.batches.inputs, self.in_flight)
        if s == self.last:
            self.batches.target_used(t)

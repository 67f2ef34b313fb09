"""Run any schedule of the IR for real: one process per worker, point-to-point transfers.

One executor runs every family (docs/design.md): it walks its worker's actions (a
:class:`~lightning_pipe.runtime.program.Program`, one call per mini-batch) and does what each says —
forward ``F``, backward ``B`` or its halves ``I`` and ``W``, optimizer ``UPDATE`` — with the weight
version the action names (:class:`~lightning_pipe.runtime.weights.StageWeights`). A flushing
schedule's call may also only accumulate (``step(update=False)``): its ``UPDATE`` actions keep the
step's gradient for the next step (gradient accumulation over calls, as Lightning's
``accumulate_grad_batches``). Receives of a call's large messages are posted when it starts, so data
moves while the worker computes (small ones when they are needed); sends are asynchronous.

The executor runs the action loop and keeps its timeline; its parts do the rest: the micro-batches
(:mod:`.batches`), where actions run and messages go (:mod:`.routing`), each micro-batch's forward
and backward (:mod:`.forward_backward`, the loss of micro-batch ``i`` weighted by its share of the
mini-batch, ``n_i / n``), the bytes autograd saves (:mod:`.activation_memory`), the updates with
clipping and loss scaling (:mod:`.updates`), the weight versions they keep (:mod:`.versions_kept`),
lent, ring-reduced and relayed stages and shared parameters (:mod:`.borrowing`, :mod:`.gradient_rings`,
:mod:`.stage_relays`, :mod:`.ties`), and what a call returns (:mod:`.step_output`).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.errors import PipelineRuntimeError, PlanningError, check_whole
from lightning_pipe.runtime.activation_memory import ActivationMemory
from lightning_pipe.runtime.batch_norm import DeferredNorms
from lightning_pipe.runtime.batches import MiniBatches, split_batch
from lightning_pipe.runtime.borrowing import Borrowing, Lending, check_borrowing, last_gradients
from lightning_pipe.runtime.calibration import gathered_stage_costs
from lightning_pipe.runtime.failure import FailureBoard, raised_elsewhere
from lightning_pipe.runtime.forward_backward import ForwardBackward
from lightning_pipe.runtime.garbage import AlignedCollection
from lightning_pipe.runtime.gradient_rings import RingReducer
from lightning_pipe.runtime.groups import pipeline_ranks, replica_groups
from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.runtime.program import Program, repeated, shift
from lightning_pipe.runtime.routing import Placement, Router
from lightning_pipe.runtime.shared_memory import open_links
from lightning_pipe.runtime.shared_memory_sizes import link_sizes, shared_memory_capacity
from lightning_pipe.runtime.stage_relays import Relays
from lightning_pipe.runtime.step_output import LossSums, StepOutput, share
from lightning_pipe.runtime.ties import find_ties, tie_groups, tied_maker, updated_elsewhere_here
from lightning_pipe.runtime.timeline import Timeline
from lightning_pipe.runtime.transport import Transport, post_ahead
from lightning_pipe.runtime.updates import Updates
from lightning_pipe.runtime.versions_kept import VersionsKept
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.early import cooldown_backwards
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule
from lightning_pipe.schedule.simulation import Interval
from lightning_pipe.schedule.stage_costs import StageCosts
from lightning_pipe.schedule.validate import validate
from lightning_pipe.util.nested import map_tensors

__all__ = ["PipelineExecutor"]


class PipelineExecutor:
    """The runtime of one worker (this process).

    Args:
        schedule: ``make(k)`` returning the schedule of ``k`` steps (validated, versions assigned), or a
            flushing :class:`Schedule` (one step is repeated).
        stages: the stage modules, all of them or those this worker runs (``{stage: module}``).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        optimizer: builds a stage's optimizer from its parameters, e.g.
            ``lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)``.
        device: where this worker computes (default: cuda:<local rank> when available, else cpu).
        recompute: recompute activations in the backward (GPipe rematerialisation), for every stage or
            per stage.
        early_gradients: in the cool-down of a flushing schedule, a backward sends its input gradient
            before computing its weight gradients (:mod:`lightning_pipe.schedule.early`).
        track_memory: count the bytes autograd saves for the micro-batches in flight, each storage
            once however many of them save it (the micro-batches of the first stage are views of one
            batch) (:attr:`saved_bytes`, :attr:`peak_saved_bytes`, and :attr:`memory_timeline`: the
            count after every action, which changes only in forwards (up, from the start of their
            compute) and backwards (down, at their end);
            saved-tensor hooks cost a little time).
        timeout_seconds: a single wait longer than this fails (a deadlock, or a peer that hangs).
        timeline_length: how many of the latest actions :attr:`timeline` keeps (``None``: all of them,
            which grows without bound over a long training run).
        gc_every: Python's automatic garbage collection is off while the executor is open; every rank
            collects at the start of every ``gc_every``-th call instead, and on a drain, so the pauses
            coincide rather than stall the pipeline one rank after another
            (:mod:`lightning_pipe.runtime.garbage`). ``None`` leaves Python's collector alone.
        clip_grad_norm: clip the gradients to this norm before each update: the global norm over
            every stage for a flushing schedule, each stage's own norm otherwise
            (:mod:`lightning_pipe.runtime.clipping`).
        clip_grad_value: clamp every gradient to ``[-value, value]`` before each update.
        before_update: ``before_update(stage, step, optimizer)`` runs just before a stage's optimizer
            applies step ``step`` (e.g. to set the learning rate the step should use).
        loss_scale: float16 mixed precision's dynamic loss scaling, shared by the stages
            (:mod:`lightning_pipe.runtime.loss_scaling`): the last stage's losses are multiplied by
            its factor, gradients are unscaled before clipping, a step that overflowed on any stage
            is skipped on all of them, and the factor is updated alike on every worker. Flushing
            schedules only.
        pipelines: data parallelism over whole pipelines: the global ranks of each pipeline's workers
            (worker ``w`` of pipeline ``p`` is rank ``pipelines[p][w]``); each pipeline trains on its
            own mini-batches and a stage's gradients are averaged over the pipelines (and summed
            over its replicas inside a pipeline). Default: one pipeline over every rank.
        post_ahead_bytes: the receives of a call's messages of at least this many bytes are posted
            when the call starts, so their transfers overlap compute; smaller ones when they are
            needed (0: all ahead). Default: :func:`~lightning_pipe.runtime.transport.post_ahead`.
        shared_memory_bytes: on the CPU, messages between workers on the same host go through a ring
            buffer of this many bytes per direction in shared memory instead of gloo's sockets
            (:mod:`lightning_pipe.runtime.shared_memory`; a message that finds the ring full goes by
            gloo). Default 64 MiB on the CPU; 0 (gloo only) on GPUs, whose messages NCCL carries.
            With ``message_bytes``, each ring is only as large as its link needs
            (:mod:`~lightning_pipe.runtime.shared_memory_sizes`), at most this.
        message_bytes: the bytes of one micro-batch's activation leaving each stage but the last
            (and of its gradient coming back), as a plan knows them: they size the rings.

    :attr:`make` gives the schedule of any number of steps as the executor runs it (with the updates
    of stages sharing a parameter on one worker after all their backwards of the step:
    :func:`~lightning_pipe.runtime.ties.tied_maker`).
    :attr:`timeline` holds the actions run (a :class:`~lightning_pipe.runtime.timeline.Timeline`,
    read as :class:`~lightning_pipe.schedule.simulation.Interval` objects): each one's start and end
    (seconds since the executor was made) and the seconds it waited for messages; the rest is its own
    compute.
    """

    def __init__(
        self,
        schedule: Callable[[int], Schedule] | Schedule,
        stages: Mapping[int, nn.Module] | Sequence[nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        device: torch.device | str | None = None,
        recompute: bool | Sequence[bool] = False,
        early_gradients: bool = True,
        track_memory: bool = False,
        timeout_seconds: float = 300.0,
        timeline_length: int | None = 100_000,
        gc_every: int | None = 50,
        post_ahead_bytes: int | None = None,
        shared_memory_bytes: int | None = None,
        message_bytes: Sequence[float] | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        before_update: Callable[[int, int, torch.optim.Optimizer | None], None] | None = None,
        loss_scale: LossScale | None = None,
        pipelines: Sequence[Sequence[int]] | None = None,
    ) -> None:
        check_whole("timeline_length", timeline_length, 0, "actions", optional=True)
        check_whole("gc_every", gc_every, 1, "calls", optional=True)
        check_whole("post_ahead_bytes", post_ahead_bytes, 0, "bytes", optional=True)
        check_whole("shared_memory_bytes", shared_memory_bytes, 0, "bytes", optional=True)
        make = schedule if callable(schedule) and not isinstance(schedule, Schedule) else repeated(schedule)
        if not dist.is_initialized():
            raise PlanningError("initialise torch.distributed first (torchrun, Lightning or init_process_group)")
        modules = dict(stages) if isinstance(stages, Mapping) else dict(enumerate(stages))
        ties = find_ties(modules)
        self.make = make = tied_maker(make, ties)
        self.schedule = make(1)
        validate(self.schedule)
        check_borrowing(self.schedule)
        self.global_rank = dist.get_rank()
        self.pipelines = pipeline_ranks(pipelines, self.schedule.workers)
        self.ranks = next(ranks for ranks in self.pipelines if self.global_rank in ranks)
        self.rank, self.world = self.ranks.index(self.global_rank), len(self.ranks)
        self.programs = Program.build(make)
        self.program = self.programs[self.rank]
        self.device = torch.device(device) if device is not None else _default_device()
        span = max(p.base for p in self.programs) + 2 * max(p.period for p in self.programs) + 1
        generated = make(span)
        split_stages = {a.stage for _, _, a in self.schedule.actions() if a.kind is Kind.I}
        placement = Placement(generated, self.program.base, self.program.period, split_stages)
        mine = sorted({a.stage for a in self.schedule.orders[self.rank] if a.kind in COMPUTE})
        missing = [s for s in mine if s not in modules]
        if missing:
            raise PlanningError(f"rank {self.rank} runs stages {mine} but got no module for {missing}")
        pipeline_groups = [tuple(dist.new_group(list(ranks)) for _ in range(3)) for ranks in self.pipelines]
        data_group, overflow_group, self.group = pipeline_groups[self.pipelines.index(self.ranks)]
        groups = replica_groups(self.schedule, self.pipelines, self.global_rank)
        snapshots = not self.schedule.flush
        self.lending = Lending.of(self.schedule, self.rank)
        owned = [s for s in mine if s not in self.lending.lenders]
        shared = updated_elsewhere_here(ties, owned)
        self.weights = {
            s: StageWeights(modules[s].to(self.device), optimizer, snapshots, groups.get(s), shared.get(s, ()))
            for s in owned
        }
        self._replicated_stages = {s for s, w in self.weights.items() if w.group is not None}
        # stages computed here with another worker's weights (FSDP, FSLPP): no optimizer, lent every call
        self.borrowed = {s: StageWeights(modules[s].to(self.device), None, False) for s in self.lending.lenders}
        self.ties = tie_groups(ties, self.schedule, self.pipelines, self.global_rank, self.lending, self.weights)
        self.norms = {s: DeferredNorms(weights.module) for s, weights in self.weights.items()}
        flags = [recompute] * self.schedule.stages if isinstance(recompute, bool) else list(recompute)
        recomputed = {s: bool(flags[s]) for s in mine}
        self.failures = FailureBoard(dist.distributed_c10d._get_default_store(), self.global_rank)
        capacity = shared_memory_capacity(shared_memory_bytes, self.device)
        rings = link_sizes(self.schedule, placement, self.rank, self.ranks, capacity, message_bytes) if capacity else {}
        self.transport = Transport(
            self.global_rank,
            self.device,
            self.failures,
            (data_group, overflow_group),
            timeout_seconds=timeout_seconds,
            keep_sends=2 * max(p.period for p in self.programs) + 2,
            post_ahead_bytes=post_ahead(post_ahead_bytes, self.device),
            links=open_links(rings, data_group) if rings else None,
        )
        if self.schedule.rings and len(self.pipelines) > 1:
            raise PlanningError(
                f"{self.schedule.family}: its stages' gradients are reduced along a ring of its workers, which is "
                "its data parallelism: run it on one pipeline (no data_parallel copies)"
            )
        self.rings = RingReducer(self.schedule, self.rank, self.ranks, self.transport)
        base, period = max(p.base for p in self.programs), max(p.period for p in self.programs)
        self.relays = Relays(generated, self.rank, self.ranks, base, period, self.transport)
        self.relays.attach(self.weights)
        self.borrowing = Borrowing(self.lending, self.rank, self.ranks, self.weights, self.borrowed, self.transport)
        self.router = Router(placement, self.rank, self.ranks, self.transport, self.borrowing, self.rings, self.relays)
        ours = [a for a in self.schedule.orders[self.rank] if a.kind is Kind.F]
        self.needs_inputs = any(a.stage == 0 for a in ours)
        self.needs_targets = any(a.stage == self.schedule.stages - 1 for a in ours)
        self.calls = 0
        self.origin = 0
        self.memory = ActivationMemory(track_memory, timeline_length)
        m = self.schedule.microbatches
        self.batches = MiniBatches(self.rank, m, self.device, self.needs_inputs, self.needs_targets, self.memory)
        self.early_gradients = early_gradients and self.schedule.flush
        self._calls_cache: dict[tuple[int, int], list[Action]] = {}
        self.timeline = Timeline(timeline_length)
        self._run_index = -1  # the run (a call or a drain) under way, counted from 0: each interval's ``call``
        self.garbage = AlignedCollection(gc_every)
        self.updates = Updates(
            self.schedule,
            self.weights,
            self.ties,
            self.norms,
            self.device,
            self.group,
            clip_grad_norm=clip_grad_norm,
            clip_grad_value=clip_grad_value,
            before_update=before_update,
            loss_scale=loss_scale,
        )
        self.loss_scale = loss_scale
        self.compute = ForwardBackward(
            stages=self.schedule.stages,
            microbatches=m,
            worker=self.rank,
            weights=self.weights,
            borrowed=self.borrowed,
            recompute=recomputed,
            batches=self.batches,
            router=self.router,
            transport=self.transport,
            memory=self.memory,
            loss_fn=loss_fn,
            pipelines=len(self.pipelines),
            loss_scale=loss_scale,
            device=self.device,
        )
        window = 4 * (self.schedule.stages + m)  # a relayed stage's next actions looked at
        self.versions = VersionsKept(self.program, self.rank, self.compute.in_flight, self.relays, window)
        self.loss_sums = LossSums(m)
        self._running: list[Action] = []  # the actions of the call (or drain) being run
        self._position = 0  # the index of the one running
        dist.barrier()
        self.epoch = time.perf_counter()

    @property
    def saved_bytes(self) -> int:
        """The bytes autograd saves now for the micro-batches in flight (``track_memory``)."""
        return self.memory.saved_bytes

    @property
    def peak_saved_bytes(self) -> int:
        """The most :attr:`saved_bytes` reached (``track_memory``)."""
        return self.memory.peak_saved_bytes

    @property
    def memory_timeline(self) -> deque[tuple[float, int]]:
        """``(moment, saved bytes)`` after every action (``track_memory``)."""
        return self.memory.timeline

    @property
    def copies_inputs(self) -> set[int]:
        """Stages whose first layer works in place on the received input (their forwards get copies)."""
        return self.compute.copies_inputs

    @property
    def next_step(self) -> int:
        """The step the next call runs (counted from the first, across drains)."""
        return self.origin + self.calls

    @property
    def in_flight(self) -> bool:
        """Whether steps are in flight between calls: a non-flushing schedule's, until :meth:`drain`."""
        return bool(self.calls) and not self.schedule.flush

    def is_first_owner(self, stage: int) -> bool:
        """Whether this rank is ``stage``'s first worker, the one that evaluates, saves and reports it."""
        return self.schedule.first_owner(stage) == self.rank

    @property
    def stage_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the stages this rank updates."""
        return [weights.optimizer for weights in self.weights.values() if weights.optimizer is not None]

    @property
    def loss_key(self) -> tuple[int, int] | None:
        """The (step, micro-batch) whose loss ``loss_fn`` is computing, for callers that log."""
        return self.compute.loss_key

    # -- the training loop's entry points --------------------------------------------------------
    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        share_losses: bool = False,
        update: bool = True,
        accumulation: int = 1,
    ) -> StepOutput:
        """Run one call: feed mini-batch ``inputs``/``targets`` (only the ranks running the first and
        last stage need them) and run every action that can run with the data given so far.

        With ``share_losses`` (a collective: every rank must ask) every rank gets the losses, and the
        last stage's outputs when ``return_outputs`` is set too.

        Gradient accumulation over calls (flushing schedules; every rank passes the same values):
        ``accumulation`` is the number of steps whose gradients one update applies, each step's losses
        divided by it for the backward (the reported losses are not), so that the update applies their
        mean, as Lightning's ``accumulate_grad_batches`` divides the loss; ``update=False`` ends the step
        without its update, the gradient kept as the start of the next step's
        (:meth:`~lightning_pipe.runtime.updates.Updates.carry`).
        """
        check_whole("accumulation", accumulation, 1, "steps")
        if (accumulation != 1 or not update) and not self.schedule.flush:
            raise PipelineRuntimeError(
                f"gradient accumulation over calls (update={update}, accumulation={accumulation}) needs a flushing "
                f"schedule: {self.schedule.family} applies each step's gradient while later steps are in flight, so "
                "no call can end without its updates; accumulate over micro-batches instead (more per step)"
            )
        if self.updates.deferred:
            raise PipelineRuntimeError(
                "the last call's updates are held: call release_updates() first, on every worker"
            )
        self.compute.accumulation = accumulation
        call = self.calls
        self.garbage.call()
        try:
            self.batches.store(self.origin + call, inputs, targets)
        except Exception as error:
            self.stop(error)
            raise
        output = self._run(
            self._actions(self.rank, call), lambda peer: self._actions(peer, call), return_outputs, update
        )
        self.calls += 1
        self._calls_cache = {key: actions for key, actions in self._calls_cache.items() if key[1] >= self.calls}
        return share(output, self.world, self.group) if share_losses else output

    def release_updates(self) -> None:
        """Apply the updates the last call held back (``updates.hold``: a flushing schedule's, after
        Lightning's gradient hooks); every worker calls it, after every call that updates."""
        try:
            self.updates.apply_deferred(self._versions_kept)
        except Exception as error:
            self.stop(error)
            raise

    def _actions(self, worker: int, call: int) -> list[Action]:
        """Worker ``worker``'s actions of call ``call`` since the last drain, in absolute steps (kept
        for the calls still looked at: this one's peers and the next few)."""
        key = (worker, call)
        if key not in self._calls_cache:
            self._calls_cache[key] = [shift(a, self.origin) for a in self.programs[worker].call(call)]
        return self._calls_cache[key]

    def _drain_actions(self, worker: int) -> list[Action]:
        return [shift(a, self.origin) for a in self.programs[worker].finish(self.calls - 1)]

    def drain(self, *, return_outputs: bool = False, share_losses: bool = False) -> StepOutput:
        """Finish every step in flight (end of epoch, validation, checkpoint); a no-op when flushed.
        The next :meth:`step` starts a new fill."""
        output = StepOutput()
        if self.calls:
            if self.relays.stages:
                self.relays.begin_drain(self._drain_actions, self.world, self.origin + self.calls)
            output = self._run(self._drain_actions(self.rank), self._drain_actions, return_outputs)
            self.relays.end_drain()
            self.transport.flush()
            self._move_origin(self.origin + self.calls)
            self.calls = 0
            self._calls_cache.clear()
            for weights in self.weights.values():  # the next fill starts from the live weights
                weights.forget_versions()
            self.garbage.full()
        return share(output, self.world, self.group) if share_losses else output

    def _move_origin(self, origin: int) -> None:
        """The step the programs count from, for the executor, its router and the relays."""
        self.origin = self.router.origin = self.relays.origin = origin

    def evaluate(self, inputs: Any, microbatches: int, on_output: Callable[[int, Any], None]) -> None:
        """A forward-only pipeline over the live weights (validation, test, predict): ``inputs`` (needed
        on the worker of the first stage) is split into ``microbatches`` micro-batches that flow through
        the stages without autograd; on the worker of the last stage, ``on_output(i, output)`` receives
        micro-batch ``i``'s output, in order. A replicated stage runs on its first worker. Every worker
        must call it with the same ``microbatches``, after a :meth:`drain` (no step in flight)."""
        if self.calls:
            raise PipelineRuntimeError("evaluate() runs on drained weights: call drain() first, on every worker")
        check_whole("microbatches", microbatches, 1)
        last = self.schedule.stages - 1
        worker = self.schedule.first_owners
        mine = [s for s in range(self.schedule.stages) if worker[s] == self.rank]
        try:
            parts = split_batch(inputs, microbatches) if 0 in mine else []
            self.transport.next_call()
            for mb in range(microbatches):  # the messages of the stages before, through the router
                for s in mine:
                    if s > 0 and worker[s - 1] != self.rank:
                        self.router.expect_from(worker[s - 1], ("E", s, mb, self.origin))
            for mb in range(microbatches):
                for s in mine:
                    if s == 0:
                        x = map_tensors(lambda t: t.to(self.device), parts[mb])
                    else:
                        x = self.router.incoming(("E", s, mb, self.origin))
                    with torch.no_grad():
                        try:
                            y = self.weights[s].module(x)
                        except Exception as error:
                            raise self._mismatch(Action(Kind.F, s, mb, self.origin), x, error) from error
                    if s == last:
                        on_output(mb, y)
                    else:
                        self.router.send_to(worker[s + 1], ("E", s + 1, mb, self.origin), y)
        except Exception as error:
            self.stop(error)
            raise

    def close(self) -> None:
        """Wait for pending sends, then release the pipeline's process groups (their connections)."""
        self.transport.flush()
        self.transport.abort()
        replicas = [w.group for w in self.weights.values() if w.group is not None]
        ties = [tie.group for tie in self.ties if tie.group is not None]
        for group in [self.group, *replicas, *ties]:
            with contextlib.suppress(RuntimeError, ValueError):  # already gone
                dist.destroy_process_group(group)
        self.garbage.close()
        for norms in self.norms.values():
            norms.close()

    def measured_costs(self, since_step: int = 0, to_next: bool = False, **network: object) -> StageCosts:
        """Every stage's mean forward, backward (and halves) and update seconds as this pipeline ran
        them, waits for messages excluded, over the steps ``>= since_step`` the timelines still hold
        (:mod:`lightning_pipe.runtime.calibration`): costs to simulate any other schedule with.
        ``network`` sets the other fields of :class:`StageCosts` (``bandwidth``, ``latency``,
        ``overhead``, ``activation_bytes``, ...); ``to_next``: an action lasts until the worker's next one
        starts (:func:`~lightning_pipe.runtime.calibration.measured_seconds`). A collective: every rank
        must call it."""
        timeline, stages = self.timeline.since(since_step), self.schedule.stages
        return gathered_stage_costs(
            timeline, self.weights, self.group, self.world, stages, since_step, (to_next,), **network
        )[0]

    def measured_costs_both(self, since_step: int = 0) -> tuple[StageCosts, StageCosts]:
        """:meth:`measured_costs` both ways from one gather: the actions alone, and each until the
        worker's next one starts (the executor's own time included). A collective."""
        compute, until_next = gathered_stage_costs(
            self.timeline.since(since_step),
            self.weights,
            self.group,
            self.world,
            self.schedule.stages,
            since_step,
            (False, True),
        )
        return compute, until_next

    def state_dict(self, weights: bool = True) -> dict[str, object]:
        """Versions kept and gradients accumulated of this worker's stages, and (``weights``) their
        weights and optimizer states. A non-flushing schedule must be drained first: the activations
        of the micro-batches still in the pipeline cannot be saved, so a restored run could not finish
        them."""
        if self.calls and not self.schedule.flush:
            raise PipelineRuntimeError(
                f"state_dict() with {self.schedule.family} steps in flight: the micro-batches still in the "
                "pipeline hold activations a checkpoint cannot keep; call drain() first, on every worker "
                "(the Lightning strategy drains before it saves)"
            )
        return {
            "calls": self.calls,
            "origin": self.origin,
            "stages": {
                s: {"module": w.module.state_dict(), **w.state_dict()} if weights else w.state_dict(optimizer=False)
                for s, w in self.weights.items()
            },
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.calls = int(state["calls"])
        self._move_origin(int(state["origin"]))
        self._calls_cache.clear()  # keyed by call, relative to the origin just replaced
        for stage, entry in state["stages"].items():
            if "module" in entry:
                self.weights[int(stage)].module.load_state_dict(entry["module"])
            self.weights[int(stage)].load_state_dict(entry)
            self.norms[int(stage)].forget()

    # -- running actions -------------------------------------------------------------------------
    def _run(
        self, actions: list[Action], peers: Callable[[int], list[Action]], return_outputs: bool, update: bool = True
    ) -> StepOutput:
        """Run ``actions`` (this worker's part of a call or a drain; ``peers(worker)``: the others'); with
        ``update`` false, a flushing call that only accumulates: each stage's gradient is carried into
        the next step, not summed over replicas or applied."""
        output = StepOutput()
        self._run_index += 1
        try:
            self.transport.next_call()
            if self.relays.stages and self.calls == 0 and actions is self._calls_cache.get((self.rank, 0)):
                self.relays.begin_run()
            self.borrowing.lend(peers)
            self.borrowing.borrow(actions)
            self.router.expect(peers)
            early = cooldown_backwards(actions, self.early_gradients, self.schedule.stages)
            self._running = actions
            returning = last_gradients(actions, self.borrowed)  # position -> (borrowed stage, step)
            gathering = last_gradients(actions, self.rings.stages)  # position -> (ring stage, step)
            # a flushing call holds every gradient of its step: each replicated stage's sum starts after its last
            summing = last_gradients(actions, self._replicated_stages) if self.schedule.flush and update else {}
            for position, action in enumerate(actions):
                self._position = position
                self.compute.sent_early = None
                start, waited = time.perf_counter(), self.transport.waited
                relayed = action.stage in self.relays.stages and (action.kind in COMPUTE or action.kind is Kind.UPDATE)
                if relayed:
                    self.relays.take(self.weights[action.stage], action)
                self._execute(action, output, return_outputs, position in early, update)
                if relayed:
                    if action.kind is not Kind.UPDATE:
                        self.versions.last_relayed[action.stage] = action
                    self.relays.give(action)
                if position in returning:
                    self.borrowing.give_back(*returning[position])
                if position in gathering:
                    stage, step = gathering[position]
                    self.rings.gather(self.weights[stage], stage, step)
                if position in summing:
                    stage, step = summing[position]
                    self.weights[stage].start_sum(step)
                self._record(action, start, waited)
            if self.updates.deferring and update:  # held: applied by release_updates, after Lightning's hooks
                self.updates.prepare() if self.updates.hold else self.updates.apply_deferred(self._versions_kept)
        except Exception as error:
            self.stop(error)
            raise
        return self.loss_sums.as_floats(output)

    def _record(self, action: Action, start: float, waited: float) -> None:
        """Put ``action`` (started at ``start``, with ``waited`` seconds of waits before it) on the
        timeline; a backward that sent its input gradient early as its two halves, ``I`` until the
        gradient left and ``W`` after: what a split backward costs is then measured
        (:mod:`~lightning_pipe.runtime.calibration`), and priced by the simulator."""
        end, waits = time.perf_counter(), self.transport.waited
        if self.memory.track:  # on the host's clock, so processes line up
            # a forward's saved bytes count from the start of its compute (after its input arrived), as the
            # simulator and the paper's time steps count them; a backward's are freed at its end
            self.memory.mark(start + (waits - waited) if action.kind is Kind.F else end)
        sent_early = self.compute.sent_early
        if sent_early is None:
            self.timeline.append(
                Interval(self.rank, action, start - self.epoch, end - self.epoch, waits - waited, self._run_index)
            )
            return
        middle, waited_before = sent_early
        epoch = self.epoch
        halves = ((Kind.I, start, middle, waited_before - waited), (Kind.W, middle, end, waits - waited_before))
        for kind, begin, finish, waited_in in halves:
            half = replace(action, kind=kind)
            self.timeline.append(Interval(self.rank, half, begin - epoch, finish - epoch, waited_in, self._run_index))

    def stop(self, error: Exception) -> None:
        """Record the failure (unless another rank's caused it) and tear the pipeline's groups down so
        every rank waiting on this one stops too; the failed frames' locals (pending transfers) go."""
        if not raised_elsewhere(error):
            self.failures.fail(error)
        seen: BaseException | None = error
        while seen is not None:
            traceback.clear_frames(seen.__traceback__)
            seen = seen.__cause__ or seen.__context__
        self.transport.abort()
        self.garbage.close()

    def _execute(self, action: Action, output: StepOutput, return_outputs: bool, early: bool, update: bool) -> None:
        if action.kind is Kind.F:
            self.compute.forward(action, output, return_outputs)
        elif action.kind in (Kind.B, Kind.I):
            self.compute.backward(action, weights_too=action.kind is Kind.B, early=early)
        elif action.kind is Kind.W:
            self.compute.weight_gradient(action)
        elif action.kind is Kind.SIGNAL:  # a cue: this worker has come this far
            self.router.signal(action)
        elif action.kind is Kind.WAIT:
            self.router.wait(action)
        elif action.kind is Kind.UPDATE and not update:
            self.borrowing.collect(action)
            self.updates.carry(action)
        elif action.kind is Kind.UPDATE and self.updates.deferring:
            self.borrowing.collect(action)
            self.updates.deferred.append(action)  # after every stage's gradient of the step: the global norm
        elif action.kind is Kind.UPDATE:
            self.borrowing.collect(action)
            if action.stage in self.rings.stages:
                self.rings.spread(self.weights[action.stage], action.stage, action.step)
            self.updates.apply(action, self._versions_kept)

    def _versions_kept(self, stage: int) -> set[int]:
        """Versions of ``stage`` that micro-batches in flight, the rest of this call or the next calls of
        this worker use; for a relayed stage, those its next actions anywhere use
        (:mod:`~lightning_pipe.runtime.versions_kept`)."""
        if stage in self.relays.stages:
            return self.versions.relayed(stage)
        return self.versions.flying(stage) | self._upcoming_versions(stage)

    def _upcoming_versions(self, stage: int) -> set[int]:
        """Versions of ``stage`` the actions after the running one, in this call and the next
        ``period + 1`` calls, compute with: worked out once per entry of the program and position in
        a call of the step's program, read off every action to come in a drain."""
        if self._running is not self._calls_cache.get((self.rank, self.calls)):  # a drain
            return self.versions.scanned(stage, self._running, self._position, self.calls, self._actions)
        return self.versions.upcoming(stage, self._running, self._position, self.calls, self.origin, self._actions)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

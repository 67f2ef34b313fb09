"""Run any schedule of the IR for real: one process per worker, point-to-point transfers.

One executor runs every family (docs/design.md): it walks its worker's actions (a
:class:`~lightning_pipe.runtime.program.Program`, one call per mini-batch) and does what each says —
forward ``F``, backward ``B`` or its halves ``I`` and ``W``, optimizer ``UPDATE`` — with the weight
version the action names (:class:`~lightning_pipe.runtime.weights.StageWeights`). Receives of a call's
large messages are posted when it starts, so data moves while the worker computes (small ones when
they are needed); sends are asynchronous.

The loss of micro-batch ``i`` is weighted by its share of the mini-batch, ``n_i / n``, so that the
accumulated gradient is the mini-batch mean ``1/N Σ ∇f_i`` of the update rules even when the last
micro-batch is smaller.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.nested import flatten, map_tensors, tensors, unflatten
from lightning_pipe.runtime.batch_norm import DeferredNorms, running_forward
from lightning_pipe.runtime.batches import rows_of, split_batch
from lightning_pipe.runtime.borrowing import Borrowing, Lending, check_borrowing, last_gradients
from lightning_pipe.runtime.calibration import measured_seconds, stage_costs
from lightning_pipe.runtime.failure import FailureBoard, add_note, raised_elsewhere
from lightning_pipe.runtime.garbage import AlignedCollection
from lightning_pipe.runtime.groups import pipeline_ranks, replica_groups
from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.runtime.program import Program, repeated, shift
from lightning_pipe.runtime.relays import Relays
from lightning_pipe.runtime.ring_sizes import link_sizes, shared_memory_capacity
from lightning_pipe.runtime.rings import RingReducer
from lightning_pipe.runtime.routing import Placement, Router
from lightning_pipe.runtime.shared_memory import open_links
from lightning_pipe.runtime.split_backward import SplitBackward
from lightning_pipe.runtime.step_output import LossSums, StepOutput, share
from lightning_pipe.runtime.ties import find_ties, tie_groups
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.runtime.updates import Updates
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.saved_bytes import saved_bytes
from lightning_pipe.schedule.early import cooldown_backwards
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule
from lightning_pipe.schedule.simulate import Interval, StageCosts
from lightning_pipe.schedule.validate import validate

__all__ = ["PipelineExecutor"]
_T = TypeVar("_T")
_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


@dataclass
class _InFlight:
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
            needed (0: all ahead). Default: 256 KiB on the CPU, where each receive gloo posts ahead
            cost more than a small transfer saves (``bench/runtime_speed.py --width 256 --batch 256
            --microbatches 8``); 0 on GPUs, where NCCL's pending sends would otherwise wait for
            their receives.
        shared_memory_bytes: on the CPU, messages between workers on the same host go through a ring
            buffer of this many bytes per direction in shared memory instead of gloo's sockets
            (:mod:`lightning_pipe.runtime.shared_memory`; a message that finds the ring full goes by
            gloo). Default 64 MiB on the CPU; 0 (gloo only) on GPUs, whose messages NCCL carries.
            With ``message_bytes``, each ring is only as large as its link needs
            (:mod:`~lightning_pipe.runtime.ring_sizes`), at most this.
        message_bytes: the bytes of one micro-batch's activation leaving each stage but the last
            (and of its gradient coming back), as a plan knows them: they size the rings.

    :attr:`timeline` holds the actions run: each one's start and end (seconds since the executor was
    made) and the seconds it waited for messages; the rest is its own compute.
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
        self.loss_fn = loss_fn
        span = max(p.base for p in self.programs) + 2 * max(p.period for p in self.programs) + 1
        generated = make(span)
        self.split_stages = {a.stage for _, _, a in self.schedule.actions() if a.kind is Kind.I}
        placement = Placement(generated, self.program.base, self.program.period, self.split_stages)
        modules = dict(stages) if isinstance(stages, Mapping) else dict(enumerate(stages))
        mine = sorted({a.stage for a in self.schedule.orders[self.rank] if a.kind in COMPUTE})
        missing = [s for s in mine if s not in modules]
        if missing:
            raise PlanningError(f"rank {self.rank} runs stages {mine} but got no module for {missing}")
        pipeline_groups = [tuple(dist.new_group(list(ranks)) for _ in range(3)) for ranks in self.pipelines]
        data_group, overflow_group, self.group = pipeline_groups[self.pipelines.index(self.ranks)]
        groups = replica_groups(self.schedule, self.pipelines, self.global_rank)
        snapshots = not self.schedule.flush
        self.lending = Lending.of(self.schedule, self.rank)
        self.weights = {
            s: StageWeights(modules[s].to(self.device), optimizer, snapshots, groups.get(s))
            for s in mine
            if s not in self.lending.lenders
        }
        self._replicated_stages = {s for s, w in self.weights.items() if w.group is not None}
        # stages computed here with another worker's weights (FSDP, FSLPP): no optimizer, lent every call
        self.borrowed = {s: StageWeights(modules[s].to(self.device), None, False) for s in self.lending.lenders}
        ties = find_ties(modules)
        self.ties = tie_groups(ties, self.schedule, self.pipelines, self.global_rank, self.lending, self.weights)
        self.norms = {s: DeferredNorms(weights.module) for s, weights in self.weights.items()}
        flags = [recompute] * self.schedule.stages if isinstance(recompute, bool) else list(recompute)
        self.recompute = {s: bool(flags[s]) for s in mine}
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
            post_ahead_bytes=_post_ahead(post_ahead_bytes, self.device),
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
        self._last_relayed: dict[int, Action] = {}  # relayed stage -> this worker's last action on it
        ours = [a for a in self.schedule.orders[self.rank] if a.kind is Kind.F]
        self.needs_inputs = any(a.stage == 0 for a in ours)
        self.needs_targets = any(a.stage == self.schedule.stages - 1 for a in ours)
        self.targets_left: dict[int, int] = {}
        self.calls = 0
        self.origin = 0
        self.inputs: dict[int, list[Any]] = {}
        self.targets: dict[int, list[Any]] = {}
        self.batch_rows: dict[int, int] = {}
        self.in_flight: dict[tuple[int, int, int], _InFlight] = {}
        self.loss_sums = LossSums(self.schedule.microbatches)
        self.track_memory = track_memory
        self.early_gradients = early_gradients and self.schedule.flush
        self.saved_bytes = 0
        self.peak_saved_bytes = 0
        self._holders: Counter[int] = Counter()  # saved storage -> forwards in flight saving it
        self._held_bytes: dict[int, int] = {}
        self._step_data: dict[int, list[torch.Tensor]] = {}  # step -> its data, while its micro-batches are in flight
        self.memory_timeline: deque[tuple[float, int]] = deque(maxlen=timeline_length)  # (moment, saved bytes)
        self._calls_cache: dict[tuple[int, int], list[Action]] = {}
        # (stage, entry of the program, position) -> versions used after it, less the call's shift
        self._upcoming: dict[tuple[int, int, int], frozenset[int]] = {}
        self.timeline: deque[Interval] = deque(maxlen=timeline_length)
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
        self.copies_inputs: set[int] = set()  # stages whose first layer works in place on the received input
        self.loss_key: tuple[int, int] | None = None
        self._running: list[Action] = []  # the actions of the call (or drain) being run
        self._sent_early: tuple[float, float] | None = None  # when the running backward's input gradient left
        self._position = 0  # the index of the one running
        dist.barrier()
        self.epoch = time.perf_counter()

    def _computing(self, stage: int) -> StageWeights:
        """The weights this worker computes ``stage`` with: its own, or borrowed."""
        return self.weights[stage] if stage in self.weights else self.borrowed[stage]

    # -- the training loop's entry points --------------------------------------------------------
    def step(
        self, inputs: Any = None, targets: Any = None, *, return_outputs: bool = False, share_losses: bool = False
    ) -> StepOutput:
        """Run one call: feed mini-batch ``inputs``/``targets`` (only the ranks running the first and
        last stage need them) and run every action that can run with the data given so far.

        With ``share_losses`` (a collective: every rank must ask) every rank gets the losses, and the
        last stage's outputs when ``return_outputs`` is set too.
        """
        call = self.calls
        self.garbage.call()
        try:
            self._store_batch(self.origin + call, inputs, targets)
        except Exception as error:
            self._stop(error)
            raise
        output = self._run(self._actions(self.rank, call), lambda peer: self._actions(peer, call), return_outputs)
        self.calls += 1
        self._calls_cache = {key: actions for key, actions in self._calls_cache.items() if key[1] >= self.calls}
        return share(output, self.world, self.group) if share_losses else output

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
            raise PlanningError("evaluate() runs on drained weights: call drain() first, on every worker")
        check_whole("microbatches", microbatches, 1)
        last = self.schedule.stages - 1
        worker = [owners[0] for owners in self.schedule.owners]
        mine = [s for s in range(self.schedule.stages) if worker[s] == self.rank]
        try:
            parts = split_batch(inputs, microbatches) if 0 in mine else []
            self.transport.next_call()
            expected = {
                (s, mb): self.transport.expect(self.ranks[worker[s - 1]], ("E", s, mb))
                for mb in range(microbatches)
                for s in mine
                if s > 0 and worker[s - 1] != self.rank
            }
            local: dict[tuple[int, int], Any] = {}
            for mb in range(microbatches):
                for s in mine:
                    if s == 0:
                        x = map_tensors(lambda t: t.to(self.device), parts[mb])
                    elif (s, mb) in expected:
                        x = self.transport.receive(self.ranks[worker[s - 1]], expected.pop((s, mb)))
                    else:
                        x = local.pop((s, mb))
                    with torch.no_grad():
                        try:
                            y = self.weights[s].module(x)
                        except Exception as error:
                            raise self._mismatch(Action(Kind.F, s, mb, self.origin), x, error) from error
                    if s == last:
                        on_output(mb, y)
                    elif worker[s + 1] == self.rank:
                        local[(s + 1, mb)] = y
                    else:
                        self.transport.send(self.ranks[worker[s + 1]], y, ("E", s + 1, mb))
        except Exception as error:
            self._stop(error)
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

    def measured_costs(self, since_step: int = 0, **network: object) -> StageCosts:
        """Every stage's mean forward, backward (and halves) and update seconds as this pipeline ran
        them, waits for messages excluded, over the steps ``>= since_step`` the timelines still hold
        (:mod:`lightning_pipe.runtime.calibration`): costs to simulate any other schedule with.
        ``network`` sets the other fields of :class:`StageCosts` (``bandwidth``, ``latency``,
        ``overhead``, ``activation_bytes``, ...). A collective: every rank must call it."""
        gradients = {
            stage: float(sum(p.numel() * p.element_size() for p in weights.params if p.requires_grad))
            for stage, weights in self.weights.items()
        }
        gathered: list[Any] = [None] * self.world
        mine = (measured_seconds(self.timeline, since_step), gradients)
        dist.all_gather_object(gathered, mine, group=self.group)
        sizes = {stage: size for _, theirs in gathered for stage, size in theirs.items()}
        gradient_bytes = [sizes.get(stage, 0.0) for stage in range(self.schedule.stages)]
        return stage_costs([totals for totals, _ in gathered], self.schedule.stages, gradient_bytes, **network)

    def state_dict(self, weights: bool = True) -> dict[str, object]:
        """Versions kept and gradients accumulated of this worker's stages, and (``weights``) their
        weights and optimizer states. A non-flushing schedule must be drained first: the activations
        of the micro-batches still in the pipeline cannot be saved, so a restored run could not finish
        them."""
        if self.calls and not self.schedule.flush:
            raise PlanningError(
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
    def _store_batch(self, step: int, inputs: Any, targets: Any) -> None:
        m = self.schedule.microbatches
        if self.needs_inputs:
            if inputs is None:
                raise PlanningError(f"rank {self.rank} runs the first stage: step() needs the inputs")
            self.inputs[step] = split_batch(map_tensors(self._to_device, inputs), m)
            if self.track_memory:  # kept (alive, so no activation takes their addresses) while the step is in flight
                self._step_data[step] = list(tensors(self.inputs[step]))
        if self.needs_targets:
            if targets is None:
                raise PlanningError(f"rank {self.rank} runs the last stage: step() needs the targets")
            self.targets[step] = split_batch(map_tensors(self._to_device, targets), m)
            self.batch_rows[step] = rows_of(targets)
            self.targets_left[step] = m

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def _run(self, actions: list[Action], peers: Callable[[int], list[Action]], return_outputs: bool) -> StepOutput:
        output = StepOutput()
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
            summing = last_gradients(actions, self._replicated_stages) if self.schedule.flush else {}
            for position, action in enumerate(actions):
                self._position = position
                self._sent_early = None
                start, waited = time.perf_counter(), self.transport.waited
                relayed = action.stage in self.relays.stages and (action.kind in COMPUTE or action.kind is Kind.UPDATE)
                if relayed:
                    self.relays.take(self.weights[action.stage], action)
                self._execute(action, output, return_outputs, position in early)
                if relayed:
                    if action.kind is not Kind.UPDATE:
                        self._last_relayed[action.stage] = action
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
            if self.updates.deferring:
                self.updates.apply_deferred(self._versions_kept)
        except Exception as error:
            self._stop(error)
            raise
        return self.loss_sums.as_floats(output)

    def _record(self, action: Action, start: float, waited: float) -> None:
        """Put ``action`` (started at ``start``, with ``waited`` seconds of waits before it) on the
        timeline; a backward that sent its input gradient early as its two halves, ``I`` until the
        gradient left and ``W`` after: what a split backward costs is then measured
        (:mod:`~lightning_pipe.runtime.calibration`), and priced by the simulator."""
        end, waits = time.perf_counter(), self.transport.waited
        if self.track_memory:  # on the host's clock, so processes line up
            # a forward's saved bytes count from the start of its compute (after its input arrived), as the
            # simulator and the paper's time steps count them; a backward's are freed at its end
            moment = start + (waits - waited) if action.kind is Kind.F else end
            self.memory_timeline.append((moment, self.saved_bytes))
        if self._sent_early is None:
            self.timeline.append(Interval(self.rank, action, start - self.epoch, end - self.epoch, waits - waited))
            return
        middle, waited_before = self._sent_early
        epoch = self.epoch
        halves = ((Kind.I, start, middle, waited_before - waited), (Kind.W, middle, end, waits - waited_before))
        for kind, begin, finish, waited_in in halves:
            half = replace(action, kind=kind)
            self.timeline.append(Interval(self.rank, half, begin - epoch, finish - epoch, waited_in))

    def _stop(self, error: Exception) -> None:
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

    def _execute(self, action: Action, output: StepOutput, return_outputs: bool, early: bool) -> None:
        if action.kind is Kind.F:
            self._forward(action, output, return_outputs)
        elif action.kind in (Kind.B, Kind.I):
            self._backward(action, weights_too=action.kind is Kind.B, early=early)
        elif action.kind is Kind.W:
            self._weight_gradient(action)
        elif action.kind is Kind.SIGNAL:  # a cue: this worker has come this far
            self.router.signal(action)
        elif action.kind is Kind.WAIT:
            self.router.wait(action)
        elif action.kind is Kind.UPDATE and self.updates.deferring:
            self.borrowing.collect(action)
            self.updates.deferred.append(action)  # after every stage's gradient of the step: the global norm
        elif action.kind is Kind.UPDATE:
            self.borrowing.collect(action)
            if action.stage in self.rings.stages:
                self.rings.spread(self.weights[action.stage], action.stage, action.step)
            self.updates.apply(action, self._versions_kept)

    def _forward(self, action: Action, output: StepOutput, return_outputs: bool) -> None:
        s, mb, t = action.stage, action.microbatch, action.step
        inputs = self.inputs[t][mb] if s == 0 else _received_forward(self.router.incoming(("F", s, mb, t)))
        weights = self._computing(s)
        state = _InFlight(inputs=inputs, version=action.version, leaves=weights.leaves(action.version))
        try:
            with running_forward(t, mb):  # batch norm's statistics count once per step (.batch_norm)
                if self.recompute[s]:
                    state.rng = self._rng_state()
                    with torch.no_grad():  # on a copy: a first layer working in place would change the input kept
                        state.outputs = weights.forward(state.leaves, map_tensors(torch.Tensor.clone, inputs))
                else:
                    state.outputs, state.saved = self._in_place_safe(
                        s, inputs, lambda x: self._forward_saving(weights, state.leaves, x, t, s == 0)
                    )
        except Exception as error:
            add_note(error, self._where(action, inputs))
            raise
        if s == self.schedule.stages - 1:
            loss = self._loss(state.outputs, t, mb)
            state.loss = None if self.recompute[s] else self._pipeline_share(loss)
            output.microbatch_losses[(t, mb)] = loss.detach()  # a float at the call's end: no sync here
            if return_outputs:
                output.outputs[(t, mb)] = map_tensors(torch.Tensor.detach, state.outputs)
        else:
            self.router.deliver(action, _sent_forward(state.outputs, not self.recompute[s]))
        self.in_flight[(s, mb, t)] = state
        if s == 0 and mb == self.schedule.microbatches - 1:
            self.inputs.pop(t, None)

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
        return f"raised in the forward of stage {s} (rank {self.rank}) on {source}, tensors {shapes}"

    def _forward_saving(
        self, weights: StageWeights, leaves: dict[str, torch.Tensor], inputs: Any, step: int, first: bool
    ) -> tuple[Any, dict[int, int]]:
        """Forward with autograd; also the storages it saved for backward when memory is tracked
        (model state excluded: the parameters, and buffers such as batch norm's running statistics;
        and ``step``'s mini-batch, the data, which the step holds whatever the schedule: the ``first``
        stage's inputs, and views of them however far they travel), counted in :attr:`saved_bytes`
        until :meth:`_release`."""
        if not self.track_memory:
            return weights.forward(leaves, inputs), {}
        data = [*self._step_data.get(step, ()), *(tensors(inputs) if first else ())]
        with saved_bytes([*leaves.values(), *weights.module.buffers(), *data]) as counted:
            result = weights.forward(leaves, inputs)
        for key, nbytes in counted.storages.items():
            if not self._holders[key]:
                self._held_bytes[key] = nbytes
                self.saved_bytes += nbytes
            self._holders[key] += 1
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
        return result, counted.storages

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

    def _loss(self, result: Any, step: int, mb: int) -> torch.Tensor:
        target = self.targets[step][mb]
        self.loss_key = (step, mb)  # which micro-batch loss_fn is computing, for callers that log
        return self.loss_fn(result, target) * (rows_of(target) / self.batch_rows[step])

    def _pipeline_share(self, loss: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's loss contributes to the gradient summed over the data-parallel
        pipelines (their mean); with one pipeline the loss itself, no division (one autograd node
        less per micro-batch)."""
        return loss if len(self.pipelines) == 1 else loss / len(self.pipelines)

    def _rng_state(self) -> tuple[torch.Tensor, ...]:
        """The random state a forward starts from (CPU, and the GPU's when computing there)."""
        if self.device.type == "cuda":
            return torch.get_rng_state(), torch.cuda.get_rng_state(self.device)
        return (torch.get_rng_state(),)

    def _recompute(self, action: Action, state: _InFlight) -> None:
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
            state.outputs, state.saved = self._in_place_safe(
                action.stage,
                state.inputs,
                lambda x: self._forward_saving(weights, state.leaves, x, action.step, action.stage == 0),
            )
        for buffer, before in buffers:
            # through .data: batch norm's backward node holds the running statistics it was given and
            # checks their version, though training mode's gradient does not read them
            buffer.data.copy_(before)
        if action.stage == self.schedule.stages - 1:
            state.loss = self._pipeline_share(self._loss(state.outputs, action.step, action.microbatch))

    def _roots(self, action: Action, state: _InFlight) -> None:
        """The tensors to differentiate and their incoming gradients (none for the scalar loss)."""
        s, mb, t = action.stage, action.microbatch, action.step
        if self.recompute[s]:
            self._recompute(action, state)
        if s == self.schedule.stages - 1:
            loss = state.loss if self.loss_scale is None else state.loss * self.loss_scale.scale
            state.roots, state.root_grads = [loss], None
            return
        grads = tensors(self.router.incoming(("B", s, mb, t)))
        outputs = tensors(state.outputs)
        if [(o.shape, o.dtype) for o in outputs] != [(g.shape, g.dtype) for g in grads]:
            producer = self.router.backward_worker(s + 1, mb, t)
            raise PlanningError(
                f"stage {s + 1} (rank {producer}) sent gradients {[(tuple(g.shape), g.dtype) for g in grads]} for "
                f"stage {s}'s outputs {[(tuple(o.shape), o.dtype) for o in outputs]} (rank {self.rank})"
            )
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        state.roots, state.root_grads = [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, action: Action, weights_too: bool, early: bool = False) -> None:
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
            self._sent_early = (time.perf_counter(), self.transport.waited)
            self._weight_gradient(action)
        elif weights_too:
            self._release(action)

    def _weight_gradient(self, action: Action) -> None:
        """``W``: the weight gradients of a micro-batch whose ``I`` ran."""
        state = self.in_flight[(action.stage, action.microbatch, action.step)]
        state.split.weight_gradients(self._computing(action.stage).accumulator(action.step))
        self._release(action)

    def _send_input_grads(self, action: Action, state: _InFlight, grads: list[torch.Tensor | None]) -> None:
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
        for key in state.saved:
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                self.saved_bytes -= self._held_bytes.pop(key)
        if t in self._step_data and t not in self.inputs and all(key[2] != t for key in self.in_flight):
            del self._step_data[t]
        if s == self.schedule.stages - 1:
            self.targets_left[t] -= 1
            if not self.targets_left[t]:
                for store in (self.targets, self.batch_rows, self.targets_left):
                    store.pop(t, None)

    def _versions_kept(self, stage: int) -> set[int]:
        """Versions of ``stage`` that micro-batches in flight, the rest of this call or the next calls of
        this worker use; for a relayed stage, those its next actions anywhere use."""
        if stage in self.relays.stages:
            window = 4 * (self.schedule.stages + self.schedule.microbatches)
            return self.relays.upcoming_versions(self._last_relayed[stage], window)
        kept = {state.version for (s, _, _), state in self.in_flight.items() if s == stage}
        return kept | self._upcoming_versions(stage)

    def _upcoming_versions(self, stage: int) -> set[int]:
        """Versions of ``stage`` the actions after the running one, in this call and the next
        ``period + 1`` calls, compute with. In a call of the step's program they depend only on the
        program's entry the call runs (:meth:`Program.entry_of`) up to a shift of every version, so
        they are worked out once per entry and position and shifted after that."""
        if self._running is not self._calls_cache.get((self.rank, self.calls)):  # a drain
            return self._scanned_versions(stage)
        entry, steps = self.program.entry_of(self.calls)
        offset = self.origin + steps
        key = (stage, entry, self._position)
        relative = self._upcoming.get(key)
        if relative is None:
            relative = self._upcoming[key] = frozenset(v - offset for v in self._scanned_versions(stage))
        return {version + offset for version in relative}

    def _scanned_versions(self, stage: int) -> set[int]:
        """:meth:`_upcoming_versions`, read off every action still to come."""
        calls = range(self.calls + 1, self.calls + self.program.period + 2)
        actions = self._running[self._position + 1 :] + [a for c in calls for a in self._actions(self.rank, c)]
        return {a.version for a in actions if a.stage == stage and a.kind in COMPUTE}


def _post_ahead(requested: int | None, device: torch.device) -> int:
    """The message size from which receives are posted ahead (see ``post_ahead_bytes``)."""
    if requested is not None:
        return requested
    return 256 * 1024 if device.type == "cpu" else 0


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""The pipeline, built on the first batch: ``forward`` captured as layers, verified and profiled,
the split planned (or a resumed checkpoint's reused), the executor made with one optimizer per stage,
and the tensors of the stages a rank does not run released.

:class:`PipelineBuilding` holds these as methods of :class:`~lightning_pipe.strategy.PipelineStrategy`
(one of the parts the strategy's class is assembled from, each a module of its own).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_pipe.capture.compiled import uncompiled
from lightning_pipe.capture.generation_cache import CACHE_OFF, generation_cache_off
from lightning_pipe.capture.verify import verify_chain
from lightning_pipe.cost.calibrated import REPLICATING_FAMILIES
from lightning_pipe.cost.profile_file import load_profile
from lightning_pipe.cost.profiler import given_names
from lightning_pipe.errors import CheckpointError, PipelineRuntimeError, PlanningError
from lightning_pipe.partition.plan_file import load_plan
from lightning_pipe.planning import (
    PREDICTED_STEPS,
    SETUP_PHASES,
    PlanOptions,
    StagePlan,
    in_flight_counts,
    memory_model,
    optimizer_copies,
    plan_stages,
    profile_costs,
    schedule_of,
    setup_line,
    setup_report,
    timed,
    within_workers,
)
from lightning_pipe.runtime import PipelineExecutor
from lightning_pipe.runtime.batches import NO_BATCH_DIMENSION, rows_of, split_batch
from lightning_pipe.runtime.link_speed import allreduce_bandwidth, allreduce_overlap
from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.runtime.shared_memory_sizes import shared_memory_capacity
from lightning_pipe.schedule import NON_FLUSHING_FAMILIES
from lightning_pipe.schedule.ir import COMPUTE, Schedule
from lightning_pipe.schedule.simulation import Simulation
from lightning_pipe.strategy.choosing import Chosen
from lightning_pipe.strategy.compiling import StageCompilation
from lightning_pipe.strategy.contract import Call, PipelineModel, pipeline_model
from lightning_pipe.strategy.differences import differences
from lightning_pipe.strategy.effects import watch_attributes
from lightning_pipe.strategy.gradient_hooks import gradient_hooks
from lightning_pipe.strategy.logs import Record, recording
from lightning_pipe.strategy.materialise import MATERIALISED, materialise, on_meta
from lightning_pipe.strategy.optimizers import stage_optimizers
from lightning_pipe.strategy.ownership import Ownership, release, tensor_ids
from lightning_pipe.strategy.random_states import replayed
from lightning_pipe.strategy.recomputation import checkpointed_blocks, recomputation_note, recomputed_stages
from lightning_pipe.strategy.sharded import read_entries
from lightning_pipe.strategy.step_prices import StepPrices, run_shape
from lightning_pipe.util.nested import flatten, map_tensors, tensors, to_cpu, unflatten
from lightning_pipe.util.units import format_bytes
from lightning_pipe.worker_memory import WorkerMemory

if TYPE_CHECKING:  # annotations only: the class differs under the standalone pytorch_lightning
    from lightning.pytorch import LightningModule

__all__ = ["PipelineBuilding"]


class PipelineBuilding:
    """Building the pipeline on the first batch (methods of :class:`~lightning_pipe.strategy.PipelineStrategy`)."""

    def _schedule_maker(self, stage_plan: StagePlan) -> Callable[[int], Schedule]:
        """``steps -> schedule`` of ``stage_plan``'s stages with this strategy's options and micro-batches
        (:func:`~lightning_pipe.planning.schedule_of`)."""
        return schedule_of(stage_plan, self.options, self.microbatches)

    def _pipeline(self, call: Call, batch: Any) -> PipelineExecutor:
        """The executor, built on the first call from ``call`` (the arguments the step gave ``forward``
        for ``batch``)."""
        if self.executor is not None:
            return self.executor
        assert self._entry is not None
        start = time.perf_counter()
        module = self.lightning_module
        optimizer = self.optimizers[0] if self.optimizers else None
        fresh = self._chain is None or self._chain_of is not module  # a released module is captured once
        meta = fresh and on_meta(module)  # built with init_module(empty_init=True) or configure_model: shapes only
        if fresh:
            seconds = self.setup_seconds = dict.fromkeys(SETUP_PHASES, 0.0)
            first = _first_microbatch(call, self.microbatches)
            if meta:
                first = Call(*map_tensors(lambda t: t.to("meta"), (first.args, first.kwargs)))
            with timed(seconds, "capture"):
                self._chain, self._chain_of = self._capture(module, first), module
            seconds["capture"] -= seconds["profile"]  # branching layers profiled for their order (._order)
            if self._chain.captured is not None:
                watch_attributes(module, self._chain.captured.graph.read)
            if self.stage_plan is None or self.stage_plan.bounds[-1][1] != len(self._chain.layers) - 1:
                profiled = seconds["profile"]
                with timed(seconds, "plan"):
                    self.stage_plan = self._plan(self._chain, first, optimizer, rows_of(batch), meta)
                seconds["plan"] -= seconds["verify"] + seconds["profile"] - profiled  # timed apart inside
        layers = self._chain.layers
        stage_plan = self.stage_plan
        make = self._schedule_maker(stage_plan)
        mine = {a.stage for a in make(1).orders[self.topology.worker] if a.kind in COMPUTE}
        if meta:  # this rank's stages only, initialised as the whole model would be (.materialise)
            everything = tensor_ids([module, *layers])
            materialise(
                module, [module, *layers], everything - self._foreign(layers, mine), self.root_device, self.optimizers
            )
            self._load_deferred()  # a resumed checkpoint's values for them
        trainer = module.trainer
        clip = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm or "norm"  # a str enum: compares equal to its value
        stages: list[Any] = stage_plan.modules(layers)
        recompute = self._recomputed(module, stages, announce=fresh)
        self.compilation = None
        if self._compiled:  # the model held compiled modules: its stages are compiled instead (.compiling)
            self.compilation = StageCompilation.of(self._compiled, stages, make(1))
            stages = self.compilation.modules(stages, mine)
            if fresh:
                rank_zero_info(self.compilation.summary())
        compiled = self.compilation is not None and bool(self.compilation.compiled)
        self.executor = PipelineExecutor(
            make,
            stages,
            self._loss,
            stage_optimizers(optimizer) if optimizer is not None else (lambda params: None),
            device=self.root_device,
            recompute=recompute,
            early_gradients=not compiled,  # a compiled stage's backward is one node: split, it would run twice
            timeout_seconds=self._timeout.total_seconds(),
            shared_memory_bytes=self.shared_memory_bytes,
            message_bytes=_message_bytes(stage_plan),
            clip_grad_norm=float(clip) if clip and algorithm == "norm" else None,
            clip_grad_value=float(clip) if clip and algorithm == "value" else None,
            before_update=self._before_update,
            loss_scale=self._loss_scale(),
            pipelines=self.pipelines,
        )
        # the user's code reads each step's gradients before its update: the updates wait for it (.gradient_hooks)
        self.executor.updates.hold = self.executor.schedule.flush and bool(gradient_hooks(module, trainer))
        if optimizer is not None:
            optimizer.state.clear()  # any restored state is the stages' now: the template only carries hyper-parameters
        self._restore_optimizer_states()
        self._restore_carried()
        self._predict_memory(self.executor.make, announce=fresh, recompute=recompute)
        self._release(module, layers, mine)
        if self._parent_watch is not None:  # the pipeline is up: failures travel through the job's store now
            self._parent_watch.stop()
        if fresh:
            self._timed_setup(start)
        return self.executor

    def _recomputed(self, module: LightningModule, stages: list[Any], announce: bool) -> bool | list[bool]:
        """Which stages recompute their forward in the backward: every one with ``recompute=True``,
        else those holding a block the model asks to checkpoint (:mod:`.recomputation`), said at a new
        plan's set-up."""
        if self.recompute:  # True, or the stages the search chose (.choosing)
            return self.recompute
        blocks = checkpointed_blocks(module)
        if not blocks:
            return False
        recomputed = recomputed_stages(blocks, stages)
        if announce:
            rank_zero_info(recomputation_note(blocks, recomputed))
        return recomputed

    def _timed_setup(self, start: float) -> None:
        """Complete :attr:`setup_seconds` of a set-up that began at ``start`` (``time.perf_counter``):
        the rest of it, ``executor`` (the executor made, this rank's stages kept), and the ``total``;
        rank 0 prints its own."""
        seconds = self.setup_seconds
        total = time.perf_counter() - start
        seconds["executor"] = total - sum(seconds.values())
        seconds["total"] = total
        rank_zero_info(setup_line(seconds))

    def _predict_memory(
        self, make: Callable[[int], Schedule], announce: bool, recompute: bool | list[bool] = False
    ) -> None:
        """This rank's predicted memory (:attr:`predicted_memory`; ``None`` when the stages were given,
        not planned): what its worker holds at its peak as it runs its actions in order
        (:class:`~lightning_pipe.worker_memory.WorkerMemory`: the weights, optimizer state and
        recomputing stages' activations of the stages it computes, and their other activations, their
        gradients and what a backward holds for a moment as its actions hold them), and the
        shared-memory rings it maps (:attr:`ring_bytes`), resident in it from the start
        (:func:`~lightning_pipe.runtime.shared_memory.open_links`). Not the sum of each stage's own
        peak, which come at other times: on one device, a ``ddp`` program holds one micro-batch's
        activations (the stages' peaks summed were 3.7 times what an H100 measured for a ResNet-50 on
        2026-11-27), and under GPipe a stage's gradient is made after its activations' peak. With
        ``announce`` (a new plan), printed per rank on rank 0 (a collective over the pipeline); the
        framework's own memory (interpreter, torch) is apart."""
        assert self.executor is not None and self.stage_plan is not None
        plan, costs = self.stage_plan.plan, self.stage_plan.costs
        rings = self.ring_bytes = self.executor.transport.links.ring_bytes + self._relay_ring_bytes
        if plan is None or costs is None:  # every rank has the same plan: none of them gathers
            self.predicted_memory = None
            return
        flags = [recompute] * len(plan.stages) if isinstance(recompute, bool) else list(recompute)
        held = WorkerMemory.of(make(PREDICTED_STEPS), costs, self.stage_plan.bounds)
        stages = held.bytes_under(plan, flags)[self.topology.worker]
        self.predicted_memory = stages + rings
        if announce:
            shares = self._gather((stages, rings))
            parts = [f"rank {w}: {format_bytes(a)} + {format_bytes(b)}" for w, (a, b) in enumerate(shares)]
            rank_zero_info("Memory per rank, its stages + its shared-memory rings: " + ", ".join(parts))

    def _within_limit(self, options: PlanOptions) -> PlanOptions:
        """The options with the memory limit less what the shared-memory rings take (:meth:`_ring_reserve`)."""
        reserve = self._ring_reserve()
        if options.memory_limit is None or not reserve:
            return options
        if options.memory_limit <= reserve:
            raise PlanningError(
                f"memory_limit={format_bytes(options.memory_limit)} leaves nothing for the stages once the "
                f"shared-memory rings between processes ({format_bytes(reserve)}) are counted: raise the limit, or "
                "make the rings smaller (shared_memory_bytes=..., 0: messages through gloo only)"
            )
        rank_zero_info(
            f"Planning within memory_limit={format_bytes(options.memory_limit)} less {format_bytes(reserve)} of "
            "shared-memory rings per process"
        )
        return dataclasses.replace(options, memory_limit=options.memory_limit - reserve)

    def _ring_reserve(self) -> float:
        """What the shared-memory rings of a rank with two neighbouring stages take (CPU training),
        and the log relay's: the memory limit is planned without it."""
        capacity = shared_memory_capacity(self.shared_memory_bytes, self.root_device)
        return 2.0 * capacity * min(2, self.workers - 1) + self._relay_ring_bytes

    @property
    def _relay_ring_bytes(self) -> int:
        """The log relay's shared-memory rings on this rank (:mod:`.log_relay`)."""
        return 0 if self._log_relay is None else self._log_relay.ring_bytes

    def _release(self, module: LightningModule, layers: list[Any], mine: set[int]) -> None:
        """Keep only this rank's stages (``mine``): every other stage's weights and buffers go to the
        meta device (:mod:`.ownership`)."""
        assert self.executor is not None and self.stage_plan is not None
        ownership = Ownership.of(module, layers, self.stage_plan.bounds)
        first, ranks = self.executor.schedule.first_owners, self.pipelines[0]
        self._writers = {name: ownership.writer(name, first, ranks) for name in module.state_dict(keep_vars=True)}
        release([module, *layers], self._foreign(layers, mine), self.optimizers)

    def _foreign(self, layers: list[Any], mine: set[int]) -> set[int]:
        """The identities of the tensors only the layers of stages other than ``mine`` use."""
        assert self.stage_plan is not None
        spans = [layers[a : b + 1] for a, b in self.stage_plan.bounds]
        held = tensor_ids(layer for s in mine for layer in spans[s])
        return tensor_ids(layer for s, span in enumerate(spans) if s not in mine for layer in span) - held

    def _written(self, name: str) -> bool:
        """Whether this rank writes state-dict entry ``name`` into a checkpoint (:meth:`Ownership.writer`)."""
        if self._writers is None:  # nothing released: global rank 0 holds everything
            return self.global_rank == 0
        return self._writers[name] == self.global_rank

    def _plan_options(self, layers: int) -> PlanOptions:
        """The plan options; when resuming a pipeline checkpoint of as many stages and layers (and no
        split was given), its split, so that a resume never depends on profiling again."""
        saved = self._saved.plan if self._saved is not None else None
        options = self.plan_options
        given = options.balance is not None or options.plan is not None or options.profile is not None
        if saved is None or given or not self.keep_plan:
            return options
        replicas = None if saved.replicas is None else list(saved.replicas)
        if len(saved.bounds) != self.stages or saved.layers != layers or (replicas and not self._replicated):
            return options
        rank_zero_info(f"Reusing the checkpoint's split of the {layers} layers: {saved.listed_bounds()}")
        balance = [last - first + 1 for first, last in saved.bounds]
        return dataclasses.replace(options, balance=balance, stage_replicas=replicas)

    def _restore_carried(self) -> None:
        """A resumed checkpoint's carried state (step count, weight versions, gradients not yet
        applied) given to this rank's stages. On the checkpoint's own split and schedule each stage
        gets its own; on another one, only a state with nothing in flight carries over (every stage at
        the same version: as after the drain that precedes every checkpoint)."""
        saved, self._saved = self._saved, None
        if saved is None or self.executor is None:
            return
        assert self.stage_plan is not None
        if saved.same_split(self.stage_plan.bounds, self.schedule_options.family, self.stage_plan.names):
            if saved.carried is None:  # only a sharded checkpoint's meta.pt read without its rank files
                raise CheckpointError(
                    "the checkpoint's pipeline entry holds no carried state: a sharded checkpoint's is in its rank "
                    "files; resume from the checkpoint's directory"
                )
            found = read_entries(saved.carried, [str(s) for s in self.executor.weights])
            stages = saved.stage_states(found)
        else:
            version = saved.settled_version()
            if version is None:
                raise PlanningError(
                    f"the checkpoint holds {saved.schedule} weight versions or gradients still to apply for its "
                    f"split {saved.plan.listed_bounds()}, which this run ({self.schedule_options.family}, "
                    f"{[list(b) for b in self.stage_plan.bounds]}) cannot take: resume with schedule="
                    f"{saved.schedule!r} and the checkpoint's split (keep_plan=True, the default, reuses it)"
                )
            stages = {s: {"version": version, "versions": {}, "gradients": {}} for s in self.executor.weights}
        self.executor.load_state_dict({"calls": saved.calls, "origin": saved.origin, "stages": stages})

    def _capture(self, module: LightningModule, first: Call) -> PipelineModel:
        """The layers of ``module``, captured on every rank from the same micro-batch (each rank's
        graph on its own device); the ranks must agree on them."""
        try:
            model: PipelineModel | PlanningError = pipeline_model(module, first, self.stages)
        except PlanningError as error:
            model = error
        names = self._gather(model.names if isinstance(model, PipelineModel) else None)
        if isinstance(model, PlanningError):
            raise model
        if any(other != model.names for other in names if other is not None):
            raise PlanningError(
                f"the ranks captured different layers from forward ({[len(n) for n in names if n]} layers): forward "
                "must record the same operations on every rank"
            )
        if None in names:
            raise PlanningError(f"rank {names.index(None)} could not capture forward (its error is in its log)")
        if whole := model.run_whole:
            listed = "; ".join(f"{path} ({why})" for path, why in whole.items())
            rank_zero_info(f"Run whole, each inside one layer, as their forward cannot be traced: {listed}")
        return self._in_order(model, first) if model.branches() and self.stages > 1 else model

    def _in_order(self, model: PipelineModel, first: Call) -> PipelineModel:
        """The branching layers in the order a kept plan, a given plan or profile file or the resumed
        checkpoint names them, or else in the order that splits best, found from the layers' profile
        (kept from run to run like the plan's, so that the same machine keeps one order:
        :mod:`lightning_pipe.capture.layer_order`). Rank 0 decides and sends the order, or its error,
        to every rank. A meta-device model (nothing to time) and a given ``balance`` (layers counted
        in forward's order) keep the recorded order."""
        if self.plan_options.balance is not None:
            return model
        decided: tuple[int, ...] | PlanningError | None = None
        named = None
        if self.global_rank == 0:
            named = self._named_order()
            try:
                decided = self._order(model, first, named)
            except PlanningError as error:
                decided = error
        decided = self.broadcast(decided)
        if isinstance(decided, PlanningError):
            raise decided
        if decided is None:
            return model
        if self.global_rank == 0 and named is None:  # found here, not named by a plan
            names = ", ".join(model.names[i] for i in decided)
            rank_zero_info(f"The layers branch; they run in the order whose split is fastest: {names}")
        return model.reordered(decided)

    def _order(self, model: PipelineModel, first: Call, kept: tuple[str, ...] | None) -> tuple[int, ...] | None:
        """Rank 0's order of the layers (:meth:`_in_order`), or the one ``kept`` names
        (:meth:`_named_order`); None for the recorded one."""
        if kept is not None and len(set(kept)) == len(kept) and sorted(kept) == sorted(model.names):
            return None if list(kept) == model.names else tuple(model.names.index(name) for name in kept)
        if any(t.is_meta for t in tensors((first.args, first.kwargs))):
            return None
        sample, device = model.inputs(first), self.root_device
        costs = profile_costs(model.layers, sample, self.plan_options, device, model.names, self.setup_seconds)
        return model.order_for(costs, self.stages)  # the profile the plan reuses where the order stays

    def _named_order(self) -> tuple[str, ...] | None:
        """The layers' names in the order that a kept plan, the given plan or profile file, or the
        checkpoint being resumed has them; None where none says (a file that cannot be read is
        refused when the plan is made)."""
        if self.stage_plan is not None and self.stage_plan.names is not None:
            return self.stage_plan.names
        options = self.plan_options
        try:
            if options.plan is not None:
                return load_plan(options.plan).names
            if options.profile is not None:
                names = given_names(load_profile(options.profile))
                return None if names is None else tuple(names)
        except (OSError, PlanningError):
            return None
        return self._saved.plan.names if self._saved is not None else None

    def _plan(self, model: PipelineModel, first: Call, optimizer: Any, batch_rows: int, meta: bool) -> StagePlan:
        """Verify the chain, profile and partition on rank 0 (with the first micro-batch), broadcast the
        plan or the error, print the plan and the prediction. A later ``validate``/``test``/``predict``
        (or ``fit``) of a module with as many layers keeps the plan."""
        counts = in_flight_counts(self.options, self.stages, self.microbatches)
        memory = memory_model(
            self.schedule_options.family, self.microbatches, optimizer_copies(optimizer), counts=counts
        )
        planned: tuple[StagePlan, Chosen | None] | PlanningError | None = None
        links = None
        if self._auto is not None:
            self._measure_machine()  # every rank: collectives
        elif self.world_size > 1:  # for the prediction (planned as documented: links free)
            if self._links_measured:
                links = allreduce_bandwidth(self.root_device)
            if self._overlap_measured and self.options.family in REPLICATING_FAMILIES:
                overlap = allreduce_overlap(self.root_device)
                self.plan_options = dataclasses.replace(self.plan_options, reduce_overlap=overlap)
        if self.global_rank == 0:
            profiled = not meta and self.plan_options.profile is None  # a calibration relates a run to a profile
            kept_in = self.plan_options.cache if profiled else None
            shape = (
                None
                if self._auto is not None
                else run_shape(self.options.family, batch_rows, self.microbatches, self._pinned())
            )
            self.step_prices = StepPrices.of(  # auto: the last kept, then each candidate's closest (.choosing)
                model.layers,
                model.names,
                optimizer,
                self.root_device,
                kept_in,
                shape,
                batch_rows,
                links,
                self.plan_options.reduce_overlap,
                self.world_size,
                self.microbatches,
            )
            try:
                if not meta:  # a model on the meta device has no values to compare
                    with timed(self.setup_seconds, "verify"):
                        self._verify(model, first)
                if self._auto is not None:  # schedule="auto": the search's winner (.choosing)
                    planned = self._choose(model, first, optimizer, batch_rows, meta)
                else:
                    stages = self.stages

                    def plan_once(options: PlanOptions) -> StagePlan:
                        return plan_stages(
                            model.layers,
                            model.inputs(first),
                            stages,
                            options,
                            memory,
                            torch.device("meta") if meta else self.root_device,
                            self._replicated,
                            names=model.names,
                            seconds=self.setup_seconds,
                            runs_on=self.root_device,
                            whole=model.run_whole,
                        )

                    options = self._within_limit(self._plan_options(len(model.layers)))
                    planned = within_workers(plan_once, options, self.options, self.microbatches), None
            except PlanningError as error:
                planned = error
        planned = self.broadcast(planned)
        if isinstance(planned, PlanningError):
            raise planned
        assert planned is not None
        stage_plan, chosen = planned
        if chosen is not None:
            self._run_chosen(chosen)
        if self.global_rank == 0:
            self._prediction, self.planned_step_seconds = self.step_prices.predict(
                stage_plan, self.options, self.microbatches, self.plan_options.contention, self.recompute
            )
            self.differences = differences(
                self.lightning_module,
                stage_plan.modules(model.layers),
                rows_of(model.inputs(first)),
                batch_rows,
                self.schedule_options.family not in NON_FLUSHING_FAMILIES,
            )
            notes = [MATERIALISED] if meta else []
            if model.captured is not None and model.captured.cache_off:
                notes.append(CACHE_OFF.format(modules=", ".join(model.captured.cache_off)))
            schedule = self._schedule_maker(stage_plan)(1)
            text = setup_report(stage_plan, self._prediction, model.captured, schedule)
            priced = [self.step_prices.said()] if self._prediction is not None else []
            rank_zero_info("\n".join([text, *priced, *self.differences, *notes]))
        return stage_plan

    def _verify(self, model: PipelineModel, first: Call) -> None:
        """The layers chained on the first micro-batch must give forward's output (both modes)."""
        module = self.lightning_module
        # forward as written: a compiled submodule would be compiled here; no generation cache
        with uncompiled(module), generation_cache_off(module):
            verify_chain(
                module,
                model.layers,
                lambda: type(module).forward(module, *first.args, **first.kwargs),
                model.inputs(first),
                model.names,
                modes=(False,) if model.captured is not None and model.captured.graph.same_in_eval else (False, True),
            )

    def _loss_scale(self) -> LossScale | None:
        """float16's loss scale, from the precision plugin's ``GradScaler`` (its settings, or its
        state restored from a checkpoint); the executor updates it, :meth:`_keep_loss_scale` hands
        it back to the scaler when a checkpoint is written and at the end of fit."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return LossScale.from_state_dict(scaler.state_dict())

    def _keep_loss_scale(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.executor is not None and self.executor.loss_scale is not None:
            scaler.load_state_dict(self.executor.loss_scale.state_dict())

    @property
    def prediction(self) -> Simulation | None:
        """The schedule simulated with the profiled costs at planning (rank 0; ``None`` elsewhere or
        when the stages were given rather than planned)."""
        return self._prediction

    @property
    def measured_step_seconds(self) -> float | None:
        """The median wall time of this rank's training steps, the first two (warm-up) left out."""
        steps = sorted(self._step_seconds[2:])
        return steps[len(steps) // 2] if steps else None

    @property
    def _first(self) -> bool:
        return self.executor is not None and self.executor.needs_inputs

    @property
    def _last(self) -> bool:
        return self.executor is not None and self.executor.needs_targets

    def _evaluates(self, stage: int) -> bool:
        """Whether this rank runs ``stage`` in a forward-only pipeline (a replicated stage runs on its
        first worker there)."""
        assert self.executor is not None
        return self.executor.is_first_owner(stage)

    def _before_update(self, stage: int, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        assert self._hyper is not None
        self._hyper.apply(step, optimizer)

    def _loss(self, output: Any, batch: Any) -> Tensor:
        """The user's ``training_step`` on one micro-batch, with the pipeline's output as the layers'."""
        assert self.executor is not None and self._entry is not None and self.executor.loss_key is not None
        step, mb = self.executor.loss_key
        record = Record(rows_of(batch))
        module = self.lightning_module
        extra, random, rows = self._step_args[step]
        check = None if rows is None else functools.partial(self._chain.check_rows, rows[mb])
        with replayed(random), self._entry.inject(output, check), recording(module, record):
            result = module.training_step(batch, *extra)
        loss = result.get("loss") if isinstance(result, dict) else result
        if not isinstance(loss, Tensor):
            raise PipelineRuntimeError(
                "training_step must return the loss (a tensor, or a dict with 'loss') for every micro-batch; "
                f"got {type(result).__name__}"
            )
        if isinstance(result, dict):
            record.extras = to_cpu({key: value for key, value in result.items() if key != "loss"})
        self._records[(step, mb)] = record
        return loss


def _message_bytes(stage_plan: StagePlan) -> list[float] | None:
    """The bytes each stage but the last sends on per micro-batch, by the plan (``None`` without one,
    or when its stages are not the ones run)."""
    if stage_plan.plan is None or len(stage_plan.plan.stages) != len(stage_plan.bounds):
        return None
    return [stage.output_bytes for stage in stage_plan.plan.stages[:-1]]


def _first_microbatch(call: Call, microbatches: int) -> Call:
    """The first micro-batch of ``call``'s arguments (as the executor will cut them)."""
    skeleton, found = flatten((call.args, call.kwargs))
    if not found:
        raise PlanningError(
            "forward was called without any tensor: a pipeline cuts forward's tensors into micro-batches"
        )
    if not any(t.dim() for t in found):  # set-up: refused as planning, not as a running step's batch
        raise PlanningError(NO_BATCH_DIMENSION)
    parts = min(microbatches, rows_of(tuple(found)))  # an evaluation batch may be smaller
    args, kwargs = unflatten(skeleton, list(split_batch(tuple(found), parts)[0]))
    return Call(tuple(args), dict(kwargs))

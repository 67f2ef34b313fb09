"""``PipelineStrategy``: pipeline-parallel training behind ``Trainer(strategy=...)``.

Lifecycle (Lightning calls these in this order):

1. **Launch and connect** as DDP does: Lightning's launchers start one process per device (the script
   re-run, or ``spawn``), each joins the process group (gloo on CPU, NCCL on GPU).
2. **Set-up** checks what a pipeline cannot run (manual optimisation, gradient accumulation over
   batches with a non-flushing schedule, several optimizers, a custom ``configure_gradient_clipping``)
   and finds the layers (:mod:`.contract`); modules compiled with ``torch.compile`` are captured
   uncompiled and each stage compiled instead (:mod:`.compiling`).
3. **First batch**: profile, partition and predict (:mod:`lightning_pipe.planning`, printed on rank 0; a resume
   reuses the checkpoint's plan), then the :class:`~lightning_pipe.runtime.PipelineExecutor` is built
   with one optimizer per stage cloned from the user's (:mod:`.optimizers`), and each rank releases
   the weights of the stages it does not run to the meta device (:mod:`.ownership`).
4. **Training**: Lightning's closure calls :meth:`training_step` once per batch — the pipeline step
   runs there, exactly once, with the update inside it; ``backward`` only runs the backward hooks,
   and :meth:`optimizer_step` runs the closure without stepping the user's optimizer (it is the
   hyper-parameter template). Under ``accumulate_grad_batches=k`` (flushing schedules) a batch that
   Lightning accumulates runs a step that keeps its gradient for the next one instead of updating,
   each loss divided by ``k`` as Lightning's closure divides it. The last stage runs the user's
   ``training_step`` per micro-batch to compute the loss; its ``self.log`` calls are combined and
   replayed on every rank (:mod:`.logs`).
5. **Validation, test, predict**: a forward-only pipeline over the same stages.
6. **Drains**: a non-flushing schedule (PipeDream, 2BW, CDP) keeps steps in flight between batches;
   they are finished on the last batch of an epoch, at ``max_steps``, before validation, before a
   checkpoint and at the end of fitting.
7. **Checkpoints**: gathered on global rank 0 by name, in Lightning's own layout: the ``state_dict``
   is the full module, ``optimizer_states`` the user's optimizer's state with every parameter's
   state (so ``load_from_checkpoint``, plain Lightning and DDP resume it, and a pipeline resumes it
   on any other split); the plan and a non-flushing schedule's carried state (weight versions)
   ride along under ``optimizer_states[0]["pipeline"]``. With ``state_dict_type="sharded"`` each rank
   writes its own stages instead, into a directory (:mod:`.sharded`). A resume reads by name the
   entries of the stages the rank runs, once they are placed, whatever split wrote them.
8. **Signals**: SIGTERM (preemption) and SLURM's requeue signal are noted by the handler and acted on
   by every rank at the start of the same training batch (:mod:`.signals`).

The class is assembled from parts, one module each, in the order above: :mod:`.topology` (where the
stages and copies sit), :mod:`.building` (3), :mod:`.training` (4, 6), :mod:`.evaluation` (5),
:mod:`.checkpointing` (7) and :mod:`.collectives`. This module keeps the options, the process set-up,
the launchers and the teardown; it is also the one built again against the standalone
``pytorch_lightning`` (:mod:`lightning_pipe.pytorch_lightning`), so the parts import no Lightning
class they use at run time (the checkpoint IO class they compare with is :attr:`plain_checkpoint_io`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor

from lightning_pipe.auto import Candidate
from lightning_pipe.capture.compiled import (
    CompileSettings,
    compiled_settings,
    put_back_calls,
    set_aside_calls,
    settings_of,
)
from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.profile_cache import profile_directory
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.planning import (
    DEFAULT_TOLERANCE,
    PlanOptions,
    StagePlan,
)
from lightning_pipe.runtime import PipelineExecutor
from lightning_pipe.runtime.allocator import release_freed_memory, settle_heap
from lightning_pipe.runtime.failure import FailureBoard
from lightning_pipe.schedule import FAMILIES
from lightning_pipe.schedule.simulation import Simulation
from lightning_pipe.strategy.after_fit import fill, guard, lift_guard
from lightning_pipe.strategy.arguments import (
    check_backend,
    check_flags,
    check_port,
    check_start_method,
    check_timeout,
    parse_option,
)
from lightning_pipe.strategy.building import PipelineBuilding
from lightning_pipe.strategy.calibrating import PipelineCalibration
from lightning_pipe.strategy.checkpointing import CheckpointHooks
from lightning_pipe.strategy.choosing import AUTO, AutoOptions, PipelineChoosing
from lightning_pipe.strategy.collectives import Collectives, close_process_groups, open_strategy_groups
from lightning_pipe.strategy.compiling import StageCompilation
from lightning_pipe.strategy.connection import connect
from lightning_pipe.strategy.contract import Entry, PipelineModel
from lightning_pipe.strategy.effects import metric_modules
from lightning_pipe.strategy.evaluation import EvaluationHooks
from lightning_pipe.strategy.gradient_hooks import GradientHooks
from lightning_pipe.strategy.launchers import ProcessLauncher, ScriptLauncher
from lightning_pipe.strategy.log_relay import RING_BYTES, LogRelay, open_log_relay
from lightning_pipe.strategy.logs import Record
from lightning_pipe.strategy.materialise import on_meta
from lightning_pipe.strategy.optimizers import HyperParameters
from lightning_pipe.strategy.ownership import group_names, parameter_names
from lightning_pipe.strategy.parent_watch import LAUNCHER_PID, ParentWatch
from lightning_pipe.strategy.pipeline_state import PipelineState
from lightning_pipe.strategy.profile_basis import ProfileBasis
from lightning_pipe.strategy.random_states import RandomStates
from lightning_pipe.strategy.refusals import flushing_only, refuse_unsupported
from lightning_pipe.strategy.signals import Signals
from lightning_pipe.strategy.step_prices import StepPrices
from lightning_pipe.strategy.topology import Topology, TopologyHooks
from lightning_pipe.strategy.training import TrainingHooks, reads_step_outputs
from lightning_pipe.strategy.trials import PinTrial, Trials
from lightning_pipe.util.units import parse_bandwidth, parse_bytes

__all__ = ["PipelineStrategy"]

_SYNC_DIST_ADVICE = r"It is recommended to use `self.log\(.*sync_dist=True"

_REGISTERED = {
    "pipe": ("1f1b", "popen"),
    "pipe_spawn": ("1f1b", "spawn"),
    "pipe_auto": ("auto", "popen"),
    "pipe_gpipe": ("gpipe", "popen"),
    "pipe_1f1b": ("1f1b", "popen"),
    "pipe_zb": ("zb_h1", "popen"),
    "pipe_pipedream": ("pipedream", "popen"),
    "pipe_2bw": ("2bw", "popen"),
    "pipe_2bw_spawn": ("2bw", "spawn"),
    "pipe_cdp": ("cdp", "popen"),
    "pipe_cdp_spawn": ("cdp", "spawn"),
    "pipe_ddp": ("ddp", "popen"),
    "pipe_fsdp": ("fsdp", "popen"),
    "pipe_lpp": ("lpp", "popen"),
    "pipe_fslpp": ("fslpp", "popen"),
}


class PipelineStrategy(
    TopologyHooks,
    PipelineBuilding,
    PipelineChoosing,
    PipelineCalibration,
    TrainingHooks,
    GradientHooks,
    EvaluationHooks,
    CheckpointHooks,
    Collectives,
    ParallelStrategy,
):
    """Pipeline-parallel training: the model's layers split into stages, one per device, run by a
    schedule of any family with its update rule.

    Args:
        schedule: the schedule family (``gpipe``, ``1f1b``, ``interleaved``, ``zb_h1``, ``pipedream``,
            ``2bw``, ``cdp``, ...; see ``lightning_pipe.schedule.FAMILIES``), or ``auto``: on the first
            batch the strategy prices every split × family × micro-batch count × per-stage
            recomputation × replication the options leave open under ``memory_limit``, prints the
            best five and why the winner won, and runs it (:mod:`.choosing`), then checks the choice
            against the run's own costs after six steps (:mod:`.calibrating`); the update rule is
            never changed silently: ``rule=None`` keeps to the flushing families (sync),
            ``rule="delayed"`` allows every family with its own rule. The flushing families
            run ``Trainer(accumulate_grad_batches=k)`` as Lightning does (``k`` steps, one update);
            the non-flushing ones (``pipedream``, ``2bw``, ``cdp``) refuse it: their steps overlap and
            their update rules apply each step's gradient, so batches ``k`` times larger with ``k``
            times the micro-batches give the gradient per update instead.
        microbatches: micro-batches per batch (default: the number of stages); ``"auto"`` or a list of
            counts: the search chooses among them (2, 4 and 8 by default with ``schedule="auto"``).
        rule, slack, virtual_stages, form, period, k: the schedule's options
            (:class:`~lightning_pipe.schedule.options.ScheduleOptions`).
        groups: ``G`` of ``lpp`` and ``fslpp`` (Rahimi 2025): the devices form ``G`` groups of
            ``devices / G`` workers, each group a looped pipeline over the stages, micro-batches dealt
            round robin over the groups.
        partitioner: how layers are split (``time`` by default: measured forward + backward).
        memory_limit: bytes per device (a number or a string such as ``"8GB"``); the partitioner plans
            within it (a device computing several stages, as interleaved and looped schedules do, with
            their weights and the activations its schedule keeps alive at once together) and refuses
            what cannot fit.
        bandwidth: between devices (``"10GB/s"``), for planning; default free, or with
            ``schedule="auto"`` measured by an all-reduce among the ranks.
        contention: for the printed prediction, how many times slower a stage computes while every
            device computes (processes sharing one machine's cores and memory bandwidth); default 1,
            devices that share nothing, or with ``schedule="auto"`` measured
            (:func:`~lightning_pipe.runtime.contention.measure_contention`).
        reduce_overlap: for the prediction, the share of the replicas' all-reduce of gradients that
            runs beside their compute (1: all of it, as a GPU's collectives on their own stream; 0:
            none, as gloo's threads on CPU processes filling the cores); default measured among
            the ranks where replicas sum gradients, or with ``schedule="auto"``
            (:func:`~lightning_pipe.runtime.link_speed.allreduce_overlap`), else 1.
        recompute: recompute activations in the backward instead of keeping them; ``"auto"`` (the
            default with ``schedule="auto"``): the stages that need it to fit ``memory_limit`` do.
        profile: a saved profile to plan with instead of profiling.
        plan: a saved plan (``lightning-pipe plan --json``) to run as is.
        balance: layers per stage, instead of planning.
        keep_plan: a resume from a pipeline checkpoint with as many stages reuses the checkpoint's
            plan (no profiling: the split does not depend on the machine's load); ``False`` plans anew.
        state_dict_type: ``full`` (default): a checkpoint is one file in Lightning's own layout, the full
            model gathered on global rank 0; ``sharded``: a directory where each rank writes its own
            stages (``torch.distributed.checkpoint``) and a resume reads only its own, by name, on any
            split (:mod:`.sharded`; ``lightning-pipe consolidate`` makes the single file).
        stage_replicas: workers per stage with ``balance`` for ``1f1b_rr``.
        profile_repeats: timed runs per layer when profiling.
        profile_cache: keep the measured profile from run to run (``True``: in
            ``$LIGHTNING_PIPE_CACHE`` or ``~/.cache/lightning_pipe/profiles``; a directory; ``False``:
            measure every run), so that the same model on the same machine gets the same split
            (:mod:`lightning_pipe.cost.profile_cache`).
        plan_tolerance: splits within this fraction of the fastest one's bottleneck are ties, decided
            by memory, then by FLOPs, so that the jitter of measured times moves the split less often from run to
            run (``bench/plan_stability.py``); 0: the fastest split as measured.
        stages: pipeline stages (default: one per device, or what the family puts on the devices of
            one pipeline); with ``stages``, the devices beyond one pipeline make data-parallel copies.
        data_parallel: copies of the whole pipeline (``devices = workers per pipeline × copies``);
            each reads its own shard of the data, and a stage's gradients are averaged over them.
        start_method: ``popen`` (re-run the script, as ``ddp``), ``spawn`` (notebooks), or
            ``forkserver`` (what Hydra multiruns use): spawn's semantics, each process forked from a
            server that imported torch, Lightning and this package once, so that repeated fits in one
            process (a multirun's jobs) start in milliseconds instead of seconds (:mod:`.launchers`).
        pin_cpus: keep each process's threads on cores of its own (Linux; CPU training with one process
            per core or per group of cores: 2BW and CDP ran 1.14-1.18x faster on 2 cores,
            ``bench/pinning.py``); data-loader workers inherit the placement. ``"auto"``: try it
            after the first steps and keep it only if the steps ran faster (:mod:`.calibrating`).
            At teardown the threads go back to every core they could use before.
        shared_memory_bytes: CPU training: messages between processes on one host go through ring
            buffers of this many bytes per direction in ``/dev/shm`` instead of gloo's sockets
            (default 64 MiB; 0: gloo only; a message that finds the ring full goes by gloo);
            :mod:`lightning_pipe.runtime.shared_memory`. The log relay's rings between processes on
            one host (any device) are 64 KiB, at most this (:mod:`.log_relay`).
        release_memory: CPU training (glibc): blocks of 4 MiB or more are unmapped when freed instead of
            kept in glibc's heap, so each process's resident memory follows the memory the plan
            predicts (:mod:`lightning_pipe.runtime.allocator`), at a cost in speed (each such block's
            pages are faulted in again). ``None`` (default): only when planning within a
            ``memory_limit``.
        gather_after_fit: at the end of ``fit``, gather the full model into the module on every rank, as
            DDP leaves it (each rank then holds the whole model); by default each rank keeps only its
            stages, as under FSDP, and rank 0 says how to get the full model (:mod:`.after_fit`).
        timeout: of the process group and of any single pipeline wait (a hang fails after it).
        process_group_backend: ``gloo``/``nccl``; default from the device.
    """

    strategy_name = "pipe"
    plain_checkpoint_io = TorchCheckpointIO  # Lightning's default: its files are written atomically (:mod:`.atomic`)

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int | Literal["auto"] | list[int] | None = None,
        *,
        rule: str | None = None,
        slack: int = 0,
        virtual_stages: int = 2,
        form: str = "pipeline",
        period: float | None = None,
        k: int | None = None,
        groups: int = 2,
        partitioner: str = "time",
        memory_limit: float | str | None = None,
        bandwidth: float | str | None = None,
        contention: float | None = None,
        reduce_overlap: float | None = None,
        recompute: bool | Literal["auto"] | None = None,
        profile: str | None = None,
        plan: str | None = None,
        balance: list[int] | None = None,
        keep_plan: bool = True,
        state_dict_type: Literal["full", "sharded"] = "full",
        stage_replicas: list[int] | None = None,
        profile_repeats: int = 3,
        profile_cache: bool | str | os.PathLike[str] = True,
        plan_tolerance: float = DEFAULT_TOLERANCE,
        stages: int | None = None,
        data_parallel: int | None = None,
        start_method: Literal["popen", "spawn", "forkserver"] = "popen",
        pin_cpus: bool | Literal["auto"] = False,
        shared_memory_bytes: int | None = None,
        release_memory: bool | None = None,
        gather_after_fit: bool = False,
        timeout: timedelta = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._auto, start = AutoOptions.of(schedule, microbatches, rule, recompute)
        self.schedule_options = dataclasses.replace(
            start,
            slack=slack,
            virtual_stages=virtual_stages,
            form=form,
            period=period,
            k=k,
            groups=groups,
        )
        self.plan_options = PlanOptions(
            partitioner=partitioner,
            memory_limit=None if memory_limit is None else parse_option("memory_limit", memory_limit, parse_bytes),
            bandwidth=float("inf") if bandwidth is None else parse_option("bandwidth", bandwidth, parse_bandwidth),
            contention=1.0 if contention is None else contention,
            reduce_overlap=1.0 if reduce_overlap is None else reduce_overlap,
            profile=profile,
            plan=plan,
            balance=balance,
            stage_replicas=stage_replicas,
            repeats=profile_repeats,
            tolerance=plan_tolerance,
            cache=profile_directory(profile_cache),
        )
        check_whole("profile_repeats", profile_repeats, 1)
        check_whole("stages", stages, 1, optional=True)
        check_whole("data_parallel", data_parallel, 1, optional=True)
        if stages is not None and data_parallel is not None:
            raise PlanningError("give stages or data_parallel, not both: the devices decide the other")
        self._stages_option, self._data_parallel_option = stages, data_parallel
        check_start_method(start_method)
        check_flags(keep_plan=keep_plan, gather_after_fit=gather_after_fit)
        if not (isinstance(pin_cpus, bool) or pin_cpus == AUTO):
            raise PlanningError(f"pin_cpus must be True, False or 'auto' (tried in the first steps); got {pin_cpus!r}")
        check_timeout(timeout)
        check_backend(process_group_backend)
        check_port()
        self.recompute: bool | list[bool] = recompute is True  # "auto": as the search chooses (.choosing)
        self.candidates: list[Candidate] = []  # rank 0, schedule="auto": the configurations priced, best first
        self._searched: tuple[ProfileBasis, dict[str, Any]] | None = None  # rank 0, auto: the profiles, the arguments
        # schedule="auto": what was not given is measured before planning (.choosing)
        self._links_measured, self._contention_measured = bandwidth is None, contention is None
        self._overlap_measured = reduce_overlap is None
        self._calibrated = self._auto is None  # the in-run costs have re-ranked the candidates (.calibrating)
        self.planned_step_seconds: float | None = None  # rank 0: the running one's, at set-up or switch
        self.calibrated_step_seconds: float | None = None  # rank 0: the running one's, by the in-run costs
        self.calibration: Calibration | None = None  # rank 0: what the first steps measured (.calibrating)
        self.step_prices = StepPrices()  # rank 0: what the prediction prices beyond the profile (.step_prices)
        self.trials: Trials | None = None  # schedule="auto": the configurations tried after calibration (.calibrating)
        self.settled_step = 0  # the training steps of this fit before the configuration running now was built
        self._pin_trial: PinTrial | None = None  # pin_cpus="auto" on the CPU: pinning tried (.calibrating)
        self._cores_before: set[int] | None = None  # where pin_cpus moved the threads from: restored at teardown
        self.keep_plan = keep_plan
        if state_dict_type not in ("full", "sharded"):
            raise PlanningError(f"state_dict_type must be 'full' or 'sharded'; got {state_dict_type!r}")
        self.state_dict_type = state_dict_type
        self._start_method = start_method
        self.pin_cpus = pin_cpus
        check_whole("shared_memory_bytes", shared_memory_bytes, 0, "bytes", optional=True)
        self.shared_memory_bytes = shared_memory_bytes
        if release_memory not in (None, True, False):
            raise PlanningError(
                f"release_memory must be True, False or None (only with a memory_limit), got {release_memory!r}"
            )
        self.release_memory = release_memory
        self.gather_after_fit = gather_after_fit
        self._full_after_fit: dict[str, Tensor] | None = None  # the gathered model, until teardown puts it in
        self._timeout = timeout
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._topology: Topology | None = None  # built in setup_environment, once the ranks are known
        self.executor: PipelineExecutor | None = None
        self.stage_plan: StagePlan | None = None
        self._entry: Entry | None = None
        self._chain: PipelineModel | None = None
        self._chain_of: LightningModule | None = None  # the module the chain was captured from
        self._connected = False  # this fit's process groups are open
        self._writers: dict[str, int] | None = None  # the rank giving each state-dict entry, once released
        self._template_names: list[str | None] = []  # the user's optimizer's parameters, by name
        self._saved: PipelineState | None = None  # the plan and carried state of a checkpoint being resumed
        self._saved_states: Mapping[str, Any] | None = None  # its optimizer state by parameter name
        self._deferred: tuple[Mapping[str, Any], list[str]] | None = None  # its entries for tensors still on meta
        self._carried: dict[str, Any] | None = None  # this rank's carried state when the executor closed
        self.differences: list[str] = []  # how the run differs from plain Lightning (rank 0, after planning)
        self._hyper: HyperParameters | None = None
        # step -> its other arguments, random streams and (on the last stage) forward's input per micro-batch
        self._step_args: dict[int, tuple[tuple[Any, ...], RandomStates, list[Any] | None]] = {}
        self._records: dict[tuple[int, int], Record] = {}
        self._pending: dict[int, dict[int, tuple[Record, float]]] = {}
        self._last_output: Any = torch.tensor(float("nan"))
        self._outputs_read = False
        self._prediction: Simulation | None = None
        self.predicted_memory: float | None = None  # this rank's: its worker's peak (.building) and its rings
        self.ring_bytes = 0  # this rank's shared-memory rings (resident from the start: part of predicted_memory)
        self._step_seconds: list[float] = []  # each training step's executor.step, in seconds
        self._step_starts: list[float] = []  # when each training step began (time.perf_counter)
        # this rank's last set-up, seconds per phase: capture, verify, profile, plan (or its wait), executor, total
        self.setup_seconds: dict[str, float] = {}
        self._posted: Any = None
        self._log_relay: LogRelay | None = None  # opened in setup_environment, closed at teardown
        self._signals: Signals | None = None
        self._parent_watch: ParentWatch | None = None
        self._whole_compiled: tuple[LightningModule, CompileSettings] | None = None  # torch.compile(model)'s
        self._compiled: list[tuple[str, CompileSettings | None]] = []  # the module's compiled parts (.compiling)
        self._compiled_calls: list[tuple[torch.nn.Module, Callable[..., Any]]] = []  # set aside until teardown
        self.compilation: StageCompilation | None = None  # the stages compiled, for a model holding compiled code

    @property
    def _lightning_module(self) -> LightningModule | None:
        return self._module

    @_lightning_module.setter
    def _lightning_module(self, module: LightningModule | None) -> None:
        """Lightning's Trainer sets the module it unwrapped from ``torch.compile(model)`` here, then refuses
        a compiled module for any strategy but its own few: the pipeline takes the original back with its
        settings, captures it and compiles each stage (:mod:`.compiling`)."""
        context = getattr(module, "_compiler_ctx", None)
        if context is not None:
            self._whole_compiled = (module, settings_of(context["dynamo_ctx"]))
            to_uncompiled(module)
        self._module = module

    # -- process set-up, as Lightning's DDP ------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            if not self.cluster_environment.creates_processes_externally and self.num_processes > 1:
                os.environ[LAUNCHER_PID] = str(os.getpid())  # rank 0 re-runs the script (.parent_watch)
        else:
            self._launcher = ProcessLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        launcher = os.environ.get(LAUNCHER_PID)
        if launcher and self._start_method == "popen" and self.cluster_environment.local_rank() > 0:
            self._parent_watch = ParentWatch(self.cluster_environment.local_rank(), int(launcher))  # .parent_watch
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._topology = self._shape()
        self._connected = False  # until this fit's groups are open (.collectives: on_exception)
        if self.lightning_module is not None:  # refused on every rank alike before the ranks connect: no
            self._refuse_unsupported(self.lightning_module.trainer)  # group to close, none to open again
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        connect(self.cluster_environment, backend, self._timeout)  # again after a failed fit (.connection)
        atexit.unregister(close_process_groups)  # registered once per process, however many fits
        atexit.register(close_process_groups)
        self._place_threads()  # pin_cpus (.calibrating)
        self._set_up_heap()
        # pickled objects on the CPU: every rank's states, each pipeline's logs, reductions of logged values
        self._objects = dist.new_group(backend="gloo", timeout=self._timeout)
        ring = RING_BYTES if self.shared_memory_bytes is None else min(RING_BYTES, self.shared_memory_bytes)
        self._log_relay = open_log_relay(
            self._objects, lambda error: self._failures.aborted(), self._timeout.total_seconds(), ring
        )
        own = [dist.new_group(ranks, backend="gloo", timeout=self._timeout) for ranks in self.pipelines]
        self._pipeline_objects = own[self.pipeline_index]
        positions = [dist.new_group(list(range(w, self.world_size, self.workers))) for w in range(self.workers)]
        self._copies = positions[self.topology.worker]
        open_strategy_groups([self._objects, *own, *positions])
        self._failures = FailureBoard(dist.distributed_c10d._get_default_store(), self.global_rank)
        self._connected = True

    def _set_up_heap(self) -> None:
        """CPU training (glibc), every process: with ``release_memory`` (by default: within a
        ``memory_limit``) freed blocks of 4 MiB or more go back to the system; without, the heap is
        settled as the profiler measured the layers in (the steps alone do not settle it reliably:
        docs/strategy.md)."""
        if self.root_device.type != "cpu":
            return
        wanted = self.release_memory
        if wanted is None:
            wanted = self.plan_options.memory_limit is not None
        if not wanted:
            settle_heap()
        elif release_freed_memory():
            rank_zero_info(
                "CPU training: freed blocks of 4 MiB or more go back to the system (glibc's mmap threshold), so each "
                "process's resident memory follows the planned memory; steps pay the page faults "
                "(release_memory=False keeps glibc's heap)"
            )

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        released = lift_guard(self.lightning_module)
        if self.data_parallel == 1:  # every rank logs the same values: there is nothing to synchronise
            warnings.filterwarnings("ignore", message=_SYNC_DIST_ADVICE, category=PossibleUserWarning)
        self.accelerator.setup(trainer)
        # a module this strategy split keeps its split (and a fit, validate or test after it gathers nothing)
        if self._chain_of is not self.lightning_module and self.reduce_boolean_decision(released, all=False):
            self.whole_again()  # any rank released tensors: the gather is a collective
        module = self.lightning_module
        whole = self._whole_compiled
        self._compiled = [(type(module).__name__, whole[1])] if whole is not None and whole[0] is module else []
        self._compiled += compiled_settings(module)
        self._compiled_calls = set_aside_calls(module)  # the step code calls forward, stood in for (.contract)
        self._entry = Entry(module)
        self._outputs_read = reads_step_outputs(trainer)
        for metric in metric_modules(self.lightning_module).values():
            metric.process_group = self._copies  # every rank of a pipeline holds the same states (.effects)
        self._signals = Signals(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # one: Lightning refuses several under automatic optimization
            self._hyper = HyperParameters(self.optimizers[0])
            self._template_names = group_names(self.optimizers[0], parameter_names(self.lightning_module))
            epoch_loop = trainer.fit_loop.epoch_loop
            if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning's per-batch collective: the
                epoch_loop._broadcast_sigterm_tensor = lambda: None  # flag travels in the log relay (.signals)
        self.setup_precision_plugin()

    def _refuse_unsupported(self, trainer: Trainer) -> None:
        """What ``trainer``'s settings ask that the pipeline cannot run (:mod:`.refusals`);
        ``schedule="auto"`` keeps to the flushing families where they need one."""
        reason = flushing_only(trainer)
        if self._auto is not None and reason is not None:
            self._auto = self._auto.flushing_only(reason)
        processes = self.num_nodes * self.num_processes
        refuse_unsupported(self.lightning_module, trainer, self.schedule_options.family, self.microbatches, processes)

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device: no rank holds it
        whole; each materialises its stages once they are placed (:mod:`.materialise`). As under
        Lightning's ``ModelParallelStrategy``, ``configure_model`` runs with real tensors unless it
        builds its modules under ``torch.device("meta")`` itself (materialised the same way)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        _move_held(self.model, self.root_device)

    def _close_executor(self) -> None:
        """Close the pipeline, if open: the user's optimizer keeps the stages' optimizer states and this
        rank their carried state; the next batch builds it again on the same split."""
        if self.executor is None:
            return
        drained = not self.executor.in_flight  # not after a failure mid-step
        self._carried = self._carried_state() if drained else None
        for stage_optimizer in self.executor.stage_optimizers:
            for optimizer in self.optimizers:
                optimizer.state.update(stage_optimizer.state)
        self.executor.close()
        self.executor = None

    def teardown(self) -> None:
        """Close the pipeline; the user's optimizer keeps the stages' optimizer states and this rank
        their carried state (a checkpoint written after ``fit`` has them). The module moves to the CPU
        as under DDP, its released tensors staying on the meta device."""
        if self._parent_watch is not None:
            self._parent_watch.stop()
        if os.environ.get(LAUNCHER_PID) == str(os.getpid()):  # its children started: not for what starts later
            del os.environ[LAUNCHER_PID]
        if self._log_relay is not None:
            self._log_relay.close()
            self._log_relay = None
        self._close_executor()
        self._restore_placement()  # the process goes on on every core it had
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        put_back_calls(self._compiled_calls)
        self._compiled_calls = []
        if self.lightning_module is not None:
            _move_held(self.lightning_module, torch.device("cpu"))
            if self._full_after_fit is not None:
                layers = self._chain.layers if self._chain is not None else []
                fill([self.lightning_module, *layers], self.lightning_module, self._full_after_fit)
                self._full_after_fit = None
            elif on_meta(self.lightning_module):
                guard(self.lightning_module)
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (family, start_method) in _REGISTERED.items():
            strategy_registry.register(
                name,
                cls,
                description=(
                    f"{FAMILIES[family]}: the {family} schedule, start method {start_method}"
                    if family in FAMILIES
                    else f"the pipeline chosen on the first batch (schedule='auto'), start method {start_method}"
                ),
                schedule=family,
                start_method=start_method,
            )


def _move_held(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors this rank holds: the released ones stay on the meta
    device (:mod:`.ownership`)."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        module.to(device)
        return
    module._apply(lambda t: t if t.is_meta else t.to(device))
    for submodule in module.modules():  # what LightningModule.device reports
        if isinstance(submodule, _DeviceDtypeModuleMixin):
            submodule._device = device

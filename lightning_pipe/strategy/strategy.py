"""``PipelineStrategy``: pipeline-parallel training behind ``Trainer(strategy=...)``.

Lifecycle (Lightning calls these in this order):

1. **Launch and connect** as DDP does: Lightning's launchers start one process per device (the script
   re-run, or ``spawn``), each joins the process group (gloo on CPU, NCCL on GPU).
2. **Set-up** checks what a pipeline cannot run (manual optimisation, gradient accumulation by
   batches, several optimizers, a custom ``configure_gradient_clipping``) and finds the layers
   (:mod:`.contract`).
3. **First batch**: profile, partition and predict (:mod:`.planning`, printed on rank 0; a resume
   reuses the checkpoint's plan), then the :class:`~lightning_pipe.runtime.PipelineExecutor` is built
   with one optimizer per stage cloned from the user's (:mod:`.optimizers`), and each rank releases
   the weights of the stages it does not run to the meta device (:mod:`.ownership`).
4. **Training**: Lightning's closure calls :meth:`training_step` once per batch — the pipeline step
   runs there, exactly once, with the update inside it; ``backward`` only runs the backward hooks,
   and :meth:`optimizer_step` runs the closure without stepping the user's optimizer (it is the
   hyper-parameter template). The last stage runs the user's ``training_step`` per micro-batch to
   compute the loss; its ``self.log`` calls are combined and replayed on every rank (:mod:`.logs`).
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
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import dis
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor

from lightning_pipe.capture.verify import verify_chain
from lightning_pipe.errors import CheckpointError, PlanningError, check_whole
from lightning_pipe.memory import MemoryModel
from lightning_pipe.nested import flatten, map_tensors, unflatten
from lightning_pipe.runtime import PipelineExecutor
from lightning_pipe.runtime.affinity import pin_threads
from lightning_pipe.runtime.allocator import release_freed_memory
from lightning_pipe.runtime.batches import rows_of, split_batch
from lightning_pipe.runtime.failure import FailureBoard, raised_elsewhere
from lightning_pipe.runtime.loss_scaling import LossScale
from lightning_pipe.runtime.ring_sizes import shared_memory_capacity
from lightning_pipe.schedule import FAMILIES, NON_FLUSHING_FAMILIES
from lightning_pipe.schedule.ir import COMPUTE
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.schedule.simulate import Simulation
from lightning_pipe.strategy.after_fit import HOW_TO_GET_IT, fill, guard, lift_guard
from lightning_pipe.strategy.arguments import check_backend, check_flags, check_port, check_timeout, parse_option
from lightning_pipe.strategy.atomic import remove, sweep, write_file
from lightning_pipe.strategy.batches import check_batches
from lightning_pipe.strategy.checkpoint_files import check_same_model, load_checkpoint
from lightning_pipe.strategy.contract import Call, Entry, PipelineModel, pipeline_model
from lightning_pipe.strategy.differences import differences
from lightning_pipe.strategy.effects import metric_modules, replay
from lightning_pipe.strategy.logs import Record, combine, logged_metrics, recording
from lightning_pipe.strategy.materialise import MATERIALISED, materialise, on_meta
from lightning_pipe.strategy.optimizers import HyperParameters, stage_optimizers
from lightning_pipe.strategy.ownership import Ownership, release, tensor_ids
from lightning_pipe.strategy.parent_watch import LAUNCHER_PID, ParentWatch
from lightning_pipe.strategy.planning import (
    DEFAULT_TOLERANCE,
    PlanOptions,
    StagePlan,
    memory_schedule,
    optimizer_copies,
    plan_stages,
    predict,
    report,
    schedule_of,
)
from lightning_pipe.strategy.profile_cache import default_directory
from lightning_pipe.strategy.relay import Relay
from lightning_pipe.strategy.report import STEPS_SHOWN, FitReport, last_steps
from lightning_pipe.strategy.resume import complete_last
from lightning_pipe.strategy.saving import SaveRanks, save_together
from lightning_pipe.strategy.sharded import read_entries, save_sharded
from lightning_pipe.strategy.signals import Signals
from lightning_pipe.strategy.stop_iteration import no_stop_iteration
from lightning_pipe.units import format_bytes, parse_bandwidth, parse_bytes

__all__ = ["PipelineStrategy"]

_SYNC_DIST_ADVICE = r"It is recommended to use `self.log\(.*sync_dist=True"

_REGISTERED = {
    "pipe": ("1f1b", "popen"),
    "pipe_spawn": ("1f1b", "spawn"),
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


def _profile_directory(cache: bool | str | os.PathLike[str]) -> Path | None:
    """The directory ``profile_cache`` names (``True``: the default one), or ``None``."""
    if cache is True:
        return default_directory()
    if cache is False:
        return None
    if isinstance(cache, str | os.PathLike):
        return Path(cache).expanduser()
    raise PlanningError(f"profile_cache must be True, False or a directory, got {cache!r}")


def _concatenate(parts: list[Any]) -> Any:
    """Micro-batches' predictions joined back into the batch's (tensors along dim 0, lists chained)."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, dict):
        return {key: _concatenate([part[key] for part in parts]) for key in first}
    if isinstance(first, tuple):
        return tuple(_concatenate(list(items)) for items in zip(*parts, strict=True))
    if isinstance(first, list):
        return [item for part in parts for item in part]
    return parts


class PipelineStrategy(ParallelStrategy):
    """Pipeline-parallel training: the model's layers split into stages, one per device, run by a
    schedule of any family with its update rule.

    Args:
        schedule: the schedule family (``gpipe``, ``1f1b``, ``interleaved``, ``zb_h1``, ``pipedream``,
            ``2bw``, ``cdp``, ...; see ``lightning_pipe.schedule.FAMILIES``).
        microbatches: micro-batches per batch (default: the number of stages).
        rule, slack, virtual_stages, form, period, k: the schedule's options
            (:class:`~lightning_pipe.schedule.options.ScheduleOptions`).
        groups: ``G`` of ``lpp`` and ``fslpp`` (Rahimi 2025): the devices form ``G`` groups of
            ``devices / G`` workers, each group a looped pipeline over the stages, micro-batches dealt
            round robin over the groups.
        partitioner: how layers are split (``time`` by default: measured forward + backward).
        memory_limit: bytes per device (a number or a string such as ``"8GB"``); the partitioner plans
            within it and refuses what cannot fit.
        bandwidth: between devices (``"10GB/s"``), for planning; default free.
        contention: for the printed prediction, how many times slower a stage computes while every
            device computes (processes sharing one machine's cores and memory bandwidth: measure it
            with ``bench/runtime_speed.py``); default 1, devices that share nothing.
        recompute: recompute activations in the backward instead of keeping them.
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
            (:mod:`lightning_pipe.strategy.profile_cache`).
        plan_tolerance: splits within this fraction of the fastest one's bottleneck are ties, decided
            by memory, then by FLOPs, so that the jitter of measured times moves the split less often from run to
            run (``bench/plan_stability.py``); 0: the fastest split as measured.
        stages: pipeline stages (default: one per device, or what the family puts on the devices of
            one pipeline); with ``stages``, the devices beyond one pipeline make data-parallel copies.
        data_parallel: copies of the whole pipeline (``devices = workers per pipeline × copies``);
            each reads its own shard of the data, and a stage's gradients are averaged over them.
        start_method: ``popen`` (re-run the script, as ``ddp``) or ``spawn`` (notebooks, Hydra multirun).
        pin_cpus: keep each process's threads on cores of its own (Linux; CPU training with one process
            per core or per group of cores: 2BW and CDP ran 1.14-1.18x faster on 2 cores,
            ``bench/pinning.py``); data-loader workers inherit the placement.
        shared_memory_bytes: CPU training: messages between processes on one host go through ring
            buffers of this many bytes per direction in ``/dev/shm`` instead of gloo's sockets
            (default 64 MiB; 0: gloo only; a message that finds the ring full goes by gloo);
            :mod:`lightning_pipe.runtime.shared_memory`.
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

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int | None = None,
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
        contention: float = 1.0,
        recompute: bool = False,
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
        start_method: Literal["popen", "spawn"] = "popen",
        pin_cpus: bool = False,
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
        self.schedule_options = ScheduleOptions(
            family=schedule,
            microbatches=microbatches,
            rule=rule,
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
            contention=contention,
            profile=profile,
            plan=plan,
            balance=balance,
            stage_replicas=stage_replicas,
            repeats=profile_repeats,
            tolerance=plan_tolerance,
            cache=_profile_directory(profile_cache),
        )
        check_whole("profile_repeats", profile_repeats, 1)
        check_whole("stages", stages, 1, optional=True)
        check_whole("data_parallel", data_parallel, 1, optional=True)
        if stages is not None and data_parallel is not None:
            raise PlanningError("give stages or data_parallel, not both: the devices decide the other")
        self._stages_option, self._data_parallel_option = stages, data_parallel
        if start_method not in ("popen", "spawn"):
            raise PlanningError(f"start_method must be 'popen' or 'spawn'; got {start_method!r}")
        check_flags(recompute=recompute, keep_plan=keep_plan, pin_cpus=pin_cpus, gather_after_fit=gather_after_fit)
        check_timeout(timeout)
        check_backend(process_group_backend)
        check_port()
        self.recompute = recompute
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
        self.executor: PipelineExecutor | None = None
        self.stage_plan: StagePlan | None = None
        self._entry: Entry | None = None
        self._chain: PipelineModel | None = None
        self._chain_of: LightningModule | None = None  # the module the chain was captured from
        self._writers: dict[str, int] | None = None  # the rank giving each state-dict entry, once released
        self._template_names: list[str | None] = []  # the user's optimizer's parameters, by name
        self._saved: dict[str, Any] | None = None  # the plan and carried state of a checkpoint being resumed
        self._saved_states: Mapping[str, Any] | None = None  # its optimizer state by parameter name
        self._deferred: tuple[Mapping[str, Any], list[str]] | None = None  # its entries for tensors still on meta
        self._carried: dict[str, Any] | None = None  # this rank's carried state when the executor closed
        self.differences: list[str] = []  # how the run differs from plain Lightning (rank 0, after planning)
        self._hyper: HyperParameters | None = None
        self._step_args: dict[int, tuple[Any, ...]] = {}
        self._records: dict[tuple[int, int], Record] = {}
        self._pending: dict[int, dict[int, tuple[Record, float]]] = {}
        self._last_output: Any = torch.tensor(float("nan"))
        self._outputs_read = False
        self._prediction: Simulation | None = None
        self.predicted_memory: float | None = None  # this rank's: its stages' (the plan's) and its rings
        self.ring_bytes = 0  # this rank's shared-memory rings (resident from the start: part of predicted_memory)
        self._step_seconds: list[float] = []
        self._posted: Any = None
        self._signals: Signals | None = None
        self._parent_watch: ParentWatch | None = None

    # -- process set-up, as Lightning's DDP ------------------------------------------------------
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

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:  # rank 0 re-runs the script
                os.environ[LAUNCHER_PID] = str(os.getpid())
        else:
            self._launcher = _SpawnLauncher(self, start_method=self._start_method)

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
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        atexit.unregister(_close_process_groups)  # registered once per process, however many fits
        atexit.register(_close_process_groups)
        if self.pin_cpus:
            pin_threads(self.local_rank, self.num_processes)
        self._release_freed_memory()
        # pickled objects on the CPU: every rank's (states), each pipeline's (logs); the ranks at the
        # same position of every pipeline (reductions of logged values)
        self._objects = dist.new_group(backend="gloo", timeout=self._timeout)
        self._relay = Relay(self._objects, lambda error: self._failures.aborted())
        own = [dist.new_group(ranks, backend="gloo", timeout=self._timeout) for ranks in self.pipelines]
        self._pipeline_objects = own[self.pipeline_index]
        positions = [dist.new_group(list(range(w, self.world_size, self.workers))) for w in range(self.workers)]
        self._copies = positions[self.global_rank % self.workers]
        self._failures = FailureBoard(dist.distributed_c10d._get_default_store(), self.global_rank)

    def _release_freed_memory(self) -> None:
        """CPU training with ``release_memory`` (by default: within a ``memory_limit``): freed blocks
        of 4 MiB or more go back to the system (:func:`release_freed_memory`)."""
        wanted = self.release_memory
        if wanted is None:
            wanted = self.plan_options.memory_limit is not None
        if wanted and self.root_device.type == "cpu" and release_freed_memory():
            rank_zero_info(
                "CPU training: freed blocks of 4 MiB or more go back to the system (glibc's mmap threshold), so each "
                "process's resident memory follows the planned memory; steps pay the page faults "
                "(release_memory=False keeps glibc's heap)"
            )

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        lift_guard(self.lightning_module)
        if self.data_parallel == 1:  # every rank logs the same values: there is nothing to synchronise
            warnings.filterwarnings("ignore", message=_SYNC_DIST_ADVICE, category=PossibleUserWarning)
        self.accelerator.setup(trainer)
        self._refuse_unsupported(trainer)
        self._entry = Entry(self.lightning_module)
        self._outputs_read = _reads_step_outputs(trainer)
        for metric in metric_modules(self.lightning_module).values():
            metric.process_group = self._copies  # every rank of a pipeline holds the same states (.effects)
        self._signals = Signals(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # one: Lightning refuses several under automatic optimization
            self._hyper = HyperParameters(self.optimizers[0])
            names = {id(p): name for name, p in self.lightning_module.named_parameters()}
            self._template_names = [names.get(id(p)) for g in self.optimizers[0].param_groups for p in g["params"]]
            epoch_loop = trainer.fit_loop.epoch_loop
            if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning's per-batch collective: the
                epoch_loop._broadcast_sigterm_tensor = lambda: None  # flag travels in the log relay (.signals)
        self.setup_precision_plugin()

    def _refuse_unsupported(self, trainer: Trainer) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise PlanningError(
                "manual optimization (automatic_optimization = False) is not supported: the pipeline runs forward, "
                "backward and the update of every stage itself"
            )
        if trainer.accumulate_grad_batches != 1:
            raise PlanningError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: a pipeline accumulates over its "
                f"micro-batches; use batches {trainer.accumulate_grad_batches}x larger with "
                f"microbatches={trainer.accumulate_grad_batches * self.microbatches} instead"
            )
        if is_overridden("configure_gradient_clipping", module, LightningModule):
            raise PlanningError(
                "configure_gradient_clipping is overridden: the pipeline clips inside each stage's update; set "
                "Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm'|'value') instead"
            )
        precision = str(trainer.precision)
        if precision not in ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed"):
            raise PlanningError(
                f"precision={precision!r} is not supported by the pipeline: use '32-true', 'bf16-mixed', "
                "'bf16-true' or '16-mixed'"
            )
        if precision == "16-mixed" and self.schedule_options.family in NON_FLUSHING_FAMILIES:
            raise PlanningError(
                f"precision='16-mixed' needs a loss scale that skips an overflowed step on every stage, which "
                f"a non-flushing schedule ({self.schedule_options.family!r}) cannot do without a flush: use "
                "precision='bf16-mixed' (no loss scale), or a flushing schedule (gpipe, 1f1b, interleaved, zb_h1)"
            )

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

    # -- the pipeline, built on the first batch ---------------------------------------------------
    def _pipeline(self, step: Callable[..., Any], args: tuple[Any, ...]) -> PipelineExecutor:
        if self.executor is not None:
            return self.executor
        assert self._entry is not None
        module = self.lightning_module
        optimizer = self.optimizers[0] if self.optimizers else None
        fresh = self._chain is None or self._chain_of is not module  # a released module is captured once
        meta = fresh and on_meta(module)  # built with init_module(empty_init=True) or configure_model: shapes only
        if fresh:
            first = _first_microbatch(self._entry.capture(step, *args), self.microbatches)
            if meta:
                first = Call(*map_tensors(lambda t: t.to("meta"), (first.args, first.kwargs)))
            self._chain, self._chain_of = self._capture(module, first), module
            if self.stage_plan is None or self.stage_plan.bounds[-1][1] != len(self._chain.layers) - 1:
                self.stage_plan = self._plan(self._chain, first, optimizer, rows_of(args[0]), meta)
        layers = self._chain.layers
        stage_plan = self.stage_plan
        make = schedule_of(stage_plan, self.options, self.microbatches)
        mine = {a.stage for a in make(1).orders[self.global_rank % self.workers] if a.kind in COMPUTE}
        if meta:  # this rank's stages only, initialised as the whole model would be (.materialise)
            everything = {id(t) for root in (module, *layers) for t in [*root.parameters(), *root.buffers()]}
            materialise(
                module, [module, *layers], everything - self._foreign(layers, mine), self.root_device, self.optimizers
            )
            self._load_deferred()  # a resumed checkpoint's values for them
        trainer = module.trainer
        clip = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm or "norm"  # a str enum: compares equal to its value
        self.executor = PipelineExecutor(
            make,
            stage_plan.modules(layers),
            self._loss,
            stage_optimizers(optimizer) if optimizer is not None else (lambda params: None),
            device=self.root_device,
            recompute=self.recompute,
            timeout_seconds=self._timeout.total_seconds(),
            shared_memory_bytes=self.shared_memory_bytes,
            message_bytes=_message_bytes(stage_plan),
            clip_grad_norm=float(clip) if clip and algorithm == "norm" else None,
            clip_grad_value=float(clip) if clip and algorithm == "value" else None,
            before_update=self._before_update,
            loss_scale=self._loss_scale(),
            pipelines=self.pipelines,
        )
        if optimizer is not None:
            optimizer.state.clear()  # any restored state is the stages' now: the template only carries hyper-parameters
        self._restore_optimizer_states()
        self._restore_carried()
        self._predict_memory(mine, announce=fresh)
        self._release(module, layers, mine)
        if self._parent_watch is not None:  # the pipeline is up: failures travel through the job's store now
            self._parent_watch.stop()
        return self.executor

    def _predict_memory(self, mine: set[int], announce: bool) -> None:
        """This rank's predicted memory (:attr:`predicted_memory`; ``None`` when the stages were given,
        not planned): the plan's for its stages (weights, gradients, optimizer state, activations in
        flight) and the shared-memory rings it maps (:attr:`ring_bytes`), resident in it from the
        start (:func:`~lightning_pipe.runtime.shared_memory.open_links`). With ``announce`` (a new
        plan), printed per rank on rank 0 (a collective over the pipeline); the framework's own memory
        (interpreter, torch) is apart."""
        assert self.executor is not None and self.stage_plan is not None
        plan = self.stage_plan.plan
        rings = self.ring_bytes = self.executor.transport.links.ring_bytes
        if plan is None:  # every rank has the same plan: none of them gathers
            self.predicted_memory = None
            return
        stages = sum(plan.stages[s].memory_bytes for s in mine)
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
        """What the shared-memory rings of a rank with two neighbouring stages take (CPU training):
        the memory limit is planned without it."""
        capacity = shared_memory_capacity(self.shared_memory_bytes, self.root_device)
        return 2.0 * capacity * min(2, self.workers - 1)

    def _release(self, module: LightningModule, layers: list[Any], mine: set[int]) -> None:
        """Keep only this rank's stages (``mine``): every other stage's weights and buffers go to the
        meta device (:mod:`.ownership`)."""
        assert self.executor is not None and self.stage_plan is not None
        ownership = Ownership.of(module, layers, self.stage_plan.bounds)
        owners, ranks = self.executor.schedule.owners, self.pipelines[0]
        self._writers = {name: ownership.writer(name, owners, ranks) for name in module.state_dict(keep_vars=True)}
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
        saved = (self._saved or {}).get("plan")
        options = self.plan_options
        given = options.balance is not None or options.plan is not None or options.profile is not None
        if saved is None or given or not self.keep_plan:
            return options
        replicas = saved["replicas"]
        if len(saved["bounds"]) != self.stages or saved["layers"] != layers or (replicas and not self._replicated):
            return options
        rank_zero_info(f"Reusing the checkpoint's split of the {layers} layers: {saved['bounds']}")
        balance = [last - first + 1 for first, last in saved["bounds"]]
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
        same = saved["plan"]["bounds"] == [list(b) for b in self.stage_plan.bounds] and (
            saved["schedule"] == self.schedule_options.family
        )
        if same:
            found = read_entries(saved["carried"], [str(s) for s in self.executor.weights])
            stages = {
                s: {"version": e["version"], "versions": e.get("versions", {}), "gradients": e.get("gradients", {})}
                for s, e in ((int(key), entry) for key, entry in found.items())
            }
        else:
            summary: dict[int, dict[str, Any]] = saved["stages"]
            versions = {entry["version"] for entry in summary.values()}
            if len(versions) > 1 or any(entry["in_flight"] for entry in summary.values()):
                raise PlanningError(
                    f"the checkpoint holds {saved['schedule']} weight versions or gradients still to apply for its "
                    f"split {saved['plan']['bounds']}, which this run ({self.schedule_options.family}, "
                    f"{[list(b) for b in self.stage_plan.bounds]}) cannot take: resume with schedule="
                    f"{saved['schedule']!r} and the checkpoint's split (keep_plan=True, the default, reuses it)"
                )
            (version,) = versions
            stages = {s: {"version": version, "versions": {}, "gradients": {}} for s in self.executor.weights}
        self.executor.load_state_dict({"calls": saved["calls"], "origin": saved["origin"], "stages": stages})

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
        return model

    def _plan(self, model: PipelineModel, first: Call, optimizer: Any, batch_rows: int, meta: bool) -> StagePlan:
        """Verify the chain, profile and partition on rank 0 (with the first micro-batch), broadcast the
        plan or the error, print the plan and the prediction. A later ``validate``/``test``/``predict``
        (or ``fit``) of a module with as many layers keeps the plan."""
        memory = MemoryModel(
            memory_schedule(self.schedule_options.family),
            self.microbatches,
            optimizer_copies(optimizer),
            split_backward=self.schedule_options.family not in NON_FLUSHING_FAMILIES,
            accumulation=True,
        )
        stage_plan: StagePlan | PlanningError | None = None
        if self.global_rank == 0:
            try:
                if not meta:  # a model on the meta device has no values to compare
                    self._verify(model, first)
                stage_plan = plan_stages(
                    model.layers,
                    model.inputs(first),
                    self.stages,
                    self._within_limit(self._plan_options(len(model.layers))),
                    memory,
                    torch.device("meta") if meta else self.root_device,
                    self._replicated,
                    names=model.names,
                )
            except PlanningError as error:
                stage_plan = error
        stage_plan = self.broadcast(stage_plan)
        if isinstance(stage_plan, PlanningError):
            raise stage_plan
        if self.global_rank == 0:
            self._prediction = predict(stage_plan, self.options, self.microbatches, self.plan_options.contention)
            self.differences = differences(
                self.lightning_module,
                stage_plan.modules(model.layers),
                rows_of(model.inputs(first)),
                batch_rows,
                self.schedule_options.family not in NON_FLUSHING_FAMILIES,
            )
            notes = [MATERIALISED] if meta else []
            schedule = schedule_of(stage_plan, self.options, self.microbatches)(1)
            text = report(stage_plan, self._prediction, model.captured, schedule)
            rank_zero_info("\n".join([text, *self.differences, *notes]))
        return stage_plan

    def _verify(self, model: PipelineModel, first: Call) -> None:
        """The layers chained on the first micro-batch must give forward's output (both modes)."""
        module = self.lightning_module
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
        return self.executor.schedule.owners[stage][0] == self.executor.rank

    def _before_update(self, stage: int, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        assert self._hyper is not None
        self._hyper.apply(step, optimizer)

    def _loss(self, output: Any, batch: Any) -> Tensor:
        """The user's ``training_step`` on one micro-batch, with the pipeline's output as the layers'."""
        assert self.executor is not None and self._entry is not None and self.executor.loss_key is not None
        step, mb = self.executor.loss_key
        record = Record(rows_of(batch))
        module = self.lightning_module
        with self._entry.inject(output), recording(module, record):
            result = module.training_step(batch, *self._step_args[step])
        loss = result.get("loss") if isinstance(result, dict) else result
        if not isinstance(loss, Tensor):
            raise PlanningError(
                "training_step must return the loss (a tensor, or a dict with 'loss') for every micro-batch; "
                f"got {type(result).__name__}"
            )
        if isinstance(result, dict):
            record.extras = _to_cpu({key: value for key, value in result.items() if key != "loss"})
        self._records[(step, mb)] = record
        return loss

    # -- training ---------------------------------------------------------------------------------
    @no_stop_iteration
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipeline step for the batch (inside Lightning's closure), its logs replayed."""
        module = self.lightning_module
        args = (*args, *kwargs.values())
        with self.precision_plugin.train_step_context():
            executor = self._pipeline(module.training_step, args)
            step = executor.origin + executor.calls
            assert self._hyper is not None
            self._hyper.record(step)
            self._step_args[step] = args[1:]
            self._chain.follow_mode(module.training)
            inputs = self._chain.inputs(self._entry.capture(module.training_step, *args)) if self._first else None
            # a rank with no last stage has nothing to add after the step: its part leaves now, so
            # the gather is complete as soon as the last stage's part arrives
            posted = None if self._last else self._post_logs({})
            start = time.perf_counter()
            output = executor.step(inputs, args[0] if self._last else None)
            self._step_seconds.append(time.perf_counter() - start)
            drained = self._drain_after_this_batch()
            if drained:
                output.microbatch_losses.update(executor.drain().microbatch_losses)
        if posted is None:
            posted = self._post_logs(output.microbatch_losses)
        self._relay_training_logs(posted, wait=drained or executor.schedule.flush or self._outputs_read)
        return map_tensors(lambda t: t.to(self.root_device), self._last_output)

    def _drain_after_this_batch(self) -> bool:
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def _post_logs(self, microbatch_losses: dict[tuple[int, int], float]) -> Any:
        """Start sending this call's micro-batch records (none but on a last stage) and this rank's
        signal notes to every rank."""
        assert self._signals is not None
        return self._relay.post(
            {
                "pipeline": self.pipeline_index,
                "rank": self.global_rank,
                "records": {key: (self._records.pop(key), loss) for key, loss in microbatch_losses.items()},
                "signals": self._signals.outgoing(),
            }
        )

    def _relay_training_logs(self, posted: Any, wait: bool) -> None:
        """Receive the records of ``posted`` (this call's gather) and log every step whose
        micro-batches are all in. A flushing schedule (and a drain) waits for them: the step's values
        are logged with the step. A non-flushing one collects them during the next call instead, so
        no rank waits for the last stage at a step boundary (the values are logged one step later)."""
        self._collect_relayed()
        if wait:
            self._collect(self._relay.wait(posted))
        else:
            self._posted = posted
        for step in sorted(s for s, parts in self._pending.items() if len(parts) == self.microbatches):
            parts = self._pending.pop(step)
            self._step_args.pop(step, None)
            records = [parts[mb][0] for mb in sorted(parts)]
            self._last_output = _step_output(math.fsum(loss for _, loss, _ in parts.values()), records)
            if any(sender != self.global_rank for _, _, sender in parts.values()):
                for record in records:
                    replay(self.lightning_module, record.effects, self.root_device)
            self._log(records)

    def _log(self, records: list[Record]) -> None:
        """Call the real ``self.log`` with what ``records`` logged, combined (every rank does)."""
        module = self.lightning_module
        for name, value, options in combine(records):
            module.log(name, torch.tensor(value), **options)
        metrics = metric_modules(module)
        for name, path, options in logged_metrics(records):
            module.log(name, metrics[path], **options)

    def _collect_relayed(self) -> None:
        """Receive the records left in flight by the last call (before any other collective)."""
        if self._posted is not None:
            posted, self._posted = self._posted, None
            self._collect(self._relay.wait(posted))

    def _collect(self, payloads: list[dict[str, Any]]) -> None:
        for payload in payloads:
            self._signals.collect(payload["signals"])
            if payload["pipeline"] == self.pipeline_index:
                for (step, mb), (record, loss) in payload["records"].items():
                    self._pending.setdefault(step, {})[mb] = (record, loss, payload["rank"])

    def on_train_start(self) -> None:
        """Refuse, before the first step, training batches too small to cut into micro-batches."""
        trainer = self.lightning_module.trainer
        loaders = getattr(trainer.fit_loop._combined_loader, "flattened", [])
        check_batches(loaders, self.microbatches, trainer.num_training_batches)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Act on the signals the relay has brought every rank (:mod:`.signals`): all ranks at the
        same batch."""
        assert self._signals is not None
        self._signals.act()

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The backward already ran in the pipeline step; only the hooks around it run here."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (the pipeline step, updates included). The user's optimizer steps with no
        gradient, which changes nothing and tells its LR schedulers that the step happened."""
        result = closure()
        optimizer.step()
        return result

    def drain(self) -> None:
        """Finish the steps in flight (a collective; nothing for a flushing schedule); their logs are
        kept for the next training step."""
        if self.executor is not None:
            self._collect_relayed()
        if self.executor is not None and self.executor.calls:
            self.executor.drain()

    def on_validation_start(self) -> None:
        self.drain()

    def on_train_end(self) -> None:
        self.drain()
        self._keep_loss_scale()
        self._report()
        if self._writers is None:  # nothing was released: every rank holds the whole model
            return
        if self.gather_after_fit:
            self._full_after_fit = self.broadcast(self.full_state_dict())  # put in place at teardown
        else:
            rank_zero_info(f"After fit, {HOW_TO_GET_IT}")

    def _report(self) -> None:
        """The end-of-fit report (:mod:`.report`): a collective; written and logged by global rank 0."""
        executor = self.executor
        if executor is None or executor.origin < STEPS_SHOWN:
            return
        since = executor.origin - STEPS_SHOWN
        in_run = executor.measured_costs(since_step=since)
        timelines = self._gather([i for i in executor.timeline if i.action.step >= since])
        trainer = self.lightning_module.trainer
        directory = Path(trainer.log_dir or trainer.default_root_dir)  # log_dir is a collective (broadcast)
        if self.global_rank != 0:
            return
        fit = FitReport(
            last_steps([i for part in timelines for i in part]),
            self._step_seconds[2:],
            in_run,
            schedule_of(self.stage_plan, self.options, self.microbatches)(STEPS_SHOWN),
            self._prediction,
        )
        picture, trace = fit.write(directory)
        for logger in trainer.loggers:
            logger.log_metrics(fit.metrics, step=trainer.global_step)
        rank_zero_info(f"{fit.summary()}; timeline {picture}, trace {trace}")

    # -- validation, test, predict --------------------------------------------------------------
    def _evaluate(self, hook: str, args: tuple[Any, ...]) -> tuple[Record | None, Any]:
        """A forward-only pipeline for ``hook`` (``validation_step``, ...): the batch flows through the
        stages in micro-batches, and on the last stage the step code runs once on the whole batch with
        the joined outputs, so what it logs or returns is what the unsplit step gives (exactly: no
        combination of micro-batches). Returns the step's record and result (``None`` elsewhere)."""
        module = self.lightning_module
        step = getattr(module, hook)
        executor = self._pipeline(step, args)
        self.drain()
        self._chain.follow_mode(module.training)
        parts = 1 if self._chain.batch_reduced else min(self.microbatches, rows_of(args[0]))
        outputs: list[Any] = []
        inputs = self._chain.inputs(self._entry.capture(step, *args)) if self._evaluates(0) else None
        executor.evaluate(inputs, parts, lambda mb, output: outputs.append(output))
        if not self._evaluates(-1):
            return None, None
        record = Record(rows_of(args[0]))
        with self._entry.inject(_concatenate(outputs)), recording(module, record):
            result = step(*args)
        return record, result

    def _replay(self, record: Record | None, result: Any) -> Any:
        """Make the last stage's evaluation step seen on every rank: its logs, its other effects
        (:mod:`.effects`) and its result."""
        gathered = self._gather((record, _to_cpu(result)) if record is not None else None)
        source = next(i for i, part in enumerate(gathered) if part is not None)
        record, result = gathered[source]
        if self.pipelines[self.pipeline_index][source] != self.global_rank:
            replay(self.lightning_module, record.effects, self.root_device)
            result = map_tensors(lambda t: t.to(self.root_device), result)
        self._log([record])
        return result

    @no_stop_iteration
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            record, result = self._evaluate("validation_step", (*args, *kwargs.values()))
        return self._replay(record, result)

    @no_stop_iteration
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            record, result = self._evaluate("test_step", (*args, *kwargs.values()))
        return self._replay(record, result)

    @no_stop_iteration
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions, on every rank (from the last stage)."""
        with self.precision_plugin.predict_step_context():
            _, result = self._evaluate("predict_step", (*args, *kwargs.values()))
        gathered = self._gather((self._evaluates(-1), _to_cpu(result)))
        return next(value for last, value in gathered if last)

    # -- weights and checkpoints ---------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the module: ``full``: :meth:`full_state_dict`; ``sharded``: the
        entries this rank writes (a collective: drains first)."""
        if self.state_dict_type == "full":
            return self.full_state_dict()
        return self._written_state()

    def full_state_dict(self) -> dict[str, Any]:
        """The whole module's state on global rank 0 (on the CPU), gathered by name from the ranks
        holding each entry (a collective: drains first); ``{}`` on the other ranks, which hold only
        their stages."""
        parts = self._gather_to_zero(_to_cpu(self._written_state()))
        if parts is None:
            return {}
        merged = {name: value for part in parts for name, value in part.items()}
        return {name: merged[name] for name in self.lightning_module.state_dict(keep_vars=True)}

    def _written_state(self) -> dict[str, Any]:
        """The state-dict entries this rank writes, after the steps in flight are finished."""
        self.drain()
        self._keep_loss_scale()  # Lightning saves the precision plugin's state after the module's
        return {name: value for name, value in self.lightning_module.state_dict().items() if self._written(name)}

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load the entries this rank holds (every entry before the stages are placed; those of a
        model on the meta device once its stages are materialised); with ``strict`` the checkpoint
        must name every entry of the module and no other, with the module's shapes."""
        module = self.lightning_module
        held = module.state_dict(keep_vars=True)
        state: Mapping[str, Any] = checkpoint["state_dict"]
        source = getattr(self, "_checkpoint_path", None) or "the checkpoint"
        if strict:
            check_same_model(source, type(module).__name__, held, state)
        present = [name for name in held if name in state]
        try:
            module.load_state_dict(read_entries(state, [n for n in present if not held[n].is_meta]), strict=False)
        except RuntimeError as error:
            raise CheckpointError(f"{source} does not fit {type(module).__name__}: {error}") from error
        later = [name for name in present if held[name].is_meta]
        self._deferred = (state, later) if later and self.executor is None else None

    def _load_deferred(self) -> None:
        """The resumed checkpoint's entries for the tensors this rank has just materialised."""
        if self._deferred is None:
            return
        (state, names), self._deferred = self._deferred, None
        held = self.lightning_module.state_dict(keep_vars=True)
        real = [name for name in names if not held[name].is_meta]
        self.lightning_module.load_state_dict(read_entries(state, real), strict=False)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The user's optimizer's state by parameter, with ``["pipeline"]``: the plan and each stage's
        carried state (step count, weight versions). ``full``: on global rank 0, in Lightning's
        layout, every parameter's state gathered by name from the stage optimizers (a collective), so
        that any run resumes it: plain Lightning, DDP, or a pipeline on another split; ``{}`` on the
        other ranks. ``sharded``: this rank's parameters' states and carried state, by name."""
        sharded = self.state_dict_type == "sharded"
        first = self.pipeline_index == 0
        states = self._parameter_states() if first else {}
        carried = self._carried_state() if first else {}
        stages: dict[int, Any] = carried.get("stages", {})
        summary = {
            s: {"version": e["version"], "in_flight": bool(e["versions"] or e["gradients"])} for s, e in stages.items()
        }
        part = {"states": states, "carried": stages} if not sharded else {"states": {}, "carried": {}}
        parts = self._gather_to_zero({**part, "summary": summary})
        if sharded:
            state = {"state": states, "param_groups": self._named_groups(optimizer)}
        elif parts is None:
            return {}
        else:
            by_name = {name: value for part in parts for name, value in part["states"].items()}
            state = dict(optimizer.state_dict())
            state["state"] = {i: by_name[name] for i, name in enumerate(self._template_names) if name in by_name}
            stages = {stage: entry for part in parts for stage, entry in part["carried"].items()}
        if stages:
            assert self.stage_plan is not None
            state["pipeline"] = {
                "plan": {
                    "bounds": [list(b) for b in self.stage_plan.bounds],
                    "replicas": None if self.stage_plan.replicas is None else list(self.stage_plan.replicas),
                    "layers": self.stage_plan.bounds[-1][1] + 1,
                },
                "schedule": self.schedule_options.family,
                "calls": carried["calls"],
                "origin": carried["origin"],
                "stages": {s: e for part in parts or [] for s, e in part["summary"].items()},
                "carried": {str(stage): entry for stage, entry in stages.items()},
            }
        return state

    def _named_groups(self, optimizer: Any) -> list[dict[str, Any]]:
        """The optimizer's parameter groups with each parameter's name in place of its position."""
        groups = optimizer.state_dict()["param_groups"]
        return [{**group, "params": [self._template_names[i] for i in group["params"]]} for group in groups]

    def _parameter_states(self) -> dict[str, Any]:
        """The optimizer state of each parameter this rank writes, by name, on the CPU: its stage
        optimizers' (or, once they are closed, the user's optimizer's, which holds them then)."""
        if self.executor is not None:
            sources = [w.optimizer.state for w in self.executor.weights.values() if w.optimizer is not None]
        else:
            sources = [optimizer.state for optimizer in self.optimizers]
        names = {id(p): name for name, p in self.lightning_module.named_parameters()}
        return {
            names[id(p)]: _to_cpu(value)
            for source in sources
            for p, value in source.items()
            if id(p) in names and self._written(names[id(p)])
        }

    def _carried_state(self) -> dict[str, Any]:
        """Step count and, per stage of this rank, its carried state (weight versions and gradients of
        a non-flushing schedule; the first worker of a replicated stage gives it)."""
        if self.executor is None:
            return self._carried or {}
        state = _to_cpu(self.executor.state_dict(weights=False))
        owners = self.executor.schedule.owners
        state["stages"] = {s: e for s, e in state["stages"].items() if owners[s][0] == self.executor.rank}
        return state

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """The user's optimizer takes the hyper-parameters; each parameter's state (found by name)
        waits for the stage optimizers, and the plan and carried state for the first batch."""
        (state,) = checkpoint["optimizer_states"]
        if self.executor is not None:
            raise PlanningError("a checkpoint can only be restored before the pipeline's first batch")
        template = self.optimizers[0]
        groups = state["param_groups"]
        saved_sizes = [len(group["params"]) for group in groups]
        sizes = [len(group["params"]) for group in template.param_groups]
        if saved_sizes != sizes:
            raise PlanningError(
                f"the checkpoint's optimizer has parameter groups of {saved_sizes} parameters, configure_optimizers "
                f"gives {sizes}: resume with the optimizer the checkpoint was written with"
            )
        named = any(isinstance(p, str) for group in groups for p in group["params"])
        if named:  # a sharded checkpoint: by name already
            self._saved_states = state["state"]
        else:
            names = self._template_names
            self._saved_states = {names[i]: value for i, value in state["state"].items() if names[i] is not None}
        start, positions = 0, []
        for size in sizes:
            positions.append(list(range(start, start + size)))
            start += size
        template.load_state_dict(
            {"state": {}, "param_groups": [{**g, "params": p} for g, p in zip(groups, positions, strict=True)]}
        )
        self._saved = state.get("pipeline")

    def _restore_optimizer_states(self) -> None:
        """Each stage optimizer takes its parameters' states from the resumed checkpoint, by name."""
        states, self._saved_states = self._saved_states, None
        if states is None or self.executor is None:
            return
        names = {id(p): name for name, p in self.lightning_module.named_parameters()}
        for weights in self.executor.weights.values():
            optimizer = weights.optimizer
            if optimizer is None:
                continue
            params = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
            found = read_entries(states, [name for name in params if name is not None])
            own = optimizer.state_dict()
            own["state"] = {i: found[name] for i, name in enumerate(params) if name in found}
            optimizer.load_state_dict(own)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Save on every rank (a collective, :mod:`.saving`): ``full``, global rank 0 writes the file;
        ``sharded``, every rank writes its trees into the directory ``filepath`` (:mod:`.sharded`),
        global rank 0 the rest of the checkpoint. The checkpoint appears under its name only once
        complete (:mod:`.atomic`); a save that fails anywhere raises on every rank."""
        path = self.broadcast(str(filepath))
        if not _is_local_file_protocol(path):
            if self.state_dict_type == "sharded":
                raise PlanningError(f"state_dict_type='sharded' writes to a local or mounted filesystem, not {path}")
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if self.state_dict_type == "full":
            save_together(path, lambda _, __: self._write_file(checkpoint, path, storage_options), False, self._ranks)
            return
        if storage_options is not None:
            raise TypeError(f"state_dict_type='sharded' takes no storage_options (got {storage_options!r})")
        trees = {"state_dict": checkpoint.pop("state_dict")}
        if checkpoint.get("optimizer_states"):
            (state,) = checkpoint["optimizer_states"]
            trees["optimizer"] = state.pop("state")
            if "pipeline" in state:
                trees["carried"] = state["pipeline"].pop("carried")

        def write(directory: Path | None, save: str) -> None:
            assert directory is not None
            stamp = {"save": save, "step": checkpoint.get("global_step")}
            save_sharded(directory, checkpoint, trees, stamp, self.is_global_zero, self._objects)

        save_together(path, write, True, self._ranks)

    def _write_file(self, checkpoint: dict[str, Any], path: str, storage_options: Any | None) -> None:
        """Global rank 0 writes the full checkpoint: atomically with Lightning's default checkpoint
        IO (a temporary beside it, renamed), or through the ``CheckpointIO`` the user gave."""
        if not self.is_global_zero:
            return
        if type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            write_file(path, lambda handle: torch.save(checkpoint, handle))
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    @property
    def _ranks(self) -> SaveRanks:
        """Every rank of the job, as a save sees them."""
        if not hasattr(self, "_objects") or self.world_size == 1:
            return SaveRanks(self.global_rank)
        return SaveRanks(self.global_rank, self._objects, self._failures.aborted)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Global rank 0 deletes a checkpoint file or directory; a directory is renamed first, so no
        half-deleted checkpoint is ever seen under its name."""
        if not self.is_global_zero:
            return
        if _is_local_file_protocol(filepath) and type(self.checkpoint_io) is TorchCheckpointIO:
            remove(filepath)
        else:
            self.checkpoint_io.remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory is read on demand (each rank reads its own entries once
        its stages are placed); a single file as Lightning reads it. Either is refused, named, when
        it is incomplete, damaged or mixes parts of several saves (:mod:`.checkpoint_files`)."""
        if not _is_local_file_protocol(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        sweep(Path(checkpoint_path).parent)
        self._checkpoint_path = str(checkpoint_path)
        read = super().load_checkpoint
        return load_checkpoint(checkpoint_path, lambda: read(checkpoint_path, weights_only), weights_only)

    def _gather_to_zero(self, part: Any) -> list[Any] | None:
        """Every rank's ``part`` on global rank 0 (``None`` on the others)."""
        if not hasattr(self, "_objects"):  # the ranks never connected (a failure at start-up): this one's
            return [part] if self.global_rank == 0 else None
        gathered: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        try:  # to rank 0 only, which writes the checkpoint: the other ranks need no copy of every stage
            dist.gather_object(part, gathered, dst=0, group=self._objects)
        except RuntimeError as error:
            raise self._failures.aborted() from error
        return gathered

    # -- collectives ------------------------------------------------------------------------------
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
        if not hasattr(self, "_failures") or self.world_size == 1:
            return  # no other rank to stop
        if not raised_elsewhere(exception):
            self._failures.fail(exception)
        if self.executor is not None:
            self.executor.transport.abort()
        for group in (self._objects, self._pipeline_objects, self._copies, None):  # None: the default group
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

    def barrier(self, name: str | None = None) -> None:
        """Lightning's barrier; a rank that failed meanwhile is named (its error raised here)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            dist.barrier()
        except RuntimeError as error:
            if not hasattr(self, "_failures"):
                raise
            raise self._failures.aborted() from error

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
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
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes == self.world_size) if all else bool(votes)

    def teardown(self) -> None:
        """Close the pipeline; the user's optimizer keeps the stages' optimizer states and this rank
        their carried state (a checkpoint written after ``fit`` has them). The module moves to the CPU
        as under DDP, its released tensors staying on the meta device."""
        if self._parent_watch is not None:
            self._parent_watch.stop()
        if self.executor is not None:
            drained = self.executor.schedule.flush or not self.executor.calls  # not after a failure mid-step
            self._carried = self._carried_state() if drained else None
            for weights in self.executor.weights.values():
                if weights.optimizer is not None:
                    for optimizer in self.optimizers:
                        optimizer.state.update(weights.optimizer.state)
            self.executor.close()
            self.executor = None
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
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
                description=f"{FAMILIES[family]}: the {family} schedule, start method {start_method}",
                schedule=family,
                start_method=start_method,
            )


class _ResumesFromComplete:
    """A launcher that resolves ``ckpt_path="last"`` to the newest complete checkpoint before
    Lightning does (:mod:`.resume`)."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            args, kwargs = complete_last(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class _ScriptLauncher(_ResumesFromComplete, _SubprocessScriptLauncher):
    """Lightning's launcher that re-runs the script."""


class _SpawnLauncher(_ResumesFromComplete, _MultiProcessingLauncher):
    """Lightning's spawn launcher, handing the main process the full trained model: its rank 0 holds
    only its own stages, so the weights it sends are gathered from every rank (and written
    atomically)."""

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        fitted = trainer.state.fn == TrainerFn.FITTING  # Lightning sends weights back only after fit
        full = self._strategy.full_state_dict() if fitted else None  # a collective: every rank
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            write_file(output.weights_path, lambda handle: torch.save(full, handle))
        return output


def _reads_step_outputs(trainer: Trainer) -> bool:
    """Whether the module or a callback of the user's reads ``outputs`` in ``on_train_batch_end``
    (what ``training_step`` returned): a non-flushing schedule then waits, at the end of each batch,
    for the batch's loss instead of reporting it with the next batch."""
    hooks = [type(trainer.lightning_module).on_train_batch_end]
    hooks += [
        type(callback).on_train_batch_end
        for callback in trainer.callbacks
        if not type(callback).__module__.startswith(("lightning.", "pytorch_lightning."))
    ]
    return any(_reads_argument(hook, "outputs") for hook in hooks)


def _reads_argument(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function``'s body reads its parameter ``name``."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        return False
    return any(i.opname.startswith("LOAD_FAST") and name in str(i.argval) for i in dis.get_instructions(code))


def _step_output(loss: float, records: list[Record]) -> Any:
    """What a step returns to Lightning (``outputs`` of ``on_train_batch_end``): the batch's loss, and
    the other keys of the dict ``training_step`` returned, its micro-batches' values joined."""
    extras = [record.extras for record in records if record.extras is not None]
    if not extras:
        return torch.tensor(loss)
    return {"loss": torch.tensor(loss), **_concatenate(extras)}


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
    parts = min(microbatches, rows_of(tuple(found)))  # an evaluation batch may be smaller
    args, kwargs = unflatten(skeleton, list(split_batch(tuple(found), parts)[0]))
    return Call(tuple(args), dict(kwargs))


def _close_process_groups() -> None:
    """At interpreter exit, close every process group, the default one last, while Python still runs:
    left to the interpreter's finalisation, the strategy's several gloo groups were destroyed in no set
    order, and a worker thread still joinable aborted the finished process now and then ("terminate
    called without an active exception", exit status -6)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


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


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU (for gathering between processes)."""
    return map_tensors(lambda t: t.detach().cpu(), obj)

"""From a composed configuration (:mod:`lightning_pipe.train.config`) to the objects of a run: the
data module, the LightningModule, the :class:`~lightning_pipe.strategy.PipelineStrategy` and the
``lightning.Trainer``. :func:`check` runs first and refuses what the schema cannot (sizes, a rule
the schedule does not run) before anything is built or any process is started."""

from __future__ import annotations

from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import get_class, instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from lightning_pipe.errors import PlanningError, check_positive
from lightning_pipe.runtime.launch import has_forkserver
from lightning_pipe.schedule import check_rule
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.strategy.choosing import AUTO, AutoOptions
from lightning_pipe.util.units import parse_bandwidth, parse_bytes

__all__ = ["check", "data_module", "logger_list", "model", "strategy", "trainer"]


def _plain(node: Any) -> Any:
    """A config node as plain Python values (enums as their names)."""
    if isinstance(node, Enum):
        return node.value
    if isinstance(node, DictConfig) or OmegaConf.is_list(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    return node


def check(cfg: DictConfig) -> None:
    """What the schema's types cannot say: sizes and bandwidths parse, the update rule runs on the
    schedule, the timeout is positive, the accuracy floor a fraction, the checkpoint to resume exists.
    The strategy's constructor refuses the rest (values out of range, files that are not plans or
    profiles, a profile cache that is a file) when :func:`strategy` builds it, before any process
    starts."""
    for key, value, parse, example in (
        ("memory.limit", cfg.memory.limit, parse_bytes, "8GB, 512MiB or a number of bytes"),
        ("pipeline.bandwidth", cfg.pipeline.bandwidth, parse_bandwidth, "10Gbit/s, 1.25GB/s or bytes per second"),
        ("pipeline.shared_memory", cfg.pipeline.shared_memory, _ring_bytes, "64MiB, 0 (gloo only) or bytes"),
    ):
        if value is None:
            continue
        try:
            parse(value)
        except (ValueError, PlanningError) as error:
            raise PlanningError(f"{key}={value!r} is not understood ({error}); use a value such as {example}") from None
    family = _plain(cfg.schedule.family)
    rule = _plain(cfg.update_rule.name)
    try:
        AutoOptions.of(family, _plain(cfg.schedule.microbatches), rule, _plain(cfg.memory.recompute))
        if family != AUTO:
            check_rule(family, rule)
    except PlanningError as error:
        raise PlanningError(f"schedule={family} update_rule={rule}: {error}") from None
    check_positive("pipeline.timeout_minutes", cfg.pipeline.timeout_minutes, "minutes")
    floor = cfg.min_test_accuracy
    if floor is not None and not 0 <= floor <= 1:
        raise PlanningError(f"min_test_accuracy must be a fraction in [0, 1] (or null: no floor); got {floor}")
    _check_checkpoint(cfg.ckpt_path)


def _check_checkpoint(path: str | None) -> None:
    """``ckpt_path``: a checkpoint that exists (a file, or a sharded checkpoint's directory), one of
    Lightning's names for one (``last``, ``best``, ``hpc``, ``registry``...) or a remote URL."""
    if path is None or path.partition(":")[0] in _CHECKPOINT_NAMES or "://" in path:
        return
    if not Path(path).exists():
        raise PlanningError(
            f"ckpt_path={path!r} does not exist (relative paths are from {Path.cwd()}): give a checkpoint file or "
            "sharded checkpoint directory, 'last', or null to start afresh"
        )


_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")
"""The checkpoints ``Trainer.fit(ckpt_path=...)`` finds by name (``registry:<model>`` included)."""


def _ring_bytes(text: str) -> int:
    """``pipeline.shared_memory``: a size, or 0 for gloo only."""
    return 0 if text.strip() in ("0", "0B") else int(parse_bytes(text))


def data_module(cfg: DictConfig) -> L.LightningDataModule:
    """The data module of ``cfg.data`` (its ``_target_``)."""
    return instantiate(cfg.data, _convert_="all")


def model(cfg: DictConfig, data: L.LightningDataModule) -> L.LightningModule:
    """The classifier of ``cfg.model`` for ``data``'s classes and input shape."""
    options = {key: _plain(value) for key, value in cfg.model.items() if key != "_target_"}
    return get_class(cfg.model._target_)(**options, num_classes=data.num_classes, input_shape=tuple(data.input_shape))


def strategy(cfg: DictConfig, multirun: bool) -> PipelineStrategy:
    """The pipeline strategy of the schedule, update rule, partitioner, memory and pipeline groups.
    ``start_method: auto`` re-runs the command for each process (Lightning's way for scripts) in a
    single run; under Hydra's multirun, whose jobs run inside one process, it starts them from a
    forkserver (``spawn`` where the platform has none), so that only the first job pays for importing
    torch and Lightning; processes that exist already (torchrun, or SLURM tasks as Hydra's submitit
    launcher starts them) are used as they are."""
    pipe, schedule = cfg.pipeline, cfg.schedule
    start = _plain(pipe.start_method)
    if start == "auto":
        external = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()
        start = ("forkserver" if has_forkserver() else "spawn") if multirun and not external else "popen"
    return PipelineStrategy(
        schedule=_plain(schedule.family),
        microbatches=_plain(schedule.microbatches),
        rule=_plain(cfg.update_rule.name),
        slack=schedule.slack,
        virtual_stages=schedule.virtual_stages,
        form=schedule.form,
        period=schedule.period,
        k=schedule.k,
        groups=schedule.groups,
        partitioner=_plain(cfg.partitioner.name),
        memory_limit=cfg.memory.limit,
        recompute=_plain(cfg.memory.recompute),
        bandwidth=pipe.bandwidth,
        contention=pipe.contention,
        reduce_overlap=pipe.reduce_overlap,
        profile=pipe.profile,
        plan=pipe.plan,
        profile_cache=pipe.profile_cache,
        balance=_plain(pipe.balance),
        stages=pipe.stages,
        data_parallel=pipe.data_parallel,
        start_method=start,
        pin_cpus=pipe.pin_cpus,
        shared_memory_bytes=_ring_bytes(pipe.shared_memory),
        release_memory=pipe.release_memory,
        timeout=timedelta(minutes=pipe.timeout_minutes),
    )


def logger_list(cfg: DictConfig, directory: Path) -> list[Logger]:
    """The loggers ``cfg.logger`` asks for, writing into ``directory`` (the run's)."""
    loggers: list[Logger] = []
    if cfg.logger.csv:
        loggers.append(CSVLogger(directory, name="", version=""))
    if cfg.logger.tensorboard:
        try:
            loggers.append(TensorBoardLogger(directory, name="", version="", default_hp_metric=False))
        except ModuleNotFoundError as error:
            raise PlanningError(f"logger=tensorboard needs {error.name}: pip install tensorboard") from None
    return loggers


def trainer(cfg: DictConfig, directory: Path, multirun: bool) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with the pipeline strategy, logging into ``directory``."""
    options = {key: _plain(value) for key, value in cfg.trainer.items()}
    options = {key: value for key, value in options.items() if value is not None}
    return L.Trainer(
        **options,
        strategy=strategy(cfg, multirun),
        logger=logger_list(cfg, directory) or False,
        default_root_dir=directory,
    )

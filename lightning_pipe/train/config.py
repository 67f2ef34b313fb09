"""The schema of ``lightning-pipe-train``'s configuration: one dataclass per config group, stored in
Hydra's ConfigStore, so a key that does not exist, a value of the wrong type or an unknown name
(``schedule.family=zigzag``, ``partitioner.name=balanced``, ``trainer.precision=fp8``) fails when
Hydra composes the configuration, with Hydra's own message, before anything is built.

The YAML files under ``conf/`` (packaged as ``lightning_pipe.conf``) name their schema in their
defaults list (``- schedule_schema``), as Hydra's "structured config schema" pattern does. Names
with a closed set of values are enums whose members are the library's own names (the keys of
:data:`~lightning_pipe.schedule.FAMILIES`, :data:`~lightning_pipe.partition.PARTITIONERS`, ...).
Sizes and bandwidths (``memory.limit=8GB``) are strings: they are parsed by
:func:`~lightning_pipe.train.build.check`, first thing in the job, with the accepted forms named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lightning_pipe.auto import ANY_RULE
from lightning_pipe.partition import PARTITIONERS
from lightning_pipe.schedule import FAMILIES, RULES
from lightning_pipe.strategy.choosing import AUTO
from lightning_pipe.zoo.models import MODEL_NAMES

__all__ = [
    "DataConfig",
    "MemoryConfig",
    "ModelConfig",
    "PartitionerConfig",
    "PipelineConfig",
    "ScheduleConfig",
    "TrainConfig",
    "TrainerConfig",
    "UpdateRuleConfig",
    "register_configs",
]


def _names(kind: str, names: Any) -> type[Enum]:
    return Enum(kind, {name: name for name in names})  # type: ignore[return-value]


Family = _names("Family", (*FAMILIES, AUTO))
Rule = _names("Rule", (*RULES, ANY_RULE))
Partitioner = _names("Partitioner", PARTITIONERS)
Model = _names("Model", ("mlp", *MODEL_NAMES))
Optimizer = _names("Optimizer", ("sgd", "adamw"))
Precision = _names("Precision", ("32-true", "bf16-mixed", "bf16-true", "16-mixed"))
StartMethod = _names("StartMethod", ("auto", "popen", "spawn", "forkserver"))


@dataclass
class PartitionerConfig:
    """How the layers are cut into stages (``lightning-pipe plan --partitioner``)."""

    name: Partitioner = Partitioner["time"]


@dataclass
class ScheduleConfig:
    """The schedule family and its options (``lightning-pipe simulate``'s)."""

    family: Family = Family["1f1b"]
    # a count, 'auto' (searched, as with family=auto) or null: the number of stages (searched with family=auto)
    microbatches: Any = None
    slack: int = 0
    virtual_stages: int = 2
    form: str = "pipeline"
    period: float | None = None
    k: int | None = None
    groups: int = 2  # G of lpp and fslpp: groups of devices / G workers


@dataclass
class UpdateRuleConfig:
    """The weight-update rule (``null``: the schedule's own)."""

    name: Rule | None = None


@dataclass
class MemoryConfig:
    """Per-device memory limit the partitioner plans under, and activation recomputation."""

    limit: str | None = None  # bytes, or a size such as 8GB, 512MiB
    recompute: Any = None  # true, false, 'auto' (the stages that need it to fit); null: 'auto' with schedule=auto


@dataclass
class PipelineConfig:
    """How the devices are used and what the planner starts from."""

    stages: int | None = None  # default: every device of a pipeline copy
    data_parallel: int | None = None  # copies of the pipeline (devices = workers x copies)
    bandwidth: str | None = None  # between stages, e.g. 10Gbit/s (default: free transfers)
    contention: float | None = None  # slowdown of a stage while every process computes (null: 1; measured if auto)
    reduce_overlap: float | None = None  # share of replicas' all-reduce beside the compute, 0..1 (null: measured)
    profile: str | None = None  # a saved profile to plan from (lightning-pipe profile)
    plan: str | None = None  # a saved plan to run (lightning-pipe plan)
    profile_cache: bool = True  # keep the measured profile for the next run ($LIGHTNING_PIPE_CACHE, ~/.cache)
    balance: list[int] | None = None  # layers per stage, instead of planning
    start_method: StartMethod = StartMethod["auto"]  # auto: popen for a run, forkserver under multirun
    pin_cpus: Any = False  # true: each process's threads on cores of its own (Linux, CPU); 'auto': kept if faster
    shared_memory: str = "64MiB"  # CPU: ring per direction between processes of one host (0: gloo only)
    release_memory: bool | None = None  # CPU: freed blocks >= 4 MiB back to the system (null: with memory.limit)
    timeout_minutes: float = 30.0


@dataclass
class ModelConfig:
    """:class:`~lightning_pipe.zoo.classifier.ImageClassifier`'s network and optimizer."""

    _target_: str = "lightning_pipe.zoo.classifier.ImageClassifier"
    model: Model = Model["mlp"]
    cifar: bool | None = None  # default: the CIFAR variant for inputs of 32x32 or less
    width: int = 128
    depth: int = 2
    optimizer: Optimizer = Optimizer["sgd"]
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1
    label_smoothing: float = 0.0


@dataclass
class DataConfig:
    """Fields every data module has; each dataset's schema adds its own."""

    _target_: str = MISSING
    batch_size: int = 64


@dataclass
class DigitsConfig(DataConfig):
    _target_: str = "lightning_pipe.zoo.data.DigitsDataModule"
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    seed: int = 0
    num_workers: int = 0
    channels: int = 1  # 3: the grey channel repeated as RGB, for the torchvision models


@dataclass
class CIFAR10Config(DataConfig):
    _target_: str = "lightning_pipe.zoo.data.CIFAR10DataModule"
    root: str = "data/cifar10"
    batch_size: int = 128
    num_workers: int = 2
    augment: bool = True
    val_size: int = 0
    seed: int = 0
    verify_md5: bool = True  # compare the files with the official checksums


@dataclass
class ImageNetConfig(DataConfig):
    _target_: str = "lightning_pipe.zoo.data.ImageNetDataModule"
    root: str = "data/imagenet"
    batch_size: int = 256
    num_workers: int = 8
    image_size: int = 224
    num_classes: int = 1000


@dataclass
class SyntheticConfig(DataConfig):
    _target_: str = "lightning_pipe.zoo.data.SyntheticDataModule"
    input_shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    num_classes: int = 10
    samples: int = 1024
    batch_size: int = 128
    seed: int = 0


@dataclass
class TrainerConfig:
    """The ``lightning.Trainer`` arguments a run sets (``trainer.*`` overrides them)."""

    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    precision: Precision = Precision["32-true"]
    max_epochs: int = 1
    max_steps: int = -1
    limit_train_batches: float | None = None
    limit_val_batches: float | None = None
    limit_test_batches: float | None = None
    val_check_interval: float | None = None
    check_val_every_n_epoch: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    log_every_n_steps: int = 10
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    enable_checkpointing: bool = True  # false: no checkpoints/ (throughput runs)
    deterministic: bool = False


@dataclass
class LoggerConfig:
    """Where the metrics go (``null``: nowhere); the run directory is Hydra's."""

    csv: bool = True
    tensorboard: bool = False


@dataclass
class TrainConfig:
    """The whole job: the groups, and what the job does with them."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    update_rule: UpdateRuleConfig = field(default_factory=UpdateRuleConfig)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: Any = MISSING  # one of the dataset schemas
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    task_name: str = "train"
    seed: int = 0
    test: bool = True  # test the trained model on the data's test split
    ckpt_path: str | None = None  # resume from this checkpoint
    min_test_accuracy: float | None = None  # fail the job below this test accuracy (a smoke check)


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (the YAML files extend them)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, node in (
        ("schedule", ScheduleConfig),
        ("update_rule", UpdateRuleConfig),
        ("partitioner", PartitionerConfig),
        ("memory", MemoryConfig),
        ("model", ModelConfig),
        ("trainer", TrainerConfig),
        ("logger", LoggerConfig),
    ):
        store.store(group=group, name=f"{group}_schema", node=node)
    for name, node in (
        ("digits", DigitsConfig),
        ("cifar10", CIFAR10Config),
        ("imagenet", ImageNetConfig),
        ("synthetic", SyntheticConfig),
    ):
        store.store(group="data", name=f"{name}_schema", node=node)

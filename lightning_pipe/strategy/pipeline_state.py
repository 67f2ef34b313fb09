"""The pipeline's own entry of a checkpoint, ``optimizer_states[0]["pipeline"]``, as one typed record.

A checkpoint holds it as plain values, so that ``torch.load(weights_only=True)`` reads it and every
version of the strategy reads what any other wrote (the same keys and value types)::

    {
        "plan": {"bounds": [[first, last], ...], "replicas": [workers, ...] or None, "layers": n},
        "schedule": "1f1b",                       # the schedule family it was written under
        "calls": 3, "origin": 0,                  # the executor's step count (calls since origin)
        "stages": {0: {"version": 3, "in_flight": False}, ...},   # by stage (an int)
        "carried": {"0": {"version": 3, "versions": {...}, "gradients": {...}}, ...},  # by stage (a str)
    }

``carried`` is absent from a sharded checkpoint's ``meta.pt`` (each rank writes its stages' under the
``carried`` tree of its own files, :mod:`.sharded`), and is a
:class:`~lightning_pipe.strategy.sharded.ShardedEntries` read on demand once :func:`.sharded.load_sharded`
has opened one. :class:`PipelineState` is the only code that writes or reads the entry by its keys:
:mod:`.checkpointing` writes it (:meth:`PipelineState.write`) and reads it when resuming, :mod:`.building`
reuses its split and restores its carried state, :mod:`.sharded` moves ``carried`` to and from the
rank files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_pipe.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_pipe.planning import StagePlan

__all__ = ["KEY", "PipelineState", "SavedPlan", "StageSummary"]

KEY = "pipeline"
"""The entry's key in the optimizer's state (``optimizer_states[0]``)."""


@dataclass(frozen=True)
class SavedPlan:
    """The split a checkpoint was written on.

    Attributes:
        bounds: each stage's first and last layer (inclusive).
        replicas: the workers of each stage (PipeDream's replicated stages), or ``None``: one each.
        layers: the model's layers.
        names: the layers' names in the order they ran (branching layers may run in another order than
            ``forward`` records them: :mod:`lightning_pipe.capture.layer_order`), or ``None`` where
            not known (a checkpoint written before 2026-11-29).
    """

    bounds: tuple[tuple[int, int], ...]
    replicas: tuple[int, ...] | None
    layers: int
    names: tuple[str, ...] | None = None

    @classmethod
    def of(cls, stage_plan: StagePlan) -> SavedPlan:
        """The split of ``stage_plan``."""
        bounds = tuple((first, last) for first, last in stage_plan.bounds)
        replicas = None if stage_plan.replicas is None else tuple(stage_plan.replicas)
        names = None if stage_plan.names is None else tuple(stage_plan.names)
        return cls(bounds, replicas, bounds[-1][1] + 1, names)

    def listed_bounds(self) -> list[list[int]]:
        """``bounds`` as the checkpoint holds them, and messages show them: ``[[0, 3], [4, 6]]``."""
        return [[first, last] for first, last in self.bounds]

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "bounds": self.listed_bounds(),
            "replicas": None if self.replicas is None else list(self.replicas),
            "layers": self.layers,
        }
        if self.names is not None:
            entry["names"] = list(self.names)
        return entry


@dataclass(frozen=True)
class StageSummary:
    """What every rank knows of a stage: its weight version, and whether it carries anything a resume
    on another split could not take (weight versions kept or gradients still to apply)."""

    version: int
    in_flight: bool

    @classmethod
    def of(cls, carried: Mapping[str, Any]) -> StageSummary:
        """The summary of one stage's carried state (:meth:`StageWeights.state_dict
        <lightning_pipe.runtime.weights.StageWeights.state_dict>`)."""
        return cls(carried["version"], bool(carried["versions"] or carried["gradients"]))

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "in_flight": self.in_flight}


@dataclass(frozen=True)
class PipelineState:
    """The pipeline's entry of a checkpoint (see the module docstring for its layout).

    Attributes:
        plan: the split it was written on.
        schedule: the schedule family it was written under.
        calls, origin: the executor's step count: ``calls`` since step ``origin``.
        stages: stage -> :class:`StageSummary`, of every stage.
        carried: ``str(stage)`` -> that stage's carried state (its version, weight versions kept and
            gradients still to apply), of every stage; ``None`` where it is written apart (the rank
            files of a sharded checkpoint); a :class:`~.sharded.ShardedEntries` once one is opened.
    """

    plan: SavedPlan
    schedule: str
    calls: int
    origin: int
    stages: Mapping[int, StageSummary]
    carried: Mapping[str, Any] | None = None

    # -- in a checkpoint ---------------------------------------------------------------------------
    @classmethod
    def read(cls, optimizer_state: Mapping[str, Any], source: str = "the checkpoint") -> PipelineState | None:
        """The entry of ``optimizer_state`` (a checkpoint's ``optimizer_states[0]``), ``None`` when it
        has none (a checkpoint of plain Lightning or DDP); ``source`` names the checkpoint in errors."""
        entry = optimizer_state.get(KEY)
        return None if entry is None else cls.from_dict(entry, source)

    def write(self, optimizer_state: MutableMapping[str, Any]) -> None:
        """Put the entry into ``optimizer_state`` (replacing any there)."""
        optimizer_state[KEY] = self.to_dict()

    def with_carried(self, carried: Mapping[str, Any] | None) -> PipelineState:
        """The same entry with ``carried`` in place of its carried state."""
        return dataclasses.replace(self, carried=carried)

    # -- the plain layout --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The entry as a checkpoint holds it: plain values only (``carried`` as given, left out when
        ``None``)."""
        entry: dict[str, Any] = {
            "plan": self.plan.to_dict(),
            "schedule": self.schedule,
            "calls": self.calls,
            "origin": self.origin,
            "stages": {stage: summary.to_dict() for stage, summary in self.stages.items()},
        }
        if self.carried is not None:
            entry["carried"] = self.carried
        return entry

    @classmethod
    def from_dict(cls, entry: object, source: str = "the checkpoint") -> PipelineState:
        """The record of ``entry`` as :meth:`to_dict` writes it (keys it does not know are ignored: a
        later version's additions); a :class:`~lightning_pipe.errors.CheckpointError` naming ``source``
        and what is missing or malformed otherwise."""
        read = _Reader(source)
        entry = read.mapping(entry, "")
        plan = read.mapping(read.key(entry, "plan", ""), "plan")
        bounds = read.key(plan, "bounds", "plan.")
        if not isinstance(bounds, list | tuple) or not bounds:
            read.refuse("plan.bounds", bounds, "a list of [first, last] layer pairs")
        pairs = tuple(read.pair(bound, f"plan.bounds[{i}]") for i, bound in enumerate(bounds))
        replicas = read.key(plan, "replicas", "plan.")
        if replicas is not None:
            if not isinstance(replicas, list | tuple):
                read.refuse("plan.replicas", replicas, "a list of worker counts or None")
            replicas = tuple(read.whole(r, f"plan.replicas[{i}]") for i, r in enumerate(replicas))
        schedule = read.key(entry, "schedule", "")
        if not isinstance(schedule, str):
            read.refuse("schedule", schedule, "a schedule family's name")
        stages = read.mapping(read.key(entry, "stages", ""), "stages")
        summaries = {}
        for stage, summary in stages.items():
            where = f"stages[{stage!r}]"
            summary = read.mapping(summary, where)
            in_flight = read.key(summary, "in_flight", f"{where}.")
            if not isinstance(in_flight, bool):
                read.refuse(f"{where}.in_flight", in_flight, "True or False")
            version = read.whole(read.key(summary, "version", f"{where}."), f"{where}.version")
            summaries[read.whole(stage, f"stages (key {stage!r})")] = StageSummary(version, in_flight)
        carried = entry.get("carried")
        if carried is not None:
            carried = read.mapping(carried, "carried")
        names = plan.get("names")
        if names is not None:
            if not isinstance(names, list | tuple) or not all(isinstance(name, str) for name in names):
                read.refuse("plan.names", names, "a list of layer names or None")
            names = tuple(names)
        layers = read.whole(read.key(plan, "layers", "plan."), "plan.layers")
        return cls(
            plan=SavedPlan(pairs, replicas, layers, names),
            schedule=schedule,
            calls=read.whole(read.key(entry, "calls", ""), "calls"),
            origin=read.whole(read.key(entry, "origin", ""), "origin"),
            stages=summaries,
            carried=carried,
        )

    # -- resuming ----------------------------------------------------------------------------------
    def same_split(self, bounds: Iterable[Iterable[int]], schedule: str, names: Sequence[str] | None = None) -> bool:
        """Whether it was written on the split ``bounds`` under ``schedule``, its layers in the order
        of ``names`` where both know it (then every stage takes its own carried state)."""
        same_order = names is None or self.plan.names is None or tuple(names) == self.plan.names
        return self.plan.bounds == tuple(tuple(bound) for bound in bounds) and self.schedule == schedule and same_order

    def settled_version(self) -> int | None:
        """The one weight version of every stage when nothing is in flight (any split takes that);
        ``None`` when the stages are at different versions or one carries versions or gradients."""
        versions = {summary.version for summary in self.stages.values()}
        if len(versions) > 1 or any(summary.in_flight for summary in self.stages.values()):
            return None
        (version,) = versions
        return version

    @staticmethod
    def stage_states(found: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
        """The carried states ``found`` (entries of :attr:`carried`, by ``str(stage)``) as the executor
        takes them (:meth:`~lightning_pipe.runtime.executor.PipelineExecutor.load_state_dict`), by stage."""
        return {
            int(key): {
                "version": entry["version"],
                "versions": entry.get("versions", {}),
                "gradients": entry.get("gradients", {}),
            }
            for key, entry in found.items()
        }


class _Reader:
    """:meth:`PipelineState.from_dict`'s checks, each refusal naming the checkpoint and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def refuse(self, field: str, value: object, wanted: str) -> NoReturn:
        where = f"{KEY}.{field}" if field else KEY
        raise CheckpointError(
            f"{self.source} holds a malformed pipeline entry (optimizer_states[0][{KEY!r}]): {where} is "
            f"{_shown(value)}, not {wanted}; it was not written by lightning_pipe, or was changed since"
        )

    def key(self, mapping: Mapping[str, Any], key: str, prefix: str) -> Any:
        if key not in mapping:
            raise CheckpointError(
                f"{self.source} holds a malformed pipeline entry (optimizer_states[0][{KEY!r}]): it has no "
                f"{prefix}{key} (it has {sorted(map(str, mapping))}); it was not written by lightning_pipe, "
                "or was changed since"
            )
        return mapping[key]

    def mapping(self, value: object, field: str) -> Mapping[Any, Any]:
        if not isinstance(value, Mapping):
            self.refuse(field, value, "a dictionary")
        return value

    def whole(self, value: object, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.refuse(field, value, "a whole number")
        return value

    def pair(self, value: object, field: str) -> tuple[int, int]:
        if not isinstance(value, list | tuple) or len(value) != 2:
            self.refuse(field, value, "a [first, last] layer pair")
        return self.whole(value[0], f"{field}[0]"), self.whole(value[1], f"{field}[1]")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."

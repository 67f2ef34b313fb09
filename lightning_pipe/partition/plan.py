"""A partition plan and its canonical evaluation.

Every partitioner returns a :class:`Plan` made by :func:`evaluate`, so plans from different
algorithms (and the exact oracle) are measured by one definition:

- a stage replicated ``r`` times takes ``T = max(Σ (u_F + u_B), allreduce(Σ param bytes, r)) / r``
  per micro-batch (PipeDream §3.1, ``T(i→j, m)``);
- a cut after layer ``i`` costs ``2·C_i`` (activation forward, gradient backward) and is pipelined
  like a stage of its own;
- the bottleneck (steady-state time per micro-batch) is the largest of these;
- the memory of a replica follows :class:`lightning_pipe.cost.memory.MemoryModel`. A device may hold
  several maximal runs of consecutive layers (non-contiguous plans); each run is a pipeline stage for
  the schedule's in-flight count, with ``downstream`` = replicas of the runs from it to the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError

__all__ = ["Plan", "Stage", "evaluate"]


@dataclass(frozen=True)
class Stage:
    """Layers held by one group of replicas.

    Attributes:
        layers: sorted layer indices (a contiguous range for contiguous plans).
        replicas: data-parallel copies of the stage (PipeDream's stage replication).
        compute_seconds: ``Σ u_F + u_B`` of the layers, per micro-batch, on one replica.
        sync_seconds: all-reduce time of the stage's parameters among its replicas.
        stage_seconds: ``max(compute, sync) / replicas``, the stage's time per micro-batch.
        memory_bytes: peak memory of one replica.
        forward_seconds, backward_seconds: measured ``Σ u_F`` and ``Σ u_B`` (what a schedule simulates).
        output_bytes: bytes the stage sends on (crossing the cut after its last layer; 0 at the end).
        saved_bytes: activation bytes kept per micro-batch in flight.
        param_bytes: one copy of the stage's parameters.
        activation_bytes: the activations part of ``memory_bytes`` (the micro-batches the memory model
            has in flight on the stage's own worker at its peak).
        backward_bytes: what its largest layer's backward holds beyond the activations and the gradient
            (:attr:`~lightning_pipe.cost.records.LayerCost.backward_bytes`), the most of its layers'.
        transient_bytes: the part of ``memory_bytes`` held only while one of its backwards runs: the
            most of its layers' ``backward_bytes`` with, where the memory model accumulates, the new
            gradient the layer adds into the step's (:meth:`~lightning_pipe.cost.memory.MemoryModel.transient_bytes`).
        kept_bytes: the part of ``memory_bytes`` a backward split in two keeps between its halves
            (:meth:`~lightning_pipe.cost.memory.MemoryModel.kept_coefficient`), held while it runs.
        weight_bytes: the part of ``memory_bytes`` its weight versions take
            (:meth:`~lightning_pipe.cost.memory.MemoryModel.weight_versions` copies of ``param_bytes``).
        first_backward_bytes: what a step's first backward of the stage holds beyond the activations
            and the whole gradient it leaves: at its layer ``l``'s peak
            (:attr:`~lightning_pipe.cost.records.LayerCost.first_bytes`) the gradients of the layers
            before ``l`` are not made yet, so the most over its layers of ``first_l − Σ_{j<l} param_j``
            (at least 0; at most ``backward_bytes``).
    """

    layers: tuple[int, ...]
    replicas: int
    compute_seconds: float
    sync_seconds: float
    stage_seconds: float
    memory_bytes: float
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    output_bytes: float = 0.0
    saved_bytes: float = 0.0
    param_bytes: float = 0.0
    activation_bytes: float = 0.0
    backward_bytes: float = 0.0
    transient_bytes: float = 0.0
    kept_bytes: float = 0.0
    weight_bytes: float = 0.0
    first_backward_bytes: float = 0.0

    @property
    def contiguous(self) -> bool:
        return self.layers[-1] - self.layers[0] + 1 == len(self.layers)

    def layers_json(self) -> list[int]:
        """``[first, last]`` for a contiguous stage, else the list of layers."""
        return [self.layers[0], self.layers[-1]] if self.contiguous else list(self.layers)


@dataclass(frozen=True)
class Plan:
    """Stages, their costs and the predicted bottleneck of a partition."""

    partitioner: str
    stages: tuple[Stage, ...]
    cut_seconds: tuple[float, ...]
    bottleneck_seconds: float
    devices: int
    memory: MemoryModel
    network: Network
    memory_limit: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def devices_used(self) -> int:
        return sum(stage.replicas for stage in self.stages)

    @property
    def contiguous(self) -> bool:
        return all(stage.contiguous for stage in self.stages)

    @property
    def peak_memory_bytes(self) -> float:
        return max(stage.memory_bytes for stage in self.stages)

    def to_dict(self) -> dict[str, object]:
        """The JSON document printed by ``lightning-pipe plan --json``; all times in seconds."""
        return {
            "partitioner": self.partitioner,
            "devices": self.devices,
            "devices_used": self.devices_used,
            "contiguous": self.contiguous,
            "memory_schedule": self.memory.schedule,  # what memory is counted as under, not the run's family
            "activations_in_flight": None if self.memory.counts is None else list(self.memory.counts),
            "microbatches": self.memory.microbatches,
            "memory_limit_bytes": self.memory_limit,
            "bandwidth_bytes_per_second": None if self.network.free else self.network.bandwidth,
            "bottleneck_seconds": self.bottleneck_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "cut_seconds": list(self.cut_seconds),
            "stages": [
                {
                    "layers": stage.layers_json(),
                    "replicas": stage.replicas,
                    "compute_seconds": stage.compute_seconds,
                    "sync_seconds": stage.sync_seconds,
                    "stage_seconds": stage.stage_seconds,
                    "memory_bytes": stage.memory_bytes,
                    "forward_seconds": stage.forward_seconds,
                    "backward_seconds": stage.backward_seconds,
                    "output_bytes": stage.output_bytes,
                    "saved_bytes": stage.saved_bytes,
                    "param_bytes": stage.param_bytes,
                    "activation_bytes": stage.activation_bytes,
                    "backward_bytes": stage.backward_bytes,
                    "transient_bytes": stage.transient_bytes,
                    "kept_bytes": stage.kept_bytes,
                    "weight_bytes": stage.weight_bytes,
                    "first_backward_bytes": stage.first_backward_bytes,
                }
                for stage in self.stages
            ],
            "notes": list(self.notes),
        }


def _runs(owner: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(first, last, group)`` of consecutive layers with the same owner."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(owner) + 1):
        if i == len(owner) or owner[i] != owner[start]:
            runs.append((start, i - 1, owner[start]))
            start = i
    return runs


def _first_backward(costs: ChainCosts, layers: Sequence[int]) -> float:
    """A stage's ``first_backward_bytes`` (:class:`Stage`): the backward runs its layers last to first,
    so while layer ``l``'s backward runs the gradients of the layers before it are still to be made."""
    before, most = 0.0, 0.0
    for index in layers:
        layer = costs.layers[index]
        most = max(most, layer.first_bytes - before)
        before += layer.param_bytes
    return most


def evaluate(
    costs: ChainCosts,
    groups: Sequence[Sequence[int]],
    replicas: Sequence[int] | None = None,
    *,
    partitioner: str,
    devices: int,
    network: Network | None = None,
    memory: MemoryModel | None = None,
    memory_limit: float | None = None,
    seconds: Sequence[float] | None = None,
    notes: Sequence[str] = (),
) -> Plan:
    """Measure a partition: ``groups[g]`` are the layers of stage ``g``, replicated ``replicas[g]``.

    ``seconds`` overrides the per-layer time (default: measured ``u_F + u_B``); heuristics that
    balance another quantity still report measured time by leaving it unset.
    """
    network = network or Network()
    memory = memory or MemoryModel()
    replicas = list(replicas) if replicas is not None else [1] * len(groups)
    layer_seconds = list(seconds) if seconds is not None else [layer.seconds for layer in costs.layers]
    owner = [-1] * len(costs)
    for g, group in enumerate(groups):
        if not group:
            raise PlanningError(f"stage {g} has no layers")
        for layer in group:
            if owner[layer] != -1:
                raise PlanningError(f"layer {layer} is assigned to stages {owner[layer]} and {g}")
            owner[layer] = g
    if -1 in owner:
        raise PlanningError(f"layer {owner.index(-1)} is assigned to no stage")
    if len(replicas) != len(groups) or min(replicas) < 1:
        raise PlanningError(f"need one replica count >= 1 per stage, got {replicas}")

    runs = _runs(owner)
    memory_bytes = [0.0] * len(groups)
    activation_bytes = [0.0] * len(groups)
    kept_bytes = [0.0] * len(groups)
    weight_bytes = [0.0] * len(groups)
    downstream = 0
    for first, last, g in reversed(runs):
        downstream += replicas[g]
        params = sum(costs.layers[i].param_bytes for i in range(first, last + 1))
        saved = costs.held_between(first, last)  # a storage two neighbours save, once; the model's output
        kept = sum(costs.layers[i].kept_gradient_bytes for i in range(first, last + 1))
        entering = costs.boundary_bytes[first - 1] if first > 0 else 0.0  # what a recomputing run keeps
        memory_bytes[g] += memory.stage_bytes(
            params, saved, downstream, replicas[g], kept, first=first == 0, input_bytes=entering
        )
        activation_bytes[g] += memory.activation_bytes(saved, downstream, replicas[g], input_bytes=entering)
        kept_bytes[g] += memory.kept_coefficient(downstream, first == 0) * kept
        weight_bytes[g] += memory.weight_versions(downstream, replicas[g]) * params

    stages = []
    for g, group in enumerate(groups):
        layers = tuple(sorted(group))
        compute = sum(layer_seconds[i] for i in layers)
        params = sum(costs.layers[i].param_bytes for i in layers)
        sync = network.allreduce_seconds(params, replicas[g])
        # one layer's backward at a time: once per worker, however many runs of layers it holds
        transient = max(
            memory.transient_bytes(layer.accumulated_bytes, layer.backward_bytes)
            for layer in (costs.layers[i] for i in layers)
        )
        last = layers[-1]
        stages.append(
            Stage(
                layers=layers,
                replicas=replicas[g],
                compute_seconds=compute,
                sync_seconds=sync,
                stage_seconds=max(compute, sync) / replicas[g],
                memory_bytes=memory_bytes[g] + transient,
                forward_seconds=sum(costs.layers[i].forward_seconds for i in layers),
                backward_seconds=sum(costs.layers[i].backward_seconds for i in layers),
                output_bytes=costs.boundary_bytes[last] if last < len(costs) - 1 else 0.0,
                saved_bytes=sum(costs.held_between(first, last) for first, last, run in runs if run == g),
                param_bytes=params,
                activation_bytes=activation_bytes[g],
                backward_bytes=max(costs.layers[i].backward_bytes for i in layers),
                transient_bytes=transient,
                kept_bytes=kept_bytes[g],
                weight_bytes=weight_bytes[g],
                first_backward_bytes=_first_backward(costs, layers),
            )
        )
    cuts = tuple(network.cut_seconds(costs.boundary_bytes[last]) for _, last, _ in runs[:-1])
    bottleneck = max([stage.stage_seconds for stage in stages] + list(cuts))
    return Plan(
        partitioner=partitioner,
        stages=tuple(stages),
        cut_seconds=cuts,
        bottleneck_seconds=bottleneck,
        devices=devices,
        memory=memory,
        network=network,
        memory_limit=memory_limit,
        notes=tuple(notes),
    )

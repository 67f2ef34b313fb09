"""What a partitioner is asked: devices, memory limit, schedule memory model and network."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.partition.contiguous import ChainProblem, StageSpan
from lightning_pipe.partition.plan import Plan, evaluate
from lightning_pipe.util.units import format_bytes

__all__ = ["PlanRequest", "check_tolerance"]


@dataclass(frozen=True)
class PlanRequest:
    """A partitioning request.

    Attributes:
        costs: the chain to split.
        devices: workers available.
        memory_limit: bytes per worker, or ``None`` for no limit.
        memory: schedule and optimizer memory model (decides activations in flight per stage).
        network: bandwidth for cut and all-reduce costs (default: free).
        straight: forbid stage replication (one worker per stage).
        tolerance: plans whose slowest stage is within this fraction of the fastest plan's count as
            ties, and the one needing the least memory is taken, then, when every layer has a FLOP
            count, the one whose largest stage has the fewest FLOPs (memory and FLOPs are counted,
            not timed: splits a few percent apart by measured times swap places less often from run
            to run).
    """

    costs: ChainCosts
    devices: int
    memory_limit: float | None = None
    memory: MemoryModel = field(default_factory=MemoryModel)
    network: Network = field(default_factory=Network)
    straight: bool = False
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        check_whole("devices", self.devices, 1)
        check_tolerance(self.tolerance)
        if self.memory_limit is not None and (math.isnan(self.memory_limit) or self.memory_limit <= 0):
            raise PlanningError(f"memory_limit must be a positive number of bytes, got {self.memory_limit!r}")

    def require_layers_per_device(self, partitioner: str) -> None:
        """Straight pipelines need at least one layer per device."""
        if self.devices > len(self.costs):
            raise PlanningError(
                f"{partitioner}: {self.devices} devices but only {len(self.costs)} layers, and each device "
                f"needs at least one layer: use --devices {len(self.costs)} or fewer, split the model into "
                "more layers, or let the pipedream partitioner replicate stages"
            )

    def problem(self, seconds: list[float] | None = None, *, replicate: bool, with_cuts: bool = True) -> ChainProblem:
        """The contiguous instance: ``seconds`` overrides the balanced per-layer quantity."""
        costs = self.costs
        cuts = [self.network.cut_seconds(b) for b in costs.boundary_bytes] if with_cuts else []
        return ChainProblem(
            seconds=np.asarray(seconds if seconds is not None else costs.column("seconds"), dtype=np.float64),
            cut_seconds=np.asarray(cuts if with_cuts else [0.0] * (len(costs) - 1), dtype=np.float64),
            param_bytes=np.asarray(costs.column("param_bytes"), dtype=np.float64),
            saved_bytes=np.asarray(costs.held_column(), dtype=np.float64),
            devices=self.devices,
            replicate=replicate,
            network=self.network,
            memory=self.memory,
            memory_limit=self.memory_limit,
            tolerance=self.tolerance,
            kept_bytes=np.asarray(costs.column("kept_gradient_bytes"), dtype=np.float64),
            shared_bytes=np.asarray(costs.column("shared_saved_bytes"), dtype=np.float64),
            backward_bytes=np.asarray(costs.column("backward_bytes"), dtype=np.float64),
            accumulated_bytes=np.asarray([layer.accumulated_bytes for layer in costs.layers], dtype=np.float64),
            proxy=(
                np.asarray(costs.column("flops"), dtype=np.float64)
                if all(layer.flops is not None for layer in costs.layers)
                else None
            ),
        )

    def plan_unchecked(
        self, partitioner: str, groups: list[list[int]], replicas: list[int], notes: list[str] = ()
    ) -> Plan:
        """Evaluate a partition with measured costs."""
        return evaluate(
            self.costs,
            groups,
            replicas,
            partitioner=partitioner,
            devices=self.devices,
            network=self.network,
            memory=self.memory,
            memory_limit=self.memory_limit,
            notes=list(self.costs.notes) + list(notes),
        )

    def plan(self, partitioner: str, groups: list[list[int]], replicas: list[int], notes: list[str] = ()) -> Plan:
        """Evaluate a partition and check it against the memory limit."""
        plan = self.plan_unchecked(partitioner, groups, replicas, notes)
        if self.memory_limit is not None and plan.peak_memory_bytes > self.memory_limit * (1 + 1e-9):
            worst = max(range(len(plan.stages)), key=lambda s: plan.stages[s].memory_bytes)
            raise PlanningError(
                f"{partitioner}: stage {worst} needs {format_bytes(plan.peak_memory_bytes)}, over the limit of "
                f"{format_bytes(self.memory_limit)}: use the memory partitioner, which plans within the limit"
            )
        return plan

    def plan_spans(self, partitioner: str, spans: list[StageSpan], notes: list[str] = ()) -> Plan:
        """:meth:`plan` for contiguous ``(first, last, replicas)`` spans."""
        groups = [list(range(first, last + 1)) for first, last, _ in spans]
        return self.plan(partitioner, groups, [replicas for _, _, replicas in spans], notes)


def check_tolerance(value: object, name: str = "tolerance") -> None:
    """Refuse a near-tie tolerance (:attr:`PlanRequest.tolerance`) that is not a fraction in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise PlanningError(f"{name} must be a fraction in [0, 1), got {value!r}")

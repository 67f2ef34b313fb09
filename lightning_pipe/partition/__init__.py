"""Partitioners: split a chain of layers into stages and place them on devices.

Every partitioner takes a :class:`PlanRequest` (costs, devices, optional memory limit, schedule
memory model, network) and returns a :class:`Plan` evaluated by one common definition
(:func:`evaluate`). Use :func:`partition` with a name from :data:`PARTITIONERS`. A branching graph
(:class:`~lightning_pipe.cost.pipedream_graph.LayerDag`) is split over its antichains by
:func:`lightning_pipe.partition.antichain.antichain_plan`, outside the registry (its docstring says why).
Its modules: :mod:`.request` (what a partitioner is asked), :mod:`.plan` (the plan and its evaluation),
:mod:`.plan_file` (plan files read back); the partitioners :mod:`.balanced` (uniform, params, time,
flops), :mod:`.contiguous` (optimal, with replication and memory limits), :mod:`.pipedream` (PipeDream's
and Black GPipe's), :mod:`.noncontiguous` (Beaumont et al. §6), :mod:`.exact` (the brute-force oracle)
and :mod:`.antichain`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.balanced import balanced, uniform
from lightning_pipe.partition.exact import exact
from lightning_pipe.partition.noncontiguous import next_fit, noncontiguous
from lightning_pipe.partition.pipedream import memory_limited, pipedream
from lightning_pipe.partition.plan import Plan, Stage, evaluate
from lightning_pipe.partition.request import PlanRequest

__all__ = ["PARTITIONERS", "Plan", "PlanRequest", "Stage", "evaluate", "next_fit", "partition"]

PARTITIONERS: dict[str, Callable[[PlanRequest], Plan]] = {
    "uniform": uniform,
    "params": partial(balanced, by="params"),
    "time": partial(balanced, by="time"),
    "flops": partial(balanced, by="flops"),
    "pipedream": pipedream,
    "memory": memory_limited,
    "noncontiguous": noncontiguous,
    "exact": exact,
}


def partition(request: PlanRequest, partitioner: str = "pipedream") -> Plan:
    """Run the partitioner called ``partitioner`` on ``request``."""
    try:
        run = PARTITIONERS[partitioner]
    except KeyError:
        raise PlanningError(f"unknown partitioner {partitioner!r}; choose one of {', '.join(PARTITIONERS)}") from None
    return run(request)

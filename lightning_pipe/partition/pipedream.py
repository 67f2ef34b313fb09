"""PipeDream's partitioner (Narayanan et al. 2019 §3.1) and its memory-limited form (Black GPipe).

``pipedream`` minimises the bottleneck ``max(T(i→j, m), 2·C_i)`` over contiguous stages, each stage
possibly replicated (data parallelism inside a stage, weight sync by all-reduce), or as a straight
pipeline with ``straight=True``. ``memory`` is the same search with a per-device memory limit that
rejects stages over it, where a stage's activations in flight follow the schedule
(:mod:`lightning_pipe.cost.memory`). Both are exact; the search itself is in
:mod:`lightning_pipe.partition.contiguous`.
"""

from __future__ import annotations

from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.plan import Plan
from lightning_pipe.partition.request import PlanRequest

__all__ = ["memory_limited", "pipedream"]


def pipedream(request: PlanRequest, name: str = "pipedream") -> Plan:
    """Optimal contiguous plan, replicated unless ``request.straight``."""
    if request.straight:
        request.require_layers_per_device(name)
    problem = request.problem(replicate=not request.straight)
    return request.plan_spans(name, problem.solve())


def memory_limited(request: PlanRequest) -> Plan:
    """:func:`pipedream` under a memory limit, which is required."""
    if request.memory_limit is None:
        raise PlanningError(
            "the memory partitioner needs a per-device memory limit (e.g. --memory-limit 16GB); "
            "without one, use the pipedream partitioner"
        )
    return pipedream(request, name="memory")

"""Straight pipelines balanced by a per-layer quantity: ``uniform``, ``params``, ``time``, ``flops``.

torchgpipe's ``balance_by_time`` / ``balance_by_size`` and the CDP paper's FLOP-equisum split
(Fournier & Oyallon 2024, §5: "split into 4 stages with similar FLOPs") are greedy heuristics for the
min-max (bottleneck) objective. Here the same quantities are balanced *optimally*: the minimum over
contiguous splits of the largest stage sum, by the exact procedure of
:mod:`lightning_pipe.partition.contiguous` (no replication, cuts free while balancing). The plan then
reports the measured time and communication of that split, so the heuristics can be compared.
"""

from __future__ import annotations

from lightning_pipe.partition.plan import Plan
from lightning_pipe.partition.request import PlanRequest

__all__ = ["balanced", "uniform"]

_QUANTITY = {"time": "seconds", "params": "param_bytes", "flops": "flops"}


def uniform(request: PlanRequest) -> Plan:
    """Equal layer counts (the first ``L mod P`` stages get one layer more)."""
    request.require_layers_per_device("uniform")
    count, extra = divmod(len(request.costs), request.devices)
    groups, first = [], 0
    for stage in range(request.devices):
        size = count + (stage < extra)
        groups.append(list(range(first, first + size)))
        first += size
    return request.plan("uniform", groups, [1] * len(groups))


def balanced(request: PlanRequest, by: str) -> Plan:
    """The straight split minimising the largest stage sum of ``by`` (``time``, ``params``, ``flops``)."""
    request.require_layers_per_device(by)
    quantity = request.costs.column(_QUANTITY[by])
    problem = request.problem(quantity, replicate=False, with_cuts=False)
    return request.plan_spans(by, problem.solve())

"""The textbook PipeDream dynamic program, the peer our planner is measured against.

``A(j, m) = min( T(1→j, m), min_{i<j, 1<=m'<m} max(A(i, m - m'), 2·C_i, T(i+1→j, m')) )`` with
``T(i→j, m) = max(Σ t, allreduce)/m`` (Narayanan et al. 2019 §3.1),
written as the paper states it: ``O(N²M²)`` time. ``A(N, M)`` uses exactly ``M`` machines, so the best
plan on at most ``M`` machines is ``min_m A(N, m)``; with ``straight=True`` there is no replication.
"""

from __future__ import annotations

import math

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts


def textbook_bottleneck(costs: ChainCosts, machines: int, network: Network, straight: bool) -> float:
    """Best bottleneck over plans using at most ``machines`` machines."""
    n = len(costs)
    time = [0.0]
    params = [0.0]
    for layer in costs.layers:
        time.append(time[-1] + layer.seconds)
        params.append(params[-1] + layer.param_bytes)

    def stage(i: int, j: int, m: int) -> float:  # layers i..j-1 (0-based, j exclusive)
        if straight and m > 1:
            return math.inf
        return max(time[j] - time[i], network.allreduce_seconds(params[j] - params[i], m)) / m

    cut = [network.cut_seconds(b) for b in costs.boundary_bytes]
    table = [[math.inf] * (machines + 1) for _ in range(n + 1)]
    for j in range(1, n + 1):
        for m in range(1, machines + 1):
            best = stage(0, j, m)
            for i in range(1, j):
                for inner in range(1, m):
                    candidate = max(table[i][m - inner], cut[i - 1], stage(i, j, inner))
                    best = min(best, candidate)
            table[j][m] = best
    return min(table[n][1:])

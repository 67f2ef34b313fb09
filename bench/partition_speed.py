"""Planner speed: our bisection planner vs the textbook O(N²M²) PipeDream DP, side by side.

Run: ``python bench/partition_speed.py``. For each chain size both planners run on the same random
chain (same seed); the table gives both times, their ratio, and checks both find the same bottleneck.
The last rows time our planner alone on the 1,000-layer, 64-device target (the textbook DP would take
hours there).
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from textbook_dp import textbook_bottleneck

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition import PlanRequest, partition


def random_chain(layers: int, seed: int = 0) -> ChainCosts:
    rng = random.Random(seed)
    return ChainCosts.from_lists(
        [rng.uniform(0.5, 2.0) for _ in range(layers)],
        [rng.uniform(1.0, 4.0) for _ in range(layers)],
        activation=[rng.uniform(1e5, 1e7) for _ in range(layers)],
        params=[rng.uniform(0, 1e7) for _ in range(layers)],
    )


def best_of(runs: int, fn) -> tuple[float, object]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    network = Network(1e9)
    print(f"{'layers':>6} {'devices':>7} {'mode':>14} {'ours s':>9} {'textbook s':>11} {'speed-up':>9}  same?")
    for layers, devices in ((40, 4), (80, 8), (120, 16)):
        costs = random_chain(layers)
        for straight in (True, False):
            request = PlanRequest(costs, devices, network=network, straight=straight)
            ours_s, plan = best_of(3, lambda r=request: partition(r, "pipedream"))
            peer_s, peer = best_of(1, lambda s=straight, c=costs, d=devices: textbook_bottleneck(c, d, network, s))
            same = math.isclose(plan.bottleneck_seconds, peer, rel_tol=1e-9)
            mode = "straight" if straight else "replicated"
            print(
                f"{layers:>6} {devices:>7} {mode:>14} {ours_s:>9.4f} {peer_s:>11.3f} {peer_s / ours_s:>8.0f}x  {same}"
            )
    costs = random_chain(1000)
    for straight in (True, False):
        for limit in (None, 3e9):
            request = PlanRequest(costs, 64, memory_limit=limit, network=network, straight=straight)
            ours_s, plan = best_of(3, lambda r=request: partition(r, "pipedream"))
            mode = ("straight" if straight else "replicated") + ("" if limit is None else "+mem")
            print(f"{1000:>6} {64:>7} {mode:>14} {ours_s:>9.4f} {'-':>11} {'-':>9}  (target < 1 s)")


if __name__ == "__main__":
    main()

"""Antichain plans (PipeDream §3.1 over downsets) against the chain DP on PipeDream's own profiles.

Run: ``python bench/antichain_plans.py``. For every ``graph.txt`` in ``tests/data/pipedream-profiles``
and 2, 4 and 8 devices, the slowest stage per micro-batch (ms) of the ``pipedream`` partitioner on the
parser's topological order ("chain") and of :func:`~lightning_pipe.partition.antichain.antichain_plan`
("antichain", bold where strictly faster), in three settings: stages replicated with 10 Gbit/s links
(PipeDream's slower cluster), straight pipelines with free links, straight pipelines with 10 Gbit/s
links. ``states``: the downsets of the graph, the empty one included (counted in full even where the
search refuses them); the last columns: seconds to make the three plans, each planner.
"""

from __future__ import annotations

import time
from pathlib import Path

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.pipedream_graph import load_pipedream_dag
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.partition.antichain import MAX_STATES, antichain_plan, downsets

PROFILES = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream-profiles"
TEN_GBIT = Network(10e9 / 8)
SETTINGS = (
    ("replicated, 10 Gbit/s", False, TEN_GBIT),
    ("straight, free", True, Network()),
    ("straight, 10 Gbit/s", True, TEN_GBIT),
)
DEVICES = (2, 4, 8)


def _pair(chain: float, antichain: float | None) -> str:
    """``chain / antichain`` in ms, the antichain's in bold where strictly faster, ``-`` where refused."""
    if antichain is None:
        return f"{chain * 1e3:.2f} / -"
    shown = f"{antichain * 1e3:.2f}"
    return f"{chain * 1e3:.2f} / {f'**{shown}**' if antichain < chain * (1 - 1e-9) else shown}"


def rows(directory: Path) -> list[str]:
    dag = load_pipedream_dag(directory / "graph.txt")
    states = len(downsets(dag, max_states=10**7))
    lines = []
    for devices in DEVICES:
        cells, chain_seconds, antichain_seconds = [], 0.0, 0.0
        for _, straight, network in SETTINGS:
            start = time.perf_counter()
            chain = partition(PlanRequest(dag.chain(), devices, network=network, straight=straight), "pipedream")
            chain_seconds += time.perf_counter() - start
            start = time.perf_counter()
            try:
                found = antichain_plan(dag, devices, network=network, straight=straight).bottleneck_seconds
            except PlanningError:
                found = None
            antichain_seconds += time.perf_counter() - start
            cells.append(_pair(chain.bottleneck_seconds, found))
        timing = f"{antichain_seconds:.2f}" if states <= MAX_STATES else f"refused in {antichain_seconds:.2f}"
        lines.append(
            f"| {directory.name} | {len(dag.layers)} | {states:,} | {devices} | {' | '.join(cells)} "
            f"| {timing} | {chain_seconds:.3f} |"
        )
    return lines


def main() -> None:
    settings = " | ".join(f"{name}: chain / antichain (ms)" for name, _, _ in SETTINGS)
    print(f"| profile | layers | states | devices | {settings} | antichain s | chain s |")
    print("|" + " --- |" * (7 + len(SETTINGS) - 1))
    for directory in sorted(path for path in PROFILES.iterdir() if path.is_dir()):
        for line in rows(directory):
            print(line, flush=True)


if __name__ == "__main__":
    main()

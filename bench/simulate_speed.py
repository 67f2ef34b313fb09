"""Simulator speed: ours vs torch.distributed.pipelining's dry-run simulator, on the same schedules.

Run: ``python bench/simulate_speed.py``. For each size, GPipe and interleaved 1F1B orders are made by
torch (``get_schedule_ops``) and by us (the same orders); torch lowers its order with
``_add_send_recv`` and dry-runs it with ``_simulate_comms_compute`` (unit-time steps, deadlock
detection), we run our validator (deadlock, versions) and our cost-aware simulator (timings, memory,
traffic). The last rows time our families alone at the
64-stage x 1,024-micro-batch target (validation and simulation separately; the target is < 2 s to
simulate).
"""

from __future__ import annotations

import time

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _add_send_recv, _simulate_comms_compute

from lightning_pipe.schedule import StageCosts, make_schedule, simulate, validate


def _seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _torch(name: str, workers: int, microbatches: int, per_rank: int) -> float:
    orders = get_schedule_ops(name, workers, microbatches, num_stages_per_rank=per_rank)
    compute = {
        rank: [a for a in actions if a is not None and "REDUCE" not in str(a)] for rank, actions in enumerate(orders)
    }
    stages = workers * per_rank

    def stage_to_rank(stage: int) -> int:
        return stage % workers

    def run() -> object:
        return _simulate_comms_compute(_add_send_recv(compute, stage_to_rank, stages), stage_to_rank, stages)

    seconds, _ = _seconds(run)
    return seconds


def main() -> None:
    header = f"{'schedule':>12} {'stages':>6} {'m':>5} {'torch sim s':>11} {'ours val s':>10} {'ours sim s':>10}"
    print(header + f" {'ratio':>6}")
    for torch_name, ours, per_rank in (("GPipe", "gpipe", 1), ("Interleaved1F1B", "interleaved", 2)):
        for workers, microbatches in ((4, 32), (8, 64), (16, 128)):
            peer = _torch(torch_name, workers, microbatches, per_rank)
            schedule = make_schedule(ours, workers * per_rank, microbatches, virtual_stages=per_rank)
            validating, graph = _seconds(lambda s=schedule: validate(s))
            costs = StageCosts.uniform(schedule.stages, 1.0, 2.0)
            simulating, _ = _seconds(lambda s=schedule, g=graph, c=costs: simulate(s, c, graph=g))
            ratio = peer / (validating + simulating)
            print(
                f"{ours:>12} {schedule.stages:>6} {microbatches:>5} {peer:>11.3f} {validating:>10.3f} "
                f"{simulating:>10.3f} {ratio:>5.1f}x"
            )
    for family in ("1f1b", "gpipe", "zb_h1", "2bw", "cdp"):
        schedule = make_schedule(family, 64, 1024)
        validating, graph = _seconds(lambda s=schedule: validate(s))
        costs = StageCosts([1.0 + s / 64 for s in range(64)], [2.0] * 64, saved_bytes=[1e6] * 64)
        simulating, _ = _seconds(lambda s=schedule, g=graph, c=costs: simulate(s, c, graph=g))
        print(f"{family:>12} {64:>6} {1024:>5} {'-':>11} {validating:>10.3f} {simulating:>10.3f} {'-':>6}")


if __name__ == "__main__":
    main()

"""Plan quality: our optimal planner vs the time and FLOP heuristics, on real profiles.

Run: ``pip install -e ".[bench]" && python bench/partition_quality.py``.

Peers, run on the same costs in the same process:

- torchgpipe's ``balance_by_time`` algorithm: :func:`torchgpipe.balance.balance_cost` on per-layer
  times in integer microseconds (what ``balance_by_time`` feeds it);
- the CDP paper's FLOP-equisum split (Fournier & Oyallon 2024 §5, "4 stages with similar FLOPs"): a
  stage is closed as soon as its FLOPs reach the average of what remains.

Every split is evaluated with the same measured per-layer times, and the table shows how much slower
each heuristic's bottleneck is than ours (1.00 = as good). The last column compares the two FLOP
splits on their own objective, the largest stage FLOPs. PipeDream's published profiles
(tests/data/pipedream-profiles) carry no FLOP counts, so the FLOP columns use models profiled
here on the CPU with torch.utils.flop_counter.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchgpipe.balance import balance_cost

from lightning_pipe.cost.network import Network
from lightning_pipe.cost.profile_file import load_profile
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition import Plan, PlanRequest, partition
from lightning_pipe.zoo.models import torchvision_chain

PROFILES = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream-profiles"


def _evaluate(request: PlanRequest, sizes: list[int], name: str) -> Plan:
    groups, first = [], 0
    for size in sizes:
        groups.append(list(range(first, first + size)))
        first += size
    return request.plan_unchecked(name, groups, [1] * len(groups))


def torchgpipe_by_time(request: PlanRequest) -> Plan:
    micros = [max(1, round(layer.seconds * 1e6)) for layer in request.costs.layers]
    return _evaluate(request, balance_cost(micros, request.devices), "torchgpipe")


def flop_equisum(request: PlanRequest) -> Plan:
    flops = request.costs.column("flops")
    sizes, remaining, stages_left, current, count = [], sum(flops), request.devices, 0.0, 0
    for index, value in enumerate(flops):
        current += value
        count += 1
        layers_left = len(flops) - index - 1
        if stages_left > 1 and (current >= remaining / stages_left or layers_left == stages_left - 1):
            sizes.append(count)
            remaining -= current
            stages_left -= 1
            current, count = 0.0, 0
    sizes.append(count)
    return _evaluate(request, sizes, "flop-equisum")


def _max_flops(costs: ChainCosts, plan: Plan) -> float:
    return max(sum(costs.layers[i].flops for i in stage.layers) for stage in plan.stages)


def _torchvision_profiles() -> list[ChainCosts]:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    profiles = []
    for name in ("resnet18", "resnet50", "vgg16"):
        chain = torchvision_chain(name, num_classes=10, cifar=True)
        profiles.append(profile_layers(chain, torch.randn(16, 3, 32, 32), repeats=5, name=f"{name}-cifar"))
    return profiles


def main() -> None:
    header = f"{'profile':>16} {'layers':>6} {'P':>3} {'bandwidth':>10} {'ours ms':>9} {'torchgpipe':>11}"
    print(header + f" {'flop-equisum':>13} {'ours-by-flops':>14} {'equisum/ours max FLOPs':>23}")
    cases = [load_profile(path / "graph.txt") for path in sorted(PROFILES.iterdir()) if path.is_dir()]
    cases += _torchvision_profiles()
    for costs in cases:
        has_flops = all(layer.flops is not None for layer in costs.layers)
        for devices in (4, 8):
            for bandwidth in (float("inf"), 10e9):
                request = PlanRequest(costs, devices, network=Network(bandwidth), straight=True)
                ours = partition(request, "pipedream").bottleneck_seconds
                ratios = [torchgpipe_by_time(request).bottleneck_seconds / ours]
                if has_flops:
                    equisum, by_flops = flop_equisum(request), partition(request, "flops")
                    ratios.append(equisum.bottleneck_seconds / ours)
                    ratios.append(by_flops.bottleneck_seconds / ours)
                    ratios.append(_max_flops(costs, equisum) / _max_flops(costs, by_flops))
                cells = [f"{r:.2f}" for r in ratios] + ["-"] * (4 - len(ratios))
                width = "free" if bandwidth == float("inf") else "10 GB/s"
                print(
                    f"{costs.name:>16} {len(costs):>6} {devices:>3} {width:>10} {ours * 1e3:>9.2f} "
                    f"{cells[0]:>11} {cells[1]:>13} {cells[2]:>14} {cells[3]:>23}"
                )


if __name__ == "__main__":
    main()

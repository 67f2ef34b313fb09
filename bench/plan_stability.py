"""Does the same model get the same plan from run to run? Repeated profiles of one model, each
partitioned by the ``time`` partitioner with and without a tie tolerance, side by side in one run.

Run: ``python bench/plan_stability.py [--model resnet18] [--rows 128 32] [--devices 2 4] [--runs 20]
[--repeats 3] [--tolerances 0 0.02 0.05]`` (about 8 minutes on 2 cores).

Each run profiles the model's layers afresh (``profile_layers``: the median of ``--repeats`` timed
forward and backward runs per layer, as ``PipelineStrategy(profile_repeats=3)`` does on its first
batch), then every (devices, tolerance) pair partitions that same profile. A tolerance ``t`` counts
plans within ``t`` of the fastest plan's bottleneck as ties and takes the one needing the least memory
(``PlanRequest.tolerance``). Printed per setting: how many distinct splits the runs gave, the share of
the most common one, and the cost of the tolerance: the chosen plan's bottleneck over the fastest
plan's, by the same profile (median and worst over the runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.zoo.models import build_chain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="a torchvision name (CIFAR variant, 32x32 inputs)")
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 32], help="micro-batch sizes")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per layer (profile_repeats)")
    parser.add_argument("--tolerances", type=float, nargs="+", default=[0.0, 0.02, 0.05])
    options = parser.parse_args(argv)
    torch.manual_seed(0)
    layers = list(build_chain(options.model, input_shape=(3, 32, 32), num_classes=10))
    print(f"model: CIFAR {options.model}, {len(layers)} layers, {options.runs} profiles per micro-batch size")
    header = "rows  devices  tolerance  distinct  most common  share  bottleneck/fastest (median, worst)"
    print(header)
    print("-" * len(header))
    for rows in options.rows:
        sample = torch.randn(rows, 3, 32, 32)
        profiles = [profile_layers(layers, sample, repeats=options.repeats) for _ in range(options.runs)]
        for devices in options.devices:
            memory = MemoryModel("1f1b", devices)
            for tolerance in options.tolerances:
                splits, ratios = [], []
                for costs in profiles:
                    fastest = partition(PlanRequest(costs, devices, memory=memory, straight=True), "time")
                    request = PlanRequest(costs, devices, memory=memory, straight=True, tolerance=tolerance)
                    plan = partition(request, "time")
                    splits.append(tuple(stage.layers[-1] for stage in plan.stages[:-1]))
                    ratios.append(plan.bottleneck_seconds / fastest.bottleneck_seconds)
                (common, count), *_ = Counter(splits).most_common(1)
                print(
                    f"{rows:4} {devices:8} {tolerance:10.2f} {len(set(splits)):9} {'cuts ' + str(list(common)):>12} "
                    f"{count / len(splits):6.2f}  {statistics.median(ratios):.3f}, {max(ratios):.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

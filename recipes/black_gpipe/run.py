"""Recipe 3 (partitions) — the Black GPipe slides: VGG-19 and ResNet-152 split over 4 devices by
PipeDream's dynamic program under a per-device memory limit (the slides' ``dp> memlim``), GPipe with
8 micro-batches.

    python recipes/black_gpipe/run.py --size smoke     # VGG-11 and ResNet-18 on 32x32 images (CI)
    python recipes/black_gpipe/run.py --size reduced   # VGG-19 and ResNet-152, 224x224, CPU profiles

Each model is profiled layer by layer on this machine's CPU (time, saved activations, weights), then
partitioned by the ``memory`` partitioner for a range of limits, given as fractions of what the
whole model needs on one device (weights, optimizer state and the 8 micro-batches' activations);
the slides' table (for their GPU profile of VGG, 27 layers) reads the same way: the tighter the
limit, the more stages and the higher the bottleneck; a loose one replicates stages (``xr``: r
devices, the slides' "reps"), up to plain data parallelism. A limit nothing fits under is reported with
the smallest limit that fits. Output: ``partitions.md``. The slides' throughput comparison (single
device / data parallel / GPipe on 1-8 GPUs at 448x448) needs GPUs and is not part of this recipe.
"""

from __future__ import annotations

import re

import torch

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.train.recipe import output_directory, sized_parser
from lightning_pipe.zoo.models import torchvision_chain

DEVICES, MICROBATCHES = 4, 8
FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
SIZES = {
    "smoke": {"models": ("vgg11", "resnet18"), "shape": (2, 3, 32, 32), "cifar": True},
    "reduced": {"models": ("vgg19", "resnet152"), "shape": (8, 3, 224, 224), "cifar": False},
}


def _span(plan) -> str:
    return " ".join(
        f"{stage.layers[0] + 1}->{stage.layers[-1] + 1}" + (f" x{stage.replicas}" if stage.replicas > 1 else "")
        for stage in plan.stages
    )


def partitions(size: str) -> str:
    setting = SIZES[size]
    memory = MemoryModel("gpipe", MICROBATCHES)
    lines = [
        f"`python recipes/black_gpipe/run.py --size {size}`: {DEVICES} devices, GPipe with {MICROBATCHES} "
        f"micro-batches of {setting['shape'][0]} images {setting['shape'][2]}x{setting['shape'][3]}, CPU profiles; "
        "layers numbered from 1.",
        "",
        "| model | layers | memory limit (MiB) | fraction of one device's need | partition "
        "| bottleneck (ms per micro-batch) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in setting["models"]:
        torch.manual_seed(0)
        chain = torchvision_chain(name, num_classes=10 if setting["cifar"] else 1000, cifar=setting["cifar"])
        costs = profile_layers(chain, torch.randn(setting["shape"]), repeats=2, name=name)
        whole = partition(PlanRequest(costs, 1, memory=memory), "pipedream").peak_memory_bytes
        for fraction in FRACTIONS:
            limit = fraction * whole
            request = PlanRequest(costs, DEVICES, memory_limit=limit, memory=memory)
            try:
                plan = partition(request, "memory")
                cells = f"{_span(plan)} | {plan.bottleneck_seconds * 1e3:.1f}"
            except PlanningError as error:
                smallest = re.search(r"smallest limit that fits \d+ device\(s\) is ([^:;,)]+)", str(error))
                cells = f"does not fit (smallest limit: {smallest.group(1) if smallest else '?'}) | -"
            lines.append(f"| {name} | {len(costs)} | {limit / 2**20:.0f} | {fraction:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = sized_parser(__doc__, SIZES)
    args = parser.parse_args(argv)
    output = output_directory(args, __file__)
    (output / "partitions.md").write_text(partitions(args.size))
    print((output / "partitions.md").read_text())


if __name__ == "__main__":
    main()

"""How well the optimizer's measured rate prices a real stage's update: the rate measured with the
caches emptied before each timed step (the package's, ``lightning_pipe/cost/update_rate.py``) and
measured warm, step after step (as it was before 2026-11-30), against the stage's own step timed cold
(its caches emptied first, as a run's forwards and backwards leave them) and warm.

Run: ``python bench/update_price.py [--rounds 3]`` (about a minute on the CPU). One process, one
thread (as each of the pipeline's 2 processes on this machine). The stages: torchvision's ResNet-18
(``num_classes=10``) cut before ``layer4`` as the 2-stage plans of ``bench/auto_plan.py`` cut it, and
``transformers``' GPT-2 at two widths (6 blocks of 128, the bench's; 4 blocks of 768, GPT-2 small's),
cut after half its blocks (left out without ``transformers``); each with SGD (momentum 0.9), Adam and
AdamW. Each round measures both rates anew, then times each stage's step cold and warm (medians of
20 steps after 3); the table gives the medians over the rounds, and each price over the measured
cold step. A run prices its stages with the cold rate (``StepPrices``); the in-run update is longer
still where the other processes compute beside it (``bench/auto_plan.py``'s calibration).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lightning_pipe.cost import update_rate as module
from lightning_pipe.runtime.allocator import settle_heap

STEPS, WARMUP = 20, 3
Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizer] = {
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
}


def stages() -> Iterator[tuple[str, list[nn.Parameter]]]:
    """Each stage's name and trainable parameters."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    net = resnet18(num_classes=10)
    first = [net.conv1, net.bn1, net.layer1, net.layer2, net.layer3]
    yield "ResNet-18 conv1..layer3", [p for m in first for p in m.parameters()]
    yield "ResNet-18 layer4, fc", [*net.layer4.parameters(), *net.fc.parameters()]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return
    for blocks, width in ((6, 128), (4, 768)):
        gpt = GPT2LMHeadModel(GPT2Config(n_layer=blocks, n_embd=width, n_head=4 if width == 128 else 12))
        half = blocks // 2
        head = [gpt.transformer.wte, gpt.transformer.wpe, *gpt.transformer.h[:half]]
        yield f"GPT-2 {blocks}x{width} embeddings..block {half - 1}", [p for m in head for p in m.parameters()]
        tail = [*gpt.transformer.h[half:], gpt.transformer.ln_f]
        yield f"GPT-2 {blocks}x{width} blocks {half}..{blocks - 1}, ln_f", [p for m in tail for p in m.parameters()]


def rate(optimizer: Optimizer, cold: bool) -> module.UpdateRate:
    """The optimizer's rate measured as the package measures it, its caches emptied before each timed
    step (``cold``) or not (nothing written: 4 bytes)."""
    with_eviction = module.evicted_bytes
    try:
        if not cold:
            module.evicted_bytes = lambda device: 4  # type: ignore[assignment]
        module._MEASURED.clear()  # measured anew, not the process's first measurement
        found = module.update_rate(optimizer([nn.Parameter(torch.zeros(1))]), torch.device("cpu"), torch.float32)
    finally:
        module.evicted_bytes = with_eviction
    assert found is not None
    return found


def step_seconds(optimizer: torch.optim.Optimizer, evict: Callable[[], None] | None) -> float:
    """The median seconds of the optimizer's step, each after ``evict`` (``None``: warm)."""
    times = []
    for index in range(WARMUP + STEPS):
        if evict is not None:
            evict()
        start = time.perf_counter()
        optimizer.step()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settle_heap()  # as a run's processes are (lightning_pipe/strategy/strategy.py)
    evict = module.evictor(torch.device("cpu"))
    named = list(stages())
    figures: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for _ in range(args.rounds):
        for name, make in OPTIMIZERS.items():
            cold_rate, warm_rate = rate(make, True), rate(make, False)
            for stage, params in named:
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                optimizer = make(params)
                tensors, nbytes = len(params), sum(p.numel() * p.element_size() for p in params)
                priced = (cold_rate.seconds(tensors, nbytes), warm_rate.seconds(tensors, nbytes))
                measured = (step_seconds(optimizer, evict), step_seconds(optimizer, None))
                figures.setdefault((name, stage), []).append((*priced, *measured))
                for p in params:
                    p.grad = None
    heading = "priced cold  warm   measured cold  warm   cold/measured  warm/measured"
    print(f"{'optimizer':13} {'stage':36} {'MiB':>5}  {heading}")
    sizes = {stage: sum(p.numel() * p.element_size() for p in params) / 2**20 for stage, params in named}
    for (name, stage), rows in figures.items():
        cold, warm, measured_cold, measured_warm = (statistics.median(column) for column in zip(*rows, strict=True))
        print(
            f"{name:13} {stage:36} {sizes[stage]:5.1f}  {cold * 1e3:8.2f} ms {warm * 1e3:5.2f}  "
            f"{measured_cold * 1e3:10.2f} ms {measured_warm * 1e3:5.2f}  "
            f"{cold / measured_cold:13.2f}  {warm / measured_cold:13.2f}"
        )


if __name__ == "__main__":
    main()

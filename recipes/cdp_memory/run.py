"""Recipe 2 — CDP (Fournier & Oyallon 2024), §4.1-4.2, §5 and Fig. 4: activation memory per worker
of data parallelism (DP) against Cyclic Data Parallelism (CDP), on ResNet-50 and ViT-B/16
(torchvision), measured with the runtime and as the paper extrapolates it.

    python recipes/cdp_memory/run.py --size smoke     # small models and images (CI)
    python recipes/cdp_memory/run.py --size reduced   # ResNet-50 and ViT-B/16 at 224x224 on the CPU

**Measured** (:mod:`lightning_pipe.train.cyclic_memory`): the model cut into ``P = N`` stages and
trained for 3 steps of ``N`` micro-batches of one image, DP and CDP-v2 alike, on one device (DP: the
``N`` micro-batches together; CDP: in the cyclic order) and on ``N`` processes (a replica per
micro-batch; DP all at once, CDP each 1/N of a pass after the previous). The runtime counts the
bytes autograd saves for the backward after every action; the memory per worker is the sum over
the workers at each moment divided by ``N``. The simulator's prediction of the same figure and the
ideal ``(N + 1) / 2N`` stand beside it.

**Extrapolated**, the paper's method: one worker's forward-backward pass is measured once — the bytes
autograd saves for the backward (saved-tensor hooks; each storage counted once, from the time it is
first saved to the time the backward last reads it; parameters excluded) against the wall time of
the pass, ``m(t)`` over ``[0, T)``. N workers of DP run that pass simultaneously, so the activation
memory per worker (total over the N workers divided by N) is ``m(t)``; in CDP worker ``i`` starts
``i T / N`` later (the uniform delay of §3.2), so the memory per worker is
``(1/N) sum_i m(t - i T / N mod T)``.

Both tables give the reduction ``1 - peak CDP / peak DP`` (the paper: about 30% for ResNet-50 and 42%
for ViT-B/16; half is the ideal of a pass whose memory rises and falls linearly). Outputs in
``--output`` (default ``recipes/cdp_memory/results/<size>``): ``table.md`` and ``memory.png``
(per-worker memory over one period, DP full and CDP dashed, as Fig. 4).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

from lightning_pipe.train.cyclic_memory import Measurement, measure, plan_split
from lightning_pipe.train.recipe import output_directory, sized_parser

WORKERS = (4, 8, 32)
MEASURED = {  # setting -> N, per size
    "smoke": {"one device": (4,), "processes": (2,)},
    "reduced": {"one device": (4, 8, 32), "processes": (2, 4)},
}
PAPER = {"resnet50": 30.0, "vit_b_16": 42.0}  # % reduction of the activation-memory peak, §5


_SMALL_VIT = {"image_size": 32, "patch_size": 8, "num_layers": 4, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128}

# builders are partials of torchvision's classes: the measured runs send them to other processes
SIZES: dict[str, dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]] = {
    "smoke": {
        "resnet18": (functools.partial(torchvision.models.resnet18, num_classes=10), (2, 3, 64, 64)),
        "vit_tiny": (
            functools.partial(torchvision.models.VisionTransformer, **_SMALL_VIT, num_classes=10),
            (2, 3, 32, 32),
        ),
    },
    "reduced": {
        "resnet50": (torchvision.models.resnet50, (8, 3, 224, 224)),
        "vit_b_16": (torchvision.models.vit_b_16, (8, 3, 224, 224)),
    },
}


def memory_curve(model: nn.Module, batch: torch.Tensor) -> tuple[list[float], list[int], float]:
    """One training pass's saved-activation memory: the times (s) where it changes, the bytes from
    each of those times on, and the pass's duration ``T``."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, list] = {}  # storage -> [bytes, first save, last read]
    start = time.perf_counter()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in parameters and key not in saved:
            saved[key] = [tensor.untyped_storage().nbytes(), time.perf_counter() - start, None]
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key in saved:
            saved[key][2] = time.perf_counter() - start
        return tensor

    labels = torch.zeros(batch.shape[0], dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = nn.functional.cross_entropy(model(batch), labels)
        loss.backward()
    period = time.perf_counter() - start
    events: dict[float, int] = {}
    for size, first, last in saved.values():
        events[first] = events.get(first, 0) + size
        end = period if last is None else last
        events[end] = events.get(end, 0) - size
    times, level, levels = sorted(events), 0, []
    for moment in times:
        level += events[moment]
        levels.append(level)
    return times, levels, period


def sample(times: list[float], levels: list[int], period: float, points: int) -> torch.Tensor:
    """``m(t)`` at ``points`` equally spaced times of ``[0, T)`` (the level of the last change at or
    before each time; 0 before the first)."""
    grid = torch.arange(points, dtype=torch.float64) * (period / points)
    index = torch.searchsorted(torch.tensor(times, dtype=torch.float64), grid, right=True) - 1
    values = torch.tensor([0, *levels], dtype=torch.float64)
    return values[index + 1]


def per_worker(curve: torch.Tensor, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-worker activation memory over one period: DP (every worker in step) and CDP (worker ``i``
    delayed by ``i/N`` of the period); ``curve`` samples ``m`` at a multiple of ``workers`` points."""
    points = curve.numel()
    if points % workers:
        raise ValueError(f"{points} samples cannot be shifted by 1/{workers} of the period")
    shift = points // workers
    cyclic = torch.stack([torch.roll(curve, i * shift) for i in range(workers)]).mean(0)
    return curve, cyclic


def measure_runs(size: str) -> dict[str, list[Measurement]]:
    """DP against CDP run by the runtime, per model: every setting and N of :data:`MEASURED`, on
    micro-batches of one image (two for the smoke size's batch norm on 1x1 maps)."""
    results: dict[str, list[Measurement]] = {}
    for name, (build, shape) in SIZES[size].items():
        microbatch = torch.randn(1 if size != "smoke" else 2, *shape[1:])
        classes = 1000 if size != "smoke" else 10
        rows = []
        for setting, counts in MEASURED[size].items():
            for workers in counts:
                split = plan_split(build, microbatch, workers)
                rows.append(measure(build, microbatch, classes, setting, workers, split))
        results[name] = rows
    return results


def measured_table(results: dict[str, list[Measurement]], command: str) -> str:
    lines = [
        f"`{command}`: peak activation memory per worker (saved tensors, MiB; one device: the device's over N),",
        "DP against CDP-v2 run by the runtime, the simulator's ratio (from the profile, and from the costs the",
        "runs measured) and the ideal beside it.",
        "",
        "| model | setting | N | DP peak | CDP peak | CDP/DP measured | simulated | simulated, run's costs "
        "| ideal (N+1)/2N | reduction | paper |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in results.items():
        paper = f"{PAPER[name]:.0f}%" if name in PAPER else "-"
        for row in rows:
            dp, cdp = row.measured["dp"] / 2**20, row.measured["cdp"] / 2**20
            measured = row.ratio("measured")
            lines.append(
                f"| {name} | {row.setting} | {row.workers} | {dp:.1f} | {cdp:.1f} | {measured:.3f} | "
                f"{row.ratio('predicted'):.3f} | {row.ratio('calibrated'):.3f} | {row.ideal:.3f} | "
                f"{100 * (1 - measured):.1f}% | {paper} |"
            )
    return "\n".join(lines) + "\n"


def extrapolate(size: str, points: int = 3200) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    for name, (build, shape) in SIZES[size].items():
        torch.manual_seed(0)
        model = build().train()
        batch = torch.randn(shape)
        memory_curve(model, batch)  # warm-up: allocator, lazy initialisation
        model.zero_grad(set_to_none=True)
        times, levels, period = memory_curve(model, batch)
        curve = sample(times, levels, period, points)
        rows = {}
        for workers in WORKERS:
            dp, cdp = per_worker(curve, workers)
            rows[workers] = (float(dp.max()), float(cdp.max()))
        results[name] = {"shape": shape, "period": period, "curve": curve, "rows": rows}
    return results


def table(results: dict[str, dict[str, object]], command: str) -> str:
    lines = [
        f"`{command}`: peak activation memory per worker (saved tensors, MiB), DP against CDP, extrapolated from",
        "one measured pass as the paper does.",
        "",
        "| model | input | N | DP peak | CDP peak | reduction | paper |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        shape = "x".join(map(str, result["shape"]))
        for workers, (dp, cdp) in result["rows"].items():
            paper = f"{PAPER[name]:.0f}%" if name in PAPER else "-"
            reduction = 100 * (1 - cdp / dp)
            lines.append(
                f"| {name} | {shape} | {workers} | {dp / 2**20:.1f} | {cdp / 2**20:.1f} | {reduction:.1f}% | {paper} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), squeeze=False)
    for axis, (name, result) in zip(axes[0], results.items(), strict=True):
        curve = result["curve"]
        phase = torch.linspace(0, 1, curve.numel() + 1)[:-1]
        axis.plot(phase, curve / 2**20, color="k", label="DP (any N)")
        for colour, workers in enumerate(WORKERS):
            _, cdp = per_worker(curve, workers)
            axis.plot(phase, cdp / 2**20, linestyle="--", color=f"C{colour}", label=f"CDP N={workers}")
        axis.axhline(float(curve.max()) / 2**21, color="0.6", linewidth=0.8, label="half of DP's peak")
        axis.set_title(name)
        axis.set_xlabel("time in the training step (fraction)")
        axis.set_ylabel("activation memory per worker (MiB)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = sized_parser(__doc__, SIZES)
    args = parser.parse_args(argv)
    output = output_directory(args, __file__)
    command = f"python recipes/cdp_memory/run.py --size {args.size}"
    runs = measure_runs(args.size)
    results = extrapolate(args.size)
    (output / "table.md").write_text(measured_table(runs, command) + "\n" + table(results, command))
    plot(results, output / "memory.png")
    print((output / "table.md").read_text())


if __name__ == "__main__":
    main()

"""Recipe 1 — CDP (Fournier & Oyallon 2024), Table 2: the test accuracy of the synchronous baseline
(``sync``: the data-parallel update), CDP-v1 and CDP-v2, over seeds, with mean and spread.

    python recipes/cdp_table2/run.py --size smoke     # 1 seed, 2 epochs on the digits (CI)
    python recipes/cdp_table2/run.py --size reduced   # 5 seeds x 20 epochs on the digits, 2 CPUs
    python recipes/cdp_table2/run.py --size full --experiment cdp_resnet18_cifar10 data.root=/data/cifar10

Each size runs one Hydra multirun of ``lightning-pipe-train`` over ``update_rule`` x ``seed`` (two or
more processes per run, spawned), then reads every run's ``results.json`` and writes into
``--output`` (default ``recipes/cdp_table2/results/<size>``): ``table.md`` (per rule: runs, mean and
standard deviation of the test accuracy, each seed's value, and the paper's figure where the
experiment is one of Table 2's) and ``accuracy.png`` (mean and each seed per rule).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

RULES = ("sync", "cdp_v1", "cdp_v2")
PAPER = {  # Table 2, top-1 %: (cdp_v1, cdp_v2, dp)
    "cdp_resnet18_cifar10": (94.1, 94.8, 94.7),
    "cdp_resnet50_cifar10": (94.0, 94.5, 94.5),
    "cdp_resnet18_imagenet": (69.9, 70.0, 70.1),
    "cdp_resnet50_imagenet": (75.8, 75.7, 75.4),
}
SIZES = {
    "smoke": {"experiment": "cdp_digits", "seeds": [0], "overrides": ["trainer.max_epochs=2"]},
    "reduced": {"experiment": "cdp_digits", "seeds": [0, 1, 2, 3, 4], "overrides": []},
    "full": {"experiment": "cdp_resnet18_cifar10", "seeds": [0, 1, 2], "overrides": []},
}


def sweep(experiment: str, seeds: list[int], overrides: list[str], directory: Path) -> None:
    """One multirun over the rules and seeds, its runs under ``directory``."""
    command = [
        sys.executable,
        "-m",
        "lightning_pipe.train",
        "-m",
        f"experiment={experiment}",
        f"update_rule={','.join(RULES)}",
        f"seed={','.join(map(str, seeds))}",
        f"hydra.sweep.dir={directory}",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def collect(directory: Path) -> dict[str, dict[int, float]]:
    """``{rule: {seed: test accuracy}}`` of the runs under ``directory``."""
    accuracies: dict[str, dict[int, float]] = {rule: {} for rule in RULES}
    for results in sorted(directory.glob("*/results.json")):
        config = yaml.safe_load((results.parent / ".hydra" / "config.yaml").read_text())
        rule = config["update_rule"]["name"]
        accuracies[rule][int(config["seed"])] = json.loads(results.read_text())["test"]["test_acc"]
    return accuracies


def table(experiment: str, accuracies: dict[str, dict[int, float]], command: str) -> str:
    paper = dict(zip(("cdp_v1", "cdp_v2", "sync"), PAPER.get(experiment, (None,) * 3), strict=True))
    lines = [
        f"`{command}` (experiment `{experiment}`): test accuracy (%) per update rule.",
        "",
        "| rule | runs | mean | std | per seed | paper (Table 2) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rule in RULES:
        values = [100 * accuracies[rule][seed] for seed in sorted(accuracies[rule])]
        if not values:
            continue
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        seeds = ", ".join(f"{v:.2f}" for v in values)
        reference = "-" if paper[rule] is None else f"{paper[rule]:.1f}"
        lines.append(
            f"| {rule} | {len(values)} | {statistics.fmean(values):.2f} | {spread:.2f} | {seeds} | {reference} |"
        )
    return "\n".join(lines) + "\n"


def plot(accuracies: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(4.5, 3.2))
    for position, rule in enumerate(RULES):
        values = [100 * v for v in accuracies[rule].values()]
        if values:
            axes.scatter([position] * len(values), values, color="0.5", s=14, zorder=2)
            axes.errorbar(position, statistics.fmean(values), fmt="o", color="C0", zorder=3)
    axes.set_xticks(range(len(RULES)), RULES)
    axes.set_ylabel("test accuracy (%)")
    axes.set_title("synchronous vs CDP-v1 vs CDP-v2")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="reduced")
    parser.add_argument("--experiment", help="a Hydra experiment (default: the size's)")
    parser.add_argument("--output", type=Path, help="where the table, the plot and the runs go")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. data.root=/data/cifar10")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    experiment = args.experiment or size["experiment"]
    output = args.output or Path(__file__).parent / "results" / args.size
    output.mkdir(parents=True, exist_ok=True)
    sweep(experiment, size["seeds"], [*size["overrides"], *args.overrides], output / "runs")
    accuracies = collect(output / "runs")
    command = "python recipes/cdp_table2/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (output / "table.md").write_text(table(experiment, accuracies, command.strip()))
    plot(accuracies, output / "accuracy.png")
    print((output / "table.md").read_text())


if __name__ == "__main__":
    main()

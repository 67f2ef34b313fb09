"""Comparing update rules over seeds: one Hydra multirun of ``lightning-pipe-train``, the test
accuracy of every run collected from its ``results.json``, a table of mean and spread per rule and a
plot. The recipes that reproduce the papers' accuracy claims (CDP's Table 2, PipeDream's rules
against synchronous training) are this comparison on their experiments."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

__all__ = ["accuracy_plot", "accuracy_table", "collect", "compare", "sweep"]


def sweep(experiment: str, rules: list[str], seeds: list[int], overrides: list[str], directory: Path) -> None:
    """Run ``experiment`` for every rule and seed (one multirun, its runs under ``directory``)."""
    command = [
        sys.executable,
        "-m",
        "lightning_pipe.train",
        "-m",
        f"experiment={experiment}",
        f"update_rule={','.join(rules)}",
        f"seed={','.join(map(str, seeds))}",
        f"hydra.sweep.dir={directory}",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def collect(directory: Path) -> dict[str, dict[int, float]]:
    """``{rule: {seed: test accuracy}}`` of the runs under ``directory``."""
    accuracies: dict[str, dict[int, float]] = {}
    for results in sorted(directory.glob("*/results.json")):
        config = yaml.safe_load((results.parent / ".hydra" / "config.yaml").read_text())
        rule = config["update_rule"]["name"] or config["schedule"]["family"]
        test = json.loads(results.read_text())["test"]
        accuracies.setdefault(rule, {})[int(config["seed"])] = test["test_acc"]
    return accuracies


def accuracy_table(accuracies: dict[str, dict[int, float]], heading: str, paper: dict[str, float] | None = None) -> str:
    """Per rule: runs, mean and standard deviation of the test accuracy (%), each seed's value, and
    the paper's figure when given."""
    paper = paper or {}
    lines = [heading, "", "| rule | runs | mean | std | per seed | paper |", "| --- | --- | --- | --- | --- | --- |"]
    for rule, by_seed in accuracies.items():
        values = [100 * by_seed[seed] for seed in sorted(by_seed)]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        seeds = ", ".join(f"{v:.2f}" for v in values)
        reference = f"{paper[rule]:.1f}" if rule in paper else "-"
        lines.append(
            f"| {rule} | {len(values)} | {statistics.fmean(values):.2f} | {spread:.2f} | {seeds} | {reference} |"
        )
    return "\n".join(lines) + "\n"


def accuracy_plot(accuracies: dict[str, dict[int, float]], path: Path, title: str) -> None:
    """Each seed's test accuracy (grey) and the mean (blue) per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(1.2 + 1.1 * len(accuracies), 3.2))
    for position, by_seed in enumerate(accuracies.values()):
        values = [100 * v for v in by_seed.values()]
        axes.scatter([position] * len(values), values, color="0.5", s=14, zorder=2)
        axes.scatter([position], [statistics.fmean(values)], color="C0", s=30, zorder=3)
    axes.set_xticks(range(len(accuracies)), list(accuracies))
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def compare(
    experiment: str,
    rules: tuple[str, ...],
    seeds: list[int],
    overrides: list[str],
    output: Path,
    table: str,
    heading: str,
    title: str,
    paper: dict[str, float] | None = None,
) -> str:
    """The comparison a recipe runs: :func:`sweep` into ``output/runs``, then the table (``output/table``,
    rules in the order given) and ``output/accuracy.png``; returns the table."""
    sweep(experiment, list(rules), seeds, overrides, output / "runs")
    found = collect(output / "runs")
    accuracies = {rule: found[rule] for rule in rules if rule in found}
    text = accuracy_table(accuracies, heading, paper)
    (output / table).write_text(text)
    accuracy_plot(accuracies, output / "accuracy.png", title)
    return text

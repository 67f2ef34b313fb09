"""The strategy started as users start Lightning: ``python train.py`` (Lightning re-runs the script
for the other processes) and a spawn-based start, with a registered name in ``Trainer(strategy=...)``,
profiling and planning on the first batch, and the end-of-fit report in the log directory."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.lightning_cases import Chain, loader, state, trainer

ROOT = Path(__file__).resolve().parent.parent


def _script(tmp_path: Path, strategy: str) -> tuple[str, Path]:
    run = subprocess.run(
        [sys.executable, "-m", "tests.strategy_script", str(tmp_path), strategy],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr, tmp_path / "lightning_logs" / "version_0"


def _plain(tmp_path: Path) -> dict[str, torch.Tensor]:
    model = Chain(blocks=4, width=32)
    trainer(tmp_path / "plain", "auto", 1, max_epochs=2).fit(model, loader(8), loader(2, seed=7))
    return state(model)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["pipe", "pipe_spawn"])
def test_launched_by_lightning(tmp_path: Path, strategy: str) -> None:
    """``Trainer(strategy="pipe", devices=2)`` (1F1B) in a plain script, with the script re-run or
    with spawned processes: the plan and prediction are printed, the trained model equals plain
    Lightning's, and the report (timeline picture, trace, pipeline metrics) is in the log directory."""
    output, logs = _script(tmp_path, strategy)
    assert "===== Partition (time) =====" in output and "Predicted schedule" in output
    assert "pipeline: measured" in output
    assert (logs / "pipeline_timeline.png").stat().st_size > 10_000
    assert '"traceEvents"' in (logs / "pipeline_trace.json").read_text()[:200]
    with open(logs / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert any(row.get("pipeline/step_ms_measured") for row in rows)
    assert any(row.get("pipeline/stage1_backward_ms") for row in rows)
    assert sum(1 for row in rows if row.get("train_loss_step")) == 16
    final = torch.load(tmp_path / "final.pt")
    expected = _plain(tmp_path)
    for name, value in expected.items():
        assert torch.allclose(final[name], value, atol=1e-5), name

"""The recipes end to end at their smoke size: the same sweep, collection, table and plot as the
committed results, on the digits for two epochs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_cdp_table2_smoke(tmp_path: Path) -> None:
    """Sync, CDP-v1 and CDP-v2 each train (multirun, 2 processes per run) and land in the table
    with an accuracy well above chance (10 classes), and the plot is drawn."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "cdp_table2" / "run.py"), "--size", "smoke", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| ")]
    by_rule = {row[1].strip(): row for row in rows[2:]}
    assert set(by_rule) == {"sync", "cdp_v1", "cdp_v2"}
    for row in by_rule.values():
        assert int(row[2]) == 1 and float(row[3]) > 50.0, row
    assert (tmp_path / "accuracy.png").stat().st_size > 0

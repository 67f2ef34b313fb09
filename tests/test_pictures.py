"""Pictures: timelines drawn at their real widths, memory curves, Chrome traces, the CLI's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe.cli import main
from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import Action, Kind, StageCosts, make_schedule, simulate
from lightning_pipe.schedule.draw import chrome_trace, draw_comparison, draw_memory, draw_timeline
from lightning_pipe.schedule.simulate import Interval

HAND = [
    Interval(0, Action(Kind.F, 0, 0, 0, 0), 0.0, 1.0),
    Interval(1, Action(Kind.F, 1, 0, 0, 0), 1.0, 2.0),
    Interval(1, Action(Kind.B, 1, 0, 0, 0), 2.0, 4.0),
    Interval(0, Action(Kind.B, 0, 0, 0, 0), 4.0, 6.0),
    Interval(0, Action(Kind.UPDATE, 0, None, 0), 6.0, 6.0),
]


def _extents(figure) -> list[tuple[float, float]]:
    """(x, width) of every drawn box."""
    boxes = []
    for collection in figure.axes[0].collections:
        for path in collection.get_paths():
            xs = path.vertices[:, 0]
            if xs.max() > xs.min():
                boxes.append((float(xs.min()), float(xs.max() - xs.min())))
    return sorted(boxes)


def test_box_widths_are_durations(tmp_path: Path) -> None:
    figure = draw_timeline(HAND, tmp_path / "hand.png")
    assert _extents(figure) == [(0.0, 1.0), (1.0, 1.0), (2.0, 2.0), (4.0, 2.0)]
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["worker 0", "worker 1"]
    assert (tmp_path / "hand.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    draw_timeline(HAND, tmp_path / "hand.svg")
    assert "<svg" in (tmp_path / "hand.svg").read_text()


def test_chrome_trace_events(tmp_path: Path) -> None:
    trace = chrome_trace(HAND, tmp_path / "trace.json", time_unit_seconds=1e-3)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in events[:4]] == [
        (0, 0.0, 1000.0),
        (1, 1000.0, 1000.0),
        (1, 2000.0, 2000.0),
        (0, 4000.0, 2000.0),
    ]
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {"worker 0", "worker 1"}


def test_comparison_shares_the_time_axis(tmp_path: Path) -> None:
    slower = [Interval(i.worker, i.action, i.start * 1.5, i.end * 1.5) for i in HAND]
    figure = draw_comparison([("predicted", HAND), ("measured", slower)], tmp_path / "both.png")
    assert len(figure.axes) == 2
    assert figure.axes[0].get_xlim() == figure.axes[1].get_xlim() == (0.0, 9.0)


def test_memory_curves(tmp_path: Path) -> None:
    sim = simulate(make_schedule("1f1b", 4, 8), StageCosts.uniform(4, saved_bytes=[2**20] * 4))
    figure = draw_memory(sim.memory_timeline, tmp_path / "memory.png")
    assert figure.axes[0].get_ylabel() == "memory (MiB)"
    assert len(figure.axes[0].lines) == 4


def test_bad_inputs_are_explained(tmp_path: Path) -> None:
    with pytest.raises(PlanningError, match=r"use one of the suffixes \.png, \.svg"):
        draw_timeline(HAND, tmp_path / "x.jpg")
    with pytest.raises(PlanningError, match="nothing to draw"):
        draw_timeline([])
    with pytest.raises(PlanningError, match="nothing to draw"):
        draw_memory([[], []])


def test_large_timelines_draw_without_labels(tmp_path: Path) -> None:
    sim = simulate(make_schedule("1f1b", 16, 256), StageCosts.uniform(16))
    figure = draw_timeline(sim.timeline, tmp_path / "big.png")
    assert not figure.axes[0].texts


def test_simulate_cli_writes_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, memory, trace, saved = (tmp_path / n for n in ("t.png", "m.svg", "trace.json", "schedule.json"))
    argv = ["simulate", "--schedule", "zb_h1", "--stages", "4", "--microbatches", "6", "--json"]
    argv += ["--plot", str(plot), "--memory-plot", str(memory), "--trace", str(trace), "--save-schedule", str(saved)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("makespan", "throughput", "bubble_fraction", "peak_activations", "weight_versions"):
        assert key in result
    assert result["peak_activations"]["count"] == [4, 3, 2, 1]
    assert plot.stat().st_size > 0 and memory.stat().st_size > 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert json.loads(saved.read_text())["family"] == "zb_h1"

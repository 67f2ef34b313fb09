"""Timeline and memory pictures, and the Chrome trace, from hand-made and simulated intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.draw import chrome_trace, draw_comparison, draw_memory, draw_timeline
from lightning_pipe.schedule.ir import Action, Kind
from lightning_pipe.schedule.pipeline import interleaved, one_f_one_b
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.simulation import Interval
from lightning_pipe.schedule.stage_costs import StageCosts
from lightning_pipe.schedule.versions import assign_versions

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def interval(worker: int, kind: Kind, stage: int, mb: int | None, start: float, end: float, step: int = 0) -> Interval:
    return Interval(worker, Action(kind, stage, mb, step, None if mb is None else 0), start, end)


def two_workers() -> list[Interval]:
    """Two stages, two micro-batches, F = 1, B = 2, updates of zero length, one zero-length transfer."""
    return [
        interval(0, Kind.F, 0, 0, 0.0, 1.0),
        interval(0, Kind.F, 0, 1, 1.0, 2.0),
        interval(0, Kind.SEND_F, 0, 1, 2.0, 2.0),
        interval(1, Kind.F, 1, 0, 1.0, 2.0),
        interval(1, Kind.B, 1, 0, 2.0, 4.0),
        interval(1, Kind.F, 1, 1, 4.0, 5.0),
        interval(1, Kind.B, 1, 1, 5.0, 7.0),
        interval(0, Kind.B, 0, 0, 4.0, 6.0),
        interval(0, Kind.B, 0, 1, 7.0, 9.0),
        interval(0, Kind.UPDATE, 0, None, 9.0, 9.0),
        interval(1, Kind.UPDATE, 1, None, 7.0, 7.0),
    ]


def box_extents(ax) -> dict[int, list[tuple[float, float]]]:
    """Per row (worker), the sorted x extents of the drawn rectangles."""
    rows: dict[int, list[tuple[float, float]]] = {}
    for collection in ax.collections:
        if not isinstance(collection, PolyCollection):
            continue
        for path in collection.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            rows.setdefault(round(float(ys.mean())), []).append((float(xs.min()), float(xs.max())))
    return {row: sorted(extents) for row, extents in rows.items()}


@pytest.fixture(scope="module")
def small_sim():
    schedule = assign_versions(one_f_one_b(4, 8, steps=2), "sync")
    return simulate(schedule, StageCosts.uniform(4, 1.0, 2.0, saved_bytes=[1e6] * 4))


def test_png_and_svg_are_written(tmp_path: Path, small_sim) -> None:
    draw_timeline(small_sim.timeline, tmp_path / "t.png", title="1F1B")
    draw_timeline(small_sim.timeline, tmp_path / "t.svg")
    draw_memory(small_sim.memory_timeline, tmp_path / "m.png")
    draw_memory(small_sim.memory_timeline, tmp_path / "m.svg")
    for name in ("t.png", "m.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_SIGNATURE)
    for name in ("t.svg", "m.svg"):
        assert "<svg" in (tmp_path / name).read_text()


def test_one_row_per_worker_with_worker_zero_on_top(small_sim) -> None:
    ax = draw_timeline(small_sim.timeline, workers=6).axes[0]
    assert list(ax.get_yticks()) == list(range(6))
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"worker {w}" for w in range(6)]
    bottom, top = ax.get_ylim()
    assert bottom > top  # inverted: worker 0 at the top
    assert ax.get_xlabel() == "time"


def test_box_widths_are_durations() -> None:
    intervals = two_workers()
    ax = draw_timeline(intervals).axes[0]
    drawn = box_extents(ax)
    for worker in (0, 1):
        expected = sorted(
            (i.start, i.end) for i in intervals if i.worker == worker and i.action.kind in (Kind.F, Kind.B)
        )
        assert drawn[worker] == expected
    assert ax.get_xlim() == (0.0, 9.0)


def test_zero_length_updates_are_bars_and_labels_name_the_box() -> None:
    ax = draw_timeline(two_workers()).axes[0]
    segments = [s for c in ax.collections if not isinstance(c, PolyCollection) for s in c.get_segments()]
    assert sorted(float(s[0][0]) for s in segments) == [7.0, 9.0]
    labels = {t.get_text() for t in ax.texts}
    assert {"F0", "F1", "B0", "B1"} <= labels


def test_labels_show_the_stage_when_a_worker_holds_several() -> None:
    schedule = assign_versions(interleaved(4, 4, virtual_stages=2), "sync")
    sim = simulate(schedule, StageCosts.uniform(4, 1.0, 2.0))
    texts = [t.get_text() for t in draw_timeline(sim.timeline).axes[0].texts]
    assert any(text.startswith("B") for text in texts)
    assert all("s" in text for text in texts if text.startswith("B"))


def test_chrome_trace(tmp_path: Path) -> None:
    intervals = two_workers()
    trace = chrome_trace(intervals, tmp_path / "trace.json", time_unit_seconds=1e-3, name="run")
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    drawn = [i for i in intervals if i.action.kind is not Kind.SEND_F]
    assert len(events) == len(drawn)
    for event, item in zip(events, drawn, strict=True):
        assert event["tid"] == item.worker
        assert event["pid"] == 0
        assert event["ts"] == pytest.approx(item.start * 1000.0)
        assert event["dur"] == pytest.approx((item.end - item.start) * 1000.0)
        assert event["args"]["stage"] == item.action.stage
        assert event["args"]["microbatch"] == item.action.microbatch
        assert event["args"]["step"] == item.action.step
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "worker 0", 1: "worker 1"}
    assert json.loads((tmp_path / "trace.json").read_text()) == trace


def test_chrome_trace_unit_seconds() -> None:
    event = next(e for e in chrome_trace(two_workers())["traceEvents"] if e["ph"] == "X" and e["name"] == "B0")
    assert (event["ts"], event["dur"]) == (2e6, 2e6)
    with pytest.raises(PlanningError, match="time_unit_seconds"):
        chrome_trace(two_workers(), time_unit_seconds=0)


def test_comparison_shares_the_time_axis(tmp_path: Path, small_sim) -> None:
    slow = simulate(small_sim.schedule, StageCosts.uniform(4, 1.5, 3.0, update=[0.5] * 4))
    figure = draw_comparison(
        [("predicted", small_sim.timeline), ("measured", slow.timeline)], tmp_path / "c.png", title="vs"
    )
    axes = figure.axes
    assert len(axes) == 2
    assert axes[0].get_xlim() == axes[1].get_xlim() == (0.0, slow.makespan)
    assert [ax.get_title(loc="left") for ax in axes] == ["predicted", "measured"]
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_SIGNATURE)


def test_memory_axis_uses_human_units(small_sim) -> None:
    ax = draw_memory(small_sim.memory_timeline).axes[0]
    assert ax.get_ylabel() == "memory (MiB)"
    assert len(ax.lines) == 4
    assert max(max(line.get_ydata()) for line in ax.lines) == pytest.approx(4e6 / 2**20)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"worker {w}" for w in range(4)]


@pytest.mark.parametrize("suffix", [".pdf", ".jpg", ""])
def test_unsupported_suffix(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(PlanningError, match=r"\.png, \.svg"):
        draw_timeline(two_workers(), tmp_path / f"t{suffix}")
    assert not list(tmp_path.iterdir())


def test_empty_inputs_are_refused() -> None:
    with pytest.raises(PlanningError, match="nothing to draw: the timeline has no intervals"):
        draw_timeline([])
    with pytest.raises(PlanningError, match="nothing to draw"):
        draw_comparison([])
    with pytest.raises(PlanningError, match="nothing to draw"):
        draw_memory([[], []])


def test_too_few_workers_and_malformed_intervals() -> None:
    with pytest.raises(PlanningError, match="workers=1 is too few"):
        draw_timeline(two_workers(), workers=1)
    with pytest.raises(PlanningError, match="end >= start"):
        draw_timeline([interval(0, Kind.F, 0, 0, 2.0, 1.0)])


def test_large_timeline_is_grouped_and_unlabelled(tmp_path: Path) -> None:
    schedule = assign_versions(one_f_one_b(16, 256), "sync")
    sim = simulate(schedule, StageCosts.uniform(16, 1.0, 2.0))
    figure = draw_timeline(sim.timeline, tmp_path / "big.png")
    ax = figure.axes[0]
    assert not ax.texts
    assert len(ax.collections) < 16 * 30  # grouped per (worker, colour), not one artist per box
    assert all(c.get_linewidth().max() == 0 for c in ax.collections if isinstance(c, PolyCollection))
    assert 6.0 <= figure.get_figwidth() <= 24.0


@pytest.mark.parametrize("panels", [1, 3])
@pytest.mark.parametrize("stages", [1, 4, 12])
@pytest.mark.parametrize("title", ["", "1f1b: last 3 steps"])
def test_comparison_panels_keep_their_names_titles_and_key_inside_the_figure(
    panels: int, stages: int, title: str
) -> None:
    """The comparison's fixed margins (no layout engine: one draw less at every fit's end): the
    workers' names, the figure's and each panel's title and the key lie inside the figure, and no
    panel's title runs into the panel above."""
    sim = simulate(assign_versions(one_f_one_b(stages, 4, steps=2), "sync"), StageCosts.uniform(stages, 1.0, 2.0))
    figure = draw_comparison([(f"panel {i}", sim.timeline) for i in range(panels)], title=title)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    inside = figure.bbox
    texts = [label for ax in figure.axes for label in ax.get_yticklabels()]
    texts += [ax._left_title for ax in figure.axes]  # each panel's name, on the left
    texts += [figure.axes[0].get_legend()] + ([figure._suptitle] if title else [])
    for text in texts:
        box = text.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, text
    for upper, lower in zip(figure.axes, figure.axes[1:], strict=False):
        assert lower._left_title.get_window_extent(renderer).y1 < upper.get_window_extent(renderer).y0
    boxes = [text.get_window_extent(renderer) for text in texts]
    slack = 0.3 * figure.dpi  # and no room wasted: the names and the top line come within 0.3 inch of the edges
    assert min(box.x0 for box in boxes) - inside.x0 < slack and inside.y1 - max(box.y1 for box in boxes) < slack

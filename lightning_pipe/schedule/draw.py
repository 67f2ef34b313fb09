"""Pictures of pipeline timelines: who computes what, when, and how much memory it holds.

The timeline picture follows the pipeline diagrams of the papers (Huang et al.'s GPipe figure,
Narayanan et al.'s PipeDream and Megatron-LM figures, Beaumont et al. Fig. 2, Rahimi's diagrams): one
row per worker, worker 0 at the top, time running to the right, one box per action coloured by its
micro-batch, forwards lighter than backwards, the weight-gradient half of a split backward darker, an
optimizer ``UPDATE`` as a thin dark bar, idle time blank. Unlike the unit-width grids of those figures
(and of torch.distributed.pipelining's visualizer), every box is as wide as the action really took,
simulated or measured, so bubbles and stragglers show at their true size.

Every function takes plain data (a sequence of :class:`~lightning_pipe.schedule.simulation.Interval`,
memory curves as ``(time, bytes)`` points) rather than a simulation, so the same code draws the
timelines the runtime measures and lays predicted and measured runs side by side
(:func:`draw_comparison`). :func:`chrome_trace` writes the same intervals as a Chrome/Perfetto trace.

Boxes are drawn with one ``broken_barh`` per worker and colour, not one patch per action; past
:data:`DETAIL_LIMIT` boxes (64 workers x 1024 micro-batches is 131k) labels and edges are dropped and
the boxes rasterized even in SVG, so such a picture still renders in seconds. Figures are built with
:class:`matplotlib.figure.Figure` directly, leaving pyplot and any GUI alone; they are saved as PNG or
SVG according to the path's suffix.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind
from lightning_pipe.schedule.simulation import Interval

__all__ = ["chrome_trace", "draw_comparison", "draw_memory", "draw_timeline"]

SUFFIXES = (".png", ".svg")
TRANSFERS = frozenset(Kind) - COMPUTE - {Kind.UPDATE}
PALETTE = matplotlib.colormaps["tab10"].colors
DETAIL_LIMIT = 2048
"""Above this many boxes the timeline is drawn without labels and box edges, rasterized."""
ROW = 0.8
"""Height of a box, in rows."""
UPDATE_COLOUR = (0.15, 0.15, 0.15)
TRANSFER_COLOUR = (0.75, 0.75, 0.75)
ODD_STEP_HATCH = "///"
MIN_FONT, MAX_FONT = 4.0, 8.0
"""Sizes of a box's label, in points."""
NAME_FONT = 9.0
"""The largest size of a worker's name on the left, in points."""
CHAR_WIDTH = 0.62
"""A character's width, as a fraction of its font size (to tell whether a text fits before drawing)."""
UNITS = ("B", "KiB", "MiB", "GiB")

Group = tuple[Kind, int, int]
"""``(kind, colour index, step parity)``: the boxes drawn with one ``broken_barh`` call."""


# -- shared helpers -----------------------------------------------------------------------------
def _output(path: str | Path | None) -> Path | None:
    """The path to save to, checked before any drawing."""
    if path is None:
        return None
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise PlanningError(f"cannot save a picture as {path.name!r}: use one of the suffixes {', '.join(SUFFIXES)}")
    return path


def _save(figure: Figure, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format=path.suffix.lower()[1:])


def _boxes(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals to draw: all but zero-length transfers; rejects malformed ones."""
    boxes = []
    for interval in intervals:
        if interval.worker < 0 or not interval.end >= interval.start:
            raise PlanningError(f"malformed interval {interval!r}: needs worker >= 0 and end >= start")
        if interval.action.kind not in TRANSFERS or interval.end > interval.start:
            boxes.append(interval)
    return boxes


def _span(boxes: Sequence[Interval]) -> tuple[float, float]:
    start = min(b.start for b in boxes)
    end = max(b.end for b in boxes)
    return start, end if end > start else start + 1.0


def _mix(colour: Sequence[float], other: float, amount: float) -> tuple[float, float, float]:
    """``colour`` moved ``amount`` of the way towards grey level ``other`` (1 white, 0 black)."""
    return tuple(c + (other - c) * amount for c in colour)


def _group(interval: Interval) -> Group:
    action = interval.action
    return action.kind, (action.microbatch or 0) % len(PALETTE), action.step % 2


def _colour(group: Group) -> tuple[float, float, float]:
    kind, index, _ = group
    if kind is Kind.UPDATE:
        return UPDATE_COLOUR
    if kind in TRANSFERS:
        return TRANSFER_COLOUR
    base = to_rgb(PALETTE[index])
    return {Kind.F: _mix(base, 1.0, 0.55), Kind.W: _mix(base, 0.0, 0.35)}.get(kind, base)


def _dark(colour: Sequence[float]) -> bool:
    return 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2] < 0.5


# -- timeline -----------------------------------------------------------------------------------
def _rows(boxes: Sequence[Interval], workers: int | None) -> int:
    needed = 1 + max(b.worker for b in boxes)
    if workers is None:
        return needed
    if workers < needed:
        raise PlanningError(f"workers={workers} is too few: the timeline has intervals of worker {needed - 1}")
    return workers


def _timeline_size(boxes: Sequence[Interval], workers: int) -> tuple[float, float]:
    """Inches: wide enough that a short box holds a short label (6..24), 0.4 inch a worker (2..16)."""
    start, end = _span(boxes)
    durations = [b.end - b.start for b in boxes if b.action.kind in COMPUTE and b.end > b.start]
    short = float(np.percentile(durations, 10)) if durations else end - start
    width = 1.5 + (end - start) / short * 22 / 72
    return min(max(width, 6.0), 24.0), min(max(1.0 + 0.4 * workers, 2.0), 16.0)


def _axes_points(ax: Axes) -> tuple[float, float]:
    """Approximate width and height of the axes in points (before layout)."""
    figure = ax.get_figure(root=True)
    box = ax.get_position()
    return box.width * figure.get_figwidth() * 72, box.height * figure.get_figheight() * 72


def _draw_boxes(ax: Axes, boxes: Sequence[Interval], detail: bool) -> None:
    """One ``broken_barh`` per (worker, colour group); zero-length updates as vertical bars."""
    bars: dict[tuple[int, Group], list[tuple[float, float]]] = defaultdict(list)
    instants: list[Interval] = []
    for box in boxes:
        if box.end > box.start:
            bars[(box.worker, _group(box))].append((box.start, box.end - box.start))
        else:
            instants.append(box)
    edges = {"edgecolor": "black", "linewidth": 0.4} if detail else {"edgecolor": "none", "linewidth": 0.0}
    for (worker, group), ranges in bars.items():
        hatch = {"hatch": ODD_STEP_HATCH, "hatchcolor": (0, 0, 0, 0.45)} if group[2] else {}
        ax.broken_barh(
            ranges, (worker - ROW / 2, ROW), facecolors=_colour(group), rasterized=not detail, **edges, **hatch
        )
    if instants:
        xs = [b.start for b in instants]
        ax.vlines(
            xs,
            [b.worker - ROW / 2 for b in instants],
            [b.worker + ROW / 2 for b in instants],
            colors=[UPDATE_COLOUR],
            linewidth=1.5,
        )


def _short(action: Action) -> str:
    """Kind and micro-batch, e.g. ``F3`` (just the kind for updates and fetches)."""
    return action.kind.value + ("" if action.microbatch is None else str(action.microbatch))


def _labels(action: Action, several_stages: bool) -> list[str]:
    """Labels to try, longest first: ``F3·s5``, ``F3`` over ``s5``, ``F3`` (the stage only when it varies)."""
    short = _short(action)
    if not several_stages:
        return [short]
    return [f"{short}·s{action.stage}", f"{short}\ns{action.stage}", short]


def _fits(text: str, font: float, width_pt: float, height_pt: float) -> bool:
    lines = text.split("\n")
    return CHAR_WIDTH * font * max(map(len, lines)) <= width_pt - 3 and 1.2 * font * len(lines) <= height_pt - 2


def _draw_labels(ax: Axes, boxes: Sequence[Interval], workers: int, span: tuple[float, float]) -> None:
    """A label inside every compute box one fits in (see :func:`_labels`)."""
    width_pt, height_pt = _axes_points(ax)
    box_height = height_pt / workers * ROW
    font = min(MAX_FONT, 0.55 * box_height)
    if font < MIN_FONT:
        return
    stages: dict[int, set[int]] = defaultdict(set)
    for box in boxes:
        if box.action.kind in COMPUTE:
            stages[box.worker].add(box.action.stage)
    per_unit = width_pt / (span[1] - span[0])
    for box in boxes:
        if box.action.kind not in COMPUTE:
            continue
        box_width = (box.end - box.start) * per_unit
        candidates = _labels(box.action, len(stages[box.worker]) > 1)
        text = next((t for t in candidates if _fits(t, font, box_width, box_height)), None)
        if text is not None:
            colour = "white" if _dark(_colour(_group(box))) else "black"
            ax.text(
                (box.start + box.end) / 2,
                box.worker,
                text,
                ha="center",
                va="center",
                fontsize=font,
                color=colour,
                linespacing=1.0,
                clip_on=True,
            )


def _legend(ax: Axes, boxes: Sequence[Interval]) -> None:
    """Key to kinds (in grey, as colour stands for the micro-batch) and to the odd-step hatch."""
    present = {b.action.kind for b in boxes}
    grey = (0.55, 0.55, 0.55)
    shades = {Kind.F: _mix(grey, 1.0, 0.55), Kind.B: grey, Kind.I: grey, Kind.W: _mix(grey, 0.0, 0.35)}
    names = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad", Kind.W: "weight grad"}
    handles = [
        Patch(facecolor=shades[k], edgecolor="black", linewidth=0.4, label=names[k]) for k in names if k in present
    ]
    if Kind.UPDATE in present:
        handles.append(Patch(facecolor=UPDATE_COLOUR, label="update"))
    if present & TRANSFERS:
        handles.append(Patch(facecolor=TRANSFER_COLOUR, label="transfer"))
    if any(b.action.step % 2 for b in boxes):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=ODD_STEP_HATCH, label="odd step"))
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
        handlelength=1.5,
    )


def _style(ax: Axes, workers: int, span: tuple[float, float], title: str) -> None:
    ax.set_xlim(*span)
    ax.set_ylim(workers - 0.5, -0.5)
    ax.set_yticks(range(workers), [f"worker {w}" for w in range(workers)])
    height_pt = _axes_points(ax)[1]
    ax.tick_params(axis="y", length=0, labelsize=min(NAME_FONT, max(3.0, 0.75 * height_pt / workers)))
    ax.set_xlabel("time")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title, loc="left", fontsize=10)


def _plot_timeline(
    ax: Axes, boxes: Sequence[Interval], workers: int, span: tuple[float, float], title: str, legend: bool
) -> None:
    detail = len(boxes) <= DETAIL_LIMIT
    _style(ax, workers, span, title)
    _draw_boxes(ax, boxes, detail)
    if detail:
        _draw_labels(ax, boxes, workers, span)
    if legend:
        _legend(ax, boxes)


def _nonempty(intervals: Sequence[Interval], what: str) -> list[Interval]:
    boxes = _boxes(intervals)
    if not boxes:
        raise PlanningError(
            f"nothing to draw: {what} has no intervals (zero-length transfers are not drawn); "
            "pass Simulation.timeline or the runtime's measured intervals"
        )
    return boxes


def draw_timeline(
    intervals: Sequence[Interval],
    path: str | Path | None = None,
    *,
    title: str = "",
    workers: int | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw one row per worker and one box per action, as wide as the action took.

    Args:
        intervals: executed actions (``Simulation.timeline`` or measured ones); times are used as given.
        path: save there when given (``.png`` or ``.svg``).
        title: shown above the rows.
        workers: rows to draw (default: up to the highest worker in ``intervals``).
        ax: draw into these axes instead of a new figure.

    Returns:
        The figure drawn into.
    """
    output = _output(path)
    boxes = _nonempty(intervals, "the timeline")
    rows = _rows(boxes, workers)
    if ax is None:
        ax = Figure(figsize=_timeline_size(boxes, rows), layout="constrained").add_subplot()
    _plot_timeline(ax, boxes, rows, _span(boxes), title, legend=True)
    figure = ax.get_figure(root=True)
    _save(figure, output)
    return figure


def _panel_margins(size: tuple[float, float], panels: int, workers: int, title: bool) -> dict[str, float]:
    """Where ``panels`` stacked timelines sit in a figure of ``size`` inches, as figure fractions: room
    for the workers' names on the left, the figure's title and the first panel's title and key on
    top, each panel's title between panels, the time axis below. Fixed margins, where a layout
    engine would draw the whole figure once more to measure them: the end-of-fit report draws one
    at every fit."""
    width, height = size
    names = (CHAR_WIDTH * NAME_FONT * len(f"worker {workers - 1}") + 12.0) / 72  # the longest name, inches
    top = 0.3 + (0.35 if title else 0.0)
    bottom, gap = 0.5, 0.3
    axes_height = max((height - top - bottom - gap * (panels - 1)) / panels, 0.3)
    return {
        "left": min(names / width, 0.3),
        "right": 1 - 0.15 / width,
        "top": 1 - top / height,
        "bottom": bottom / height,
        "hspace": gap / axes_height,
    }


def draw_comparison(
    panels: Sequence[tuple[str, Sequence[Interval]]], path: str | Path | None = None, *, title: str = ""
) -> Figure:
    """Stack timelines (e.g. ``[("predicted", sim.timeline), ("measured", measured)]``) on one time axis.

    Every panel gets as many rows as the largest one, so worker ``w`` sits at the same height in each.
    """
    output = _output(path)
    if not panels:
        raise PlanningError("nothing to draw: draw_comparison needs at least one (name, intervals) panel")
    named = [(name, _nonempty(intervals, f"panel {name!r}")) for name, intervals in panels]
    rows = max(_rows(boxes, None) for _, boxes in named)
    every = [b for _, boxes in named for b in boxes]
    span = _span(every)
    width, height = _timeline_size(every, rows)
    size = (width, min(height * len(named), 24.0))
    figure = Figure(figsize=size)
    grid = _panel_margins(size, len(named), rows, bool(title))
    axes = figure.subplots(len(named), 1, sharex=True, squeeze=False, gridspec_kw=grid)[:, 0]
    for index, (ax, (name, boxes)) in enumerate(zip(axes, named, strict=True)):
        _plot_timeline(ax, boxes, rows, span, name, legend=index == 0)
        if index < len(named) - 1:
            ax.set_xlabel("")
    if title:
        figure.suptitle(title, y=1 - 0.1 / size[1])  # 0.1 inch from the top, whatever the figure's height
    _save(figure, output)
    return figure


# -- memory -------------------------------------------------------------------------------------
def _unit(peak: float) -> tuple[str, float]:
    """The largest binary unit the peak reaches (at least bytes)."""
    power = 0 if peak < 1 else min(int(math.log(peak, 1024)), len(UNITS) - 1)
    return UNITS[power], 1024.0**power


def _steps(curve: Sequence[tuple[float, float]], scale: float) -> tuple[list[float], list[float]]:
    """Times and scaled values of a step curve, the last value kept where several share a time."""
    last: dict[float, float] = {}
    for time, nbytes in curve:
        last[time] = nbytes / scale
    times = sorted(last)
    return times, [last[t] for t in times]


def draw_memory(
    curves: Sequence[Sequence[tuple[float, float]]],
    path: str | Path | None = None,
    *,
    title: str = "",
    ax: Axes | None = None,
) -> Figure:
    """Step plot of the bytes each worker holds over time (``Simulation.memory_timeline`` or measured).

    Args:
        curves: per worker, ``(time, bytes)`` points; the value holds until the next point.
        path: save there when given (``.png`` or ``.svg``).
        title: shown above the plot.
        ax: draw into these axes instead of a new figure.
    """
    output = _output(path)
    if not any(curves):
        raise PlanningError("nothing to draw: the memory curves hold no (time, bytes) points")
    peak = max(nbytes for curve in curves for _, nbytes in curve)
    unit, scale = _unit(peak)
    if ax is None:
        ax = Figure(figsize=(8.0, 3.5), layout="constrained").add_subplot()
    colours = matplotlib.colormaps["tab10" if len(curves) <= 10 else "viridis"]
    for worker, curve in enumerate(curves):
        times, values = _steps(curve, scale)
        colour = colours(worker if len(curves) <= 10 else worker / max(1, len(curves) - 1))
        ax.step(times, values, where="post", color=colour, linewidth=1.2, label=f"worker {worker}")
    ax.set_xlabel("time")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(linewidth=0.3, alpha=0.5)
    if len(curves) <= 16:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 8 else 1, loc="upper right")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    figure = ax.get_figure(root=True)
    _save(figure, output)
    return figure


# -- Chrome / Perfetto trace --------------------------------------------------------------------
def chrome_trace(
    intervals: Sequence[Interval],
    path: str | Path | None = None,
    *,
    time_unit_seconds: float = 1.0,
    name: str = "lightning_pipe",
) -> dict:
    """The intervals as Chrome trace-event JSON (open in ``chrome://tracing`` or ui.perfetto.dev).

    One complete (``"X"``) event per drawn action on process 0, thread = worker, ``ts``/``dur`` in
    microseconds (times times ``time_unit_seconds`` times 1e6), plus ``thread_name`` metadata
    ``"worker N"``; a measured action that waited for messages carries ``args.waited_us``. Written as
    JSON to ``path`` when given.
    """
    if not (math.isfinite(time_unit_seconds) and time_unit_seconds > 0):
        raise PlanningError(f"time_unit_seconds must be a finite number > 0, got {time_unit_seconds!r}")
    scale = time_unit_seconds * 1e6
    boxes = _boxes(intervals)
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for worker in sorted({b.worker for b in boxes}):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": worker, "args": {"name": f"worker {worker}"}})
    for box in boxes:
        action = box.action
        args = {"stage": action.stage, "microbatch": action.microbatch, "step": action.step, "version": action.version}
        if action.peer is not None:
            args["peer"] = action.peer
        if box.waited > 0:
            args["waited_us"] = box.waited * scale
        events.append(
            {
                "name": _short(action),
                "cat": action.kind.value,
                "ph": "X",
                "pid": 0,
                "tid": box.worker,
                "ts": box.start * scale,
                "dur": (box.end - box.start) * scale,
                "args": args,
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(trace))
    return trace

"""The end-of-fit report: what the pipeline did against what was predicted.

At the end of ``fit`` the strategy puts beside each other, for the last steps of the run:

- the *measured* timeline (every worker's actions with their waits for messages),
- the timeline *predicted* at set-up from the layer profile (when the model was profiled), and
- the timeline the simulator gives with the *in-run* costs (each stage's mean compute as the pipeline
  ran it, waits excluded: :meth:`~lightning_pipe.runtime.PipelineExecutor.measured_costs`),

drawn on one time axis (``pipeline_timeline.png``) and as a Chrome/Perfetto trace
(``pipeline_trace.json``), and logs per-stage compute, per-worker waits and the measured and predicted
step times through the trainer's loggers. The two files go to the logger's log directory; without a
logger (or one with no directory), to a directory of the run's own, ``<default_root_dir>/pipeline_logs/
version_<N>`` (:func:`run_directory`), so that no run writes over another's, nor into the working
directory.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from lightning_pipe.schedule import StageCosts, simulate
from lightning_pipe.schedule.draw import chrome_trace, draw_comparison
from lightning_pipe.schedule.ir import Schedule
from lightning_pipe.schedule.simulation import Interval, Simulation

__all__ = ["LOGS", "STEPS_SHOWN", "FitReport", "last_steps", "run_directory"]

STEPS_SHOWN = 3
LOGS = "pipeline_logs"
"""The folder under ``default_root_dir`` that holds the runs' report directories when there is no logger."""


def run_directory(root: Path) -> Path:
    """A new directory ``root/pipeline_logs/version_<N>``, made here. As Lightning's loggers number
    their runs (``lightning_logs/version_<N>``), N is one more than the largest version there (0 for
    the first); a version another run makes in the meantime is skipped, so two runs never share one."""
    parent = root / LOGS
    parent.mkdir(parents=True, exist_ok=True)
    found = (name.removeprefix("version_") for name in (p.name for p in parent.iterdir() if p.is_dir()))
    version = max((int(n) for n in found if n.isdigit()), default=-1) + 1
    while True:
        directory = parent / f"version_{version}"
        try:
            directory.mkdir()
        except FileExistsError:
            version += 1
        else:
            return directory


def last_steps(intervals: Sequence[Interval], steps: int = STEPS_SHOWN) -> list[Interval]:
    """The intervals of the last ``steps`` steps, shifted to start at 0."""
    chosen = sorted({i.action.step for i in intervals})[-steps:]
    kept = [i for i in intervals if i.action.step in chosen]
    if not kept:
        return []
    origin = min(i.start for i in kept)
    return [replace(i, start=i.start - origin, end=i.end - origin) for i in kept]


@dataclass
class FitReport:
    """What :meth:`write` reports (built on global rank 0 from every worker's timeline)."""

    measured: list[Interval]
    step_seconds: list[float]
    in_run: StageCosts
    schedule: Schedule
    predicted: Simulation | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        replay = simulate(self.schedule, self.in_run, early_gradients=True)
        self.in_run_prediction = replay
        waits: dict[int, float] = {}
        busy: dict[int, float] = {}
        for interval in self.measured:
            waits[interval.worker] = waits.get(interval.worker, 0.0) + interval.waited
            busy[interval.worker] = busy.get(interval.worker, 0.0) + interval.end - interval.start
        for stage in range(self.in_run.stages):
            self.metrics[f"pipeline/stage{stage}_forward_ms"] = 1e3 * self.in_run.forward[stage]
            self.metrics[f"pipeline/stage{stage}_backward_ms"] = 1e3 * self.in_run.backward[stage]
        for worker in sorted(busy):
            self.metrics[f"pipeline/worker{worker}_wait_fraction"] = waits[worker] / busy[worker] if busy[worker] else 0
        if self.step_seconds:
            self.metrics["pipeline/step_ms_measured"] = 1e3 * statistics.median(self.step_seconds)
        self.metrics["pipeline/step_ms_in_run_prediction"] = 1e3 * replay.steady_step
        if self.predicted is not None:
            self.metrics["pipeline/step_ms_predicted"] = 1e3 * self.predicted.steady_step

    def summary(self) -> str:
        """One line for the console."""
        parts = []
        if "pipeline/step_ms_measured" in self.metrics:
            parts.append(f"measured {self.metrics['pipeline/step_ms_measured']:.1f} ms/step")
        if self.predicted is not None:
            parts.append(f"predicted from the profile {self.metrics['pipeline/step_ms_predicted']:.1f}")
        parts.append(f"from the in-run stage costs {self.metrics['pipeline/step_ms_in_run_prediction']:.1f}")
        return "pipeline: " + ", ".join(parts)

    def write(self, directory: Path) -> tuple[Path, Path]:
        """The comparison picture and the measured trace, in ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        panels = []
        if self.predicted is not None:
            panels.append(("predicted (profile)", last_steps(self.predicted.timeline)))
        panels.append(("predicted (in-run costs)", last_steps(self.in_run_prediction.timeline)))
        panels.append(("measured", self.measured))
        picture, trace = directory / "pipeline_timeline.png", directory / "pipeline_trace.json"
        draw_comparison(panels, picture, title=f"{self.schedule.family}: last {STEPS_SHOWN} steps")
        chrome_trace(self.measured, trace, name=f"{self.schedule.family} (measured)")
        return picture, trace

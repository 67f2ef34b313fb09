"""The actions an executor ran, kept out of the way of Python's garbage collector.

An executor records each action it runs with its start, end and waits (an
:class:`~lightning_pipe.schedule.simulation.Interval`), the latest ``timeline_length`` of them: the
in-run calibration, the end-of-fit report and the timelines are drawn from them. Kept as objects,
every interval and its :class:`~lightning_pipe.schedule.ir.Action` are two more objects that every
full collection walks (the executor collects every ``gc_every`` calls on every rank,
:mod:`.garbage`): 100,000 intervals, the default, took 17.6 ms a collection in a process with
nothing else tracked (``bench/gc_pause.py``), and a 2-stage MLP's 3 ms steps took 6 ms by the time
its timeline was full (``bench/long_fit.py``). A :class:`Timeline` keeps each interval as a tuple of
numbers and strings instead, which CPython stops tracking at the first collection that meets it
(0.6 ms a collection for 100,000), and makes the intervals again when they are read: a few times a
fit.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from lightning_pipe.schedule.ir import Action, Kind
from lightning_pipe.schedule.simulation import Interval

__all__ = ["Timeline"]

_Row = tuple[int, str, int, "int | None", int, "int | None", "int | None", float, float, float, int]
"""An interval as plain values: worker, the action's kind, stage, micro-batch, step, version and
peer, then start, end, waited and call."""

_STEP = 4
"""Where a row holds its action's step."""


class Timeline:
    """The latest ``maxlen`` intervals appended (``None``: all of them), oldest first."""

    def __init__(self, maxlen: int | None = None) -> None:
        self._rows: deque[_Row] = deque(maxlen=maxlen)

    @property
    def maxlen(self) -> int | None:
        return self._rows.maxlen

    def append(self, interval: Interval) -> None:
        action = interval.action
        self._rows.append(
            (
                interval.worker,
                action.kind.value,
                action.stage,
                action.microbatch,
                action.step,
                action.version,
                action.peer,
                interval.start,
                interval.end,
                interval.waited,
                interval.call,
            )
        )

    def since(self, step: int) -> list[Interval]:
        """The intervals from the first of a step ``>= step`` on, oldest first: the actions of earlier
        steps run after it are among them, as what an action lasted until the next one started counts
        them (:func:`~lightning_pipe.runtime.calibration.measured_seconds`)."""
        return list(map(_interval, itertools.dropwhile(lambda row: row[_STEP] < step, self._rows)))

    def __iter__(self) -> Iterator[Interval]:
        return map(_interval, self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def _interval(row: _Row) -> Interval:
    worker, kind, stage, microbatch, step, version, peer, start, end, waited, call = row
    return Interval(worker, Action(Kind(kind), stage, microbatch, step, version, peer), start, end, waited, call)

"""The versions a stashing stage keeps at an update, worked out once per position of the program and
shifted from call to call, against the plain scan of every action still to come in this call and the
next ones (the definition), over every non-flushing family, through fills, steady states and drains."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import COMPUTE, make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages

_CASES = [
    ("pipedream", 2, {"rule": "stash"}),
    ("pipedream", 4, {"rule": "vertical"}),
    ("2bw", 2, {}),
    ("2bw", 4, {"slack": 1}),
    ("2bw", 3, {"rule": "stash"}),
    ("cdp", 2, {"rule": "cdp_v1"}),
    ("cdp", 2, {"rule": "cdp_v2"}),
]


def _scanned(executor: PipelineExecutor, stage: int) -> set[int]:
    calls = range(executor.calls + 1, executor.calls + executor.program.period + 2)
    rest = executor._running[executor._position + 1 :]
    actions = rest + [a for call in calls for a in executor._actions(executor.rank, call)]
    return {a.version for a in actions if a.stage == stage and a.kind in COMPUTE}


def _worker(rank: int) -> list[tuple]:
    """Each case: 7 calls, a drain, 9 more calls; every update's answer checked against the scan."""
    checked: list[tuple] = []
    upcoming = PipelineExecutor._upcoming_versions

    def compared(self: PipelineExecutor, stage: int) -> set[int]:
        answer = upcoming(self, stage)
        checked.append((self.schedule.family, self.calls, self._position, answer == _scanned(self, stage)))
        return answer

    PipelineExecutor._upcoming_versions = compared
    try:
        for family, microbatches, options in _CASES:
            executor = PipelineExecutor(
                lambda k, f=family, m=microbatches, o=options: make_schedule(f, 2, m, k, **o),
                build_stages(2, width=8),
                nn.functional.cross_entropy,
                OPTIMIZERS["sgd"],
            )
            for call, (inputs, targets) in enumerate(batches(16, rows=4 * microbatches)):
                executor.step(inputs, targets)
                if call == 6:
                    executor.drain()
            executor.drain()
            executor.close()
    finally:
        PipelineExecutor._upcoming_versions = upcoming
    return checked


@pytest.mark.timeout(120)
def test_the_versions_kept_at_an_update_are_those_of_the_actions_to_come() -> None:
    """Guards the shift of a cached answer (a version off by one drops a version still in use, or
    keeps one too many) and its key (two positions or phases sharing an answer)."""
    for checked in run_local(_worker, 2, timeout=100):
        families = {family for family, *_ in checked}
        assert families == {family for family, _, _ in _CASES}
        wrong = [entry for entry in checked if not entry[-1]]
        assert not wrong, wrong[:5]
        assert len(checked) > 100

"""A worker's calls plus the final drain run exactly the generated schedule, for any step count."""

from __future__ import annotations

import pytest

from lightning_pipe.runtime.program import Program
from lightning_pipe.schedule import make_schedule

CASES = [
    ("1f1b", 4, 4, {}),
    ("gpipe", 3, 5, {}),
    ("interleaved", 4, 3, {}),
    ("zb_h1", 3, 4, {}),
    ("2bw", 4, 4, {}),
    ("2bw", 3, 2, {}),
    ("2bw", 3, 3, {"rule": "stash"}),
    ("pipedream", 4, 2, {}),
    ("pipedream", 4, 1, {"rule": "vertical"}),
    ("cdp", 4, 3, {}),
    ("cdp", 3, 3, {"form": "pyramid"}),
    ("cdp", 5, 5, {"form": "pyramid", "rule": "cdp_v1"}),
]


@pytest.mark.parametrize(("family", "stages", "microbatches", "options"), CASES)
def test_calls_and_drain_reassemble_the_schedule(family: str, stages: int, microbatches: int, options: dict) -> None:
    programs = Program.build(lambda steps: make_schedule(family, stages, microbatches, steps, **options))
    for total in range(1, max(p.base for p in programs) + 2 * max(p.period for p in programs) + 3):
        reference = make_schedule(family, stages, microbatches, total, **options)
        for worker, program in enumerate(programs):
            ran = [a for call in range(total) for a in program.call(call)] + program.finish(total - 1)
            assert ran == list(reference.orders[worker]), (total, worker)


def test_non_flushing_calls_overlap_steps() -> None:
    (first, *_rest) = Program.build(lambda steps: make_schedule("2bw", 4, 4, steps))
    steps_in_call = {a.step for a in first.call(5)}
    assert steps_in_call == {4, 5}  # backwards of the previous step run alongside this step's forwards

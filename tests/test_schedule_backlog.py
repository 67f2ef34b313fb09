"""A link's backlog bound equals the largest backlog of any run: every reachable state of small schedules."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.schedule import Action, Kind, make_schedule
from lightning_pipe.schedule.backlog import link_loads, messages
from lightning_pipe.schedule.graph import build_graph

FAMILIES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {}),
    ("zb_h1", {}),
    ("2bw", {}),
    ("pipedream", {}),
    ("cdp", {}),
    ("1f1b_rr", {"stage_replicas": [1, 2]}),
]


def _size(producer: Action, consumer: Action) -> float:
    """Distinct bytes per stage and direction, so that a wrong message is seen."""
    return float(10 * producer.stage + (1 if consumer.kind is Kind.F else 3) + producer.microbatch % 2)


def _largest_backlogs(schedule, size) -> dict[tuple[int, int], float]:
    """Every state a run can reach (each worker's next action runs once all it waits for has), and in
    each the bytes sent on every link and not yet taken (taking a message takes the earlier ones)."""
    graph = build_graph(schedule)
    links = messages(graph, size)
    orders = schedule.orders
    best: dict[tuple[int, int], float] = defaultdict(float)
    start = tuple(0 for _ in orders)
    seen, frontier = {start}, [start]
    while frontier:
        state = frontier.pop()
        for (sender, receiver), items in links.items():
            taken = max((i for i, (_, at, _) in enumerate(items) if at < state[receiver]), default=-1)
            backlog = sum(n for i, (at, _, n) in enumerate(items) if at < state[sender] and i > taken)
            best[(sender, receiver)] = max(best[(sender, receiver)], backlog)
        for worker, position in enumerate(state):
            if position == len(orders[worker]):
                continue
            if all(dep[1] < state[dep[0]] for dep in graph.deps.get((worker, position), ())):
                following = (*state[:worker], position + 1, *state[worker + 1 :])
                if following not in seen:
                    seen.add(following)
                    frontier.append(following)
    return dict(best)


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    stages=st.integers(2, 3),
    microbatches=st.integers(1, 4),
    steps=st.integers(1, 2),
)
def test_the_bound_is_the_largest_backlog_of_any_run(
    family: tuple[str, dict], stages: int, microbatches: int, steps: int
) -> None:
    name, options = family
    if name == "1f1b_rr":  # 3 workers: stage 1 on two of them
        stages, microbatches = 2, max(microbatches, 2)
    if name in ("2bw", "pipedream", "cdp"):  # their papers' m >= P
        microbatches = max(microbatches, stages)
    if name == "interleaved":  # 2 workers, each looping over 2 of the 4 stages
        stages, microbatches = 4, 2 * (1 + microbatches % 2)
    schedule = make_schedule(name, stages, microbatches, steps, **options)
    loads = link_loads(schedule, _size)
    assert {link: load.backlog for link, load in loads.items()} == _largest_backlogs(schedule, _size)
    for link, items in messages(build_graph(schedule), _size).items():
        assert loads[link].largest == max(nbytes for _, _, nbytes in items)


def _backlogs(schedule) -> dict[tuple[int, int], float]:
    return {link: load.backlog for link, load in link_loads(schedule, _one).items()}


def _one(producer: Action, consumer: Action) -> float:
    return 1.0


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_gpipe_lets_every_micro_batch_wait_and_1f1b_its_warm_up(stages: int) -> None:
    """GPipe: a stage sends all m forwards before its successor need take any (and the gradients
    likewise). 1F1B: stage s runs P - s forwards before its first backward, which waits for the next
    stage's; the link s -> s+1 holds at most P - s activations, and s+1 -> s as many gradients."""
    microbatches = 2 * stages
    gpipe = _backlogs(make_schedule("gpipe", stages, microbatches))
    one_f_one_b = _backlogs(make_schedule("1f1b", stages, microbatches))
    for s in range(stages - 1):
        assert gpipe[(s, s + 1)] == gpipe[(s + 1, s)] == microbatches
        assert one_f_one_b[(s, s + 1)] == one_f_one_b[(s + 1, s)] == stages - s
    assert one_f_one_b == _largest_backlogs(make_schedule("1f1b", stages, microbatches), _one)

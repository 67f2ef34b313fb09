"""Pipeline families with one stage per worker or stages looped over workers.

All of them are built from two orders of one stage's work on a stream of micro-batches:

- *fill-drain* (GPipe, Huang et al. 2019): every forward, then every backward;
- *one-forward-one-backward* with a warm-up of ``w`` forwards (PipeDream, Narayanan et al. 2019
  §3.2): ``w`` forwards, then forward/backward pairs, then the remaining backwards. Stage ``s`` then
  keeps ``w + 1`` activations; 1F1B uses ``w = P - s - 1`` (``min(P - s, m)`` activations), and
  Beaumont et al.'s 1F1B*(T) (Algorithm 1) the group index of the stage minus one: a 1-periodic
  pattern alternates one forward and one backward per period, so its only freedom is the warm-up.

1F1B's warm-up leaves no time for messages: in steady state a micro-batch's activation and gradient
lie on the critical path, so with a one-way delay ``d`` per message the period of a stage exceeds
``F + B`` (``F + B + d`` on two stages). With ``slack`` ``k`` a stage warms up with
``(P - s - 1)(1 + k)`` forwards: adjacent stages' warm-ups differ by ``1 + k``, so each link has
``k`` forward/backward pairs of the sender to hide its round trip behind, at the price of
``(P - s - 1) k`` more activations on stage ``s``. A flushing 1F1B caps every warm-up at ``m``.

With a flush every step stands alone (synchronous updates); without one the stream runs across
steps (PipeDream, 2BW, CDP) and the update of a step is placed right after the step's last backward
on the stage; under 2BW's rule, after the forwards that follow it too, since they compute with the
version before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.schedule.ir import Action, Kind, Schedule

__all__ = [
    "build_1f1b",
    "check_slack",
    "fill_drain",
    "gpipe",
    "interleaved",
    "looped_bfs",
    "one_f_one_b",
    "one_f_one_b_order",
    "stream",
    "warmup_1f1b",
    "with_updates",
]

Job = tuple[int, int]
"""``(step, microbatch)`` of one micro-batch in a stream."""


def check_sizes(family: str, stages: int, microbatches: int, steps: int) -> None:
    """Every generator's basic argument check."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps)):
        check_whole(f"{family}: {name}", value, 1)


def stream(microbatches: int, steps: int) -> list[Job]:
    """All micro-batches of all steps in data order."""
    return [(t, i) for t in range(steps) for i in range(microbatches)]


def fill_drain(stage: int, jobs: Sequence[Job]) -> list[Action]:
    """GPipe's order on one stage: all forwards, then all backwards (first in, first out)."""
    return [Action(Kind.F, stage, i, t) for t, i in jobs] + [Action(Kind.B, stage, i, t) for t, i in jobs]


def one_f_one_b_order(stage: int, jobs: Sequence[Job], warmup: int) -> list[Action]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    warmup = max(0, min(warmup, len(jobs)))
    order = [Action(Kind.F, stage, i, t) for t, i in jobs[:warmup]]
    for k in range(warmup, len(jobs)):
        t, i = jobs[k]
        back_t, back_i = jobs[k - warmup]
        order += [Action(Kind.F, stage, i, t), Action(Kind.B, stage, back_i, back_t)]
    order += [Action(Kind.B, stage, i, t) for t, i in jobs[len(jobs) - warmup :]]
    return order


def with_updates(order: list[Action], stages: Sequence[int], past_forwards: bool = False) -> list[Action]:
    """Insert ``UPDATE(s, t)`` right after the last backward of step ``t`` of stage ``s``; with
    ``past_forwards``, after the forwards of steps ``<= t + 1`` that directly follow that backward.
    Under 2BW's rule those compute with the version before the update (every micro-batch of step
    ``t + 1`` at ``θ_t``), so the update need not delay them, and the stages downstream wait for them
    (the first stage's update otherwise sits between two of its forwards on the critical path)."""
    last = {}
    for position, action in enumerate(order):
        if action.kind in (Kind.B, Kind.W) and action.stage in stages:
            last[(action.stage, action.step)] = position
    result: list[Action] = []
    waiting: list[Action] = []
    placed = {position: key for key, position in last.items()}
    for position, action in enumerate(order):
        if waiting and not (
            past_forwards
            and action.kind is Kind.F
            and all(action.stage == u.stage and action.step <= u.step + 1 for u in waiting)
        ):
            result += waiting
            waiting = []
        result.append(action)
        if position in placed:
            stage, step = placed[position]
            waiting.append(Action(Kind.UPDATE, stage, None, step))
    return result + waiting


def _per_step(jobs: list[Job], flush: bool) -> list[list[Job]]:
    if not flush:
        return [jobs]
    steps = sorted({t for t, _ in jobs})
    return [[job for job in jobs if job[0] == t] for t in steps]


def build(
    family: str,
    stages: int,
    microbatches: int,
    steps: int,
    stage_order: Callable[[int, list[Job]], list[Action]],
    *,
    flush: bool = True,
    rule: str = "sync",
    params: dict[str, object] | None = None,
) -> Schedule:
    """One worker per stage, each running ``stage_order`` on every step (flush) or on the whole
    stream (no flush), with updates after each step's last backward (and, under the ``2bw`` rule,
    after the forwards that follow it and do not need it: :func:`with_updates`)."""
    check_sizes(family, stages, microbatches, steps)
    jobs = stream(microbatches, steps)
    orders = []
    for stage in range(stages):
        order = [action for part in _per_step(jobs, flush) for action in stage_order(stage, part)]
        orders.append(with_updates(order, [stage], past_forwards=rule == "2bw"))
    return Schedule(
        family=family,
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        orders=orders,
        owners=[(s,) for s in range(stages)],
        rule=rule,
        flush=flush,
        params=dict(params or {}),
    )


def gpipe(stages: int, microbatches: int, steps: int = 1) -> Schedule:
    """GPipe: fill-drain with a flush every step."""
    return build("gpipe", stages, microbatches, steps, fill_drain)


def check_slack(family: str, slack: int) -> None:
    """``slack`` must be a whole number of micro-batches >= 0 (0: plain 1F1B)."""
    check_whole(f"{family}: slack", slack, 0, "micro-batches")


def warmup_1f1b(stages: int, stage: int, slack: int = 0) -> int:
    """1F1B's warm-up on ``stage``: ``P - s - 1`` forwards, ``(P - s - 1)(1 + slack)`` with slack."""
    return (stages - stage - 1) * (1 + slack)


def build_1f1b(
    family: str, stages: int, microbatches: int, steps: int, slack: int, *, flush: bool = True, rule: str = "sync"
) -> Schedule:
    """1F1B on every stage, with ``slack`` (see the module), flushed every step or streaming across
    steps: the one builder of ``1f1b``, ``pipedream`` and ``2bw``."""
    check_slack(family, slack)
    return build(
        family,
        stages,
        microbatches,
        steps,
        lambda s, jobs: one_f_one_b_order(s, jobs, warmup_1f1b(stages, s, slack)),
        flush=flush,
        rule=rule,
        params={"slack": slack} if slack else None,
    )


def one_f_one_b(stages: int, microbatches: int, steps: int = 1, slack: int = 0) -> Schedule:
    """1F1B with a flush every step (PipeDream-Flush, Narayanan et al. 2021); ``slack``: see the module."""
    return build_1f1b("1f1b", stages, microbatches, steps, slack)


def _looped(family: str, stages: int, microbatches: int, steps: int, virtual_stages: int) -> int:
    check_sizes(family, stages, microbatches, steps)
    check_whole(f"{family}: virtual_stages", virtual_stages, 1)
    if stages % virtual_stages:
        raise PlanningError(
            f"{family}: {stages} stages cannot be looped {virtual_stages} times over workers: stages must be a "
            f"multiple of virtual_stages (e.g. {virtual_stages * max(1, stages // virtual_stages)} stages)"
        )
    return stages // virtual_stages


def _looped_schedule(family: str, stages: int, microbatches: int, steps: int, orders: list[list[Action]]) -> Schedule:
    """Stage ``s`` owned by worker ``s mod len(orders)``."""
    v = stages // len(orders)
    owners = [(s % len(orders),) for s in range(stages)]
    return Schedule(family, stages, microbatches, steps, orders, owners, params={"virtual_stages": v})


def looped_bfs(stages: int, microbatches: int, steps: int = 1, virtual_stages: int = 2) -> Schedule:
    """Breadth-first looping (Lamy-Poirier 2023): stage ``s`` on worker ``s mod (P/v)``; a worker
    runs every micro-batch through its first stage, then its next, then the backwards in reverse
    (last stage and last micro-batch first), as torch.distributed.pipelining's ScheduleLoopedBFS."""
    workers = _looped("looped_bfs", stages, microbatches, steps, virtual_stages)
    orders: list[list[Action]] = [[] for _ in range(workers)]
    for t in range(steps):
        for w in range(workers):
            mine = list(range(w, stages, workers))
            order = [Action(Kind.F, s, i, t) for s in mine for i in range(microbatches)]
            order += [Action(Kind.B, s, i, t) for s in reversed(mine) for i in reversed(range(microbatches))]
            orders[w] += with_updates(order, mine)
    return _looped_schedule("looped_bfs", stages, microbatches, steps, orders)


def _round_size(microbatches: int, workers: int) -> int:
    rounds = max(1, microbatches // workers)
    return microbatches // rounds if microbatches % rounds == 0 else workers


def interleaved(stages: int, microbatches: int, steps: int = 1, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM §2.2): stage ``s`` on worker
    ``s mod p`` (``p = P / v``). Micro-batches go through a worker's chunks in rounds of ``g``
    (depth first); worker ``r`` warms up with ``2(p - r - 1) + (v - 1)g`` forwards, then alternates,
    the backwards visiting chunks in reverse. ``g = p`` in the paper; like torch.distributed.pipelining
    we take ``g = m / max(1, m // p)`` when that divides ``m`` (the same orders), and otherwise rounds
    of ``p`` with a smaller last one, so that any ``m`` works."""
    workers = _looped("interleaved", stages, microbatches, steps, virtual_stages)
    orders: list[list[Action]] = [[] for _ in range(workers)]
    size = _round_size(microbatches, workers)
    groups = [list(range(g, min(g + size, microbatches))) for g in range(0, microbatches, size)]
    for t in range(steps):
        for w in range(workers):
            chunks = list(range(w, stages, workers))
            forwards = [Action(Kind.F, s, i, t) for group in groups for s in chunks for i in group]
            backwards = [Action(Kind.B, s, i, t) for group in groups for s in reversed(chunks) for i in group]
            warm = min(len(forwards), 2 * (workers - w - 1) + (virtual_stages - 1) * size)
            order = forwards[:warm]
            for k in range(warm, len(forwards)):
                order += [forwards[k], backwards[k - warm]]
            order += backwards[len(forwards) - warm :]
            orders[w] += with_updates(order, chunks)
    return _looped_schedule("interleaved", stages, microbatches, steps, orders)

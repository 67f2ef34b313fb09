"""Spell out a schedule's communication: ``SEND``/``RECV`` pairs and weight ``FETCH`` actions.

Generators emit compute actions only; the data dependencies between workers imply the messages.
:func:`with_transfers` writes them into the orders, as torch.distributed.pipelining lowers its
compute-only schedules: after each compute whose result another worker needs, a ``SEND`` to that
worker; before each compute that needs another worker's result, the matching ``RECV`` (the runtime
posts receives ahead of time, the ``RECV`` is where it waits); before the first action of a run of
actions on a stage whose weights live elsewhere, a ``FETCH`` from an owner. The lowered schedule
validates and simulates like the original.
"""

from __future__ import annotations

from lightning_pipe.schedule.graph import build_graph, data_dependencies, message_kinds
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["with_transfers"]


def with_transfers(schedule: Schedule) -> Schedule:
    """The schedule with explicit ``SEND_F``/``RECV_F``, ``SEND_B``/``RECV_B`` and ``FETCH`` actions.

    As in torch.distributed.pipelining, a ``SEND`` carries the sending stage and a ``RECV`` the
    receiving one: ``SEND_B`` of stage ``s + 1`` matches ``RECV_B`` of stage ``s``.
    """
    graph = build_graph(schedule)
    split = {(a.stage, a.microbatch, a.step) for _, _, a in schedule.actions() if a.kind is Kind.I}
    sends: dict[tuple[int, int], list[Action]] = {}
    receives: dict[tuple[int, int], list[Action]] = {}
    for worker, position, action in schedule.actions():
        if action.kind not in COMPUTE:
            continue
        for key in data_dependencies(action, schedule.stages - 1, split):
            source = graph.where[key]
            if source[0] == worker:
                continue
            message = message_kinds(action, schedule.orders[source[0]][source[1]])
            if message is None:
                continue
            send, receive = message
            producer = schedule.orders[source[0]][source[1]]
            outgoing = Action(send, producer.stage, action.microbatch, action.step, peer=worker)
            sends.setdefault(source, []).append(outgoing)
            receives.setdefault((worker, position), []).append(
                Action(receive, action.stage, action.microbatch, action.step, peer=source[0])
            )
    orders = []
    for worker, order in enumerate(schedule.orders):
        lowered: list[Action] = []
        current: tuple[int, int] | None = None
        for position, action in enumerate(order):
            lowered += receives.get((worker, position), [])
            if action.kind in COMPUTE and worker not in schedule.owners[action.stage]:
                run = (action.stage, action.version or 0)
                if run != current:
                    owner = schedule.first_owner(action.stage)
                    lowered.append(Action(Kind.FETCH, action.stage, None, action.step, action.version, owner))
                current = run
            elif action.kind in COMPUTE:
                current = None
            lowered.append(action)
            lowered += sends.get((worker, position), [])
        orders.append(lowered)
    return schedule.with_orders(orders)

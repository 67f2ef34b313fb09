"""A family's schedule with every stage on one device: how a pipeline is tried before a cluster.

:func:`on_one_worker` puts every worker's program of a schedule into one worker's, in an order its
dependency graph lets run (:meth:`~lightning_pipe.schedule.graph.Graph.order`): each worker's own order
is kept, and an action comes after everything it waits for (a stage's forward after the previous
stage's, a backward after the next stage's, an update after its stage's backwards). The stages keep
their forwards, backwards and updates, hence their update rule and their gradients; one device runs
them one after the other, so the pipeline's overlap is gone and the time of a step is the sum of its
actions'. Messages between stages stay on the device (the runtime hands them over without a
transfer).

Families whose stages are owned by several workers (replicated stages, ``1f1b_rr``), or that reduce
gradients along rings or pass a stage's state from worker to worker (CDP's dp and ZeRO forms) have no
one-worker program of this kind: they are refused. Options: ``form="single"`` (:class:`~lightning_pipe.
schedule.options.ScheduleOptions`), as CDP's own single-device form.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.graph import build_graph
from lightning_pipe.schedule.ir import Kind, Schedule

__all__ = ["on_one_worker"]

_BETWEEN_WORKERS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.FETCH, Kind.SIGNAL, Kind.WAIT})


def on_one_worker(schedule: Schedule) -> Schedule:
    """``schedule``'s actions in one worker's program (the module docstring); a one-worker schedule
    is returned as it is.

    Raises:
        PlanningError: a stage has several owners, or the schedule reduces gradients along rings or
            relays stages between workers.
    """
    if schedule.workers == 1:
        return schedule
    if schedule.rings or schedule.relays or any(len(owners) != 1 for owners in schedule.owners):
        raise PlanningError(
            f"{schedule.family} cannot put its stages on one device: its stages are replicated or passed between "
            "workers; one device runs every stage of gpipe, 1f1b, interleaved, looped_bfs, 1f1b_star, kperiodic, "
            "zb_h1, pp, ddp, fsdp, lpp, fslpp (form='single') and cdp (its single form)"
        )
    graph = build_graph(schedule)
    actions = [graph.action(node) for node in graph.order()]
    order = tuple(replace(action, peer=None) for action in actions if action.kind not in _BETWEEN_WORKERS)
    return replace(
        schedule,
        orders=(order,),
        owners=tuple((0,) for _ in schedule.owners),
        params={**schedule.params, "form": "single"},
    )

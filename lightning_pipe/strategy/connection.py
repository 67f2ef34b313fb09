"""The default process group of a fit, joined so that a fit after a failed one in the same processes
connects again.

A failure closes the default group on every rank (:meth:`.Collectives.on_exception`: that is what
stops the other ranks within seconds). The next ``fit``, ``validate`` or ``test`` in the same
processes — a sweep that catches the error and goes on, the tuner, a notebook — must open it again.
Opening it as the first fit did (a rendezvous at ``MASTER_ADDR:MASTER_PORT``) fails there: rank 0's
first store still holds the port and its keys (the failure record among them), and the groups
opened afterwards take the names the closed ones had, so their rendezvous would read stale keys.

So each process keeps the store of its first connection, and every later connection opens the
default group over a fresh namespace of it: ``lightning_pipe/<n>/``, the ``n``-th reconnection of
this process. Every rank closes the default group at the same failures, so every rank counts the same
``n``.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection

__all__ = ["connect"]

_Rendezvous = tuple[str, int, int, int]
"""Address, port, world size and rank of a connection."""

_STORES: dict[_Rendezvous, tuple[dist.Store, int]] = {}
"""Per rendezvous this process joined: the store of its first connection and how many times the
default group was opened again over it."""


def connect(environment: ClusterEnvironment, backend: str, timeout: timedelta) -> None:
    """Open the default process group for a fit, or keep the one already open (by the launcher, an
    earlier fit, or the user)."""
    rendezvous = (environment.main_address, environment.main_port, environment.world_size(), environment.global_rank())
    if dist.is_initialized():
        if rendezvous not in _STORES:
            _STORES[rendezvous] = (dist.distributed_c10d._get_default_store(), 0)
        return
    if rendezvous not in _STORES:
        _init_dist_connection(environment, backend, timeout=timeout)
        _STORES[rendezvous] = (dist.distributed_c10d._get_default_store(), 0)
        return
    store, reconnections = _STORES[rendezvous]
    _STORES[rendezvous] = (store, reconnections + 1)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_pipe/{reconnections + 1}/", store),
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timeout,
    )

"""The strategy's arguments that need more than a type check, checked when it is made: how the
processes start, what the process group depends on (once the processes are up, a bad timeout
surfaces as a store that "timed out after -60000ms", and an unknown backend or port as torch's own
error on every rank) and the sizes given as text.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

from lightning_pipe.errors import PlanningError, check_flag
from lightning_pipe.runtime.launch import has_forkserver

__all__ = ["check_backend", "check_flags", "check_port", "check_start_method", "check_timeout", "parse_option"]

_PORTS = range(1, 65536)
START_METHODS = ("popen", "spawn", "forkserver")


def check_timeout(timeout: object) -> None:
    """Refuse a process-group timeout that is not a positive ``timedelta``."""
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise PlanningError(
            f"timeout must be a positive datetime.timedelta, e.g. timedelta(minutes=30) (Hydra: "
            f"pipeline.timeout_minutes=30); got {timeout!r}"
        )


def check_flags(**flags: object) -> None:
    """Refuse a flag (``pin_cpus``, ``recompute``, ...) that is not ``True`` or ``False``."""
    for name, value in flags.items():
        check_flag(name, value)


def check_backend(backend: object) -> None:
    """Refuse a ``process_group_backend`` that torch does not know or was built without: ``gloo``,
    ``nccl``, ..., or ``device:backend`` pairs such as ``cpu:gloo,cuda:nccl``; ``None`` picks one."""
    if backend is None:
        return
    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    names = [part.rpartition(":")[2].strip().lower() for part in backend.split(",")] if isinstance(backend, str) else []
    unknown = [name for name in names if name not in known or not dist.is_backend_available(name)]
    if not names or unknown:
        available = [name for name in known if name != "fake" and dist.is_backend_available(name)]  # fake: tests
        raise PlanningError(
            f"process_group_backend={backend!r} is not a backend of this torch: use one of "
            f"{', '.join(available)}, or None (gloo on CPU, nccl on GPU)"
        )


def check_start_method(start_method: str) -> None:
    """Refuse a start method Lightning's launchers do not have, or one this platform lacks."""
    if start_method not in START_METHODS:
        raise PlanningError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}; got {start_method!r}")
    if start_method == "forkserver" and not has_forkserver():
        raise PlanningError("start_method='forkserver': this platform has no forkserver (Windows); use 'spawn'")


def check_port(environment: Mapping[str, str] = os.environ) -> None:
    """Refuse a ``MASTER_PORT`` (the port the process group meets on) that is not a port number."""
    port = environment.get("MASTER_PORT")
    if port is not None and _as_port(port) is None:
        raise PlanningError(
            f"MASTER_PORT={port!r} (environment) is not a port: the processes meet on it; set a whole number in "
            f"1..65535, or unset it for a free port"
        )


def _as_port(text: str) -> int | None:
    """``text`` as a port number the way torch reads ``MASTER_PORT`` (``int()``), or ``None``."""
    try:
        number = int(text)
    except ValueError:
        return None
    return number if number in _PORTS else None


def parse_option(name: str, value: float | str, parse: Callable[[float | str], float]) -> float:
    """``value`` of option ``name`` (``memory_limit``, ``bandwidth``) parsed, or an error naming the option."""
    try:
        return parse(value)
    except PlanningError as error:
        raise PlanningError(f"{name}={value!r}: {error}") from None

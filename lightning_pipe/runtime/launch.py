"""Run a function on several local processes joined by a gloo process group (tests, benchmarks).

Production jobs start their processes with torchrun, SLURM or Lightning's launchers;
:func:`run_local` is the small equivalent for one machine: it picks a free port, starts
``world_size`` processes, initialises ``torch.distributed`` in each, runs ``fn(rank, *args)`` and
returns every rank's result. A deadline bounds the whole run; a rank that raises or dies is reported
with what every other rank said, and stragglers are terminated.

The processes are forked from a ``forkserver`` that has imported torch, Lightning and this package
once (where the platform has one; ``spawn`` elsewhere): a spawned process spends seconds importing
them, a forked one milliseconds. Each process gets the caller's environment as it is at the call,
as a spawned one would (the server's own is the one it started with).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipe.runtime.affinity import pin_threads

PRELOADED = ("torch", "torch.distributed", "lightning", "lightning_pipe", "lightning_pipe.runtime.frozen_preload")
"""What the forkserver imports once, before it forks the processes of every :func:`run_local`; the
last freezes what the others made (:mod:`lightning_pipe.runtime.frozen_preload`)."""

__all__ = ["LocalRunError", "adopt_environment", "has_forkserver", "preloading_forkserver", "run_local"]


class LocalRunError(RuntimeError):
    """A rank of :func:`run_local` failed, died or timed out; ``errors`` maps each such rank to its
    error message (with traceback) or fate."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    pin_cpus: bool,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    environment: dict[str, str],
) -> None:
    adopt_environment(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        if pin_cpus:
            pin_threads(rank, world_size)
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)  # plain bytes: shared-memory tensors die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def preloading_forkserver() -> Any:
    """The forkserver context, its server (one per process, started by its first use) set to
    preload :data:`PRELOADED`; ``None`` where the platform has no forkserver (Windows)."""
    if not has_forkserver():
        return None
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))  # no effect once the server runs: it keeps its modules
    return context


def adopt_environment(environment: dict[str, str]) -> None:
    """Make ``environment`` (the caller's, taken at the launch) this process's whole environment: a
    process forked from the forkserver starts with the server's, as it was when the server started."""
    os.environ.clear()
    os.environ.update(environment)


def has_forkserver() -> bool:
    """Whether this platform can start processes from a forkserver."""
    return "forkserver" in mp.get_all_start_methods()


def _context() -> Any:
    """A forkserver context that preloads :data:`PRELOADED`, or ``spawn`` where there is none."""
    return preloading_forkserver() or mp.get_context("spawn")


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    pin_cpus: bool = False,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each in its own process (with
    ``pin_cpus``, each on cores of its own: :func:`~lightning_pipe.runtime.affinity.pin_threads`).

    Raises:
        LocalRunError: a rank raised (its error and traceback are in the message), a process died
            without reporting, or the run took longer than ``timeout`` seconds.
    """
    context = _context()
    results = context.Queue()
    port = _free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, port, threads, pin_cpus, fn, args, results, environment),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(values) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                unfinished = sorted(set(range(world_size)) - set(values) - set(errors))
                errors.update({r: f"did not finish within {timeout:.0f} s" for r in unfinished})
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.2))
            except queue.Empty:  # nothing yet: note who died without a word, keep waiting for the others
                for r, process in enumerate(processes):
                    if process.exitcode not in (None, 0) and r not in values and r not in errors:
                        errors[r] = f"died with exit code {process.exitcode}"
                continue
            if status == "ok":
                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
    if errors:
        first = min(errors)
        others = "".join(f"\n--- rank {r}: {errors[r].splitlines()[0]}" for r in sorted(errors) if r != first)
        raise LocalRunError(f"rank {first} failed: {errors[first]}{others}", errors)
    return [values[rank] for rank in range(world_size)]

"""Where a pipeline action's time goes: torch.profiler over our executor's run against the same
stages trained alone, and the processor cost of one gloo send.

Run: ``python bench/profile_actions.py [--family 1f1b] [--microbatches 8] [--rows 32] [--steps 20]``.
The model and data are ``bench/runtime_speed.py``'s (2 stages of 4 Linear+ReLU blocks of 512, 2
processes x 1 thread over gloo). For each rank it prints the operators that took the most time, in
the pipeline (``--steps`` steps after 10 warm-up ones) and with the rank training its own stage
alone while the other does the same (``runtime_speed.py``'s "two stages alone"). Then a micro-
benchmark: the wall time of ``dist.isend`` of one activation, and of the send plus 20 matrix
products of the next action, with the receiver idle or computing and its receive posted early or
late (medians of 50). Last, how long a 64 KiB message takes to arrive at a receiver waiting for it
while the sender computes on or idles, and how long a receiver's wait takes when it computed for
5 ms after posting the receive (the message sent meanwhile): whether gloo moves the bytes while
both processes compute (medians of 70).
"""

from __future__ import annotations

import argparse
import statistics
import time

import runtime_speed as bench
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local

WARMUP = 10


def operators(rank: int, args: argparse.Namespace) -> tuple[str, str]:
    """The profiler's tables of this rank: in the pipeline, and training its stage alone."""
    model = bench.default_model(args.rows, args.microbatches, args.steps)
    batches = bench.data(WARMUP + args.steps, model)
    executor = PipelineExecutor(
        lambda k: bench.schedule(args.family, args.microbatches, k),
        {rank: bench.stage_module(rank, model)},
        nn.functional.cross_entropy,
        bench._sgd,
    )
    for inputs, targets in batches[:WARMUP]:
        executor.step(inputs, targets)
    executor.drain()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as in_run:
        for inputs, targets in batches[WARMUP:]:
            executor.step(inputs, targets)
        executor.drain()
    executor.close()
    module = bench.stage_module(rank, model)
    optimizer = bench._sgd(list(module.parameters()))
    inputs = [bench.stage_input(rank, model, args.rows) for _ in range(args.microbatches)]
    targets = torch.randint(0, 10, (args.rows,))
    record: tuple[list[float], ...] = ([], [], [], [])
    bench._train_alone(rank, module, optimizer, inputs, targets, 0, record)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as alone:
        bench._train_alone(rank, module, optimizer, inputs, targets, args.steps - bench.WARMUP, record)
    dist.barrier()
    return tuple(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12) for p in (in_run, alone))


def send_cost(rank: int, nbytes: int, busy_receiver: bool, posted: bool) -> tuple[float, float] | None:
    """Median seconds of rank 0's ``isend`` call, and of the send plus the next action's compute."""
    message, buffer = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    weights, rows = torch.randn(512, 512), torch.randn(32, 512)
    calls, totals = [], []
    for tag in range(60):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            work = dist.isend(message, 1, tag=tag)
            calls.append(time.perf_counter() - start)
            for _ in range(20):
                rows @ weights
            work.wait()
            totals.append(time.perf_counter() - start)
        else:
            work = dist.irecv(buffer, 0, tag=tag) if posted else None
            for _ in range(40 if busy_receiver else 0):
                rows @ weights
            (work or dist.irecv(buffer, 0, tag=tag)).wait()
    return (statistics.median(calls[10:]), statistics.median(totals[10:])) if rank == 0 else None


def delivery(rank: int, nbytes: int, sender_busy: bool, receiver_busy: bool) -> float | None:
    """Median seconds from the send to the end of the receiver's wait (receiver idle), or of the
    receiver's wait alone after it computed for about 5 ms (receiver busy)."""
    message, buffer = torch.zeros(nbytes // 8, dtype=torch.float64), torch.zeros(nbytes // 8, dtype=torch.float64)
    weights, rows = torch.randn(512, 512), torch.randn(32, 512)
    seconds = []
    for tag in range(80):
        dist.barrier()
        if rank == 0:
            message[0] = time.perf_counter()
            work = dist.isend(message, 1, tag=tag)
            for _ in range(40 if sender_busy else 0):
                rows @ weights
            work.wait()
        else:
            work = dist.irecv(buffer, 0, tag=tag)
            for _ in range(60 if receiver_busy else 0):
                rows @ weights
            start = time.perf_counter()
            work.wait()
            seconds.append(time.perf_counter() - (start if receiver_busy else float(buffer[0])))
    return statistics.median(seconds[10:]) if rank == 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for rank, (in_run, alone) in enumerate(run_local(operators, 2, args, timeout=900)):
        print(f"===== rank {rank}: {args.family} pipeline, {args.steps} steps\n{in_run}")
        print(f"===== rank {rank}: its stage alone (the other rank too), {args.steps} steps\n{alone}")
    nbytes = args.rows * 512 * 4
    for busy in (False, True):
        for posted in (True, False):
            call, total = run_local(send_cost, 2, nbytes, busy, posted, timeout=300)[0]
            print(
                f"isend of {nbytes // 1024} KiB, receiver {'computing' if busy else 'idle'}, its receive posted "
                f"{'early' if posted else 'late'}: call {call * 1e6:.0f} us, send + 20 products {total * 1e6:.0f} us"
            )
    for sender_busy in (False, True):
        seconds = run_local(delivery, 2, nbytes, sender_busy, False, timeout=300)[1]
        print(
            f"{nbytes // 1024} KiB to a waiting receiver, sender {'computing' if sender_busy else 'idle'}: "
            f"{seconds * 1e6:.0f} us"
        )
    seconds = run_local(delivery, 2, nbytes, True, True, timeout=300)[1]
    print(f"receiver's wait after 5 ms of its own compute, both computing: {seconds * 1e6:.0f} us")


if __name__ == "__main__":
    main()

"""Runtime throughput: ours vs torch.distributed.pipelining, non-flushing vs flushing, pipeline vs one
process, and measured vs simulated time per step — all in one run on this machine.

Run: ``python bench/runtime_speed.py [--steps 12] [--width 512] [--depth 4] [--batch 256] [--microbatches 2 4]``.

Every configuration trains the same balanced 2-stage MLP (``depth`` Linear+ReLU blocks of ``width``
per stage) on the same mini-batches, 2 processes x 1 thread over gloo (the peer: torch's
``PipelineStage`` with ``Schedule1F1B`` / ``ScheduleGPipe``, SGD stepped after each schedule step).
Times are wall-clock per optimizer step over ``--steps`` steps after warm-up ones, between two
barriers; the table reports throughput ratios. The simulator's prediction uses per-stage forward,
backward and update times profiled (lightning_pipe.profiler) in the two worker processes at once,
the gloo bandwidth measured by a ping-pong of one activation, blocking transfers, and the same
schedule.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.profiler import profile_layers
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import StageCosts, make_schedule, simulate

WARMUP = 3


def stage_module(stage: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(stage)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    if stage == 1:
        blocks.append(nn.Linear(width, 10))
    return nn.Sequential(*blocks)


def data(steps: int, width: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(steps)
    ]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _timed(run_step, batches) -> list[float]:
    """Seconds per step over the batches after the warm-up ones, between two barriers (no barrier
    between steps: a non-flushing pipeline keeps running across them)."""
    for inputs, targets in batches[:WARMUP]:
        run_step(inputs, targets)
    dist.barrier()
    start = time.perf_counter()
    for inputs, targets in batches[WARMUP:]:
        run_step(inputs, targets)
    dist.barrier()
    return [(time.perf_counter() - start) / (len(batches) - WARMUP)]


def ours(rank: int, family: str, microbatches: int, steps: int, width: int, depth: int, batch: int) -> list[float]:
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, microbatches, k),
        {rank: stage_module(rank, width, depth)},
        nn.functional.cross_entropy,
        _sgd,
    )
    # a non-flushing schedule is timed in steady state: per call, with the pipeline kept full
    times = _timed(lambda x, y: executor.step(x, y), data(steps + WARMUP, width, batch))
    executor.drain()
    executor.close()
    return times


def peer(rank: int, name: str, microbatches: int, steps: int, width: int, depth: int, batch: int) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = stage_module(rank, width, depth)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]
    schedule = kind(stage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)
    optimizer = _sgd(list(module.parameters()))

    def run_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets)
        optimizer.step()
        optimizer.zero_grad()

    return _timed(run_step, data(steps + WARMUP, width, batch))


def single_process(steps: int, width: int, depth: int, batch: int) -> float:
    torch.set_num_threads(1)
    model = nn.Sequential(stage_module(0, width, depth), stage_module(1, width, depth))
    optimizer = _sgd(list(model.parameters()))
    times = []
    for inputs, targets in data(steps + WARMUP, width, batch):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def ping(rank: int, rows: int, width: int) -> float:
    """Bytes per second of a gloo transfer of one activation between the two processes (round trips)."""
    tensor = torch.zeros(rows, width)
    for repeat in range(25):
        if repeat == 5:
            dist.barrier()
            start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
    seconds = (time.perf_counter() - start) / 20 / 2
    return tensor.numel() * tensor.element_size() / seconds


def stage_costs(rank: int, microbatches: int, width: int, depth: int, batch: int) -> tuple[float, float, float]:
    """Forward, backward and optimizer-step seconds of this rank's stage, profiled in the worker
    process while the other worker profiles its own (the conditions the pipeline runs in)."""
    module = stage_module(rank, width, depth)
    sample = torch.randn(batch // microbatches, width, requires_grad=rank > 0)
    profiled = profile_layers([module], sample, repeats=10, count_flops=False).layers[0]
    optimizer = _sgd(list(module.parameters()))
    for param in module.parameters():
        param.grad = torch.zeros_like(param)
    start = time.perf_counter()
    for _ in range(10):
        optimizer.step()
    return profiled.forward_seconds, profiled.backward_seconds, (time.perf_counter() - start) / 10


def predicted(
    family: str, microbatches: int, costs: list[tuple[float, float, float]], nbytes: float, bandwidth: float
) -> float:
    """Simulated steady-state time per step of ``family`` with the profiled stage costs."""
    stage_costs = StageCosts(
        [c[0] for c in costs],
        [c[1] for c in costs],
        update=[c[2] for c in costs],
        activation_bytes=[nbytes, 0.0],
        bandwidth=bandwidth,
        overlap=False,  # on 2 busy cores the copies take the senders' time
    )
    return simulate(make_schedule(family, 2, microbatches, 8), stage_costs).steady_step


RUNS = (
    ("ours 1f1b", ours, "1f1b"),
    ("torch Schedule1F1B", peer, "1f1b"),
    ("ours gpipe", ours, "gpipe"),
    ("torch ScheduleGPipe", peer, "gpipe"),
    ("ours 2bw", ours, "2bw"),
    ("ours cdp", ours, "cdp"),
    ("ours zb_h1", ours, "zb_h1"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    size = (args.steps, args.width, args.depth, args.batch)
    alone = single_process(*size)
    print(
        f"model: 2 stages x {args.depth} blocks of {args.width}, batch {args.batch}; one process, one thread: "
        f"{alone * 1e3:.1f} ms per step"
    )
    print(f"{'run':>20} {'m':>3} {'ms/step':>8} {'speed-up':>22} {'vs 1 proc':>9} {'simulated':>9} {'error':>6}")
    for microbatches in args.microbatches:
        bandwidth = run_local(ping, 2, args.batch // microbatches, args.width)[0]
        costs = run_local(stage_costs, 2, microbatches, args.width, args.depth, args.batch)
        nbytes = args.batch // microbatches * args.width * 4
        step: dict[str, float] = {}
        for label, worker, name in RUNS:
            times = run_local(worker, 2, name, microbatches, *size, timeout=600)
            step[label] = statistics.median(max(pair) for pair in zip(*times, strict=True))
        for label, _, name in RUNS:
            row = f"{label:>20} {microbatches:>3} {step[label] * 1e3:>8.1f}"
            if label.startswith("ours"):
                baseline = f"torch {'Schedule1F1B' if name == '1f1b' else 'ScheduleGPipe'}"
                if name in ("2bw", "cdp", "zb_h1"):
                    baseline = "ours 1f1b"
                speedup = f"{step[baseline] / step[label]:.2f}x vs {baseline.split()[-1]}"
                expected = predicted(name, microbatches, costs, nbytes, bandwidth)
                error = abs(step[label] - expected) / expected
                row += f" {speedup:>22} {alone / step[label]:>8.2f}x {expected * 1e3:>7.1f}ms {error:>5.0%}"
            print(row)


if __name__ == "__main__":
    main()

"""Runtime throughput: ours vs torch.distributed.pipelining, non-flushing vs flushing, pipeline vs one
process, and measured vs simulated time per step — all in one run on this machine.

Run: ``python bench/runtime_speed.py [--steps 8] [--rounds 8] [--width 512] [--depth 4] [--batch 1024]
[--microbatches 2 4]``.

Every configuration trains the same balanced 2-stage MLP (``depth`` Linear+ReLU blocks of ``width``
per stage) on the same mini-batches, 2 processes x 1 thread over gloo (the peer: torch's
``PipelineStage`` with ``Schedule1F1B`` / ``ScheduleGPipe``, SGD stepped after each schedule step).
The same two processes run every configuration once per round, round after round, so a slow spell of
the machine hits them alike (the one-process baseline too: rank 0 trains the unsplit model with one
thread while rank 1 waits); a configuration's time per step is its median over the rounds, each
round timing ``--steps`` steps after warm-up ones between two barriers, and a speed-up is the median
of the rounds' ratios. The simulator's prediction uses per-stage forward, backward and update times
profiled (lightning_pipe.profiler) in the two worker processes at once, in every round (the error is
the median of the rounds' errors), and a message latency and bandwidth fitted to ping-pongs of an
empty and of an activation-sized message. ``spread`` is (slowest - fastest round) / median.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.profiler import profile_layers
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import StageCosts, make_schedule, simulate

WARMUP = 3
OURS = ("1f1b", "gpipe", "2bw", "cdp", "zb_h1")
PEERS = ("1f1b", "gpipe")
_Batches = list[tuple[torch.Tensor, torch.Tensor]]


def stage_module(stage: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(stage)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    if stage == 1:
        blocks.append(nn.Linear(width, 10))
    return nn.Sequential(*blocks)


def data(steps: int, width: int, batch: int) -> _Batches:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(steps)
    ]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _timed(run_step: Callable[[torch.Tensor, torch.Tensor], object], batches: _Batches) -> float:
    """Seconds per step over the batches after the warm-up ones, between two barriers (no barrier
    between steps: a non-flushing pipeline keeps running across them)."""
    for inputs, targets in batches[:WARMUP]:
        run_step(inputs, targets)
    dist.barrier()
    start = time.perf_counter()
    for inputs, targets in batches[WARMUP:]:
        run_step(inputs, targets)
    dist.barrier()
    return (time.perf_counter() - start) / (len(batches) - WARMUP)


def ours(rank: int, family: str, microbatches: int, batches: _Batches, width: int, depth: int) -> float:
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, microbatches, k),
        {rank: stage_module(rank, width, depth)},
        nn.functional.cross_entropy,
        _sgd,
    )
    # a non-flushing schedule is timed in steady state: per call, with the pipeline kept full
    seconds = _timed(lambda x, y: executor.step(x, y), batches)
    executor.drain()
    executor.close()
    return seconds


def peer(rank: int, name: str, microbatches: int, batches: _Batches, width: int, depth: int) -> float:
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

    return _timed(run_step, batches)


def single_process(rank: int, batches: _Batches, width: int, depth: int) -> float:
    """Seconds per step of the unsplit model in one process with one thread (rank 0), while rank 1
    waits idle at a barrier."""
    if rank == 0:
        model = nn.Sequential(stage_module(0, width, depth), stage_module(1, width, depth))
        optimizer = _sgd(list(model.parameters()))
        times = []
        for inputs, targets in batches:
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times[WARMUP:]) if rank == 0 else 0.0


def _round_trip(rank: int, tensor: torch.Tensor, repeats: int = 30) -> float:
    """Median seconds of a ping-pong of ``tensor`` between the two processes."""
    times = []
    dist.barrier()
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def network(rank: int, rows: int, width: int) -> tuple[float, float]:
    """Latency (seconds per message) and bandwidth (bytes per second; ``inf`` when the activation
    goes no slower than an empty message) of gloo between the two processes, from ping-pongs of
    one element and of one activation."""
    empty = _round_trip(rank, torch.zeros(1)) / 2
    activation = torch.zeros(rows, width)
    full = _round_trip(rank, activation) / 2
    nbytes = activation.numel() * activation.element_size()
    return empty, nbytes / (full - empty) if full > empty else math.inf


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


def worker(rank: int, microbatches: int, steps: int, rounds: int, width: int, depth: int, batch: int) -> dict:
    """Everything measured in the two processes: network, stage costs, and every configuration
    once per round."""
    batches = data(steps + WARMUP, width, batch)
    result: dict = {
        "network": network(rank, batch // microbatches, width),
        "costs": [],
        "times": {},
    }
    for _ in range(rounds):
        result["costs"].append(stage_costs(rank, microbatches, width, depth, batch))
        result["times"].setdefault("one process", []).append(single_process(rank, batches, width, depth))
        for family in OURS:
            seconds = ours(rank, family, microbatches, batches, width, depth)
            result["times"].setdefault(f"ours {family}", []).append(seconds)
        for name in PEERS:
            seconds = peer(rank, name, microbatches, batches, width, depth)
            result["times"].setdefault(f"torch {name}", []).append(seconds)
    return result


def predicted(
    family: str, microbatches: int, costs: list[tuple[float, float, float]], nbytes: float, net: tuple[float, float]
) -> float:
    """Simulated steady-state time per step of ``family`` with the profiled stage costs."""
    stage_costs = StageCosts(
        [c[0] for c in costs],
        [c[1] for c in costs],
        update=[c[2] for c in costs],
        activation_bytes=[nbytes, 0.0],
        latency=net[0],
        bandwidth=net[1],
    )
    return simulate(make_schedule(family, 2, microbatches, 8), stage_costs, early_gradients=True).steady_step


LABELS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def _paired(baseline: list[float], times: list[float]) -> float:
    """Median over the rounds of baseline / time: each ratio compares runs made minutes apart at
    most, under the same load."""
    return statistics.median(b / t for b, t in zip(baseline, times, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(
        f"model: 2 stages x {args.depth} blocks of {args.width}, batch {args.batch}; {args.rounds} rounds of "
        f"{args.steps} steps"
    )
    print(
        f"{'run':>20} {'m':>3} {'ms/step':>8} {'spread':>6} {'speed-up':>22} {'vs 1 proc':>9} {'simulated':>9} "
        f"{'error':>6}"
    )
    for microbatches in args.microbatches:
        results = run_local(
            worker, 2, microbatches, args.steps, args.rounds, args.width, args.depth, args.batch, timeout=1800
        )
        net = results[0]["network"]
        costs = list(zip(*(r["costs"] for r in results), strict=True))  # per round: (rank 0's, rank 1's)
        nbytes = args.batch // microbatches * args.width * 4
        per_round = {
            label: [max(pair) for pair in zip(*(r["times"][label] for r in results), strict=True)]
            for label in results[0]["times"]
        }
        step = {label: statistics.median(times) for label, times in per_round.items()}
        spread = {label: (max(times) - min(times)) / step[label] for label, times in per_round.items()}
        alone = step["one process"]
        for family in OURS:
            label = f"ours {family}"
            baseline = f"torch {family}" if family in PEERS else "ours 1f1b"
            speedup = f"{_paired(per_round[baseline], per_round[label]):.2f}x vs {LABELS.get(family, '1f1b')}"
            expected_by_round = [predicted(family, microbatches, list(c), nbytes, net) for c in costs]
            expected = statistics.median(expected_by_round)
            error = statistics.median(abs(t - e) / e for t, e in zip(per_round[label], expected_by_round, strict=True))
            print(
                f"{label:>20} {microbatches:>3} {step[label] * 1e3:>8.1f} {spread[label]:>6.0%} {speedup:>22} "
                f"{_paired(per_round['one process'], per_round[label]):>8.2f}x {expected * 1e3:>7.1f}ms {error:>5.0%}"
            )
            if family in PEERS:
                other = f"torch {family}"
                name = f"torch {LABELS[family]}"
                print(f"{name:>20} {microbatches:>3} {step[other] * 1e3:>8.1f} {spread[other]:>6.0%}")
        print(f"{'one process':>20} {microbatches:>3} {alone * 1e3:>8.1f} {spread['one process']:>6.0%}")
        print(f"{'':>20} gloo: {net[0] * 1e6:.0f} us per message, {net[1] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()

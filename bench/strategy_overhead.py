"""PipelineStrategy's overhead: what Lightning's loop and the strategy add to our pipeline, against
plain Lightning on one device, the bare executor on two processes and Lightning's DDP on two
processes, all in one run.

Run: ``python bench/strategy_overhead.py [--steps 20] [--rounds 5] [--width 512] [--depth 4]
[--batch 1024] [--features 768] [--microbatches 2 8] [--no-log] [--pin]`` (about 5 minutes on 2 cores);
``--pin`` keeps each process's threads on a core of its own for every configuration, Lightning's and
DDP's included (``pin_cpus`` of ``run_local``).

The module (:class:`MLP`) is ``bench/runtime_speed.py``'s balanced 2-stage MLP in one ``nn.Sequential``
``self.net`` whose blocks ``forward`` calls in turn, a split point (``pipe_split``) between two, so that
each block is one layer of the plan at every size: ``depth`` Linear+ReLU blocks of ``width``
reading ``features`` inputs, ``depth`` more and a 10-class head; cross-entropy, SGD with momentum,
and ``self.log("train_loss", loss)`` every step as a user's module would (``--no-log``: none). Every
configuration trains it from the same initial weights on the same 3 warm-up and ``--steps`` timed
batches of ``--batch`` rows (one epoch, ``max_steps``), one thread per process, each process started
as torchrun leaves it (``LOCAL_RANK`` and ``OMP_NUM_THREADS=1`` set, process group joined). Three
comparisons:

(a) one process: ``PipelineStrategy("1f1b", microbatches=1)`` on ``devices=1`` (one stage) against
    plain Lightning (``strategy="auto"``, ``devices=1``); target: at most 5% slower. Two references
    show where a difference comes from: a hand-written torch loop (forward, backward, SGD step,
    zero_grad) and our executor alone with the one stage.
(b) two processes: ``PipelineStrategy("1f1b")`` and ``("2bw")`` against the bare
    ``PipelineExecutor`` running the same schedule (the strategy's own ``ScheduleOptions``) on the
    same stages (``balance=[depth, depth + 1]``), micro-batches, batches and optimizer, fed by the
    same ``DataLoader``, no losses shared: what Lightning's loop and the strategy's glue cost; target:
    at most 5% slower, at each micro-batch count. Two more rows per schedule add to the bare executor
    one blocking collective per call: ``+gather`` (``share_losses=True``, an ``all_gather_object``
    after each call, as a blocking relay of the logs would be) and ``+bcast`` (a one-element
    broadcast from rank 0 before each call, as the SIGTERM flag Lightning's training loop broadcasts
    at every batch when there are several processes; the strategy replaces it by a flag in its log
    relay, which a non-flushing schedule leaves in flight).
(c) two processes: ``PipelineStrategy("2bw")`` and the bare executor's 2BW against Lightning's
    ``strategy="ddp"``, each rank of which trains on its half of every batch (the same rows per
    update as the pipeline, and a synchronous update): the ratio of samples per second.

Timing: Lightning's runs are timed by a callback from ``on_train_batch_start`` of the first timed
batch to ``on_train_batch_end`` of the last, each behind a barrier; the executor's from before its
first timed ``step`` to after the ``drain`` that ends the epoch, between two barriers. A
non-flushing schedule (2BW) carries work from one batch into the next, so a per-batch callback time
would charge a batch with its predecessors' work: every configuration is timed over the whole window
(the epoch-end drain included, which the strategy runs inside the last batch) divided by the timed
steps. Lightning's rows also report the part of that window spent outside the batch hooks
(``between``: fetching the next batch and the loop's bookkeeping between ``on_train_batch_end`` and
the next ``on_train_batch_start``, the SIGTERM broadcast included).

Protocol as in ``bench/runtime_speed.py``: the same processes run every configuration once per
round, in an order drawn anew each round (the same on every rank), under the executor's
garbage-collection policy (the import heap frozen, automatic collection off, a full collection
before each configuration, so no run pays a collection at random); a configuration's ms/step is the
median of the rounds (the slower rank's figure in each), ``spread`` is (slowest - fastest round) /
median, and every ratio is the median of the rounds' paired ratios. The one-process comparison runs
in its own process (a pipeline of one stage needs a process group of one), the two-process ones in a
second job of two processes. The load average printed at the end tells whether anything else ran.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from runtime_speed import WARMUP, _paired, _sgd, data, stage_module
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from lightning_pipe.capture import pipe_split
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.garbage import AlignedCollection
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule.options import ScheduleOptions

_Batches = list[tuple[torch.Tensor, torch.Tensor]]
_Key = tuple[str, int]  # a run: its name and micro-batches (0: none, DDP)
_Runs = dict[_Key, Callable[[], tuple[float, float | None]]]  # seconds per step, and between batches
TARGET = 1.05  # the strategy's time per step over its reference's, at most
STRATEGY, EXECUTOR = "PipelineStrategy", "executor"
PLAIN, TORCH, DDP = "plain Lightning", "torch loop", "Lightning ddp"
GATHER, BCAST = "+gather", "+bcast"  # the bare executor with one collective per call (executor_run)


class MLP(L.LightningModule):
    """``runtime_speed``'s two stages chained in ``self.net`` (same layers, same initial weights)."""

    def __init__(self, model: argparse.Namespace) -> None:
        super().__init__()
        self.net = nn.Sequential(*stage_module(0, model), *stage_module(1, model))
        self.log_loss = model.log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.net):  # each block a layer of the plan, whatever its size
            if index:
                pipe_split()
            x = block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _sgd(list(self.parameters()))


def loader(batches: _Batches) -> DataLoader:
    """The batches as they are, in order (no sampler, no collation of rows)."""
    return DataLoader(batches, batch_size=None)


class WindowTimer(L.Callback):
    """Seconds per step from the start of batch ``WARMUP`` to the end of the last batch (behind a
    barrier each), and the part of it spent between the batch hooks."""

    def __init__(self, batches: int) -> None:
        self.last = batches - 1
        self.start = self.end = 0.0
        self.inside = self.between = self.batch_start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == WARMUP:
            dist.barrier()
            self.start = time.perf_counter()
        self.batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if batch_idx >= WARMUP:
            self.inside += now - self.batch_start
        if batch_idx == self.last:
            self.between = now - self.start - self.inside  # the closing barrier's wait left out
            dist.barrier()
            self.end = time.perf_counter()

    def result(self) -> tuple[float, float]:
        steps = self.last + 1 - WARMUP
        assert self.end > self.start > 0, "the timed window was not reached"
        return (self.end - self.start) / steps, self.between / steps


def trainer(strategy: Any, devices: int, callback: L.Callback, steps: int, root: str) -> L.Trainer:
    """A Trainer of one epoch of ``steps`` batches on ``devices`` CPU processes, timed by ``callback``,
    with nothing but the training (no logger, checkpoints, progress bar or validation), writing under
    ``root``."""
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=[callback],
        max_epochs=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )


def fit(model: argparse.Namespace, batches: _Batches, strategy: Any, devices: int) -> tuple[float, float]:
    """Train one epoch of ``batches`` with Lightning: seconds per step and seconds between batches
    (anything Lightning or the strategy writes goes to ``model.root``, a temporary directory)."""
    timer = WindowTimer(len(batches))
    trainer(strategy, devices, timer, len(batches), model.root).fit(MLP(model), loader(batches))
    assert torch.get_num_threads() == 1, "Lightning changed the thread count"
    return timer.result()


def timed_loop(run_step: Callable[[torch.Tensor, torch.Tensor], object], batches: _Batches, finish: Callable) -> float:
    """Seconds per step of ``run_step`` over the loader of ``batches`` after the warm-up ones, from
    before the first timed step to after ``finish`` (the drain), between two barriers."""
    start = 0.0
    for index, (inputs, targets) in enumerate(loader(batches)):
        if index == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        run_step(inputs, targets)
    finish()
    dist.barrier()
    return (time.perf_counter() - start) / (len(batches) - WARMUP)


def executor_run(model: argparse.Namespace, batches: _Batches, family: str, microbatches: int, sync: str = "") -> float:
    """The bare executor on the strategy's stages and schedule; seconds per step. ``sync``, one
    collective per call as the strategy's loop has: ``+gather``, the losses gathered on every rank
    after each call (``share_losses=True``: ``all_gather_object``, as the strategy's replay of the
    logs); ``+bcast``, a one-element broadcast from rank 0 before each call (as the SIGTERM flag
    Lightning's training loop broadcasts at every batch when there are several processes)."""
    layers = list(MLP(model).net)
    stages = [nn.Sequential(*layers[: model.depth]), nn.Sequential(*layers[model.depth :])]
    world = dist.get_world_size()
    if world == 1:
        stages = [nn.Sequential(*layers)]
    rank = dist.get_rank()
    executor = PipelineExecutor(
        ScheduleOptions(family).make(world, microbatches),
        {rank: stages[rank]},
        nn.functional.cross_entropy,
        _sgd,
    )

    def run_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        inputs, targets = (inputs if executor.needs_inputs else None), (targets if executor.needs_targets else None)
        if sync == BCAST:
            dist.broadcast(torch.zeros(1), src=0)
        executor.step(inputs, targets, share_losses=sync == GATHER)

    seconds = timed_loop(run_step, batches, executor.drain)
    executor.close()
    return seconds


def torch_loop(model: argparse.Namespace, batches: _Batches) -> float:
    """A hand-written loop on the whole module (one process): forward, backward, step, zero_grad."""
    module = MLP(model)
    optimizer = _sgd(list(module.parameters()))

    def run_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        nn.functional.cross_entropy(module(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    return timed_loop(run_step, batches, lambda: None)


def _strategy(family: str, microbatches: int, model: argparse.Namespace, stages: int) -> PipelineStrategy:
    balance = [model.depth, model.depth + 1] if stages == 2 else [2 * model.depth + 1]
    return PipelineStrategy(family, microbatches=microbatches, balance=balance)


def _prepare(rank: int) -> None:
    """As torchrun leaves a worker: ``LOCAL_RANK`` set (Lightning sees processes launched externally)
    and ``OMP_NUM_THREADS=1`` (else Lightning's launcher, which a ``PipelineStrategy`` or ``ddp`` run
    goes through, sets ``torch.set_num_threads(cores // devices)``: 2 threads on 1 device here). And
    Lightning's info lines (devices, the strategy's plan) and its warnings about the loader off."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")


def _rounds(runs: dict[Any, Callable[[], Any]], model: argparse.Namespace) -> dict[Any, list[Any]]:
    """Every run once per round, in an order drawn anew each round (the same on every rank), a full
    collection before each, automatic collection off; whatever Lightning writes goes to a temporary
    directory (``model.root``), removed at the end."""
    garbage = AlignedCollection(every=1)
    results: dict[Any, list[Any]] = {label: [] for label in runs}
    labels = list(runs)
    with tempfile.TemporaryDirectory(prefix="strategy_overhead_") as model.root:
        for round_index in range(model.rounds):
            for label in random.Random(round_index).sample(labels, len(labels)):
                garbage.full()
                results[label].append(runs[label]())
    garbage.close()
    return results


def one_device(rank: int, model: argparse.Namespace) -> dict[_Key, list[Any]]:
    """(a), in a process group of one: the strategy and plain Lightning, and two references."""
    _prepare(rank)
    batches = data(model.steps + WARMUP, model)
    runs: _Runs = {
        (f"{STRATEGY} 1f1b", 1): lambda: fit(model, batches, _strategy("1f1b", 1, model, 1), 1),
        (PLAIN, 1): lambda: fit(model, batches, "auto", 1),
        (TORCH, 1): lambda: (torch_loop(model, batches), None),
        (f"{EXECUTOR} 1 stage", 1): lambda: (executor_run(model, batches, "1f1b", 1), None),
    }
    return _rounds(runs, model)


def _halves(batches: _Batches, rank: int) -> _Batches:
    """Rank ``rank``'s half of every batch (DDP: the same rows per update as the pipeline)."""
    return [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches]


def two_processes(rank: int, model: argparse.Namespace) -> dict[_Key, list[Any]]:
    """(b) and (c): the strategy, the bare executor (with and without a collective per call) and
    DDP, on two processes."""
    _prepare(rank)
    batches = data(model.steps + WARMUP, model)

    def strategy_fit(family: str, microbatches: int) -> tuple[float, float]:
        return fit(model, batches, _strategy(family, microbatches, model, 2), 2)

    def bare(family: str, microbatches: int, sync: str) -> tuple[float, None]:
        return executor_run(model, batches, family, microbatches, sync), None

    runs: _Runs = {(DDP, 0): lambda: fit(model, _halves(batches, rank), "ddp", 2)}
    for m in model.microbatches:
        for family in ("1f1b", "2bw"):
            runs[(f"{STRATEGY} {family}", m)] = functools.partial(strategy_fit, family, m)
            for sync in ("", GATHER, BCAST):
                runs[(f"{EXECUTOR} {family}{sync}", m)] = functools.partial(bare, family, m, sync)
    return _rounds(runs, model)


def _per_round(results: list[dict[_Key, list[Any]]]) -> tuple[dict[_Key, list[float]], dict[_Key, list[float]]]:
    """Per run and round, the slower rank's seconds per step, and its seconds between batches (for
    Lightning's runs)."""
    step: dict[_Key, list[float]] = {}
    between: dict[_Key, list[float]] = {}
    for key in results[0]:
        slower = [max(ranks, key=lambda pair: pair[0]) for ranks in zip(*(r[key] for r in results), strict=True)]
        step[key] = [seconds for seconds, _ in slower]
        if slower[0][1] is not None:
            between[key] = [outside for _, outside in slower]
    return step, between


class _Table:
    """Rows of one comparison: run, m, median ms/step, spread, samples/s, ms between batches, and a
    paired ratio."""

    def __init__(self, title: str, step: dict[_Key, list[float]], between: dict[_Key, list[float]], batch: int):
        self.step, self.between, self.batch = step, between, batch
        print(f"\n{title}")
        print(f"{'run':>24} {'m':>3} {'ms/step':>8} {'spread':>6} {'samples/s':>9} {'between':>8}   paired ratio")

    def row(self, key: _Key, comparison: str = "") -> None:
        times = self.step[key]
        median = statistics.median(times)
        spread = (max(times) - min(times)) / median
        between = f"{statistics.median(self.between[key]) * 1e3:.2f}" if key in self.between else ""
        m = str(key[1]) if key[1] else ""
        print(
            f"{key[0]:>24} {m:>3} {median * 1e3:>8.1f} {spread:>6.0%} {self.batch / median:>9.0f} {between:>8}   "
            f"{comparison}".rstrip()
        )

    def time_ratio(self, key: _Key, reference: _Key, target: bool = False) -> str:
        """Median over the rounds of the run's time per step over the reference's."""
        ratio = _paired(self.step[key], self.step[reference])  # median of key / reference, round by round
        verdict = f" (target <= {TARGET:.2f}x: {'met' if ratio <= TARGET else 'NOT met'})" if target else ""
        return f"time {ratio:.3f}x {reference[0]}{verdict}"

    def speed_ratio(self, key: _Key, reference: _Key) -> str:
        """Median over the rounds of the run's samples/s over the reference's (same samples per step)."""
        return f"samples/s {_paired(self.step[reference], self.step[key]):.3f}x {reference[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps per run (after {WARMUP} warm-up ones)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4, help="Linear+ReLU blocks per stage")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--features", type=int, help="inputs of the first layer (default: 1.5 width, balanced)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--no-log", dest="log", action="store_false", help="training_step calls no self.log")
    parser.add_argument("--pin", action="store_true", help="each process's threads on a core of its own (pin_cpus)")
    args = parser.parse_args()
    args.features = args.features or args.width * 3 // 2
    print(
        f"model: 2 x {args.depth} blocks of {args.width} ({args.features} inputs) + head, batch {args.batch}, "
        f"self.log {'on' if args.log else 'off'}, {'pinned' if args.pin else 'not pinned'}; "
        f"{args.rounds} rounds of {args.steps} timed steps (+{WARMUP}); "
        f"torch {torch.__version__}, lightning {L.__version__}"
    )
    began, load = time.monotonic(), os.getloadavg()[0]

    step, between = _per_round(run_local(one_device, 1, args, timeout=1800, pin_cpus=args.pin))
    table = _Table("(a) one process x one thread (between: ms/step outside the batch hooks)", step, between, args.batch)
    table.row((PLAIN, 1))
    table.row((f"{STRATEGY} 1f1b", 1), table.time_ratio((f"{STRATEGY} 1f1b", 1), (PLAIN, 1), target=True))
    for reference in (TORCH, f"{EXECUTOR} 1 stage"):
        table.row((reference, 1), table.time_ratio((reference, 1), (PLAIN, 1)))

    step, between = _per_round(run_local(two_processes, 2, args, timeout=3600, pin_cpus=args.pin))
    table = _Table(
        "(b) two processes x one thread: the strategy against the bare executor (same schedule, stages, batches); "
        f"{GATHER}/{BCAST}: the executor with one collective per call",
        step,
        between,
        args.batch,
    )
    for m in args.microbatches:
        for family in ("1f1b", "2bw"):
            ours, bare = (f"{STRATEGY} {family}", m), (f"{EXECUTOR} {family}", m)
            table.row(ours, table.time_ratio(ours, bare, target=True))
            table.row(bare)
            for sync in (GATHER, BCAST):
                table.row((f"{bare[0]}{sync}", m), table.time_ratio((f"{bare[0]}{sync}", m), bare))
    table = _Table(
        "(c) two processes x one thread: 2BW against Lightning's DDP (each rank half of every batch)",
        step,
        between,
        args.batch,
    )
    table.row((DDP, 0))
    for m in args.microbatches:
        for name in (f"{STRATEGY} 2bw", f"{EXECUTOR} 2bw"):
            table.row((name, m), table.speed_ratio((name, m), (DDP, 0)))
    print(
        f"\nload average (1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} after (about 2 expected from our "
        f"processes alone); {time.monotonic() - began:.0f} s"
    )


if __name__ == "__main__":
    main()

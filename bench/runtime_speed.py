"""Runtime throughput: ours vs torch.distributed.pipelining, non-flushing vs flushing, pipeline vs one
process, and measured vs simulated time per step — all in one run on this machine.

Run: ``python bench/runtime_speed.py [--steps 8] [--rounds 8] [--width 512] [--depth 4] [--batch 1024]
[--rows 32 512] [--features 768] [--microbatches 2 4] [--post-ahead-bytes N] [--shared-memory-bytes N]
[--pin]``: every micro-batch count with mini-batches of ``--batch`` rows, or, with ``--rows``, with
micro-batches of each of those sizes (a mini-batch of ``m x rows``); ``--post-ahead-bytes`` is our
executor's ``post_ahead_bytes`` (default its own), ``--shared-memory-bytes`` its
``shared_memory_bytes`` (default its own: 64 MiB rings in shared memory between the two processes;
0: gloo, as torch's peer); ``--pin`` keeps each process's threads on a core of its own for every
configuration, torch's peer and the baselines included (``pin_cpus``). The settings of
``docs/runtime.md``: ``--microbatches 2 4 8 16 --rows 32`` and
``--microbatches 2 4 8 16 --rows 512 --width 256``.

Every configuration trains the same balanced 2-stage MLP on the same mini-batches, 2 processes x 1
thread (ours exchanging messages through shared memory unless ``--shared-memory-bytes 0``, the others
over gloo; the peer: torch's ``PipelineStage`` with ``Schedule1F1B`` / ``ScheduleGPipe``, SGD
stepped after each schedule step). Each stage is ``depth`` Linear+ReLU blocks of ``width``; the last
one ends with a 10-class head, the first one reads ``features`` inputs. The data need no gradient, so
the first layer has no input-gradient half: with ``features = 1.5 width`` its forward and weight
gradient make up for it and both stages cost the same (the profiled costs are printed).
The same two processes run every configuration once per round, in an order drawn anew each round
(the same on both ranks, so no configuration always follows another), round after round, so a slow
spell of the machine hits them alike (the one-process baseline too: rank 0 trains the unsplit model
with one thread while rank 1 waits); a configuration's time per step is its median over the rounds,
each round timing ``--steps`` steps after warm-up ones between two barriers, and a speed-up is the
median of the rounds' ratios. ``two stages alone`` is the ceiling of any 2-stage pipeline on this
machine: both workers train their own stage at once, micro-batch by micro-batch, with no messages
(the two processes slow each other down on two cores). ``bare loop`` is a plain reference: a
hand-written non-flushing 1F1B (``_Bare``: blocking receives where needed, no schedule, versions or
timeline), what 2BW and CDP do minus everything that makes them correct. ``2bw slack 1`` is 2BW with
one more warm-up forward on stage 0 (``slack=1``), so each message has a forward and a backward to
cross in. The two-stages-alone runs are also the profile the simulator's prediction uses: each
stage's mean forward, backward and update seconds, measured in every round (the error is the median
of the rounds' errors); with them a message's latency and bandwidth, fitted to ping-pongs of an
empty and of an activation-sized message, and its processor time at each end (process CPU time per
message of the activation-sized ping-pong, the transport's threads included).
Two more predictions use costs measured inside a pipeline (``PipelineExecutor.measured_costs``: each
stage's mean compute per action in the timed steps, waits for messages excluded): ``in-run sim`` from
the configuration's own run, ``from 1f1b`` from our 1F1B's run of the same round (a calibration run
of one schedule predicting the others), with the same latency and bandwidth but no processor time per
message on top (the measured actions include it).
``in-run vs alone`` is what each action costs inside a pipeline beyond its compute: a stage's mean
forward (backward) inside the pipeline, waits excluded, less the same forward (backward) in the two-
stages-alone run of the same round (both processes busy in both), median over the rounds, in
milliseconds and as a share of the action alone; it includes the processor time of sending and receiving
the action's message, printed on the transport's line, and the two processes slowing each other. ``executor``
is the executor's own cost per action (bookkeeping, versions, loss weighting, timeline; no messages):
the whole model trained in one process as a one-stage pipeline of each family, against a plain loop of
the same forwards, backwards and update, interleaved in rounds, per action (``2m + 1`` per step), and
the same difference in the time each spends outside the model's compute (the stage's forward call,
autograd and the optimizer's step, timed around those calls: the loops' own Python, measured
directly rather than as the difference of two noisy totals). The
summary ends each run: per setting, 2BW and CDP against our 1F1B, measured and as the simulator predicts
from our 1F1B's costs (``from 1f1b``), and our 1F1B and GPipe against torch's.
``spread`` is (slowest - fastest round) / median. Every configuration, torch's peer and the baselines
included, runs under our executor's garbage-collection policy (``lightning_pipe/runtime/garbage.py``):
the heap of imports frozen, automatic collection off, a full collection before each configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.runtime import weights
from lightning_pipe.runtime.calibration import alone_costs
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.failure import FailureBoard
from lightning_pipe.runtime.garbage import AlignedCollection
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.runtime.shared_memory import open_links
from lightning_pipe.runtime.shared_memory_sizes import DEFAULT_SHARED_MEMORY_BYTES
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.schedule import Schedule, StageCosts, make_schedule, simulate

WARMUP = 3
OURS = ("1f1b", "gpipe", "2bw", "2bw slack 1", "cdp", "zb_h1")
VARIANTS = {"2bw slack 1": ("2bw", {"slack": 1})}  # a family with options
PEERS = ("1f1b", "gpipe")
_Batches = list[tuple[torch.Tensor, torch.Tensor]]


def schedule(name: str, microbatches: int, steps: int, stages: int = 2) -> Schedule:
    """The schedule of ``name``: a family, or a family with options (:data:`VARIANTS`)."""
    family, options = VARIANTS.get(name, (name, {}))
    return make_schedule(family, stages, microbatches, steps, **options)


def default_model(rows: int, microbatches: int, steps: int) -> argparse.Namespace:
    """The settings of this benchmark's defaults (4 blocks of 512, 768 inputs, the executor's own
    ``post_ahead_bytes``) with micro-batches of ``rows`` rows: for other scripts that reuse it."""
    return argparse.Namespace(
        width=512,
        depth=4,
        features=768,
        batch=rows * microbatches,
        steps=steps,
        post_ahead_bytes=None,
        shared_memory_bytes=None,
    )


def stage_module(stage: int, model: argparse.Namespace) -> nn.Module:
    torch.manual_seed(stage)
    widths = [model.features if stage == 0 else model.width] + [model.width] * model.depth
    blocks = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in itertools.pairwise(widths)]
    if stage == 1:
        blocks.append(nn.Linear(model.width, 10))
    return nn.Sequential(*blocks)


def stage_input(stage: int, model: argparse.Namespace, rows: int) -> torch.Tensor:
    """A micro-batch of what the stage reads (activations need a gradient, data do not)."""
    return torch.randn(rows, model.features if stage == 0 else model.width, requires_grad=stage > 0)


def data(steps: int, model: argparse.Namespace) -> _Batches:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(model.batch, model.features, generator=generator),
            torch.randint(0, 10, (model.batch,), generator=generator),
        )
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


def ours(
    rank: int, name: str, microbatches: int, batches: _Batches, model: argparse.Namespace
) -> tuple[float, StageCosts]:
    """Seconds per step, and every stage's mean compute per action as the pipeline ran them in the
    timed steps, waits for messages excluded (``PipelineExecutor.measured_costs``)."""
    executor = PipelineExecutor(
        lambda k: schedule(name, microbatches, k),
        {rank: stage_module(rank, model)},
        nn.functional.cross_entropy,
        _sgd,
        post_ahead_bytes=model.post_ahead_bytes,
        shared_memory_bytes=model.shared_memory_bytes,
    )
    # a non-flushing schedule is timed in steady state: per call, with the pipeline kept full
    seconds = _timed(lambda x, y: executor.step(x, y), batches)
    executor.drain()
    measured = executor.measured_costs(since_step=WARMUP)
    executor.close()
    return seconds, measured


def peer(rank: int, name: str, microbatches: int, batches: _Batches, model: argparse.Namespace) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = stage_module(rank, model)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]
    pipe = kind(stage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)
    optimizer = _sgd(list(module.parameters()))

    def run_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if rank == 0:
            pipe.step(inputs)
        else:
            pipe.step(target=targets)
        optimizer.step()
        optimizer.zero_grad()

    return _timed(run_step, batches)


class _Bare:
    """A hand-written non-flushing 1F1B on two ranks, nothing but the compute and the messages:
    blocking receives at the point of need, sends of the tensors themselves, no schedule,
    no weight versions, no timeline. Rank 0 runs F(i+1) before B(i), rank 1 F(i) then B(i), across
    steps. It is a timing reference, not training: the optimizer steps a copy of the weights (the
    same work as a real update, which would need the weight versions this loop has none of)."""

    def __init__(self, rank: int, microbatches: int, model: argparse.Namespace) -> None:
        self.rank, self.microbatches, self.width = rank, microbatches, model.width
        self.module = stage_module(rank, model)
        self.params = list(self.module.parameters())
        self.copies = [p.detach().clone() for p in self.params]
        self.optimizer = _sgd(self.copies)
        self.pending: torch.Tensor | None = None  # rank 0: the output whose backward is still to run
        self.sends: list[dist.Work] = []

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        parts = zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches), strict=True)
        for x, y in parts:
            if self.rank == 0:
                out = self.module(x)
                self.sends.append(dist.isend(out.detach(), 1))
                self.finish()
                self.pending = out
            else:
                x = torch.empty(x.shape[0], self.width)
                dist.recv(x, 0)
                x.requires_grad_()
                nn.functional.cross_entropy(self.module(x), y).backward()
                self.sends.append(dist.isend(x.grad, 0))
        self.update()

    def finish(self) -> None:
        """Rank 0: the backward of the micro-batch in flight, with the gradient rank 1 sent."""
        if self.pending is not None:
            grad = torch.empty_like(self.pending)
            dist.recv(grad, 1)
            self.pending.backward(grad)
            self.pending = None

    def update(self) -> None:
        for copy, param in zip(self.copies, self.params, strict=True):
            copy.grad, param.grad = param.grad, None
        self.optimizer.step()
        self.optimizer.zero_grad()
        for work in self.sends[:-1]:
            work.wait()
        self.sends = self.sends[-1:]


def bare(rank: int, microbatches: int, batches: _Batches, model: argparse.Namespace) -> float:
    """Seconds per step of :class:`_Bare` (rank 0's last backward after the timed steps)."""
    loop = _Bare(rank, microbatches, model)
    seconds = _timed(loop.step, batches)
    loop.finish()
    for work in loop.sends:
        work.wait()
    return seconds


def single_process(rank: int, batches: _Batches, model: argparse.Namespace) -> float:
    """Seconds per step of the unsplit model in one process with one thread (rank 0), while rank 1
    waits idle at a barrier."""
    if rank == 0:
        whole = nn.Sequential(stage_module(0, model), stage_module(1, model))
        optimizer = _sgd(list(whole.parameters()))
        times = []
        for inputs, targets in batches:
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(whole(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.fmean(times[WARMUP:]) if rank == 0 else 0.0


def _messenger(model: argparse.Namespace) -> Transport:
    """Our transport between the two processes, as the executor makes it: through shared memory
    (unless ``--shared-memory-bytes 0``), else gloo."""
    rank = dist.get_rank()
    capacity = DEFAULT_SHARED_MEMORY_BYTES if model.shared_memory_bytes is None else model.shared_memory_bytes
    groups = (dist.new_group([0, 1]), dist.new_group([0, 1]))
    links = open_links({(0, 1): capacity, (1, 0): capacity}, groups[0]) if capacity else None
    board = FailureBoard(dist.distributed_c10d._get_default_store(), rank)
    return Transport(rank, torch.device("cpu"), board, groups, links=links)


def _ping_pong(rank: int, transport: Transport, tensor: torch.Tensor) -> None:
    """Rank 0 sends ``tensor`` to rank 1, which sends it back."""
    peer = 1 - rank
    if rank == 1:
        transport.receive(peer, transport.expect(peer, "ping"))
    transport.send(peer, tensor, "ping")
    if rank == 0:
        transport.receive(peer, transport.expect(peer, "ping"))
    transport.flush()


def _round_trip(rank: int, transport: Transport, tensor: torch.Tensor, repeats: int = 30) -> tuple[float, float]:
    """Median seconds of a ping-pong of ``tensor`` between the two processes, and this process's CPU
    seconds (all its threads) per message sent or received."""
    times = []
    dist.barrier()
    for _ in range(3):  # warm-up
        _ping_pong(rank, transport, tensor)
    cpu = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        _ping_pong(rank, transport, tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu) / (2 * repeats)


def network(rank: int, rows: int, model: argparse.Namespace) -> tuple[float, float, float]:
    """Latency (seconds per message), bandwidth (bytes per second; ``inf`` when the activation goes
    no slower than an empty message) and processor seconds per activation at each end, of our
    transport between the two processes (as our executor's messages go), from ping-pongs of one
    element and of one activation."""
    transport = _messenger(model)
    empty = _round_trip(rank, transport, torch.zeros(1))[0] / 2
    activation = torch.zeros(rows, model.width)
    full, overhead = _round_trip(rank, transport, activation)
    transport.abort()
    nbytes = activation.numel() * activation.element_size()
    return empty, nbytes / (full / 2 - empty) if full / 2 > empty else math.inf, overhead


def stages_alone(
    rank: int, microbatches: int, steps: int, model: argparse.Namespace, together: bool = True
) -> tuple[float, ...]:
    """Each worker trains its own stage on its own, with no messages, both at once (``together``) or
    one after the other while the other waits: seconds per step, and the stage's mean forward,
    backward and update seconds (the profile the simulator uses: the time per step it predicts is a
    mean over steps, as the one measured is)."""
    module = stage_module(rank, model)
    optimizer = _sgd(list(module.parameters()))
    rows = model.batch // microbatches
    inputs = [stage_input(rank, model, rows) for _ in range(microbatches)]
    targets = torch.randint(0, 10, (rows,))
    forward, backward, update, per_step = [], [], [], []
    for turn in [None] if together else [0, 1]:
        dist.barrier()
        if turn in (None, rank):
            _train_alone(rank, module, optimizer, inputs, targets, steps, (forward, backward, update, per_step))
    dist.barrier()
    skip = WARMUP * microbatches
    return (
        statistics.fmean(per_step[WARMUP:]),
        statistics.fmean(forward[skip:]),
        statistics.fmean(backward[skip:]),
        statistics.fmean(update[WARMUP:]),
    )


def _train_alone(
    rank: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: list[torch.Tensor],
    targets: torch.Tensor,
    steps: int,
    record: tuple[list[float], ...],
) -> None:
    forward, backward, update, per_step = record
    for _ in range(WARMUP + steps):
        begin = time.perf_counter()
        for x in inputs:
            start = time.perf_counter()
            out = module(x)
            if rank == 1:
                out = nn.functional.cross_entropy(out, targets)
            middle = time.perf_counter()
            out.backward(None if rank == 1 else torch.ones_like(out))
            x.grad = None
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        update.append(time.perf_counter() - start)
        per_step.append(time.perf_counter() - begin)


OVERHEAD_FAMILIES = ("1f1b", "gpipe", "2bw", "cdp")


def _one_stage(model: argparse.Namespace) -> nn.Module:
    return nn.Sequential(stage_module(0, model), stage_module(1, model))


class _ComputeClock:
    """Seconds spent in the model's own compute while :meth:`installed`: every module's forward (the
    outermost call; the replicas a non-flushing schedule computes stashed versions with included),
    autograd (``torch.autograd.backward`` and ``grad``) and the optimizer's step (``SGD.step``, or the
    same update written into a stashed version's storage: ``out_of_place.step_into``). The rest of a
    step is the training loop's own Python."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._start = 0.0

    def _enter(self, *_: object) -> None:
        if not self._depth:
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, *_: object) -> None:
        self._depth -= 1
        if not self._depth:  # a call inside another is counted once, by the outer one
            self.seconds += time.perf_counter() - self._start

    def timed(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave()

        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._leave),
        ]
        originals = (torch.autograd.backward, torch.autograd.grad, torch.optim.SGD.step, weights.step_into)
        torch.autograd.backward, torch.autograd.grad = self.timed(originals[0]), self.timed(originals[1])
        torch.optim.SGD.step, weights.step_into = self.timed(originals[2]), self.timed(originals[3])
        try:
            yield
        finally:
            torch.autograd.backward, torch.autograd.grad, torch.optim.SGD.step, weights.step_into = originals
            for hook in hooks:
                hook.remove()


def overhead_worker(rank: int, microbatches: int, model: argparse.Namespace) -> dict[str, list[float]]:
    """One process, one thread, no messages: per round, seconds per step of the whole model as a
    one-stage pipeline of each family in :data:`OVERHEAD_FAMILIES` and as a plain loop of the same
    forwards, backwards and update (the difference is what the executor itself costs), and, under
    ``"own <name>"``, the seconds per step each spent outside the model's compute (:class:`_ComputeClock`)."""
    garbage = AlignedCollection(every=1)
    batches = data(model.steps + WARMUP, model)
    times: dict[str, list[float]] = {}

    def measured(name: str, run_step: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        for inputs, targets in batches[:WARMUP]:
            run_step(inputs, targets)
        clock = _ComputeClock()
        with clock.installed():
            start = time.perf_counter()
            for inputs, targets in batches[WARMUP:]:
                run_step(inputs, targets)
            seconds = (time.perf_counter() - start) / (len(batches) - WARMUP)
        times.setdefault(name, []).append(seconds)
        times.setdefault(f"own {name}", []).append(seconds - clock.seconds / (len(batches) - WARMUP))

    def plain() -> None:
        module = _one_stage(model)
        optimizer = _sgd(list(module.parameters()))

        def run_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
            for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True):
                (nn.functional.cross_entropy(module(x), y) * (len(y) / len(targets))).backward()
            optimizer.step()
            optimizer.zero_grad()

        measured("plain", run_step)

    def executor(family: str) -> None:
        stages = [_one_stage(model)]
        pipeline = PipelineExecutor(
            lambda k: schedule(family, microbatches, k, stages=1), stages, nn.functional.cross_entropy, _sgd
        )
        measured(family, lambda x, y: pipeline.step(x, y))
        pipeline.drain()
        pipeline.close()

    runs = [plain] + [functools.partial(executor, family) for family in OVERHEAD_FAMILIES]
    for round_index in range(model.rounds):
        for run in random.Random(round_index).sample(runs, len(runs)):
            garbage.full()
            run()
    garbage.close()
    return times


def worker(rank: int, microbatches: int, model: argparse.Namespace) -> dict:
    """Everything measured in the two processes: network, and every configuration once per round
    (the stages alone giving the round's profile)."""
    # every configuration runs as our executor runs by default, torch's peer alike: the heap of imports
    # frozen, automatic collection off, a full collection before each configuration
    garbage = AlignedCollection(every=1)
    batches = data(model.steps + WARMUP, model)
    result: dict = {"network": [], "costs": [], "times": {}, "in-run costs": {}, "in turn": []}
    times = result["times"]

    def alone() -> None:
        seconds, *costs = stages_alone(rank, microbatches, model.steps, model)
        result["costs"].append(tuple(costs))
        times.setdefault("two stages alone", []).append(seconds)

    def in_turn() -> None:
        result["in turn"].append(stages_alone(rank, microbatches, model.steps, model, together=False)[0])

    def run_ours(name: str) -> None:
        seconds, in_run = ours(rank, name, microbatches, batches, model)
        times.setdefault(f"ours {name}", []).append(seconds)
        result["in-run costs"].setdefault(name, []).append(in_run)

    def run_peer(name: str) -> None:
        times.setdefault(f"torch {name}", []).append(peer(rank, name, microbatches, batches, model))

    def one_process() -> None:
        times.setdefault("one process", []).append(single_process(rank, batches, model))

    def run_bare() -> None:
        times.setdefault("bare loop", []).append(bare(rank, microbatches, batches, model))

    runs = [alone, in_turn, one_process, run_bare]
    runs += [functools.partial(run_ours, name) for name in OURS] + [functools.partial(run_peer, name) for name in PEERS]
    for round_index in range(model.rounds):
        result["network"].append(network(rank, model.batch // microbatches, model))
        # a new order every round, the same on both ranks: no configuration always follows another
        for run in random.Random(round_index).sample(runs, len(runs)):
            garbage.full()
            run()
    garbage.close()
    return result


def _profile(per_rank: tuple[tuple[float, float, float], ...]) -> StageCosts:
    """A round's stage costs from the two-stages-alone run: each rank's (forward, backward, update)."""
    forward, backward, update = (list(column) for column in zip(*per_rank, strict=True))
    return StageCosts(forward, backward, update=update)


def predicted(name: str, microbatches: int, costs: StageCosts, nbytes: float, net: tuple[float, ...]) -> float:
    """Simulated steady-state time per step of ``name`` (:func:`schedule`) with ``costs`` and the
    network ``net`` (latency, bandwidth, processor time per message)."""
    return simulate(schedule(name, microbatches, 8), _priced(costs, nbytes, net), early_gradients=True).steady_step


def _priced(costs: StageCosts, nbytes: float, net: tuple[float, ...]) -> StageCosts:
    return dataclasses.replace(costs, activation_bytes=[nbytes, 0.0], latency=net[0], bandwidth=net[1], overhead=net[2])


def _prediction(
    name: str,
    microbatches: int,
    costs: list[StageCosts],
    networks: list[tuple[float, ...]],
    nbytes: float,
    measured: list[float],
) -> tuple[float, float]:
    """Median over the rounds of the simulated step (each round with its own stage costs and network)
    and of its relative error against the measured step."""
    expected = [predicted(name, microbatches, c, nbytes, n) for c, n in zip(costs, networks, strict=True)]
    errors = [abs(t - e) / e for t, e in zip(measured, expected, strict=True)]
    return statistics.median(expected), statistics.median(errors)


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
    parser.add_argument("--features", type=int, help="inputs of the first layer (default: 1.5 width, balanced)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rows", type=int, nargs="+", help="micro-batch sizes (default: --batch / m)")
    parser.add_argument("--post-ahead-bytes", type=int, help="our executor's post_ahead_bytes (default: its own)")
    parser.add_argument(
        "--shared-memory-bytes", type=int, help="our executor's shared_memory_bytes (default: its own; 0: gloo)"
    )
    parser.add_argument("--pin", action="store_true", help="each process's threads on a core of its own (pin_cpus)")
    args = parser.parse_args()
    args.features = args.features or args.width * 3 // 2
    print(
        f"model: 2 stages x {args.depth} blocks of {args.width} ({args.features} inputs), "
        f"{f'micro-batches of {args.rows} rows' if args.rows else f'batch {args.batch}'}; "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    summary: list[str] = []
    for microbatches, rows in itertools.product(args.microbatches, args.rows or [None]):
        cell = argparse.Namespace(**vars(args))
        cell.batch = microbatches * rows if rows else args.batch
        summary.append(_run_cell(microbatches, cell))
    print(
        f"\nsummary: {'m':>3} {'rows':>5} {'2bw/1f1b':>8} {'predicted':>9} {'shared':>7} {'cdp/1f1b':>8} "
        f"{'predicted':>9} {'shared':>7} "
        f"{'1f1b/torch':>10} {'gpipe/torch':>11}   (paired medians; speed-ups, > 1: faster)"
    )
    print("\n".join(summary))


def _run_cell(microbatches: int, args: argparse.Namespace) -> str:
    """Every configuration at ``microbatches`` micro-batches of ``args.batch / microbatches`` rows:
    prints its rows of the table, returns its summary line."""
    rows = args.batch // microbatches
    print(f"\n--- m = {microbatches}, micro-batches of {rows} rows (mini-batch {args.batch})")
    print(
        f"{'run':>20} {'m':>3} {'ms/step':>8} {'spread':>6} {'speed-up':>22} {'vs 1 proc':>9} {'simulated':>9} "
        f"{'error':>6} {'in-run sim':>10} {'error':>6} {'from 1f1b':>9} {'error':>6}"
    )
    results = run_local(worker, 2, microbatches, args, timeout=3600, pin_cpus=args.pin)
    networks = results[0]["network"]  # per round
    net = [statistics.median(column) for column in zip(*networks, strict=True)]
    costs = [_profile(pair) for pair in zip(*(r["costs"] for r in results), strict=True)]  # per round
    nbytes = rows * args.width * 4
    per_round = {
        label: [max(pair) for pair in zip(*(r["times"][label] for r in results), strict=True)]
        for label in results[0]["times"]
    }
    step = {label: statistics.median(times) for label, times in per_round.items()}
    spread = {label: (max(times) - min(times)) / step[label] for label, times in per_round.items()}
    in_run = results[0]["in-run costs"]  # per family and round: every stage's costs (alike on both ranks)
    # measured actions already hold the processor time of their messages: no overhead on top
    wires = [(latency, bandwidth, 0.0) for latency, bandwidth, _ in networks]
    for family in OURS:
        label = f"ours {family}"
        baseline = f"torch {family}" if family in PEERS else "ours 1f1b"
        speedup = f"{_paired(per_round[baseline], per_round[label]):.2f}x vs {LABELS.get(family, '1f1b')}"
        expected, error = _prediction(family, microbatches, costs, networks, nbytes, per_round[label])
        replayed, replay_error = _prediction(family, microbatches, in_run[family], wires, nbytes, per_round[label])
        calibrated, calibrated_error = _prediction(
            family, microbatches, in_run["1f1b"], wires, nbytes, per_round[label]
        )
        print(
            f"{label:>20} {microbatches:>3} {step[label] * 1e3:>8.1f} {spread[label]:>6.0%} {speedup:>22} "
            f"{_paired(per_round['one process'], per_round[label]):>8.2f}x {expected * 1e3:>7.1f}ms {error:>5.0%} "
            f"{replayed * 1e3:>8.1f}ms {replay_error:>5.0%} {calibrated * 1e3:>7.1f}ms {calibrated_error:>5.0%}"
        )
        if family in PEERS:
            other = f"torch {family}"
            name = f"torch {LABELS[family]}"
            print(f"{name:>20} {microbatches:>3} {step[other] * 1e3:>8.1f} {spread[other]:>6.0%}")
    for reference in ("bare loop", "two stages alone"):
        print(
            f"{reference:>20} {microbatches:>3} {step[reference] * 1e3:>8.1f} {spread[reference]:>6.0%} "
            f"{'':>22} {_paired(per_round['one process'], per_round[reference]):>8.2f}x"
        )
    print(f"{'one process':>20} {microbatches:>3} {step['one process'] * 1e3:>8.1f} {spread['one process']:>6.0%}")
    for stage in range(2):
        forward, backward, update = (
            statistics.median(getattr(c, name)[stage] for c in costs) * 1e3
            for name in ("forward", "backward", "update")
        )
        print(
            f"{'':>20} stage {stage}: F {forward:.2f} ms, B {backward:.2f} ms, update {update:.2f} ms "
            "(median of the rounds' means)"
        )
    transport = "gloo" if args.shared_memory_bytes == 0 else "shared memory"
    print(
        f"{'':>20} {transport}: {net[0] * 1e6:.0f} us per message, {net[1] / 1e9:.2f} GB/s, "
        f"{net[2] * 1e6:.0f} us of processor per activation at each end (medians of the rounds)"
    )
    for family in OURS:
        print(f"{'in-run vs alone ' + family:>20} {_overhead(in_run[family], costs, microbatches)}")
    own = run_local(overhead_worker, 1, microbatches, args, timeout=3600)[0]
    actions = 2 * microbatches + 1
    compute = statistics.median(own["plain"]) / actions
    for family in OVERHEAD_FAMILIES:
        extra = statistics.median(t - p for t, p in zip(own[family], own["plain"], strict=True)) / actions
        python = statistics.median(
            (t - p) / actions for t, p in zip(own[f"own {family}"], own["own plain"], strict=True)
        )
        print(
            f"{'executor ' + family:>20} {extra * 1e6:+.0f} us per action ({extra / compute:+.1%} of a plain action, "
            f"{compute * 1e3:.2f} ms): one process, one stage, no messages, median of paired rounds; outside "
            f"the model's compute {python * 1e6:+.0f} us ({python / compute:+.1%})"
        )
    # the machine's contention, per round: both stages' time at once over their time one at a time
    together = [sum(pair) for pair in zip(*(r["times"]["two stages alone"] for r in results), strict=True)]
    in_turn = [sum(pair) for pair in zip(*(r["in turn"] for r in results), strict=True)]
    contention = [max(t / s, 1.0) for t, s in zip(together, in_turn, strict=True)]  # below 1: noise
    print(
        f"{'contention':>20} {statistics.median(contention):.2f}x: each stage's step with both stages at once over "
        "one at a time (median of the rounds)"
    )
    # each round's 1F1B costs made costs alone with the round's contention (the calibration, once)
    calibration = [
        alone_costs(
            _priced(dataclasses.replace(c, contention=k), nbytes, n),
            schedule("1f1b", microbatches, 8),
            early_gradients=True,
        )
        for c, n, k in zip(in_run["1f1b"], wires, contention, strict=True)
    ]
    ratios = [
        f"{_paired(per_round['ours 1f1b'], per_round[f'ours {family}']):>7.2f}x "
        f"{_predicted_ratio(family, microbatches, in_run['1f1b'], wires, nbytes):>8.2f}x "
        f"{_predicted_ratio(family, microbatches, calibration, wires, nbytes):>6.2f}x"
        for family in ("2bw", "cdp")
    ]
    peers = [_paired(per_round[f"torch {family}"], per_round[f"ours {family}"]) for family in PEERS]
    return f"{'':>8} {microbatches:>3} {rows:>5} {ratios[0]} {ratios[1]} {peers[0]:>9.2f}x {peers[1]:>10.2f}x"


def _overhead(in_run: list[StageCosts], alone: list[StageCosts], microbatches: int) -> str:
    """Per stage, what a forward and a backward cost inside the pipeline beyond the same compute alone
    (median over the rounds of the difference of the rounds' means), in ms and as a share of alone;
    the backward's mean over a step's ``microbatches``: the first, then the ones adding to it."""

    def mean(costs: StageCosts, kind: str, stage: int) -> float:
        extra = costs.accumulate[stage] * (microbatches - 1) / microbatches if costs.accumulate else 0.0
        return getattr(costs, kind)[stage] + (extra if kind == "backward" else 0.0)

    parts = []
    for stage in range(2):
        for kind in ("forward", "backward"):
            extra = statistics.median(
                mean(i, kind, stage) - mean(a, kind, stage) for i, a in zip(in_run, alone, strict=True)
            )
            base = statistics.median(mean(a, kind, stage) for a in alone)
            parts.append(f"{kind[0].upper()}{stage} {extra * 1e3:+.3f} ms ({extra / base:+.1%})")
    return ", ".join(parts)


def _predicted_ratio(
    name: str, microbatches: int, costs: list[StageCosts], networks: list[tuple[float, ...]], nbytes: float
) -> float:
    """Median over the rounds of the simulated step of our 1F1B over that of ``name``, each round
    simulated with its own costs (a calibration run's; with a contention, the costs alone) and
    network: the predicted speed-up."""
    return statistics.median(
        predicted("1f1b", microbatches, c, nbytes, n) / predicted(name, microbatches, c, nbytes, n)
        for c, n in zip(costs, networks, strict=True)
    )


if __name__ == "__main__":
    main()

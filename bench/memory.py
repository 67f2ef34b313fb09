"""Resident memory per rank: the pipeline (each rank holds only its stages) against plain Lightning on
one process and Lightning's DDP, side by side in one run, and against what the plan predicts.

Run: ``python bench/memory.py [--model mlp|resnet18|gpt2] [--width 4096] [--depth 16] [--optimizer sgd|adam]
[--pipe 2 4] [--ddp 2] [--batch 16] [--steps 3] [--microbatches M] [--shared-memory-bytes B]
[--kinds plain ddp pipe pipe-meta] [--mmap-threshold BYTES] [--release-memory] [--counted]`` (the default, a
1.07 GB MLP, about 6 minutes on 2 cores and 24 GB).

``--model mlp`` is ``depth`` Linear(width, width)+ReLU blocks and a 10-class head in one
``nn.Sequential`` (16 x 4096^2 fp32: 1.07 GB of weights: weight-heavy); ``--model resnet18`` the CIFAR
ResNet-18 of the recipes (45 MB of weights; at ``--batch 256`` activation-heavy); ``--model gpt2`` a
``transformers`` ``GPT2LMHeadModel`` of 8 blocks 512 wide (8 heads, 1024 tokens' vocabulary) on
``--batch`` rows of 256 tokens, trained with AdamW whatever ``--optimizer`` says (the
``LightningModule`` of ``tests/user_modules.py``). Cross-entropy, SGD with momentum (one state tensor
per parameter) or Adam (two). Every configuration runs in fresh
processes (a process's peak is its own):

- ``plain``: Lightning on one process (``strategy="auto"``);
- ``ddp P``: Lightning's DDP on P processes (each a full replica: weights, gradients, optimizer state,
  and DDP's gradient buckets, one more gradient-sized copy);
- ``pipe P``: ``PipelineStrategy("1f1b")`` on P processes, split by the ``time`` partitioner (its plan
  prints each stage's memory);
- ``pipe-meta P``: the same, the model built in ``trainer.init_module(empty_init=True)`` (on the meta
  device: each rank materialises only its stages, so no rank ever holds the whole model).

Each rank reads ``/proc/self/status`` at three points: before the model is built (``base``: the
interpreter, torch, Lightning and the process group, the framework baseline), at the end of fit
(``steady``: VmRSS) and its peak (VmHWM). ``holds`` is the bytes of the parameters the rank holds at
the end (not on the meta device), ``expected`` = base + holds x (1 weight + 1 gradient + the
optimizer's copies; DDP: + 1 bucket copy) + the MLP's activations (``--batch`` rows of ``width`` floats
per layer; not counted for the ResNet). Built eagerly, the pipeline's model is whole on every rank
until the split is known (its weights, ``whole``), so that peak is expected at base + max(whole, its
stages' state); built on the meta device, at ``expected``. ``peak/exp`` compares the measured peak
with that, ``steady/exp`` the steady state with ``expected``. ``plan MB`` is the memory the strategy
predicts for the rank (``PipelineStrategy.predicted_memory``): the plan's for its stage (weights,
gradient, optimizer state, activations in flight: Beaumont et al. 2021, §3.2) and the shared-memory
rings it maps; ``rise/plan`` is the measured rise of the peak over ``base`` against it.

The rise is then taken apart, sampled every 5 ms from the base to the end of fit: ``alloc MB``, the
peak of the bytes glibc has handed out and not had back (``mallinfo2``, less its value at the base: on CPU what
``torch.cuda.max_memory_allocated`` counts on a GPU), against the plan's memory for the rank's stages
(``alloc/stages``); ``shm MB``, the peak of its shared memory (``RssShmem``), against its rings
(``rings MB``); ``other MB``, the rise less both (the heap glibc keeps, code pages of the kernels
loaded, threads' stacks; the peaks need not coincide).

``--counted`` also counts, in the pipeline's runs, the bytes of tensors alive at the dispatcher from
the second batch on (:class:`~lightning_pipe.cost.allocated.AllocatedPeak`, the shared-memory rings'
tensors among them: what ``torch.cuda.max_memory_allocated`` counts on a GPU, without glibc's free
space), against the strategy's whole prediction (``counted/plan``); the counting slows the steps.

On CPU the peak is glibc's: a freed block below its (self-raising, up to 32 MiB) mmap threshold stays in
the process's heap, and the heap's free space adds to the resident memory of activation-heavy runs.
``--release-memory`` runs the pipeline with ``release_memory=True`` (blocks of 4 MiB or more go back
to the system when freed: :mod:`lightning_pipe.runtime.allocator`); ``--mmap-threshold BYTES`` sets
``MALLOC_MMAP_THRESHOLD_`` for every process of the run, plain Lightning's and DDP's too. Either way
each allocation of that size pays its page faults.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.allocator import mallinfo
from lightning_pipe.zoo.classifier import ImageClassifier
from tests.lightning_cases import AllocatedFrom

MB = 2**20
_OPTIMIZER_COPIES = {"sgd": 1, "adam": 2}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class _Peaks:
    """From the base until fit ends, samples every 5 ms the bytes glibc has handed out and not yet been given
    back (``mallinfo2``: heap blocks in use + mmapped blocks; on CPU what
    ``torch.cuda.max_memory_allocated`` counts on a GPU, without the free space glibc keeps) and the
    shared memory the process maps (``RssShmem``: its rings), keeping each one's peak;
    ``allocated`` is the peak less what was allocated at the start (``None`` without glibc)."""

    def __init__(self) -> None:
        self._glibc = mallinfo() is not None
        self._start = self._in_use()
        self._peak, self.shared = self._start, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _in_use(self) -> int:
        info = mallinfo()
        return 0 if info is None else info.in_use

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._in_use())
            self.shared = max(self.shared, _status("RssShmem"))
            self._stop.wait(0.005)

    @property
    def allocated(self) -> int | None:
        return self._peak - self._start if self._glibc else None

    def start(self) -> _Peaks:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ResNet(ImageClassifier):
    """The CIFAR ResNet-18 of the recipes (activation-heavy: 45 MB of weights, batch 256)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__("resnet18", optimizer="sgd" if optimizer == "sgd" else "adamw")


GPT2_SHAPE = {"n_layer": 8, "n_embd": 512, "n_head": 8, "vocab_size": 1024, "n_positions": 256}
GPT2_TOKENS = 256


def _gpt2() -> L.LightningModule:
    from tests.user_modules import HuggingFaceGPT2

    return HuggingFaceGPT2(**GPT2_SHAPE)


class DeepMLP(L.LightningModule):
    def __init__(self, width: int, depth: int, optimizer: str) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(depth):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(width, 10))
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _worker(rank: int, kind: str, options: argparse.Namespace, root: str) -> dict[str, float]:
    os.environ["LOCAL_RANK"] = str(rank)
    for name in ("lightning.pytorch", "lightning.fabric"):  # the plans and Lightning's notices: only the table
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    processes = torch.distributed.get_world_size()
    base = _status("VmRSS")
    peaks = _Peaks().start()  # from the base on: the model's weights count, built eagerly or not
    if kind.startswith("pipe"):  # planned by the time partitioner: the plan predicts each stage's memory
        strategy: Any = PipelineStrategy(  # profiled every run: the profiling is part of rank 0's peak
            "1f1b",
            microbatches=options.microbatches or processes,
            shared_memory_bytes=options.shared_memory_bytes,
            release_memory=True if options.release_memory else None,  # None: the strategy's default
            profile_cache=False,
        )
    else:
        strategy = kind if kind == "ddp" else "auto"
    counted = AllocatedFrom(1) if options.counted and kind.startswith("pipe") else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=processes,
        strategy=strategy,
        max_steps=options.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[counted] if counted is not None else [],
    )
    with trainer.init_module(empty_init=kind == "pipe-meta"):
        if options.model == "resnet18":
            model: L.LightningModule = ResNet(options.optimizer)
        elif options.model == "gpt2":
            model = _gpt2()
        else:
            model = DeepMLP(options.width, options.depth, options.optimizer)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = options.batch * options.steps
    if options.model == "gpt2":
        data = TensorDataset(torch.randint(0, GPT2_SHAPE["vocab_size"], (rows, GPT2_TOKENS)))
    else:
        shape = (3, 32, 32) if options.model == "resnet18" else (options.width,)
        data = TensorDataset(torch.randn(rows, *shape), torch.randint(0, 10, (rows,)))
    trainer.fit(model, DataLoader(data, batch_size=options.batch))
    peaks.stop()
    holds = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    predicted = getattr(trainer.strategy, "predicted_memory", None)  # its stages' (the plan's) + its rings
    copies = 2 + _OPTIMIZER_COPIES[options.optimizer] + (1 if kind == "ddp" else 0)
    mlp = options.model == "mlp"  # the others' activations are not estimated here: the plan predicts them
    activations = 2 * (2 * options.depth + 1) * options.batch * options.width * 4 if mlp else 0
    expected = base + holds * copies + activations
    return {
        "base": base,
        "peak": _status("VmHWM"),
        "steady": _status("VmRSS"),
        "holds": holds,
        "whole": whole,
        "expected": expected,
        "expected_peak": max(expected, base + whole + activations) if kind == "pipe" else expected,
        "predicted": predicted,
        "rings": getattr(trainer.strategy, "ring_bytes", 0),
        "allocated": peaks.allocated,
        "shared": peaks.shared,
        "counted": None if counted is None else counted.peak,
    }


def _parts(r: dict[str, Any]) -> str:
    """The allocated peak against the plan's stages, the shared memory against the rings, the rest."""
    allocated = "-" if r["allocated"] is None else f"{r['allocated'] / MB:.0f}"
    stages = r["predicted"] - r["rings"] if r["predicted"] else None
    ratio = f"{r['allocated'] / stages:.2f}" if stages and r["allocated"] is not None else "-"
    other = "-" if r["allocated"] is None else f"{(r['peak'] - r['base'] - r['allocated'] - r['shared']) / MB:.0f}"
    parts = f" {allocated:>9} {ratio:>13} {r['shared'] / MB:7.0f} {r['rings'] / MB:9.0f} {other:>9}"
    if r["counted"] is None:
        return parts
    return parts + f" {r['counted'] / MB:10.0f} {r['counted'] / r['predicted']:12.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "resnet18", "gpt2"], default="mlp")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--optimizer", choices=sorted(_OPTIMIZER_COPIES), default="sgd")
    parser.add_argument("--pipe", type=int, nargs="+", default=[2, 4], help="process counts of the pipeline runs")
    parser.add_argument("--ddp", type=int, nargs="*", default=[2], help="process counts of the DDP runs")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=None, help="per batch (default: the processes)")
    parser.add_argument("--shared-memory-bytes", type=int, default=None, help="the pipeline's rings (0: gloo only)")
    parser.add_argument("--kinds", nargs="+", default=["plain", "ddp", "pipe", "pipe-meta"], help="runs to make")
    parser.add_argument("--root", default=tempfile.mkdtemp(prefix="bench_memory_"), help="the runs' files")
    parser.add_argument("--mmap-threshold", type=int, default=None, help="glibc's MALLOC_MMAP_THRESHOLD_")
    parser.add_argument(
        "--release-memory", action="store_true", help="the pipeline's release_memory=True (its runs only)"
    )
    parser.add_argument(
        "--counted", action="store_true", help="also the tensors alive at the dispatcher (the pipeline's runs)"
    )
    options = parser.parse_args(argv)
    if options.model == "gpt2":  # its LightningModule trains with AdamW (two states per parameter)
        options.optimizer = "adam"
    if options.mmap_threshold is not None:  # read by glibc when each (spawned) process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(options.mmap_threshold)
    runs = [("plain", 1), *(("ddp", p) for p in options.ddp)]
    runs += [(kind, p) for p in options.pipe for kind in ("pipe", "pipe-meta")]
    runs = [(kind, p) for kind, p in runs if kind in options.kinds]
    model = {
        "resnet18": "CIFAR ResNet-18",
        "gpt2": f"transformers GPT-2 {GPT2_SHAPE}, {GPT2_TOKENS} tokens",
    }.get(options.model, f"{options.depth} x Linear({options.width}, {options.width}) + head")
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's default")
    print(
        f"model: {model}, {options.optimizer}, batch {options.batch}, {options.steps} steps, "
        f"MALLOC_MMAP_THRESHOLD_: {threshold}, the pipeline's release_memory: "
        f"{'True' if options.release_memory else 'its default (off: no memory limit)'}"
    )
    header = (
        "run         rank  base MB  holds MB  peak MB  steady MB  expected MB  peak/exp  steady/exp  plan MB  rise/plan"
        "  alloc MB  alloc/stages  shm MB  rings MB  other MB"
    ) + ("  counted MB  counted/plan" if options.counted else "")
    print(header)
    print("-" * len(header))
    for kind, processes in runs:
        results = run_local(_worker, processes, kind, options, options.root, timeout=900)
        for rank, r in enumerate(results):
            print(
                f"{kind + ' ' + str(processes):11} {rank:4} {r['base'] / MB:8.0f} {r['holds'] / MB:9.0f} "
                f"{r['peak'] / MB:8.0f} {r['steady'] / MB:10.0f} {r['expected'] / MB:12.0f} "
                f"{r['peak'] / r['expected_peak']:9.2f} {r['steady'] / r['expected']:11.2f} "
                + (
                    f"{r['predicted'] / MB:8.0f} {(r['peak'] - r['base']) / r['predicted']:10.2f}"
                    if r["predicted"]
                    else f"{'-':>8} {'-':>10}"
                )
                + _parts(r),
                flush=True,
            )
    print(f"whole model: {results[0]['whole'] / MB:.0f} MB of weights")


if __name__ == "__main__":
    main()

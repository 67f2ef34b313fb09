"""The CUDA path on one GPU, in one run: the CUDA tests, ``PipelineStrategy`` on one device against plain
Lightning on the same device, and the plan's predictions against what the device measured.

Run: ``python bench/gpu_check.py --out DIR`` on a machine with one GPU (sized for under 8 minutes on an
H100: 32 trainings of 14 steps and the CUDA tests; 292-320 s on an H100 on 2026-11-27; the report is
written after each training, so a run cut short keeps what it measured, and pytest's whole output goes
to ``DIR/cuda_tests.log``);
``python bench/gpu_check.py --dry-run --out DIR`` runs the same sections on the CPU at tiny sizes (140 s on
2 cores shared with other work; ``tests/test_gpu_check.py`` runs it with ``--models resnet``), so the
script is known to work before a GPU is at hand; ``--cpu-memory`` runs them on the CPU with a ResNet-50 on
16 images of 112x112 and a GPT-2 of 4 blocks 256 wide (a 8192-token vocabulary) on 8 rows of 128 tokens,
for section 3's memory (105 s on 2 cores on 2026-12-01); ``--models`` picks the models of sections 2 and 3.
Nothing is downloaded: the models are built from their configurations. Both write
``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (the tables printed) and print what they run first.

1. **tests**: ``python -m pytest -m cuda tests/test_cuda.py`` in a subprocess (the profiler against CUDA
   events, the executor on the GPU against its rule's reference and ``torch.cuda.max_memory_allocated``,
   the strategy on one GPU against plain Lightning in ``32-true``, ``bf16-mixed`` and ``16-mixed``): the
   count of each outcome and every case's (on the CPU each is skipped).
2. **throughput**: per model, plain Lightning (``strategy="auto"``, one device) and then each pipeline
   configuration on the same device, one training after the other in this process, as a user's script
   runs them (Lightning starts the process group of one): CDP's single form (``cdp``,
   ``form="single"``) with 2 and 4 stages, and every synchronous family in its single-device form
   (``form="single"``: every worker's program in one, ``lightning_pipe/schedule/one_device.py``) with 4
   stages and 4 micro-batches (``lpp`` and ``fslpp`` with one group, ``1f1b_star`` with a period of 3,
   ``kperiodic`` with k = 1; CDP's single form runs the GPT-2's tied embedding and head with a copy
   per stage, their updates of a step after both stages' backwards). Models: a torchvision ResNet-50
   on 64 images of 224x224 per step (SGD with momentum) and a GPT-2-small-shaped
   ``transformers`` ``GPT2LMHeadModel`` (12 blocks, 768 wide, 12 heads, a 50257-token vocabulary) on 8
   rows of 512 tokens per step (AdamW), dropout off; a model is profiled once per micro-batch size
   (the profiles kept in ``DIR/profiles``). Each training runs 3 batches, then 10 timed ones (the dry
   run 1 and 2): ``samples/s`` is the rows of a step over the median interval between batch ends (a
   non-flushing schedule's drain in the last batch does
   not move it), ``/ plain`` the ratio to plain Lightning's in the same run; ``actions/step`` the
   executor's actions (forwards, backwards, updates) per training step, and ``own ms/action`` the
   pipeline's step time less plain Lightning's over them: what the executor adds per action on top of
   the same kernels.
3. **predictions**: the plan's peak memory of each stage (``Plan.stages[s].memory_bytes``: weights,
   gradients, optimizer state, activations in flight) and their sum for the device
   (``PipelineStrategy.predicted_memory``) against ``torch.cuda.max_memory_allocated`` from the first
   timed batch to the end of the training (goal: within 10%; on the CPU, where no allocator counts, the
   bytes of tensors alive counted at the dispatcher, ``lightning_pipe/cost/allocated.py``, which slows
   the dry run's steps: its times are not a measurement); the
   strategy's predicted step time (``planned_step_seconds``, the schedule simulated with the profile)
   against the measured median. On one device the stages' memory is measured together: the per-stage
   figures are the plan's.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer_runs import Classifier, StepTimes, quiet_trainer
from transformer_throughput import _no_dropout, _quiet

from lightning_pipe import PipelineStrategy
from lightning_pipe.schedule import FAMILIES, NON_FLUSHING_FAMILIES
from tests.lightning_cases import AllocatedFrom
from tests.user_modules import HuggingFaceGPT2

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = "tests/test_cuda.py"
PLAIN = "plain"
MODELS = ("resnet", "gpt2")
STAGES = 4  # of the synchronous families on one device (and micro-batches per step)
OPTIONS: dict[str, dict[str, Any]] = {  # what a family cannot be made without on one device
    "1f1b_star": {"period": 3.0},
    "kperiodic": {"k": 1},
    "lpp": {"groups": 1},
    "fslpp": {"groups": 1},
}
MB = 2**20
TESTS_TIMEOUT = 300  # seconds for section 1; a hang there is recorded and the rest still runs


@dataclass(frozen=True)
class Sizes:
    """One size of the check: the models' shapes, rows per step and the steps run."""

    image: int
    images: int
    resnet: str  # "resnet50", or "tiny" (torchvision's ResNet with one BasicBlock per stage)
    gpt2: dict[str, int]
    tokens: int
    rows: int
    warmup: int
    steps: int
    profile_repeats: int  # timed runs per layer when the strategy profiles
    cpu: bool = False  # run on the CPU whatever the machine has


GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
FULL = Sizes(224, 64, "resnet50", GPT2_SMALL, 512, 8, 3, 10, 3)
GPT2_TINY = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16}
DRY = Sizes(32, 8, "tiny", GPT2_TINY, 16, 8, 1, 2, 1, cpu=True)
GPT2_MID = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256}
MEMORY = Sizes(112, 16, "resnet50", GPT2_MID, 128, 8, 1, 1, 1, cpu=True)
"""``--cpu-memory``: the sizes at which the CPU checks the plan's memory (ResNet-50 itself)."""


def configurations() -> list[tuple[str, dict[str, Any]]]:
    """The pipelines of section 2: a name and the strategy's options. Every synchronous family runs
    its single-device form (``form="single"``)."""
    runs = [(f"cdp single P={p}", {"schedule": "cdp", "form": "single", "stages": p}) for p in (2, 4)]
    for family in FAMILIES:
        if family not in NON_FLUSHING_FAMILIES:
            options = {"schedule": family, "form": "single", "stages": STAGES, "microbatches": STAGES}
            runs.append((f"{family} P={STAGES}", {**options, **OPTIONS.get(family, {})}))
    return runs


def _resnet(sizes: Sizes) -> nn.Module:
    from torchvision.models import resnet50
    from torchvision.models.resnet import BasicBlock, ResNet

    return resnet50() if sizes.resnet == "resnet50" else ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _model(name: str, sizes: Sizes) -> tuple[L.LightningModule, TensorDataset, int]:
    """The module, its data (``warmup + steps + 1`` steps) and its rows per step, seeded alike each time."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if name == "resnet":
        rows = sizes.images
        count = rows * (sizes.warmup + sizes.steps + 1)
        images = torch.randn(count, 3, sizes.image, sizes.image, generator=generator)
        classes = 1000 if sizes.resnet == "resnet50" else 10
        return Classifier(_resnet(sizes)), TensorDataset(images, torch.randint(0, classes, (count,))), rows
    module = _no_dropout(HuggingFaceGPT2(**sizes.gpt2))
    count = sizes.rows * (sizes.warmup + sizes.steps + 1)
    tokens = torch.randint(0, sizes.gpt2["vocab_size"], (count, sizes.tokens), generator=generator)
    return module, TensorDataset(tokens), sizes.rows


class _Measure(StepTimes):
    """The step clock, the GPU's peak memory from the first timed batch and the executor's actions,
    read before the strategy closes it (on the CPU the peak is counted at the dispatcher:
    :class:`~tests.lightning_cases.AllocatedFrom`)."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup
        self.peak: int | None = None
        self.actions: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if index == self.warmup and module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
            torch.cuda.reset_peak_memory_stats(module.device)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
            self.peak = torch.cuda.max_memory_allocated(module.device)
        executor = getattr(trainer.strategy, "executor", None)
        if executor is not None:
            self.actions = len(executor.timeline)


def _train(name: str, sizes: Sizes, strategy: Any, precision: str, root: Path) -> dict[str, Any]:
    """One training of model ``name``; its times, memory and, for a pipeline, the plan's predictions."""
    module, data, rows = _model(name, sizes)
    measure = _Measure(sizes.warmup)
    on_cpu = sizes.cpu or not torch.cuda.is_available()
    counted = AllocatedFrom(sizes.warmup) if on_cpu else None
    trainer = quiet_trainer(
        root,
        [measure] if counted is None else [measure, counted],
        accelerator="cpu" if on_cpu else "gpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(data, batch_size=rows, drop_last=True))
    timed = measure.ends[sizes.warmup :]
    seconds = statistics.median(b - a for a, b in itertools.pairwise(timed))
    result: dict[str, Any] = {"rows": rows, "step_seconds": seconds, "samples_per_second": rows / seconds}
    result["measured_bytes"] = measure.peak if counted is None else counted.peak
    if isinstance(strategy, PipelineStrategy):
        plan = strategy.stage_plan.plan if strategy.stage_plan is not None else None
        result["stages"] = strategy.stages
        result["microbatches"] = strategy.microbatches
        result["actions_per_step"] = None if measure.actions is None else measure.actions / trainer.global_step
        result["predicted_stage_bytes"] = None if plan is None else [stage.memory_bytes for stage in plan.stages]
        result["predicted_bytes"] = strategy.predicted_memory
        result["predicted_step_seconds"] = strategy.planned_step_seconds
        result["setup_seconds"] = dict(strategy.setup_seconds)
    del trainer, module
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _model_runs(
    name: str, sizes: Sizes, precision: str, out: Path, results: dict[str, Any], save: Callable[[], Any]
) -> None:
    """Plain Lightning, then every configuration, into ``results`` with their ratios, calling ``save``
    after each; a configuration that fails is recorded with its error and the others go on."""
    root = out / "runs" / name
    results[PLAIN] = _train(name, sizes, "auto", precision, root / PLAIN)
    for label, options in configurations():
        strategy = PipelineStrategy(**options, profile_cache=out / "profiles", profile_repeats=sizes.profile_repeats)
        try:
            results[label] = _train(name, sizes, strategy, precision, root / label.replace(" ", "_"))
        except Exception as error:
            results[label] = {"error": f"{type(error).__name__}: {error}"[:500]}
        _ratios(results)
        save()
        run = results[label]
        print(f"{name} {label}: " + (run.get("error") or f"{run['samples_per_second']:.1f} samples/s"), flush=True)


def _ratios(runs: dict[str, Any]) -> None:
    """Each pipeline's samples/s over plain Lightning's, and its own time per action, in place."""
    plain = runs[PLAIN]
    for label, run in runs.items():
        if label == PLAIN or "error" in run:
            continue
        run["ratio"] = run["samples_per_second"] / plain["samples_per_second"]
        actions = run["actions_per_step"]
        extra = run["step_seconds"] - plain["step_seconds"]
        run["own_seconds_per_action"] = None if not actions else extra / actions
        measured, predicted = run["measured_bytes"], run["predicted_bytes"]
        run["memory_ratio"] = None if measured is None or not predicted else measured / predicted
        planned = run["predicted_step_seconds"]
        run["step_ratio"] = None if not planned else run["step_seconds"] / planned


def run_tests(out: Path) -> dict[str, Any]:
    """Section 1: the CUDA cases in a subprocess; the count of each outcome and every case's."""
    report = out / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", CUDA_TESTS]
    command += ["-p", "no:cacheprovider", "-W", "ignore", f"--junitxml={report}"]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=TESTS_TIMEOUT)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:  # the throughput sections still run
        returncode, output = None, f"{expired.stdout or ''}{expired.stderr or ''}\ntimed out after {TESTS_TIMEOUT} s"
        output = output if isinstance(output, str) else output.decode()
    (out / "cuda_tests.log").write_text(output)  # every failure's traceback
    cases = {}
    if report.exists():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            cases[case.get("name")] = outcome
    counts = {outcome: list(cases.values()).count(outcome) for outcome in ("passed", "failure", "error", "skipped")}
    return {
        "command": " ".join(["python", *command[1:6]]),
        "returncode": returncode,
        "seconds": time.monotonic() - began,
        "counts": counts,
        "cases": cases,
        "output": output.strip().splitlines()[-1:],  # pytest's summary line
    }


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.0f}"


def _cell(value: float | None, form: str = "{:.2f}") -> str:
    return "-" if value is None else form.format(value)


def tables(report: dict[str, Any]) -> str:
    """The Markdown of ``report``: the tests, the throughput and the predictions."""
    tests = report["tests"]
    lines = [f"# gpu_check: {report['device']}", "", f"torch {report['torch']}, precision {report['precision']}"]
    lines += ["", f"## 1. CUDA tests: `{tests['command']}`", ""]
    lines += ["| " + " | ".join(tests["counts"]) + " |", "| --- " * len(tests["counts"]) + "|"]
    lines += ["| " + " | ".join(str(n) for n in tests["counts"].values()) + " |", ""]
    lines += [f"- {name}: {outcome}" for name, outcome in tests["cases"].items()]
    lines += ["", "## 2. Throughput on one device against plain Lightning", ""]
    header = ["model", "configuration", "P", "m", "samples/s", "/ plain", "actions/step", "own ms/action"]
    lines += ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    for model, runs in report["throughput"].items():
        for label, run in runs.items():
            if "error" in run:
                lines.append(f"| {model} | {label} | fails: {run['error'][:200]} |")
                continue
            own = run.get("own_seconds_per_action")
            cells = [model, label, str(run.get("stages", "-")), str(run.get("microbatches", "-"))]
            cells += [f"{run['samples_per_second']:.1f}", _cell(run.get("ratio")), _cell(run.get("actions_per_step"))]
            cells.append(_cell(None if own is None else own * 1000, "{:.3f}"))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## 3. Predicted against measured: peak memory (goal: within 10%) and step time", ""]
    header = ["model", "configuration", "stage MB (plan)", "device MB (plan)", "measured MB", "measured/plan"]
    header += ["step ms (plan)", "step ms", "measured/plan"]
    lines += ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    for model, runs in report["throughput"].items():
        for label, run in runs.items():
            cells = [model, label]
            if "error" in run:
                lines.append("| " + " | ".join([*cells, "fails"]) + " |")
                continue
            stages = run.get("predicted_stage_bytes")
            cells.append("-" if stages is None else ", ".join(_mb(b) for b in stages))
            cells += [_mb(run.get("predicted_bytes")), _mb(run["measured_bytes"]), _cell(run.get("memory_ratio"))]
            planned = run.get("predicted_step_seconds")
            cells += [_cell(None if planned is None else planned * 1000, "{:.1f}"), f"{run['step_seconds'] * 1000:.1f}"]
            cells.append(_cell(run.get("step_ratio")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _write(report: dict[str, Any], out: Path, began: float) -> str:
    """``gpu_check.json`` and ``gpu_check.md`` as measured so far; the tables."""
    report["seconds"] = time.monotonic() - began
    text = tables(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes, to check the script")
    parser.add_argument(
        "--cpu-memory", action="store_true", help="on the CPU, ResNet-50 at 112x112: section 3's memory (minutes)"
    )
    parser.add_argument("--precision", default="32-true", help="Lightning's precision of every training")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="the models of sections 2-3")
    args = parser.parse_args(argv)
    on_cpu = args.dry_run or args.cpu_memory
    if not on_cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run to check the script on the CPU")
    sizes = DRY if args.dry_run else MEMORY if args.cpu_memory else FULL
    device = "cpu (dry run)" if args.dry_run else "cpu (memory sizes)" if on_cpu else torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    _quiet()
    labels = [PLAIN, *(label for label, _ in configurations())]
    print(f"gpu_check on {device}: 1. python -m pytest -m cuda {CUDA_TESTS}", flush=True)
    print(f"2./3. resnet ({sizes.resnet}, {sizes.images} images of {sizes.image}x{sizes.image}) and gpt2 ", end="")
    print(f"({sizes.gpt2}, {sizes.rows} rows of {sizes.tokens} tokens), {sizes.warmup} + {sizes.steps} steps, ", end="")
    print(f"{args.precision}: {', '.join(labels)}", flush=True)
    began = time.monotonic()
    report: dict[str, Any] = {"device": device, "dry_run": on_cpu, "torch": torch.__version__}
    report["precision"] = args.precision
    report["tests"] = run_tests(args.out)
    report["throughput"] = {}
    _write(report, args.out, began)
    for name in args.models:  # written after each training: a run cut short keeps what it measured
        report["throughput"][name] = {}
        _model_runs(
            name, sizes, args.precision, args.out, report["throughput"][name], lambda: _write(report, args.out, began)
        )
    print(_write(report, args.out, began), flush=True)
    print(f"{report['seconds']:.0f} s; written: {args.out / 'gpu_check.json'}, {args.out / 'gpu_check.md'}", flush=True)
    return report


if __name__ == "__main__":
    main()

"""Set-up time of a pipeline for a model it has never seen, by phase, as the strategy times it on its
first batch (``PipelineStrategy.setup_seconds``), with the functions it calls there, without a Trainer.

Run: ``python bench/setup_time.py [--models gpt2 encoder resnet18] [--rounds 3] [--batch ROWS] [--torch]``
(about a minute and a half on 2 cores with the defaults).

Models, each set up for 2 stages (1F1B, 2 micro-batches) from one micro-batch on the CPU, one thread
(what each of two ranks gets on 2 cores):

- ``gpt2``: ``transformers``' ``GPT2LMHeadModel`` (12 blocks, 128 wide, 4 heads, 1024 tokens, 256
  positions, ``use_cache=False``) in a LightningModule whose ``forward(input_ids)`` returns
  ``self.model(input_ids, labels=input_ids)`` (``tests/user_modules.py``'s ``HuggingFaceGPT2``), on
  8 rows of 128 tokens; left out, with a note, when ``transformers`` is not installed;
- ``encoder``: an embedding, a 6-block ``nn.TransformerEncoder`` (128 wide, 4 heads, causal mask) and
  a head (``EncoderLM``), on 8 rows of 128 tokens;
- ``resnet18``: torchvision's ResNet-18 on 8 images of 224x224;
- ``resnet50`` and ``nanogpt`` (``tests/user_modules.py``'s ``GPT`` of GPT-2 small's size: 768 wide,
  12 heads, 50304 tokens, tied embedding and LM head, the loss in ``forward(idx, targets)``; 256
  tokens): the earlier table's models, on 4 rows there (``--models resnet50 nanogpt --torch``).

Columns, medians over ``--rounds`` rounds (each model once per round, in turn), seconds:

- ``forward``: one forward of the micro-batch, no autograd (the unit of the others);
- ``capture``: :func:`lightning_pipe.strategy.contract.pipeline_model` (three traces, the layers);
- ``verify``: :func:`lightning_pipe.capture.verify.verify_chain` as the strategy runs it (eval mode,
  and train mode when the layers' code differs between the modes);
- ``profile``: the layers profiled inside :func:`~lightning_pipe.planning.plan_stages` (3
  timed runs per layer, no profile cache);
- ``plan``: the rest of ``plan_stages`` (the partition) and the schedule's prediction;
- ``total``: the four;
- with ``--torch``: ``torch.distributed.pipelining.pipeline`` splitting a copy of the model at the
  middle block, or ``fails``, and capture + verify over it.
"""

from __future__ import annotations

import argparse
import copy as copy_module
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_pipe.capture.verify import verify_chain
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.planning import (
    SETUP_PHASES,
    PlanOptions,
    optimizer_copies,
    plan_stages,
    predict,
    timed,
)
from lightning_pipe.schedule import memory_schedule
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.contract import Call, pipeline_model
from tests.user_modules import GPT, EncoderLM, GPTConfig, HuggingFaceGPT2

STAGES, MICROBATCHES, FAMILY = 2, 2, "1f1b"


@dataclass
class Model:
    """A model to set up: how to build it and its micro-batch, and where torch's ``pipeline()`` splits it."""

    build: Callable[[int], tuple[nn.Module, tuple[Any, ...]]]
    rows: int
    split: str


def _tokens(rows: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length))


def _gpt2(rows: int) -> tuple[nn.Module, tuple[Any, ...]]:
    return HuggingFaceGPT2(), (_tokens(rows, 128, 1024),)


def _encoder(rows: int) -> tuple[nn.Module, tuple[Any, ...]]:
    return EncoderLM(), (_tokens(rows, 128, 1024),)


def _nanogpt(rows: int) -> tuple[nn.Module, tuple[Any, ...]]:
    tokens = _tokens(rows, 257, 50304)
    config = GPTConfig(block_size=256, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    return GPT(config), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _torchvision(name: str) -> Callable[[int], tuple[nn.Module, tuple[Any, ...]]]:
    return lambda rows: (getattr(torchvision.models, name)(), (torch.randn(rows, 3, 224, 224),))


MODELS = {
    "gpt2": Model(_gpt2, 8, "model.transformer.h.6"),
    "encoder": Model(_encoder, 8, "encoder.layers.3"),
    "resnet18": Model(_torchvision("resnet18"), 8, "layer3"),
    "resnet50": Model(_torchvision("resnet50"), 4, "layer3"),
    "nanogpt": Model(_nanogpt, 4, "transformer.h.6"),
}


def _seconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def set_up(module: nn.Module, args: tuple[Any, ...]) -> dict[str, float]:
    """The set-up of ``module`` for :data:`STAGES` stages from the micro-batch ``args``, timed by
    phase as the strategy times it (:data:`~lightning_pipe.planning.SETUP_PHASES`)."""
    seconds = dict.fromkeys(SETUP_PHASES, 0.0)
    call = Call(args)
    with timed(seconds, "capture"):
        model = pipeline_model(module, call, STAGES)
    assert model.captured is not None
    inputs = model.inputs(call)
    modes = (False,) if model.captured.graph.same_in_eval else (False, True)
    with timed(seconds, "verify"):
        verify_chain(module, model.layers, lambda: module(*args), inputs, model.names, modes=modes)
    memory = MemoryModel(
        memory_schedule(FAMILY), MICROBATCHES, optimizer_copies(None), split_backward=True, accumulation=True
    )
    with timed(seconds, "plan"):
        stage_plan = plan_stages(
            model.layers, inputs, STAGES, PlanOptions(), memory, torch.device("cpu"), names=model.names, seconds=seconds
        )
        predict(stage_plan, ScheduleOptions(FAMILY, MICROBATCHES), MICROBATCHES)
    seconds["plan"] -= seconds["profile"]
    seconds["total"] = sum(seconds.values())
    return seconds


def _torch_pipeline(module: nn.Module, args: tuple[Any, ...], split: str) -> float:
    """Seconds of ``torch.distributed.pipelining.pipeline`` on a copy (it leaves a wrapped ``forward``
    behind), or NaN when it cannot split the model."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    copy = copy_module.deepcopy(module)
    try:
        return _seconds(lambda: pipeline(copy, mb_args=args, split_spec={split: SplitPoint.BEGINNING}))
    except Exception as error:  # the peer cannot split every model: say so in the table
        print(f"torch.distributed.pipelining.pipeline fails: {str(error).splitlines()[0][:150]}")
        return float("nan")


def _round(module: nn.Module, args: tuple[Any, ...], split: str, peer: bool) -> dict[str, float]:
    with torch.no_grad():
        result = {"forward": _seconds(lambda: module(*args))}
    result.update(set_up(module, args))
    if peer:
        result["torch"] = _torch_pipeline(module, args, split)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["gpt2", "encoder", "resnet18"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, help="rows of the micro-batch (default: each model's)")
    parser.add_argument("--torch", action="store_true", help="time torch.distributed.pipelining.pipeline too")
    options = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models: dict[str, tuple[nn.Module, tuple[Any, ...], str]] = {}
    for name in options.models:
        spec = MODELS[name]
        try:
            module, args = spec.build(options.batch or spec.rows)
        except ModuleNotFoundError as error:
            print(f"{name}: left out, {error.name} is not installed (pip install {error.name})")
            continue
        models[name] = (module.train(), args, spec.split)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(options.rounds):
        for name, (module, args, split) in models.items():
            rounds[name].append(_round(module, args, split, options.torch))
    columns = ["forward", *SETUP_PHASES, "total", *(["torch"] if options.torch else [])]
    print(f"{STAGES} stages, {options.rounds} rounds, medians, seconds")
    header = f"{'model':<10} {'rows':>4} " + " ".join(f"{c:>8}" for c in columns)
    print(header + (f" {'(c+v)/torch':>11}" if options.torch else ""))
    for name, results in rounds.items():
        median = {key: statistics.median(r[key] for r in results) for key in columns}
        cells = " ".join(f"{'fails':>8}" if median[c] != median[c] else f"{median[c]:>8.2f}" for c in columns)
        line = f"{name:<10} {len(models[name][1][0]):>4} {cells}"
        if options.torch:
            ratio = statistics.median((r["capture"] + r["verify"]) / r["torch"] for r in results)
            line += f" {ratio:>10.2f}x" if ratio == ratio else f" {'-':>11}"
        print(line)


if __name__ == "__main__":
    main()

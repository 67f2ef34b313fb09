"""Set-up time of a pipeline for a model it has never seen: capturing ``forward`` as layers and
verifying the chain, against torch.distributed.pipelining's ``pipeline()`` (torch.export) splitting
the same model, and against one plain forward of the model.

Run: ``python bench/setup_time.py [--rounds 3] [--batch 4]`` (about 3 minutes on 2 cores).

Models: torchvision's ResNet-50 on 224x224 images, and a 12-layer GPT of GPT-2 small's size (768
wide, 12 heads, 50304 tokens, tied embedding and LM head, the loss in ``forward(idx, targets)``) on
256-token sequences: ``tests/user_modules.py``'s GPT. Each is set up for 2 stages from one
micro-batch of ``--batch`` rows, on the CPU, one thread.

Columns, medians over ``--rounds`` rounds (each configuration once per round, in turn):
- ``forward``: one forward of the micro-batch, no autograd (the unit of the others);
- ``capture``: :func:`lightning_pipe.capture.capture` (three traces: train mode on the micro-batch,
  eval mode and train mode on two or three rows; layer grouping; the layer modules);
- ``verify``: :func:`lightning_pipe.capture.verify.verify_chain` (forward and the chain in eval mode,
  and in train mode when the layers' code differs between the modes), as the strategy runs it;
- ``torch``: ``torch.distributed.pipelining.pipeline`` with one split point in the middle of the model
  (ResNet-50: ``layer3``; GPT: block 6), or ``fails`` when it cannot capture the model (its export
  stops at the GPT's ``forward``);
- ratios: ours (capture + verify) over torch's, and over one forward.
"""

from __future__ import annotations

import argparse
import copy as copy_module
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch.distributed.pipelining import SplitPoint, pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_pipe.capture import capture
from lightning_pipe.capture.verify import verify_chain
from tests.user_modules import GPT, GPTConfig


def _models(batch: int) -> dict[str, tuple[torch.nn.Module, tuple[Any, ...], str]]:
    torch.manual_seed(0)
    config = GPTConfig(block_size=256, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    tokens = torch.randint(0, config.vocab_size, (batch, 257))
    return {
        "ResNet-50": (torchvision.models.resnet50(), (torch.randn(batch, 3, 224, 224),), "layer3"),
        "GPT 12 layers": (GPT(config), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), "transformer.h.6"),
    }


def _seconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _round(model: torch.nn.Module, args: tuple[Any, ...], split: str) -> dict[str, float]:
    with torch.no_grad():
        forward = _seconds(lambda: model(*args))
    captured: list[Any] = []
    capture_seconds = _seconds(lambda: captured.append(capture(model, args, stages=2)))
    layers = captured[0].layers
    names = [spec.name for spec in captured[0].specs]
    modes = (False,) if captured[0].graph.same_in_eval else (False, True)  # as the strategy verifies
    verify_seconds = _seconds(
        lambda: verify_chain(model, layers, lambda: model(*args), tuple(args), names, modes=modes)
    )
    copy = copy_module.deepcopy(model)  # pipeline() wraps the split module's forward and leaves it so
    try:
        torch_seconds = _seconds(lambda: pipeline(copy, mb_args=args, split_spec={split: SplitPoint.BEGINNING}))
    except Exception as error:  # the peer cannot split every model: say so in the table
        print(f"torch.distributed.pipelining.pipeline fails: {str(error).splitlines()[0][:150]}")
        torch_seconds = float("nan")
    return {"forward": forward, "capture": capture_seconds, "verify": verify_seconds, "torch": torch_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    models = _models(options.batch)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(options.rounds):
        for name, (model, args, split) in models.items():
            rounds[name].append(_round(model.train(), args, split))
    print(f"micro-batch of {options.batch} rows, {options.rounds} rounds, medians, seconds")
    print(f"{'model':<14} {'forward':>8} {'capture':>8} {'verify':>8} {'torch':>8} {'ours/torch':>10} {'ours/fwd':>9}")
    for name, results in rounds.items():
        median = {key: statistics.median(r[key] for r in results) for key in results[0]}
        ours = [r["capture"] + r["verify"] for r in results]
        versus_torch = statistics.median(o / r["torch"] for o, r in zip(ours, results, strict=True))
        versus_forward = statistics.median(o / r["forward"] for o, r in zip(ours, results, strict=True))
        torch_text = f"{median['torch']:>8.2f}" if median["torch"] == median["torch"] else f"{'fails':>8}"
        ratio_text = f"{versus_torch:>9.2f}x" if versus_torch == versus_torch else f"{'-':>10}"
        print(
            f"{name:<14} {median['forward']:>8.2f} {median['capture']:>8.2f} {median['verify']:>8.2f} "
            f"{torch_text} {ratio_text} {versus_forward:>8.1f}x"
        )


if __name__ == "__main__":
    main()

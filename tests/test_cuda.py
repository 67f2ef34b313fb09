"""The CUDA path on one GPU: every case here is marked ``cuda`` and skipped where
``torch.cuda.is_available()`` is false (``python -m pytest -m cuda tests/test_cuda.py``;
``bench/gpu_check.py`` runs them first).

- the profiler's times are the kernels' times, as CUDA events measure them (it synchronises the
  device around every clock read: an unsynchronised clock would read the launches, microseconds);
- a ResNet-18 stage's profiled saved bytes are what the allocator holds after its forward, and a
  block's profiled ``backward_bytes`` what the allocator's peak over its backward says;
- the executor moves CPU stages and CPU batches to the GPU, trains there and equals the single-process
  reference of its rule computed on the CPU; the bytes it counts as saved for the backward are within
  what ``torch.cuda.max_memory_allocated`` sees the step allocate;
- ``PipelineStrategy`` on ``Trainer(accelerator="gpu", devices=1)`` trains as plain Lightning on the same
  GPU in ``32-true``, ``bf16-mixed`` and ``16-mixed`` (a ``GradScaler`` on CUDA) with one stage, and
  in ``32-true`` with three stages on the one device (1F1B's single form); CDP's single form equals its
  rules' references.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import make_schedule
from tests.lightning_cases import Chain, batch_list, fit_case, plain_fit, stage_modules
from tests.reference import OPTIMIZERS, batches, build_stages, cdp_v2, one_step_late, reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here: these cases check the CUDA path on a GPU"
    ),
]


def _event_seconds(run: Any, repeats: int = 5) -> float:
    """The median of ``repeats`` runs of ``run()`` timed by CUDA events on the current stream (after
    one untimed run)."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


@pytest.mark.timeout(120)
def test_profiled_times_are_the_kernels_times() -> None:
    """A Linear(4096, 4096) on 8192 rows (275 GFLOP forward, as much again for the weights' gradient:
    milliseconds on any GPU, against microseconds to launch them) profiles to the forward and backward
    times CUDA events give for the same kernels, within 30%. The input needs no gradient, as a model's
    data: the backward timed is the weights' alone (on an H100 on 2026-11-27 a reference that also
    took the input's gradient measured twice the profile)."""
    layer = nn.Linear(4096, 4096, device="cuda")
    x = torch.randn(8192, 4096, device="cuda")
    costs = profile_layers(nn.Sequential(layer), x, repeats=5, count_flops=False)
    forward = _event_seconds(lambda: layer(x))
    y = layer(x)  # the first layer's input keeps its requires_grad (none here): the weights' gradients alone
    gradient = torch.randn_like(y)
    backward = _event_seconds(lambda: torch.autograd.grad(y, list(layer.parameters()), gradient, retain_graph=True))
    (profiled,) = costs.layers
    assert costs.meta["device"].startswith("cuda")
    assert profiled.forward_seconds == pytest.approx(forward, rel=0.3)
    assert profiled.backward_seconds == pytest.approx(backward, rel=0.3)
    assert profiled.activation_bytes == 8192 * 4096 * 4


@pytest.mark.timeout(120)
def test_a_convolutional_stage_saves_what_the_allocator_holds() -> None:
    """torchvision's ResNet-18 in its blocks (convolutions, batch norm, in-place ReLU), one stage: the
    profile's saved bytes for it (each storage two neighbouring blocks save counted once) are within
    10% of what the CUDA allocator holds after the stage's forward, its input included (the first
    convolution saves it). On an H100 on 2026-11-27 a ResNet-50's plan was 0.60-0.89 of the peak
    measured, before the storages at block boundaries were counted once: this case says whether what
    is left lies in the profile or in what cuDNN keeps beyond the saved tensors."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda()
    blocks = [nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)]
    blocks += [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
    costs = profile_layers(blocks, torch.randn(8, 3, 64, 64, device="cuda"), repeats=1, count_flops=False)
    stage = nn.Sequential(*blocks)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    output = stage(x)  # the last block's ReLU saves its output: counted in the profile
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert output.requires_grad
    assert held == pytest.approx(costs.saved_between(0, len(blocks) - 1), rel=0.1)


def test_a_blocks_backward_holds_what_the_allocator_sees() -> None:
    """A ResNet-18 block on the GPU: its profiled ``backward_bytes`` (seen at the dispatcher, the same
    on every device) against the CUDA allocator's peak over its backward: the rise above what was held
    when the backward began, with the output's gradient it was given, less the parameters' gradients it
    leaves (which may come before or after the peak: a range). What the dispatcher does not see (cuDNN's
    workspaces) would put the allocator's figure above it."""
    import torchvision

    torch.manual_seed(0)
    block = torchvision.models.resnet18().layer1[0].cuda()
    sample = torch.randn(16, 64, 56, 56, device="cuda").requires_grad_()
    costs = profile_layers([block], sample, repeats=1, count_flops=False)
    output = block(sample.clone())
    received = torch.randn_like(output)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.autograd.backward([output], [received])
    torch.cuda.synchronize()
    rise = torch.cuda.max_memory_allocated() - start + received.numel() * received.element_size()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in block.parameters())
    assert 0.9 * (rise - grads) <= costs.layers[0].backward_bytes <= 1.1 * rise


def _train_on_gpu(rank: int, stages: int, steps: int) -> dict[str, Any]:
    """Worker of :func:`run_local`: CDP's single form (every stage on this one GPU, rule ``cdp_v2``)
    trained from CPU stages on CPU batches, saved bytes counted; the final parameters (on the CPU),
    where the stages and optimizer states lived, the counted peak and what the CUDA allocator saw."""
    executor = PipelineExecutor(
        lambda k: make_schedule("cdp", stages, stages, k, rule="cdp_v2", form="single"),
        build_stages(stages, width=1024),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        device="cuda",
        track_memory=True,
    )
    data = batches(steps, rows=512)
    executor.step(*data[0])  # the warm-up: cuBLAS's workspace and the optimizers' states allocated
    executor.drain()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for inputs, targets in data[1:]:
        executor.step(inputs, targets)
    executor.drain()
    torch.cuda.synchronize()
    params = [p for weights in executor.weights.values() for p in weights.params]
    result = {
        "devices": {p.device.type for p in params},
        "states": {t.device.type for o in executor.stage_optimizers for s in o.state.values() for t in s.values()},
        "final": {stage: [p.detach().cpu() for p in weights.params] for stage, weights in executor.weights.items()},
        "saved": executor.peak_saved_bytes,
        "rise": torch.cuda.max_memory_allocated() - base,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "batch_bytes": sum(t.numel() * t.element_size() for t in data[1]),
    }
    executor.close()
    return result


@pytest.mark.timeout(180)
def test_executor_trains_on_the_gpu_as_the_reference_and_counts_what_the_allocator_sees() -> None:
    """Four stages of CDP's single form on one GPU, built on the CPU and fed CPU batches: stages and
    optimizer states live on the GPU; the parameters equal the CPU reference of ``cdp_v2`` to 1e-5 (the
    rule differs from synchronous training by 5e-4 here); the peak of the bytes autograd saved (counted
    by the executor) is at most the rise of ``torch.cuda.max_memory_allocated`` over the steps, and that
    rise at most twice what a step can hold at once (saved bytes, a gradient and a momentum per
    parameter, the batch) plus 64 MiB."""
    stages, steps = 4, 5
    (result,) = run_local(_train_on_gpu, 1, stages, steps, timeout=150)
    assert result["devices"] == {"cuda"} and result["states"] == {"cuda"}
    data = batches(steps, rows=512)  # a drain after the warm-up step: the rule starts again after it
    expected = reference(build_stages(stages, width=1024), data, stages, cdp_v2(stages), "sgd", runs=[1, steps - 1])
    for stage, params in result["final"].items():
        for got, want in zip(params, expected[stage], strict=True):
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (stage, (got - want).abs().max())
    assert result["saved"] > 0
    assert result["saved"] <= result["rise"]
    held = result["saved"] + 2 * result["param_bytes"] + result["batch_bytes"]
    assert result["rise"] <= 2 * held + 64 * 2**20, (result["rise"], held)


GPU = {"accelerator": "gpu"}
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed"]
ATOL = 1e-6  # one stage, one micro-batch: the same kernels as plain Lightning's, in every precision


def _cases_worker(rank: int, root: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_on_cpu(fit_case(rank, str(Path(root) / case["name"]), case)) for case in cases]


def _on_cpu(result: dict[str, Any]) -> dict[str, Any]:
    """The parts of a fit's result the test reads, their tensors on the CPU (to cross processes)."""
    return {
        "final": {name: value.cpu() for name, value in result["final"].items()},
        "global_step": result["global_step"],
        "precision": result["precision"],
    }


@pytest.mark.timeout(300)
def test_strategy_on_one_gpu_trains_as_plain_lightning(tmp_path: Path) -> None:
    """``PipelineStrategy()`` (one stage) on one GPU ends with plain Lightning's parameters on the same
    GPU in 32-true, bf16-mixed and 16-mixed (whose scaler's state it hands back alike), and so does
    1F1B with its three stages on the one GPU (``form="single"``) to 1e-5; CDP's single form on three
    stages of the one GPU ends with its rules' CPU references to 1e-5."""
    one_stage = [
        {"name": f"one_stage_{precision}", "batches": 5, "strategy": {}, "trainer": {**GPU, "precision": precision}}
        for precision in PRECISIONS
    ]
    single = [
        {"name": f"cdp_single_{rule}", "batches": 6, "trainer": GPU, "strategy": {"schedule": "cdp", "form": "single"}}
        for rule in ("cdp_v2", "cdp_v1")
    ]
    for case, rule in zip(single, ("cdp_v2", "cdp_v1"), strict=True):
        case["strategy"].update(rule=rule, balance=[2, 2, 3])
    spread = {"name": "1f1b_single", "batches": 6, "trainer": GPU, "strategy": {"schedule": "1f1b", "form": "single"}}
    spread["strategy"]["balance"] = [2, 2, 3]
    cases = [*one_stage, *single, spread]
    (results,) = run_local(_cases_worker, 1, str(tmp_path), cases, timeout=270)
    got = {case["name"]: result for case, result in zip(cases, results, strict=True)}
    for case in one_stage:
        expected = plain_fit(tmp_path / "plain" / case["name"], case)
        result = got[case["name"]]
        assert result["global_step"] == expected["global_step"] == 5
        for name, want in expected["final"].items():
            assert torch.allclose(result["final"][name], want.cpu(), atol=ATOL, rtol=0), name
        assert result["precision"] == expected["precision"]  # 16-mixed: the loss scale handed back alike
    expected = plain_fit(tmp_path / "plain" / spread["name"], spread)["final"]
    for name, want in expected.items():  # 1F1B's three stages on the one GPU, three micro-batches
        assert torch.allclose(got[spread["name"]]["final"][name], want.cpu(), atol=1e-5, rtol=0), name
    for case, rule in zip(single, (cdp_v2(3), one_step_late), strict=True):
        stages = stage_modules(Chain(), case["strategy"]["balance"])
        flat = [p for stage in reference(stages, batch_list(6), 3, rule, "sgd") for p in stage]
        names = [name for name, _ in Chain().named_parameters()]
        for name, want in zip(names, flat, strict=True):
            assert torch.allclose(got[case["name"]]["final"][name], want, atol=1e-5), (case["name"], name)

"""Single-process reference implementations of the update rules (docs/design.md), and the workers that run
the same training through the multi-process runtime, for the runtime tests to compare.

A rule is a function ``version(stage, microbatch, step) -> v``: the gradient of micro-batch ``i`` of
step ``t`` is taken with stage ``j``'s weights after ``v`` updates, and ``θ^j_{t+1}`` is the
optimizer step from ``θ^j_t`` with the mean of those gradients:

- sync:   ``v = t``                                 θ_{t+1} = θ_t − γ/N Σ ∇f_i(θ_t)
- 2bw / cdp_v1: ``v = t − 1``                       θ_{t+1} = θ_t − γ/N Σ ∇f_i(θ_{t−1})
- cdp_v2: ``v = t`` if ``i + j >= N − 1`` else ``t − 1`` (0-based, Fournier & Oyallon Eq. CDP-v2)
- stash / vertical: PipeDream's, from the in-flight counts of its 1F1B order (:func:`pipedream_stash`,
  :func:`pipedream_vertical`), not read off a schedule.

A rule counts steps from the start of a run: after a drain (end of epoch, validation, checkpoint)
the pipeline fills anew from the live weights and the rule starts over (:func:`reference`'s ``runs``).
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.schedule import Action, Kind, Schedule, make_schedule

Rule = Callable[[int, int, int], int]


def sync(stage: int, microbatch: int, step: int) -> int:
    return step


def one_step_late(stage: int, microbatch: int, step: int) -> int:
    return max(step - 1, 0)


def cdp_v2(stages: int) -> Rule:
    def version(stage: int, microbatch: int, step: int) -> int:
        return step if microbatch + stage >= stages - 1 else max(step - 1, 0)

    return version


def pipedream_stash(stages: int, microbatches: int, slack: int = 0) -> Rule:
    """Weight stashing (Narayanan et al. 2019, §3.3) on PipeDream's 1F1B order, from the paper's
    definitions rather than from a schedule: a forward uses the newest version its stage has. In the
    steady state stage ``j`` keeps ``P - j`` micro-batches in flight, plus ``slack`` for each link
    downstream of it, so the forward of the ``n``-th micro-batch (``n = t m + i``) follows the
    backward of micro-batch ``n - in_flight``; a stage updates right after a step's ``m``-th backward.
    Its version is therefore ``floor((n - in_flight + 1) / m)``, and 0 during the fill."""

    def version(stage: int, microbatch: int, step: int) -> int:
        in_flight = stages - stage + slack * (stages - 1 - stage)
        return max(step * microbatches + microbatch - in_flight + 1, 0) // microbatches

    return version


def pipedream_vertical(stages: int, microbatches: int, slack: int = 0) -> Rule:
    """Vertical sync (Narayanan et al. 2019, §3.3): every stage of a micro-batch uses the version
    its first stage used, :func:`pipedream_stash`'s version of stage 0."""
    stash = pipedream_stash(stages, microbatches, slack)

    def version(stage: int, microbatch: int, step: int) -> int:
        return stash(0, microbatch, step)

    return version


class GatedLinear(nn.Linear):
    """A linear layer with an ``extra`` bias used only on micro-batches of fewer than 3 rows: some
    micro-batches (and replicas) give ``extra`` no gradient."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__(inputs, outputs)
        self.extra = nn.Parameter(torch.randn(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.extra if x.shape[0] < 3 else y


def build_stages(
    count: int, seed: int = 0, width: int = 8, frozen: tuple[tuple[int, str], ...] = (), gated: bool = False
) -> list[nn.Module]:
    """A small MLP chain: tanh layers, dropout-free, deterministic given ``seed``; the parameters
    ``frozen`` names (``(stage, name)``) do not require gradients; with ``gated`` the first layer is a
    :class:`GatedLinear`."""
    torch.manual_seed(seed)
    first = GatedLinear(6, width) if gated else nn.Linear(6, width)
    stages: list[nn.Module] = [nn.Sequential(first, nn.Tanh())]
    stages += [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count - 2)]
    stages.append(nn.Linear(width, 3))
    for stage, name in frozen:
        stages[stage].get_parameter(name).requires_grad_(False)
    return stages


def batches(steps: int, rows: int = 10, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
        for _ in range(steps)
    ]


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.01),
}


def reference(
    stages: list[nn.Module],
    data,
    microbatches: int,
    rule: Rule,
    optimizer: str,
    record: dict[tuple[int, int], tuple[float, torch.Tensor]] | None = None,
    runs: Sequence[int] | None = None,
    accumulate: int = 1,
) -> list[list[torch.Tensor]]:
    """Train ``stages`` in one process following ``rule``; returns each stage's final parameters. A
    parameter without gradient in a step (frozen, or unused) is skipped by the optimizer, as in
    plain PyTorch training. ``record`` receives, per ``(step, micro-batch)``, the micro-batch's loss
    weighted by its share of the mini-batch and the last stage's output.

    ``runs`` cuts the steps into runs separated by drains (epochs, validation, checkpoints; default:
    one run of every step). A drain finishes every step in flight, so the next run fills anew from
    the live weights: the rule starts over, its step counted from the run's first step, and step
    ``t`` of a run begun at step ``o`` (after ``o`` updates) uses version ``o + rule(j, i, t - o)``.
    The optimizers' states (momentum, Adam's moments) carry over.

    ``accumulate``: gradient accumulation over steps, as Lightning's ``accumulate_grad_batches``
    (:func:`updates`): each loss divided by it, the gradients summed over the steps until an update;
    a step without one leaves the weights as they are (its version is the same weights)."""
    stages = copy.deepcopy(stages)
    optimizers = [OPTIMIZERS[optimizer](list(s.parameters())) if list(s.parameters()) else None for s in stages]
    history = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in stages]
    starts = list(itertools.accumulate([len(data)] if runs is None else runs, initial=0))  # then the end
    assert starts[-1] == len(data), (runs, len(data))
    grads: list[list[torch.Tensor | None]] = [[None] * len(list(s.parameters())) for s in stages]
    for step, (inputs, targets) in enumerate(data):
        origin = max(start for start in starts if start <= step)  # the first step of this step's run
        for i, (x, y) in enumerate(
            zip(torch.tensor_split(inputs, microbatches), torch.tensor_split(targets, microbatches), strict=True)
        ):
            weights = [
                {
                    n: t.clone().requires_grad_(stages[j].get_parameter(n).requires_grad)
                    for n, t in history[j][origin + rule(j, i, step - origin)].items()
                }
                for j in range(len(stages))
            ]
            out = x
            for j, stage in enumerate(stages):
                out = functional_call(stage, weights[j], (out,))
            loss = nn.functional.cross_entropy(out, y) * (len(y) / len(targets))
            if record is not None:
                record[(step, i)] = (float(loss.detach()), out.detach().clone())
            (loss / accumulate).backward()
            for j in range(len(stages)):
                for index, leaf in enumerate(weights[j].values()):
                    if leaf.grad is not None:
                        grads[j][index] = leaf.grad if grads[j][index] is None else grads[j][index] + leaf.grad
        updating = updates(step - origin, min(s for s in starts if s > step) - origin, accumulate)
        for j, stage in enumerate(stages):
            for param, grad in zip(stage.parameters(), grads[j], strict=True):
                param.grad = grad
            if optimizers[j] is not None and updating:
                optimizers[j].step()
            history[j].append({n: p.detach().clone() for n, p in stage.named_parameters()})
        if updating:
            grads = [[None] * len(list(s.parameters())) for s in stages]
    return [[p.detach() for p in s.parameters()] for s in stages]


def updates(step: int, steps: int, accumulate: int) -> bool:
    """Whether step ``step`` of a run of ``steps`` ends with an update when ``accumulate`` steps'
    gradients make one (Lightning's rule for the batches of an epoch: every ``accumulate``-th, and
    the last)."""
    return (step + 1) % accumulate == 0 or step + 1 == steps


def leading_forwards(actions: list[Action]) -> int:
    """How many forwards come before the first backward (or its input half)."""
    return next((n for n, a in enumerate(actions) if a.kind is not Kind.F), len(actions))


def run_pipeline(rank: int, cases: list[dict]) -> dict[str, dict[int, list[torch.Tensor]]]:
    """Worker of :func:`lightning_pipe.runtime.launch.run_local`: train every case with the runtime,
    drained after each of its ``"runs"`` (the steps between drains; by default one run of every
    step), accumulating the gradients of ``"accumulate"`` steps per update (:func:`updates`); returns
    ``{case name: {stage: parameters}}`` for the stages this rank holds, under ``"leading forwards"``
    how many forwards this rank ran before its first backward, and under ``"ring messages"`` the
    partial and whole sums it sent along rings, per case."""
    results: dict = {"leading forwards": {}, "ring messages": {}}
    for case in cases:
        options = case.get("options", {})
        executor = PipelineExecutor(
            lambda k, c=case, o=options: make_schedule(c["family"], c["stages"], c["microbatches"], k, **o),
            build_stages(case["stages"], frozen=case.get("frozen", ()), gated=case.get("gated", False)),
            nn.functional.cross_entropy,
            OPTIMIZERS[case["optimizer"]],
            recompute=case.get("recompute", False),
            post_ahead_bytes=case.get("post_ahead_bytes"),
            shared_memory_bytes=case.get("shared_memory_bytes"),
        )
        if case.get("foreign_init"):  # stages this rank computes but does not own start from other weights
            torch.manual_seed(100 + rank)
            for weights in executor.borrowed.values():
                for param in weights.params:
                    nn.init.normal_(param.data)
        data = iter(batches(case["steps"], rows=case.get("rows", 10)))
        accumulate = case.get("accumulate", 1)
        for run in case.get("runs", [case["steps"]]):  # a drain after each run, as at an epoch's end
            for step, (inputs, targets) in enumerate(itertools.islice(data, run)):
                executor.step(inputs, targets, update=updates(step, run, accumulate), accumulation=accumulate)
            executor.drain()
        executor.close()
        held = {s for s in executor.weights if s not in executor.relays.stages or s in executor.relays.held}
        results[case["name"]] = {s: [p.detach().clone() for p in executor.weights[s].params] for s in held}
        results["leading forwards"][case["name"]] = leading_forwards([i.action for i in executor.timeline])
        results["ring messages"][case["name"]] = dict(executor.rings.sent)
    return results


_HAND_TOKEN = re.compile(r"^(\d+)(UPDATE|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)(?:@(\d+))?(?:v(\d+))?(?:>(\d+))?$")


def hand_action(token: str) -> Action:
    """An action written as the IR prints it, plus a peer: ``1F0@2v1`` is the forward of stage 1,
    micro-batch 0, step 2 at version 1 (step and version optional); ``>w`` names a peer."""
    match = _HAND_TOKEN.match(token)
    if match is None:
        raise ValueError(f"not an action: {token!r}")
    stage, kind, microbatch, step, version, peer = match.groups()
    return Action(
        Kind(kind),
        int(stage),
        int(microbatch) if microbatch else None,
        int(step or 0),
        None if version is None else int(version),
        None if peer is None else int(peer),
    )


def hand_schedule(
    orders: list[str], owners: tuple[tuple[int, ...], ...], stages: int, microbatches: int, steps: int
) -> Schedule:
    """A schedule written by hand: one line of space-separated :func:`hand_action` tokens per worker."""
    parsed = [[hand_action(token) for token in line.split()] for line in orders]
    return Schedule("hand", stages, microbatches, steps, parsed, owners)

"""Branching layers laid out in the order that splits best (``capture/layer_order.py``).

Oracles: the reordered chain computes ``forward`` (train mode, the same random draws); the order's
best straight split equals a brute force over every topological order of the layer graph and every
split; the recorded order is kept for a chain, for split points and when the gain is under ``GAIN``;
the strategy runs a two-tower model in the searched order, and a resume keeps the checkpoint's order.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy, PlanningError
from lightning_pipe.capture import capture, pipe_split
from lightning_pipe.capture.graph import capture_graph
from lightning_pipe.capture.layer_order import GAIN, branches, layer_dag, searched_order
from lightning_pipe.capture.layers import group_nodes
from lightning_pipe.cli import main
from lightning_pipe.cost.pipedream_graph import LayerDag
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.contract import PipelineModel
from tests.lightning_cases import assert_states_close, final_state, trainer

WIDTH = 32
TOWER = 1024


class TwoTowers(nn.Module):
    """A tower and one a quarter as heavy (in FLOPs) beside it, joined by a head: the recorded order
    puts the whole heavy tower first. Dropout after the heavy tower's second layer and the light
    tower's first."""

    def __init__(self, split: bool = False, dropout: bool = True) -> None:
        super().__init__()
        self.a1, self.a2 = nn.Linear(TOWER, TOWER), nn.Linear(TOWER, TOWER)
        self.b1, self.b2 = nn.Linear(TOWER, TOWER // 4), nn.Linear(TOWER // 4, TOWER)
        self.drop_a, self.drop_b = (nn.Dropout(0.5), nn.Dropout(0.5)) if dropout else (nn.Identity(), nn.Identity())
        self.head = nn.Linear(2 * TOWER, 4)
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.drop_a(self.a2(self.a1(x)))
        if self.split:
            pipe_split()
        b = self.b2(self.drop_b(self.b1(x)))
        return self.head(torch.cat([a, b], dim=1))


def _chain(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    carried: object = (x,)
    for layer in layers:
        carried = layer(carried)
    assert isinstance(carried, torch.Tensor)
    return carried


def _same_as_forward(model: nn.Module, x: torch.Tensor, stages: int) -> list[str]:
    """The names of the layers in the searched order, after checking their chain against ``forward``
    in train mode."""
    captured = capture(model, (x,), stages=stages)
    order = searched_order(captured.graph, captured.grouped, stages)
    if order is not None:
        captured = captured.reordered(order)
    torch.manual_seed(3)
    expected = model(x)
    torch.manual_seed(3)
    got = _chain(list(captured.layers), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    return [spec.name for spec in captured.specs]


def _best_split(dag: LayerDag, order: tuple[int, ...], stages: int) -> float:
    """Brute force: the smallest bottleneck of ``order`` cut into at most ``stages`` runs."""
    seconds = [dag.layers[i].seconds for i in order]
    best = sum(seconds)
    for k in range(1, min(stages, len(order))):
        for cuts in itertools.combinations(range(1, len(order)), k):
            bounds = (0, *cuts, len(order))
            best = min(best, max(sum(seconds[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def _topological_orders(dag: LayerDag) -> Iterator[tuple[int, ...]]:
    position_ok = {(src, dst) for src, dst in dag.edges}
    for order in itertools.permutations(range(len(dag.layers))):
        where = {node: i for i, node in enumerate(order)}
        if all(where[src] < where[dst] for src, dst in position_ok):
            yield order


def test_the_light_tower_is_split_beside_the_heavy_one_and_draws_as_forward_does() -> None:
    model, x = TwoTowers().train(), torch.randn(4, TOWER)
    graph = capture_graph(model, (x,), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    order = searched_order(graph, grouped, 2)
    assert order is not None
    dag = layer_dag(graph, grouped)
    recorded = _best_split(dag, tuple(range(len(grouped))), 2)
    assert _best_split(dag, order, 2) <= (1 - GAIN) * recorded
    names = _same_as_forward(model, x, stages=2)
    assert names.index("b1") < names.index("a2")  # the light tower's start moved up beside the heavy one
    assert names.index("drop_a") < names.index("drop_b")  # random draws in forward's order


def test_kept_where_nothing_is_gained_or_the_user_split() -> None:
    x = torch.randn(4, TOWER)
    chain = nn.Sequential(nn.Linear(TOWER, TOWER), nn.ReLU(), nn.Linear(TOWER, TOWER), nn.Linear(TOWER, 4))
    for model in (chain, TwoTowers(split=True)):
        graph = capture_graph(model, (x,), {})
        assert searched_order(graph, group_nodes(graph, min_layers=8, max_share=0.25), 2) is None
    graph = capture_graph(TwoTowers(), (x,), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    assert searched_order(graph, grouped, 2, max_states=3) is None  # beyond the search: recorded order
    even = [(1.0, 2.0)] * len(grouped)  # every layer as long: the recorded order splits as well
    assert searched_order(graph, grouped, 2, seconds=even) is None


def test_an_order_the_layers_cannot_run_in_is_refused() -> None:
    """A plan file of another model could name these layers in an order where one runs before what it
    uses: refused, naming it, before any layer is built."""
    captured = capture(TwoTowers(), (torch.randn(4, TOWER),), stages=2)
    names = [spec.name for spec in captured.specs]
    swapped = list(range(len(names)))
    swapped[0], swapped[1] = 1, 0  # a2 before a1
    with pytest.raises(PlanningError, match="a2 would run before a1"):
        captured.reordered(swapped)
    with pytest.raises(PlanningError, match="must list each once"):
        captured.reordered([0, 0, *range(2, len(names))])


class InPlace(nn.Module):
    """The side branch reads ``p``; later the main branch changes ``p`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.side, self.main = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.stem(x)
        s = self.side(p)
        m = self.main(x)
        p.mul_(2)
        return m + p + s


class InPlaceThroughAView(nn.Module):
    """A heavy branch changes a view of ``p`` in place; a light one read ``p`` before it, and only the
    last layer uses what it made: nothing but the change keeps it before the heavy branch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.heavy1, self.heavy2 = nn.Linear(WIDTH, 8 * WIDTH), nn.Linear(8 * WIDTH, WIDTH)
        self.light1, self.light2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.stem(x)
        s = self.light1(p)
        h = self.heavy2(self.heavy1(p))
        p.view(-1).mul_(2)
        t = self.light2(s)
        return h + t + p


def test_an_in_place_change_keeps_its_place_among_the_readers() -> None:
    model, x = InPlace(), torch.randn(4, WIDTH)
    graph = capture_graph(model, (x,), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    layer_of = {node: i for i, (group, _) in enumerate(grouped) for node in group}
    mutation = next(n for n in layer_of if n.op == "call_method" and n.target == "mul_")
    side = next(n for n in layer_of if n.op == "call_module" and n.target == "side")
    edges = set(layer_dag(graph, grouped).edges)
    assert (layer_of[side], layer_of[mutation]) in edges or layer_of[side] == layer_of[mutation]
    _same_as_forward(model, x, stages=2)
    model = InPlaceThroughAView()
    graph = capture_graph(model, (x,), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    layer_of = {node: i for i, (group, _) in enumerate(grouped) for node in group}
    mutation = next(n for n in layer_of if n.op == "call_method" and n.target == "mul_")
    reader = next(n for n in layer_of if n.op == "call_module" and n.target == "light1")
    assert (layer_of[reader], layer_of[mutation]) in set(layer_dag(graph, grouped).edges)
    _same_as_forward(model, x, stages=2)


class TwoAttentions(nn.Module):
    """Two attention leaves side by side, each with dropout inside (no dropout module of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.MultiheadAttention(WIDTH, 2, dropout=0.5, batch_first=True)
        self.b = nn.MultiheadAttention(WIDTH, 2, dropout=0.5, batch_first=True)
        self.head = nn.Bilinear(WIDTH, WIDTH, 4)  # joins the two in a layer of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x, x, x)[0], self.b(x, x, x)[0])


def test_leaves_that_draw_inside_keep_their_order() -> None:
    graph = capture_graph(TwoAttentions().train(), (torch.randn(2, 3, WIDTH),), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    layer_of = {node: i for i, (group, _) in enumerate(grouped) for node in group}
    a, b = (next(n for n in layer_of if n.op == "call_module" and n.target == name) for name in "ab")
    assert (layer_of[a], layer_of[b]) in set(layer_dag(graph, grouped).edges)
    calm = TwoAttentions()
    calm.a.dropout = calm.b.dropout = 0.0
    graph = capture_graph(calm.train(), (torch.randn(2, 3, WIDTH),), {})
    grouped = group_nodes(graph, min_layers=8, max_share=0.25)
    assert branches(graph, grouped)  # without dropout nothing ties them: either may run first


@st.composite
def branching_models(draw: st.DrawFn) -> tuple[nn.Module, int]:
    """A random DAG of up to six linear blocks of drawn costs (each block sums some earlier outputs),
    dropout after some; the output sums the blocks nothing else reads."""
    n = draw(st.integers(3, 6))
    inputs = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=2))) if i else [] for i in range(n)]
    widths = [draw(st.sampled_from([1, 2, 4, 8])) for _ in range(n)]
    dropped = [draw(st.booleans()) for _ in range(n)]
    return _Blocks(inputs, widths, dropped), draw(st.integers(2, 3))


class _Blocks(nn.Module):
    """Block ``i`` is one linear layer ``widths[i]`` times as wide as needed (its FLOPs), cut back."""

    def __init__(self, inputs: list[list[int]], widths: list[int], dropped: list[bool]) -> None:
        super().__init__()
        self.inputs, self.dropped = inputs, dropped
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH * k) for k in widths)
        read = {j for sources in inputs for j in sources}
        self.sinks = [i for i in range(len(inputs)) if i not in read]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, sources in enumerate(self.inputs):
            h = sum((outs[j] for j in sources), torch.zeros_like(x)) if sources else x
            h = self.blocks[i](h)[:, :WIDTH]
            outs.append(F.dropout(h, 0.3, self.training) if self.dropped[i] else h)
        return sum((outs[i] for i in self.sinks), torch.zeros_like(x))


@settings(max_examples=50, deadline=None)
@given(branching_models())
def test_the_order_splits_as_well_as_any_topological_order(case: tuple[nn.Module, int]) -> None:
    model, stages = case
    model.train()
    x = torch.randn(3, WIDTH)
    graph = capture_graph(model, (x,), {})
    grouped = group_nodes(graph, min_layers=4 * stages, max_share=1.0 / (2 * stages))
    order = searched_order(graph, grouped, stages)
    dag = layer_dag(graph, grouped)
    assert len(grouped) <= 7, [len(g) for g, _ in grouped]  # a layer per block: in the brute force's reach
    orders = list(_topological_orders(dag))
    recorded = _best_split(dag, tuple(range(len(grouped))), stages)
    best = min(_best_split(dag, o, stages) for o in orders)
    if order is None:
        assert best > (1 - GAIN) * recorded or len(grouped) <= stages
    else:
        assert order in orders
        assert _best_split(dag, order, stages) == pytest.approx(best)
    _same_as_forward(model, x, stages)


class TwoTowerClassifier(L.LightningModule):
    """The two towers as a user writes a classifier around them (no dropout: compared exactly)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TwoTowers(dropout=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _towers_fit(root: str, strategy: Any, devices: int, epochs: int = 1, resume: str | None = None) -> dict[str, Any]:
    """Fit the two towers for ``epochs`` (from the checkpoint ``resume``), save ``root/last.ckpt``."""
    module = TwoTowerClassifier()
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, TOWER, generator=generator), torch.randint(0, 4, (256,), generator=generator))
    run = trainer(root, strategy, devices, max_epochs=epochs)
    run.fit(module, DataLoader(data, batch_size=128), ckpt_path=resume)
    run.save_checkpoint(str(Path(root) / "last.ckpt"))
    plan = getattr(run.strategy, "stage_plan", None)
    seconds = getattr(run.strategy, "setup_seconds", None)
    return {"final": final_state(run, module), "names": plan.names if plan is not None else None, "seconds": seconds}


def _flop_order(model: PipelineModel, costs: Any, stages: int) -> tuple[int, ...] | None:
    """The order by FLOPs: what the layers' times choose on a quiet machine, without their noise."""
    assert model.captured is not None
    return searched_order(model.captured.graph, model.captured.grouped, stages)


def _towers_worker(rank: int, root: str, plan: str) -> list[dict[str, Any]]:
    """A fit in the searched order, then, on a machine whose times would keep the recorded order, one
    resumed from its checkpoint and one given the plan file ``lightning-pipe plan`` wrote: the
    checkpoint's order and the file's hold; and one given a balance, which counts the layers in
    forward's order."""
    os.environ["LOCAL_RANK"] = str(rank)
    PipelineModel.order_for = _flop_order  # type: ignore[method-assign]  # (its own process)
    first = _towers_fit(str(Path(root) / "first"), PipelineStrategy("1f1b", microbatches=2), 2)
    PipelineModel.order_for = lambda *args: None  # type: ignore[method-assign]
    resumed = _towers_fit(
        str(Path(root) / "resumed"),
        PipelineStrategy("1f1b", microbatches=2),
        2,
        epochs=2,
        resume=str(Path(root) / "first" / "last.ckpt"),
    )
    planned = _towers_fit(str(Path(root) / "planned"), PipelineStrategy("1f1b", microbatches=2, plan=plan), 2)
    PipelineModel.order_for = _flop_order  # type: ignore[method-assign]
    balanced = _towers_fit(str(Path(root) / "balanced"), PipelineStrategy("1f1b", microbatches=2, balance=[4, 3]), 2)
    return [first, resumed, planned, balanced]


def _plan_file(path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``lightning-pipe plan --json`` of the two towers written to ``path`` (the layers ordered by
    FLOPs, as a quiet machine's times order them); the layers' names, and that it said so."""
    with monkeypatch.context() as patched:
        patched.setattr(PipelineModel, "order_for", _flop_order)
        argv = ["plan", "--model", "tests.test_layer_order:TwoTowerClassifier", "--input-shape", str(TOWER)]
        assert main([*argv, "--batch-size", "64", "--devices", "2", "--straight", "--repeats", "1", "--json"]) == 0
    printed = capsys.readouterr()
    assert "The layers branch" in printed.err
    path.write_text(printed.out)
    return json.loads(printed.out)["layer_names"]


@pytest.mark.timeout(300)
def test_a_reordered_pipeline_trains_as_plain_lightning_and_keeps_its_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The strategy runs the searched order and trains as plain Lightning; a resume keeps the
    checkpoint's order, a plan file from ``lightning-pipe plan`` its own, though the times would
    keep the recorded order; a given balance keeps forward's order."""
    planned_names = _plan_file(tmp_path / "plan.json", monkeypatch, capsys)
    recorded = ["model.a1", "model.a2", "model.drop_a", "model.b1", "model.drop_b", "model.b2+model", "model.head"]
    assert planned_names.index("model.b1") < planned_names.index("model.a2")
    ranks = run_local(_towers_worker, 2, str(tmp_path / "pipe"), str(tmp_path / "plan.json"), timeout=260)
    plain = [_towers_fit(str(tmp_path / f"plain{epochs}"), "auto", 1, epochs=epochs) for epochs in (1, 2)]
    for first, resumed, planned, balanced in ranks:
        names = list(first["names"])
        assert names.index("model.b1") < names.index("model.a2"), names  # the strategy ran the searched order
        assert list(resumed["names"]) == names  # the checkpoint's order, not the recorded one
        assert list(planned["names"]) == planned_names  # the plan file's
        assert list(balanced["names"]) == recorded
        assert_states_close(first["final"], plain[0]["final"], 1e-5)
        assert_states_close(resumed["final"], plain[1]["final"], 1e-5)
        assert_states_close(planned["final"], plain[0]["final"], 1e-5)
    seconds = ranks[0][0]["seconds"]  # rank 0 profiled the layers for their order, then in it
    assert min(seconds.values()) >= 0 and seconds["profile"] > 0
    assert seconds["total"] == pytest.approx(sum(value for phase, value in seconds.items() if phase != "total"))

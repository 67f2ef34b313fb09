"""Each rank holds only its stages (:mod:`lightning_pipe.strategy.ownership`), in one process.

The oracle: a stage holds exactly the tensors its layers read (found from the layers themselves,
independently of the state-dict bookkeeping), tied parameters on every stage that uses them; a
released tensor is freed (no reference left anywhere) and the module keeps every name and shape.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.strategy.contract import Entry, pipeline_model
from lightning_pipe.strategy.ownership import Ownership, release, tensor_ids
from tests.user_modules import GPTModule


@functools.cache
def _captured_gpt() -> tuple[GPTModule, list[nn.Module]]:
    torch.manual_seed(0)
    module = GPTModule()
    tokens = torch.randint(0, 64, (4, 17))
    call = Entry(module).capture(module.training_step, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), 0)
    return module, pipeline_model(module, call, 2).layers


def _gpt() -> tuple[GPTModule, list[nn.Module]]:
    """A fresh copy of the captured GPT and its layers (copied together: the layers share the
    module's tensors, as the captured ones do), captured once for the whole file."""
    module, layers = copy.deepcopy(_captured_gpt())
    assert module.model.transformer.wte.weight is module.model.lm_head.weight
    assert tensor_ids(layers) <= tensor_ids([module])
    return module, layers


def _split(layers: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = [0, *sorted(set(cuts)), layers]
    return [(a, b - 1) for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_rank_holds_its_stages_tensors_and_the_ones_outside_the_layers(data: st.DataObject) -> None:
    """For any split of the GPT's layers and any stage a rank runs: after the release it holds the
    tensors of that stage's layers (the tied embedding and LM head wherever they are used) and every
    tensor no layer uses; every other tensor is on the meta device with its shape, and freed."""
    module, layers = _gpt()
    cuts = data.draw(st.lists(st.integers(1, len(layers) - 1), min_size=1, max_size=3))
    bounds = _split(len(layers), cuts)
    stage = data.draw(st.integers(0, len(bounds) - 1))
    ownership = Ownership.of(module, layers, bounds)
    optimizer = torch.optim.AdamW(module.parameters())
    shapes = {name: value.shape for name, value in module.state_dict().items()}
    first, last = bounds[stage]
    expected = {id(t) for layer in layers[first : last + 1] for t in [*layer.parameters(), *layer.buffers()]}
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    state = module.state_dict(keep_vars=True)
    expected_names = {name for name, t in state.items() if id(t) in expected or id(t) not in inside}
    unique = {id(t): t for t in state.values() if id(t) not in expected and id(t) in inside}
    dropped = [weakref.ref(t) for t in unique.values()]
    dropped_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    del unique
    others = tensor_ids(layer for s, (a, b) in enumerate(bounds) if s != stage for layer in layers[a : b + 1])
    released = release([module, *layers], others - expected, [optimizer])
    del state
    gc.collect()
    held = {name for name, value in module.state_dict().items() if not value.is_meta}
    assert held == expected_names == ownership.names([stage])
    assert {name: value.shape for name, value in module.state_dict().items()} == shapes
    assert all(ref() is None for ref in dropped), "a released tensor is still referenced"
    assert released == dropped_bytes
    assert all(p.is_meta or id(p) in expected for group in optimizer.param_groups for p in group["params"])
    assert module.model.transformer.wte.weight is module.model.lm_head.weight  # still tied


def test_every_entry_has_one_writer_the_first_worker_of_its_first_stage() -> None:
    """The tied embedding (used by the first and the last layer) is written by the first stage's
    worker; an entry outside the layers by the first pipeline's first rank."""
    module, layers = _gpt()
    bounds = _split(len(layers), [2, 4])
    ownership = Ownership.of(module, layers, bounds)
    first_owners, ranks = [0, 1, 2], [10, 11, 12]
    assert ownership.writer("model.lm_head.weight", first_owners, ranks) == 10
    assert ownership.writer("model.transformer.wte.weight", first_owners, ranks) == 10
    assert "model.lm_head.weight" in ownership.stage_names[0] and "model.lm_head.weight" in ownership.stage_names[2]
    assert ownership.writer("model.transformer.ln_f.weight", first_owners, ranks) == 12
    module.register_buffer("class_weights", torch.ones(3))  # used by the step code, not forward
    ownership = Ownership.of(module, layers, bounds)
    assert ownership.outside == {"class_weights"}
    assert ownership.writer("class_weights", first_owners, ranks) == 10
    assert all("class_weights" in ownership.names([s]) for s in range(3))

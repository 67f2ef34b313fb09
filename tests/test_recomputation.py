"""Which stages recompute when the model asks for activation checkpointing
(:mod:`lightning_pipe.strategy.recomputation`): the blocks found under each ecosystem's convention,
and the stages holding them, against a brute-force oracle over random splits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from lightning_pipe.strategy.recomputation import checkpointed_blocks, recomputation_note, recomputed_stages

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


def _gpt2(layers: int = 4) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def test_transformers_blocks_not_the_model_holding_them() -> None:
    model = _gpt2()
    assert checkpointed_blocks(model) == {}
    model.gradient_checkpointing_enable()
    assert list(checkpointed_blocks(model)) == [f"transformer.h.{i}" for i in range(4)]


def test_transformers_every_nth_block() -> None:
    model = _gpt2(layers=6)
    model.gradient_checkpointing_enable(every_n_layers=3)
    assert list(checkpointed_blocks(model)) == ["transformer.h.0", "transformer.h.3"]


def test_timm_model_checkpoints_its_blocks() -> None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, depth=2)
    assert checkpointed_blocks(model) == {}
    model.set_grad_checkpointing(True)
    assert list(checkpointed_blocks(model)) == ["VisionTransformer"]  # the model itself: every stage of it


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stages_holding_a_wrapped_block_recompute(data: st.DataObject) -> None:
    """A chain of blocks, some wrapped in ``checkpoint_wrapper``, split anywhere: a stage recomputes
    exactly when one of its blocks is wrapped."""
    count = data.draw(st.integers(2, 8))
    wrapped = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    blocks = [nn.Linear(2, 2) for _ in range(count)]
    chain = nn.Sequential(*(checkpoint_wrapper(b) if w else b for b, w in zip(blocks, wrapped, strict=True)))
    cuts = sorted(data.draw(st.sets(st.integers(1, count - 1), max_size=count - 1)))
    bounds = list(zip([0, *cuts], [*cuts, count], strict=True))
    stages = [nn.Sequential(*blocks[a:b]) for a, b in bounds]  # the blocks themselves, as the layers hold them
    assert list(checkpointed_blocks(chain)) == [str(i) for i, w in enumerate(wrapped) if w]
    assert recomputed_stages(checkpointed_blocks(chain), stages) == [any(wrapped[a:b]) for a, b in bounds]


def test_the_note_names_blocks_and_stages() -> None:
    model = _gpt2(layers=6)
    model.gradient_checkpointing_enable()
    note = recomputation_note(checkpointed_blocks(model), [True, False, True])
    assert "transformer.h.0, transformer.h.1, transformer.h.2, ... (6 in all)" in note
    assert "stages 0, 2 recompute" in note

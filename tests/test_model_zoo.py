"""The models people pipeline, built from their config classes and called as their documentation
shows, run unchanged on 2 processes: Hugging Face ``transformers`` decoders (GPT-2 with its default
generation cache, a Llama-style decoder: rotary embeddings, grouped-query attention, RMSNorm, the
causal mask built in ``forward``; Mixtral, a mixture of experts routing each token to 2 of 4), an
encoder (BERT with ``attention_mask``, ``token_type_ids`` and ``labels=``, its loss object made in
``forward``), an encoder-decoder (T5: two stacks, cross-attention, embeddings shared with the
head), a ``timm`` ViT, ``transformers``' Swin (which sets its windows' shift in ``forward``),
torchvision's EfficientNet-B0 and a ``segmentation-models-pytorch`` U-Net.

1F1B and GPipe end equal to plain Lightning fed the same micro-batches (``accumulate_grad_batches``,
batch norm's running statistics moved once per step by the whole batch's rows, as the pipeline
does: the reference of :mod:`tests.test_user_modules`) to 1e-6, and, on the models without batch
norm (SGD on a mean loss), to plain Lightning's whole-batch run to 1e-5. 2BW ends equal to the
single-process reference of its rule, plain Lightning fed the same micro-batches whose gradients
are taken one step late (``tests/lightning_cases.py``'s ``one_step_late``), to 1e-6, and it is not
synchronous training. The step reads the model's own output class (``out.loss``,
``out["logits"]``), and so do ``validation_step`` and ``predict_step``, whose logs and predictions
equal plain Lightning's. ``gradient_checkpointing_enable()`` becomes the stages' recomputation.
Batches as ``transformers``' collators make them (a ``BatchEncoding`` padded to each batch's longest
text) change their sequence length from step to step and train as plain Lightning, on a dozen
decoders built from their configs (:data:`DECODER_CONFIGS`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from tests.lightning_cases import (
    assert_states_close,
    deferred_statistics,
    final_state,
    one_step_late,
    step_losses,
    trainer,
)

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
smp = pytest.importorskip("segmentation_models_pytorch")

ROWS, MICROBATCHES, BATCHES, VOCAB, LENGTH = 8, 2, 2, 64, 8
LANGUAGE = ("gpt2", "llama", "mixtral", "bert", "t5")
VISION = ("vit", "swin", "efficientnet", "unet")
BATCH_NORM = ("efficientnet", "unet")
DECODERS = ("gpt2", "gpt2_checkpointed", "llama", "mixtral", "qwen2")  # called with labels=ids
ROTARY_DECODER = {  # Llama's and Qwen2's sizes: rotary embeddings, grouped-query attention
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32,
}


def _network(name: str) -> nn.Module:
    t = transformers
    if name == "gpt2_checkpointed":  # as transformers' documentation turns activation checkpointing on
        model = _network("gpt2")
        model.gradient_checkpointing_enable()
        return model
    if name == "gpt2":
        config = t.GPT2Config(
            n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        return t.GPT2LMHeadModel(config)  # use_cache=True, the default
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**ROTARY_DECODER))
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**ROTARY_DECODER))
    if name == "mixtral":  # a mixture of experts: each token routed to 2 of 4 experts
        return t.MixtralForCausalLM(t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **ROTARY_DECODER))
    if name == "bert":
        config = t.BertConfig(
            num_hidden_layers=4,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return t.BertForSequenceClassification(config)
    if name == "t5":
        config = t.T5Config(
            num_layers=2,
            num_decoder_layers=2,
            d_model=32,
            d_ff=64,
            num_heads=4,
            d_kv=8,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        return t.T5ForConditionalGeneration(config)
    if name == "vit":
        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, depth=4, num_classes=3
        )
    if name == "swin":  # sets its windows' shift in forward, from the input's size
        config = t.SwinConfig(
            image_size=16,
            patch_size=2,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 4],
            window_size=4,
            num_labels=3,
            drop_path_rate=0.0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return t.SwinForImageClassification(config)
    if name == "features":  # a backbone's feature maps, as timm documents features_only
        return timm.create_model("resnet18", pretrained=False, features_only=True, out_indices=(2, 3, 4))
    if name == "efficientnet":
        import torchvision

        return torchvision.models.efficientnet_b0(weights=None, num_classes=3, dropout=0.0, stochastic_depth_prob=0.0)
    return smp.Unet(
        "resnet18", encoder_weights=None, in_channels=3, classes=2, encoder_depth=3, decoder_channels=(32, 16, 8)
    )


class ZooModule(L.LightningModule):
    """What a user writes around the model: ``forward`` calls it, the step reads its output."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.name = name
        self.model = _network(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.name in DECODERS:
            (ids,) = batch
            out = self(ids, labels=ids)
            loss = out.loss
        elif self.name == "bert":
            ids, mask, types, labels = batch
            out = self(ids, attention_mask=mask, token_type_ids=types, labels=labels)
            loss = out.loss
            self.log("train_acc", (out["logits"].argmax(-1) == labels).float().mean())
        elif self.name == "t5":
            ids, labels = batch
            loss = self(input_ids=ids, labels=labels).loss
        elif self.name == "swin":
            images, labels = batch
            loss = self(pixel_values=images, labels=labels).loss
        elif self.name == "unet":
            images, masks = batch
            loss = nn.functional.cross_entropy(self(images), masks)
        else:
            images, labels = batch
            loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses = [*getattr(self, "losses", []), float(outputs["loss"])]

    def on_train_end(self) -> None:
        executor = getattr(self.trainer.strategy, "executor", None)  # which stages recompute, on this rank
        self.recomputed = {} if executor is None else dict(executor.compute.recompute)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.5)


def _data(name: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    rows = BATCHES * ROWS
    ids = torch.randint(1, VOCAB, (rows, LENGTH), generator=g)
    if name in DECODERS:
        return TensorDataset(ids)
    if name == "bert":
        mask = torch.ones(rows, LENGTH, dtype=torch.long)
        mask[::2, -3:] = 0  # padded rows: the mask matters
        types = torch.zeros(rows, LENGTH, dtype=torch.long)
        types[:, LENGTH // 2 :] = 1
        return TensorDataset(ids, mask, types, torch.randint(0, 3, (rows,), generator=g))
    if name == "t5":
        return TensorDataset(ids, torch.randint(1, VOCAB, (rows, 5), generator=g))
    # EfficientNet's last maps are 1x1 at 16x16 (32x smaller): batch norm over a micro-batch's 4 values
    # is then so ill-conditioned that plain PyTorch on 1 and 2 threads differs by 0.03 in the loss
    size = 64 if name == "efficientnet" else 16
    images = torch.randn(rows, 3, size, size, generator=g)
    if name == "unet":
        return TensorDataset(images, (images[:, 0] > 0).long())
    return TensorDataset(images, (images[:, 0].mean((1, 2)) > 0).long())  # learnable in a few steps


def _fit(
    name: str, root: str, strategy: Any, devices: int, epochs: int, reference: int = 1, late: bool = False
) -> dict[str, Any]:
    """Train ``name``; with ``reference`` > 1 plain Lightning fed that many micro-batches per step
    (with ``late``, under 2BW's rule)."""
    module = ZooModule(name)
    callbacks = [deferred_statistics(L)(reference)] if reference > 1 and name in BATCH_NORM else []
    callbacks += [one_step_late(L)(reference)] if late else []
    run = trainer(root, strategy, devices, max_epochs=epochs, accumulate_grad_batches=reference, callbacks=callbacks)
    run.fit(module, DataLoader(_data(name), batch_size=ROWS // reference))
    losses = step_losses(module.losses, reference) if reference > 1 else module.losses
    return {"final": final_state(run, module), "losses": losses, "recomputed": module.recomputed}


def _worker(rank: int, root: str, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    os.environ["LOCAL_RANK"] = str(rank)
    results = []
    for name, schedule in cases:
        strategy = PipelineStrategy(schedule, microbatches=MICROBATCHES)
        epochs = 2 if schedule == "2bw" else 1
        results.append(_fit(name, f"{root}/{name}_{schedule}", strategy, 2, epochs))
    return results


def _one_thread(fit: Any, *args: Any) -> Any:
    """``fit(*args)`` on one thread, as each pipeline process computes (``run_local``): a convolution's
    sums are grouped by thread, and batch norm over a micro-batch's few values shows the rounding."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fit(*args)
    finally:
        torch.set_num_threads(threads)


def _largest_gap(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return max(float((one[k] - other[k]).abs().max()) for k in one if one[k].is_floating_point() and one[k].numel())


def _run(names: tuple[str, ...], tmp_path: Path) -> None:
    cases = [(name, schedule) for name in names for schedule in ("1f1b", "gpipe", "2bw")]
    per_rank = run_local(_worker, 2, str(tmp_path), cases, timeout=560)
    for name in names:
        expected = _one_thread(_fit, name, str(tmp_path / f"{name}_plain"), "auto", 1, 1, MICROBATCHES)
        whole = None if name in BATCH_NORM else _one_thread(_fit, name, str(tmp_path / f"{name}_whole"), "auto", 1, 1)
        late = _one_thread(_fit, name, str(tmp_path / f"{name}_late"), "auto", 1, 2, MICROBATCHES, True)
        early = _one_thread(_fit, name, str(tmp_path / f"{name}_sync"), "auto", 1, 2, MICROBATCHES)
        assert _largest_gap(late["final"], early["final"]) > 1e-4, name  # 2BW's rule is not synchronous training
        for rank in per_rank:
            for schedule in ("1f1b", "gpipe"):
                got = rank[cases.index((name, schedule))]
                assert got["losses"] == pytest.approx(expected["losses"], abs=1e-6), (name, schedule)
                assert_states_close(got["final"], expected["final"], 1e-6)
                if whole is not None:  # SGD on a mean loss: the micro-batches' mean gradient is the batch's
                    assert got["losses"] == pytest.approx(whole["losses"], abs=1e-5), (name, schedule)
                    assert_states_close(got["final"], whole["final"], 1e-5)
            got = rank[cases.index((name, "2bw"))]
            assert got["losses"] == pytest.approx(late["losses"], abs=1e-6), name
            assert_states_close(got["final"], late["final"], 1e-6)
            assert sum(got["losses"][-BATCHES:]) < sum(got["losses"][:BATCHES]), (name, got["losses"])


@pytest.mark.timeout(600)
def test_transformers_models_run_unchanged(tmp_path: Path) -> None:
    _run(LANGUAGE, tmp_path)


@pytest.mark.timeout(600)
def test_vision_models_run_unchanged(tmp_path: Path) -> None:
    _run(VISION, tmp_path)


@pytest.mark.timeout(300)
def test_activation_checkpointing_becomes_stage_recomputation(tmp_path: Path) -> None:
    """GPT-2 after ``gradient_checkpointing_enable()``: every stage holds checkpointed blocks, so each
    recomputes its forward in the backward (its activations not kept), and 1F1B still ends equal to
    plain Lightning (checkpointing itself) fed the same micro-batches."""
    name = "gpt2_checkpointed"
    per_rank = run_local(_worker, 2, str(tmp_path), [(name, "1f1b")], timeout=280)
    expected = _one_thread(_fit, name, str(tmp_path / "plain"), "auto", 1, 1, MICROBATCHES)
    for rank, (got,) in enumerate(per_rank):
        assert got["recomputed"] == {rank: True}
        assert got["losses"] == pytest.approx(expected["losses"], abs=1e-6)
        assert_states_close(got["final"], expected["final"], 1e-6)


class EvaluatedModule(ZooModule):
    """What a user adds for evaluation: ``validation_step`` and ``predict_step`` read the model's own
    output class, as the training step does."""

    def _output(self, batch: Any) -> Any:
        if self.name == "features":
            return self(batch[0])
        if self.name == "bert":
            ids, mask, types, labels = batch
            return self(ids, attention_mask=mask, token_type_ids=types, labels=labels)
        (ids,) = batch
        return self(ids, labels=ids)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self._output(batch)
        if self.name == "features":  # a list of maps, one per level, each with the batch's rows
            self.log("val_levels", float(len(out)))
            self.log("val_top", sum(level.amax((1, 2, 3)).mean() for level in out))
            return
        self.log("val_loss", out.loss)
        self.log("val_top", out.logits.max(-1).values.mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self._output(batch)
        if self.name == "features":
            return torch.cat([level.mean((2, 3)) for level in out], 1)
        return out.logits.argmax(-1)


def _evaluate(root: str, strategy: Callable[[], Any], devices: int, names: tuple[str, ...]) -> dict[str, Any]:
    results = {}
    for name in names:
        run = trainer(f"{root}/{name}", strategy(), devices)
        data = DataLoader(_data(name), batch_size=ROWS)
        module = EvaluatedModule(name)
        results[name] = (run.validate(module, data, verbose=False), run.predict(module, data))
    return results


def _evaluating_worker(rank: int, root: str, names: tuple[str, ...]) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    return _evaluate(root, lambda: PipelineStrategy("1f1b", microbatches=MICROBATCHES), 2, names)


@pytest.mark.timeout(300)
def test_evaluation_steps_read_the_models_output_class(tmp_path: Path) -> None:
    """``validation_step`` and ``predict_step`` read ``out.loss`` and ``out.logits`` of a
    ``transformers`` output through the pipeline, on every rank, and log and predict what plain
    Lightning does to 1e-6 (the loss computed inside ``forward`` makes the last stage run each batch
    whole, so nothing is combined); a ``timm`` backbone's list of feature maps comes back one map per
    level, each with the batch's rows, from the micro-batches' lists."""
    names = ("gpt2", "bert", "features")
    per_rank = run_local(_evaluating_worker, 2, str(tmp_path), names, timeout=280)
    expected = _one_thread(_evaluate, str(tmp_path / "plain"), lambda: "auto", 1, names)
    for got in per_rank:
        for name in names:
            (metrics,), predictions = got[name]
            (plain,), plain_predictions = expected[name]
            assert (
                metrics.keys()
                == plain.keys()
                == ({"val_levels", "val_top"} if name == "features" else {"val_loss", "val_top"})
            )
            assert metrics == pytest.approx(plain, abs=1e-6), name
            assert len(predictions) == len(plain_predictions) == BATCHES
            for a, b in zip(predictions, plain_predictions, strict=True):
                assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-6), name


PROMPT = torch.tensor([[5, 9, 3], [7, 1, 2]])


def _generated(module: ZooModule) -> torch.Tensor | str:
    """The trained decoder's greedy continuation of :data:`PROMPT`, as ``transformers`` documents
    ``generate`` (or the error it raises)."""
    try:
        return module.model.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0)
    except RuntimeError as error:
        return str(error)


def _generating_worker(rank: int, root: str) -> dict[bool, tuple[torch.Tensor | str, list[str]]]:
    os.environ["LOCAL_RANK"] = str(rank)
    results = {}
    for gather in (True, False):
        module = ZooModule("qwen2")
        strategy = PipelineStrategy("1f1b", microbatches=MICROBATCHES, gather_after_fit=gather)
        trainer(f"{root}/{gather}", strategy, 2).fit(module, DataLoader(_data("qwen2"), batch_size=ROWS))
        results[gather] = (_generated(module), [name for name, t in module.named_buffers() if t.is_meta])
    return results


def _plain_generated(root: str) -> torch.Tensor | str:
    module = ZooModule("qwen2")
    run = trainer(root, "auto", 1, accumulate_grad_batches=MICROBATCHES)
    run.fit(module, DataLoader(_data("qwen2"), batch_size=ROWS // MICROBATCHES))
    return _generated(module)


@pytest.mark.timeout(300)
def test_a_decoder_gathered_after_fit_generates(tmp_path: Path) -> None:
    """After ``fit`` with ``gather_after_fit=True`` every rank's Qwen2 decoder generates what plain
    Lightning's does: its rotary embedding's ``inv_freq``, a buffer the state dict leaves out, is
    gathered too. Without it, ``model.generate`` on a rank holding only its stages says how to get
    the whole model."""
    per_rank = run_local(_generating_worker, 2, str(tmp_path), timeout=280)
    expected = _one_thread(_plain_generated, str(tmp_path / "plain"))
    assert isinstance(expected, torch.Tensor) and expected.shape == (2, 7)
    for rank, got in enumerate(per_rank):
        gathered, still_meta = got[True]
        assert still_meta == [], rank
        assert isinstance(gathered, torch.Tensor), (rank, gathered)
        assert torch.equal(gathered, expected), rank
    for got in per_rank:
        kept, _ = got[False]
        assert isinstance(kept, str) and "gather_after_fit=True" in kept, kept


def _fit_again(root: str, strategy: Callable[[], Any], devices: int, reference: int) -> dict[str, Any]:
    """Qwen2 fitted, then fitted again by a new Trainer (a fresh optimizer, from the trained weights),
    then resumed by a third from the checkpoint the first wrote (its weights and optimizer, one epoch
    more): the final state after each."""
    module = ZooModule("qwen2")
    data = DataLoader(_data("qwen2"), batch_size=ROWS // reference)
    finals = {}
    for name, options, resume in (
        ("first", {}, None),
        ("again", {}, None),
        ("resumed", {"max_epochs": 2}, f"{root}/first.ckpt"),
    ):
        run = trainer(f"{root}/{name}", strategy(), devices, accumulate_grad_batches=reference, **options)
        run.fit(module, data, ckpt_path=resume)
        if name == "first":
            run.save_checkpoint(f"{root}/first.ckpt")
        finals[name] = final_state(run, module)
    return finals


def _fitting_again_worker(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    return _fit_again(root, lambda: PipelineStrategy("1f1b", microbatches=MICROBATCHES), 2, 1)


@pytest.mark.timeout(300)
def test_a_module_fitted_again_by_a_new_trainer(tmp_path: Path) -> None:
    """After ``fit`` each rank holds only its stages; a new Trainer fitting the same module again gathers
    them back (the rotary embedding's ``inv_freq``, in no state dict, included) and splits it anew,
    and one resuming from a checkpoint takes the checkpoint's values over those the module held: each
    ends as plain Lightning's same three fits fed the same micro-batches, to 1e-6."""
    per_rank = run_local(_fitting_again_worker, 2, str(tmp_path), timeout=280)
    expected = _one_thread(_fit_again, str(tmp_path / "plain"), lambda: "auto", 1, MICROBATCHES)
    for got in per_rank:
        for name in ("first", "again", "resumed"):
            assert got[name].keys() == expected[name].keys(), name
            assert_states_close(got[name], expected[name], 1e-6)
    assert _largest_gap(expected["again"], expected["resumed"]) > 1e-4  # the resumed run is not the refit


def _padded_batches(rows: int = 22, batch: int = 8) -> list[dict[str, torch.Tensor]]:
    """Texts of 1 to 12 words, tokenized and padded to each batch's longest as ``transformers``'
    documentation shows (``DataCollatorForLanguageModeling(tokenizer, mlm=False)``: the padding
    masked, its labels -100), with a tokenizer built here (no download); the last batch is short."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    g = torch.Generator().manual_seed(3)
    texts = [
        " ".join(
            f"w{int(i)}" for i in torch.randint(2, VOCAB, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g)
        )
        for _ in range(rows)
    ]
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return list(DataLoader([tokenizer(text) for text in texts], batch_size=batch, collate_fn=collator))


_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}
DECODER_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "gemma2": {"head_dim": 8},
    "gemma3_text": {"head_dim": 8},
    "phi3": {"pad_token_id": 0},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {"head_dim": 8, "moe_intermediate_size": 16, **_EXPERTS},
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        **_EXPERTS,
    },
    "olmo2": {},
    "falcon": {},
    "gpt_neox": {},
    "opt": {"dropout": 0.0, "ffn_dim": 64},
}
"""Decoders by ``model_type``, each with what its config class needs beside the shared sizes
(:data:`ROTARY_DECODER`: 4 blocks, 32 wide) and no dropout (each process draws its own masks)."""


class PaddedDecoder(L.LightningModule):
    """A decoder (``model_type``) fine-tuned on padded batches: ``forward`` takes the collator's batch
    as ``transformers``' documentation calls the model (``model(**batch)``)."""

    def __init__(self, model_type: str = "llama") -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **{**ROTARY_DECODER, **DECODER_CONFIGS[model_type]})
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class WholeBatchDecoder(PaddedDecoder):
    """:class:`PaddedDecoder` whose ``forward`` takes the collator's ``BatchEncoding`` itself."""

    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss


def _padded_worker(rank: int, root: str, runs: list[tuple[str, str]]) -> list[dict[str, torch.Tensor]]:
    os.environ["LOCAL_RANK"] = str(rank)
    finals = []
    for model_type, schedule in runs:
        module = WholeBatchDecoder(model_type) if schedule == "gpipe" else PaddedDecoder(model_type)
        strategy = PipelineStrategy(schedule, microbatches=MICROBATCHES)
        run = trainer(f"{root}/{model_type}_{schedule}", strategy, 2, max_epochs=2)
        run.fit(module, DataLoader(_padded_batches(), batch_size=None))
        finals.append(final_state(run, module))
    return finals


def padded_reference(model_type: str, root: str | Path, threads: int = 1) -> dict[str, torch.Tensor]:
    """Plain Lightning on one process (on ``threads`` threads; a pipeline's processes compute on one)
    fed the micro-batches a pipeline cuts the padded batches into."""
    pieces = [
        {key: value.tensor_split(MICROBATCHES)[i] for key, value in batch.items()}
        for batch in _padded_batches()
        for i in range(MICROBATCHES)
    ]
    module = PaddedDecoder(model_type)
    run = trainer(root, "auto", 1, max_epochs=2, accumulate_grad_batches=MICROBATCHES)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run.fit(module, DataLoader(pieces, batch_size=None))
    finally:
        torch.set_num_threads(before)
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


@pytest.mark.timeout(300)
def test_batches_padded_to_their_longest_text_train_as_plain_lightning(tmp_path: Path) -> None:
    """Batches whose sequence length changes from step to step (padded to each batch's longest text,
    the last batch short, a ``BatchEncoding``) run through the graph captured on the first: 1F1B on
    every decoder of :data:`DECODER_CONFIGS` and GPipe on Llama (``forward`` taking the
    ``BatchEncoding`` itself: :class:`WholeBatchDecoder`) end as plain Lightning fed the same
    micro-batches to 1e-6 (each micro-batch's loss is the mean over its own tokens, as under gradient
    accumulation)."""
    assert len({batch["input_ids"].shape for batch in _padded_batches()}) == 3
    runs = [(model_type, "1f1b") for model_type in DECODER_CONFIGS] + [("llama", "gpipe")]
    per_rank = run_local(_padded_worker, 2, str(tmp_path), runs, timeout=280)
    expected = {model_type: padded_reference(model_type, tmp_path / model_type) for model_type in DECODER_CONFIGS}
    for finals in per_rank:
        for (model_type, _), final in zip(runs, finals, strict=True):
            assert_states_close(final, expected[model_type], 1e-6)

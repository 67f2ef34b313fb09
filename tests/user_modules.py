"""LightningModules in the shapes public code gives them, written here (none copied), small enough
for CPU tests. Nothing in them knows about pipelines.

- :class:`GPTModule`: a nanoGPT-style GPT in the usual thin LightningModule: a ``ModuleDict`` with a
  ``ModuleList`` of blocks, the token embedding tied to the LM head, ``forward(idx, targets)``
  returning ``(logits, loss)``, AdamW over decay and no-decay groups.
- :class:`DenseNetModule`: the lightning-hydra-template's MNIST module: its ``nn.Sequential`` one level
  down (``self.net.model``), BatchNorm1d, torchmetrics ``MeanMetric``/``Accuracy``/``MaxMetric``
  objects passed to ``self.log``, a ``model_step`` helper, ``self.trainer.model.parameters()``.
- :class:`LitResnet`: the CIFAR-10 baseline of Lightning's tutorials, written against the standalone
  ``pytorch_lightning`` package: torchvision's ResNet-18 with a 3x3 stem and no max-pool,
  ``forward = log_softmax(self.model(x))``, NLL loss, SGD with OneCycleLR stepped every batch.
- :class:`LitAutoEncoder`: an encoder and a decoder ``nn.Sequential``, ``forward = decoder(encoder(x))``,
  one ``_common_step`` for every stage whose loss compares the output with the input.
- :class:`LitClassifier`: a ``Backbone`` module passed in, ``forward = self.backbone(x)``.
- :class:`EpochEndOutputs`: the Lightning 2 pattern of collecting step outputs in lists on the module
  for ``on_*_epoch_end`` hooks.
- :class:`HuggingFaceGPT2`: ``transformers``' ``GPT2LMHeadModel`` in the usual thin LightningModule,
  ``forward(input_ids)`` returning the model's output (its ``loss`` for ``labels=input_ids``).
- :class:`EncoderLM`: an embedding, a ``torch.nn.TransformerEncoder`` under a causal mask and a head.
- Lightning's own demos (``LightningTransformer``, ``BoringModel``) are imported from the installed
  package by the tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy


# -- a GPT --------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout = self.dropout if self.training else 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        device = idx.device
        b, t = idx.size()  # noqa: RUF059 (as public code has it)
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class GPTModule(L.LightningModule):
    def __init__(self, config: GPTConfig | None = None, learning_rate: float = 3e-3, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.model = GPT(config or GPTConfig())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        return self.model(idx, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        _, loss = self(idx, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, targets = batch
        _, loss = self(idx, targets)
        self.log("val_loss", loss, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=(0.9, 0.95))


# -- the lightning-hydra-template's MNIST module ------------------------------------------------------
class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 64, lin1_size: int = 32, lin2_size: int = 32, output_size: int = 10):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()  # noqa: RUF059 (as public code has it)
        x = x.view(batch_size, -1)
        return self.model(x)


class DenseNetModule(L.LightningModule):
    def __init__(self, net: nn.Module | None = None, optimizer: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net or SimpleDenseNet()
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        self.val_acc_best(acc)
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        build = self.hparams.optimizer or functools.partial(torch.optim.Adam, lr=0.01)
        optimizer = build(params=self.trainer.model.parameters())
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1, patience=10)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1},
        }


# -- Lightning's CIFAR-10 baseline, on the standalone package -------------------------------------------
def create_model() -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
    model.maxpool = nn.Identity()
    return model


class LitResnet(pl.LightningModule):
    def __init__(self, lr: float = 0.05, steps_per_epoch: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return F.log_softmax(out, dim=1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        self.log("train_loss", loss)
        return loss

    def evaluate(self, batch: Any, stage: str | None = None) -> None:
        x, y = batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        preds = torch.argmax(logits, dim=1)
        acc = (preds == y).float().mean()
        if stage:
            self.log(f"{stage}_loss", loss, prog_bar=True)
            self.log(f"{stage}_acc", acc, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, 2 * self.hparams.lr, epochs=self.trainer.max_epochs, steps_per_epoch=self.hparams.steps_per_epoch
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# -- Lightning's autoencoder and backbone classifier examples ------------------------------------------
class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden_dim: int = 16, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(8 * 8, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 8 * 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._common_step(batch, batch_idx, "val")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> torch.Tensor:
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch: Any) -> torch.Tensor:
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch: Any, batch_idx: int, stage: str) -> torch.Tensor:
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim: int = 32) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8 * 8, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(L.LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone or Backbone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y), on_step=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


# -- step outputs collected for the epoch-end hooks --------------------------------------------------
class EpochEndOutputs(LitClassifier):
    """Lightning 2's documented replacement of ``*_epoch_end(outputs)``: lists on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.validation_step_outputs: list[torch.Tensor] = []
        self.epoch_means: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.validation_step_outputs.append(loss)
        return loss

    def on_validation_epoch_end(self) -> None:
        epoch_mean = torch.stack(self.validation_step_outputs).mean()
        self.log("validation_epoch_mean", epoch_mean)
        self.epoch_means.append(float(epoch_mean))
        self.validation_step_outputs.clear()


# -- a Hugging Face GPT-2 and a torch.nn.TransformerEncoder ----------------------------------------------
class HuggingFaceGPT2(L.LightningModule):
    """A small ``GPT2LMHeadModel`` (``transformers`` is imported here: only who builds one needs it),
    without the key-value cache (``use_cache=False``)."""

    def __init__(
        self, n_layer: int = 12, n_embd: int = 128, n_head: int = 4, vocab_size: int = 1024, n_positions: int = 256
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        ends = vocab_size - 1  # GPT-2's own 50256 is outside a smaller vocabulary (transformers warns)
        config = GPT2Config(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            vocab_size=vocab_size,
            n_positions=n_positions,
            bos_token_id=ends,
            eos_token_id=ends,
        )
        self.model = GPT2LMHeadModel(config)
        self.model.config.use_cache = False

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids, labels=input_ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self(input_ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EncoderLM(L.LightningModule):
    """Next-token prediction with ``nn.TransformerEncoder`` (``norm_first``, batch first, GELU)."""

    def __init__(self, layers: int = 6, width: int = 128, heads: int = 4, vocab: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

"""The language-modelling task: a Lightning module that carries Transformer-XL memory.

It subclasses NNI's ``LightningModule`` so the one-shot search can wrap it: the
model is handed in with ``set_model`` (NNI does the same with the supernet),
and everything here only assumes the :class:`parnas.model.TransformerXL`
interface (``model(x, mems) -> (h, mems)``, ``model.nll(h, y)``).

Memory is kept per stream name: one for training, one for evaluation, so an
evaluation in the middle of training neither sees nor disturbs the training
memory. Perplexity is ``exp(total NLL / predicted tokens)`` over the whole
split, summed across DDP ranks, never a mean of per-batch perplexities.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from nni.nas.evaluator.pytorch import LightningModule
from torch import Tensor, nn

from parnas.config import TrainConfig
from parnas.model import Memory


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then cosine decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def segment_nll(model: nn.Module, x: Tensor, y: Tensor, mems: Memory | None) -> tuple[Tensor, Memory]:
    """Per-token NLL of one segment (B, L) and the memory for the next one."""
    h, mems = model(x, mems)
    return model.nll(h, y), mems


@dataclass(frozen=True)
class Evaluation:
    nll: float  # total negative log-likelihood, nats
    tokens: int  # predicted tokens
    seconds: float

    @property
    def loss(self) -> float:
        return self.nll / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
             device: torch.device | str = "cpu") -> Evaluation:
    """Perplexity over a whole split, memory carried across segments, dropout off."""
    was_training = model.training
    model.eval()
    total, count, mems = torch.zeros((), dtype=torch.float64, device=device), 0, None
    start = time.perf_counter()
    for x, y in batches:
        nll, mems = segment_nll(model, x.to(device), y.to(device), mems)
        total += nll.double().sum()
        count += y.numel()
    model.train(was_training)
    return Evaluation(total.item(), count, time.perf_counter() - start)


class LanguageModelTask(LightningModule):
    """Trains ``self.model`` on contiguous segments; validates by whole-split perplexity."""

    def __init__(self, train: TrainConfig) -> None:
        super().__init__()
        self.train_cfg = train
        self.mems: dict[str, Memory | None] = {}
        self._val_sums: Tensor | None = None

    # --- training -----------------------------------------------------------
    def forward(self, x: Tensor, mems: Memory | None = None) -> tuple[Tensor, Memory]:
        return self.model(x, mems)

    def on_train_epoch_start(self) -> None:
        self.mems.pop("train", None)  # the stream starts over; so does its memory

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        nll, self.mems["train"] = segment_nll(self.model, x, y, self.mems.get("train"))
        loss = nll.mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", loss.detach().exp())
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])  # type: ignore[union-attr]
        return loss

    def configure_optimizers(self) -> Any:
        cfg = self.train_cfg
        optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr / cfg.lr))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # --- evaluation ---------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self.mems["val"] = None
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (total NLL, tokens)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        nll, self.mems["val"] = segment_nll(self.model, x, y, self.mems.get("val"))
        self._val_sums += torch.stack([nll.double().sum(), nll.new_tensor(y.numel(), dtype=torch.float64)])

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        loss = (sums[0] / sums[1]).float()
        self.log("val/loss", loss)  # already summed over ranks: identical everywhere
        self.log("val/ppl", loss.exp(), prog_bar=True)

    # --- checkpoints carry the training memory, so a resumed run sees what it would have seen
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["parnas_train_memory"] = self.mems.get("train")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.mems["train"] = checkpoint.get("parnas_train_memory")

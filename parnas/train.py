"""Train a fixed Transformer-XL with Lightning: data module, trainer, final metrics.

``train(cfg)`` is what ``parnas train`` runs. The pieces (``SegmentData``,
``build_trainer``) are reused by the search and retrain stages.

DDP: Lightning's distributed sampler is switched off, because the streams, not
the segments, are what ranks divide: rank r of W reads streams
[r*B/W, (r+1)*B/W) of every segment, so each rank's memory stays contiguous.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from parnas.config import Config, TrainConfig
from parnas.data import ContextBatches, load_splits
from parnas.files import write_json_atomic
from parnas.model import TransformerXL, build_fixed_model
from parnas.task import LanguageModelTask, evaluate


class SegmentData(pl.LightningDataModule):
    """Contiguous segments of each split; rank and world size are read at ``setup``."""

    def __init__(self, splits: dict[str, np.ndarray], batch_size: int, eval_batch_size: int, seg_len: int) -> None:
        super().__init__()
        self.splits, self.batch_size, self.eval_batch_size, self.seg_len = splits, batch_size, eval_batch_size, seg_len

    def batches(self, split: str, rank: int = 0, world_size: int = 1) -> ContextBatches:
        train = split == "train"
        return ContextBatches(self.splits[split], self.batch_size if train else self.eval_batch_size, self.seg_len,
                              rank=rank, world_size=world_size, drop_last=train)

    def _loader(self, split: str) -> DataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return DataLoader(self.batches(split, rank, world), batch_size=None, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")


def build_trainer(cfg: TrainConfig, out_dir: Path, **overrides: Any) -> pl.Trainer:
    """A Trainer that validates every ``eval_every`` optimiser steps, across epoch boundaries."""
    checkpoints = ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=cfg.ckpt_every,
                                  save_last=True, save_top_k=1)
    kwargs: dict[str, Any] = dict(
        max_steps=cfg.max_steps, max_epochs=-1,
        val_check_interval=cfg.eval_every * cfg.accumulate, check_val_every_n_epoch=None,
        accumulate_grad_batches=cfg.accumulate, gradient_clip_val=cfg.clip or None,
        accelerator=cfg.accelerator, devices=cfg.devices, precision=cfg.precision,
        strategy="ddp" if cfg.devices > 1 else "auto", use_distributed_sampler=False,
        logger=TensorBoardLogger(out_dir, name="tensorboard", version=""),
        callbacks=[checkpoints, TQDMProgressBar(refresh_rate=1 if sys.stderr.isatty() else cfg.log_every)],
        log_every_n_steps=cfg.log_every, num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Train ``cfg.model.layout`` from scratch (or resume), then evaluate; returns the metrics it writes."""
    pl.seed_everything(cfg.train.seed, verbose=False)
    out_dir = Path(cfg.train.out_dir)
    tokenizer, splits = load_splits(cfg.data)
    model = build_fixed_model(cfg.model, tokenizer.vocab_size)
    task = LanguageModelTask(cfg.train)
    task.set_model(model)
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    trainer = build_trainer(cfg.train, out_dir)
    last = out_dir / "checkpoints" / "last.ckpt"
    start = time.perf_counter()
    trainer.fit(task, datamodule=data, ckpt_path=str(last) if resume and last.exists() else None)
    seconds = time.perf_counter() - start
    if not trainer.is_global_zero:
        return {}
    metrics = final_metrics(model, data, trainer.strategy.root_device)
    metrics.update(steps=trainer.global_step, train_seconds=round(seconds, 2),
                   train_tokens_per_s=round(trainer.global_step * cfg.train.accumulate * cfg.data.batch_size
                                            * cfg.data.seg_len / seconds, 1),
                   parameters=sum(p.numel() for p in model.parameters()), blocks=model.block_kinds,
                   vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.kind, config=cfg.to_dict())
    write_json_atomic(out_dir / "metrics.json", metrics)
    return metrics


def final_metrics(model: TransformerXL, data: SegmentData, device: torch.device) -> dict[str, Any]:
    """Whole-split perplexity on valid and test (exp of total NLL over predicted tokens)."""
    out: dict[str, Any] = {}
    for split in ("valid", "test"):
        batches = data.batches(split)
        result = evaluate(model, batches, device)
        name = "val" if split == "valid" else "test"
        out[f"{name}_ppl"] = round(result.ppl, 3) if math.isfinite(result.ppl) else None
        out[f"{name}_tokens"] = result.tokens
        out[f"{name}_untargeted_tokens"] = batches.tail_tokens
        out[f"{name}_eval_tokens_per_s"] = round(result.tokens_per_s, 1)
    return out

"""Train a fixed Transformer-XL with Lightning: :func:`fit` and the final metrics.

:func:`fit` is the one training path for a fixed model (``parnas train`` and ``parnas retrain``). Everything
(folder, settings, data, resumability) is checked before a file is written. A run whose final validation loss
diverged still writes ``metrics.json`` (``diverged: true``), then ends with one line and exit status 2.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from parnas import architecture
from parnas.config import Config
from parnas.data.corpora import load_splits
from parnas.data.tokenizer import Tokenizer
from parnas.files import resume_source, write_json_atomic
from parnas.kinds import attending
from parnas.nn.model import TransformerXL, build_fixed_model
from parnas.owned_folders import take_run_dir
from parnas.training.compiling import compile_model
from parnas.training.data_module import check_segments
from parnas.training.devices import check_devices
from parnas.training.evaluation import divergence, divergence_step, final_metrics, finite_or_none, peak_memory_mb
from parnas.training.interrupt import finishing
from parnas.training.memory import check_memory
from parnas.training.resume import check_resumable, load_to_resume, take_over
from parnas.training.task import LanguageModelTask
from parnas.training.trainer import Throughput, build_trainer, end_process_group, position_restored_by_task


def tokenizer_meta(tokenizer: Tokenizer) -> dict[str, Any]:
    """What a checkpoint keeps of the tokenizer: its identity and its file, so sampling needs no corpus, and
    the sha256 of the train split it was built from, so evaluation can refuse another corpus."""
    data = bytearray(tokenizer.path.read_bytes())
    corpus = {"corpus_sha256": tokenizer.corpus_sha256} if tokenizer.corpus_sha256 else {}
    return {**tokenizer.identity(), "filename": tokenizer.path.name,
            "file": torch.frombuffer(data, dtype=torch.uint8).clone(), **corpus}


def train(cfg: Config, resume: bool | str | Path = False) -> dict[str, Any]:
    """``parnas train``: train ``cfg.model.layout`` from scratch (or resume), then evaluate; returns the metrics.
    Takes ``train.out_dir`` (:func:`parnas.owned_folders.take_run_dir`) unless the command around it has."""
    with take_run_dir(cfg.train.out_dir, resume):
        check_devices(cfg.train)
        tokenizer, splits = load_splits(cfg.data)
        cfg, record = fixed_layout(cfg, tokenizer)
        check_segments(cfg, splits)
        check_memory(cfg, tokenizer.vocab_size, [[kind] for kind in cfg.model.blocks])  # before the model is allocated
        pl.seed_everything(cfg.train.seed, verbose=False)
        model = build_fixed_model(cfg.model, tokenizer.vocab_size)
        return fit(cfg, model, tokenizer, splits, record, resume=resume)


def fixed_layout(cfg: Config, tokenizer: Tokenizer) -> tuple[Config, dict[str, Any]]:
    """``cfg`` with its layout made explicit (``model.blocks``, the standard Transformer-XL's when empty), and the
    architecture record a fixed run keeps beside its checkpoint, as a search's export would describe it."""
    layout = cfg.model.layout
    record = architecture.make_record({architecture.label(i): k for i, k in enumerate(layout)},
                                      replace(cfg.model, blocks=()), tokenizer.vocab_size,
                                      tokenizer=tokenizer.identity(), search={"layout": "model.blocks"})
    return replace(cfg, model=replace(cfg.model, blocks=tuple(layout))), record


def fit(cfg: Config, model: TransformerXL, tokenizer: Tokenizer, splits: dict[str, np.ndarray],
        record: dict[str, Any], *, resume: bool | str | Path = False,
        callbacks: Sequence[pl.Callback] = (), test: bool = True, valid_fraction: float = 1.0) -> dict[str, Any]:
    """Train ``model`` (built by the caller, seeded) with ``cfg``; on rank 0 evaluate and write metrics.json.

    ``record``: the architecture record every checkpoint holds. With ``resume`` the run continues from
    ``<out_dir>/checkpoints/last.ckpt`` (or the checkpoint ``resume`` names), which must match ``cfg``; without it
    ``out_dir`` must hold no run. ``test``, ``valid_fraction``: what the final evaluation reads. Returns the
    metrics on rank 0, ``{}`` on other ranks."""
    with take_run_dir(cfg.train.out_dir, resume):
        return _fit(cfg, model, tokenizer, splits, record, resume, callbacks, test, valid_fraction)


def _fit(cfg: Config, model: TransformerXL, tokenizer: Tokenizer, splits: dict[str, np.ndarray],
         record: dict[str, Any], resume: bool | str | Path, callbacks: Sequence[pl.Callback],
         test: bool = True, valid_fraction: float = 1.0) -> dict[str, Any]:
    out_dir = Path(cfg.train.out_dir)
    last, source = out_dir / "checkpoints" / "last.ckpt", resume_source(out_dir, resume)
    if source:
        check_resumable(load_to_resume(source), cfg, record, tokenizer, str(source))
    data = check_segments(cfg, splits)  # before tensorboard/ exists
    meta = {"config": cfg.to_dict(), "architecture": record, "tokenizer": tokenizer_meta(tokenizer)}
    task = LanguageModelTask(cfg.train, meta)
    task.set_model(model)
    compile_model(model, cfg.train.compile)
    trainer = build_trainer(cfg.train, out_dir)
    trainer.callbacks = [*trainer.callbacks, *callbacks]
    throughput = next(c for c in trainer.callbacks if isinstance(c, Throughput))
    if source:
        take_over(source, last)
    start = time.perf_counter()
    with position_restored_by_task():
        trainer.fit(task, datamodule=data, ckpt_path=str(last) if source else None, weights_only=True)
    seconds = time.perf_counter() - start
    end_process_group()
    if not trainer.is_global_zero:
        return {}
    with finishing(trainer, "the final evaluation"):
        device = trainer.strategy.root_device
        model.to(device)  # Lightning's teardown moved it to the CPU: evaluate where it trained
        metrics = final_metrics(model, data, cfg.train.precision, test=test, valid_fraction=valid_fraction)
        kinds = model.block_kinds
        history = [{k: finite_or_none(v) if isinstance(v, float) else v for k, v in line.items()}
                   for line in task.val_history]  # JSON has no inf
        metrics.update(
            steps=trainer.global_step, train_seconds=round(seconds, 2),
            train_tokens_per_s=round(throughput.tokens_per_s, 1) if throughput.tokens else None,  # None: none timed
            peak_memory_mb=round(peak_memory_mb(device), 1),
            peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
            parameters=sum(p.numel() for p in model.parameters()), attention_blocks=attending(kinds),
            architecture=architecture.layout_string(kinds), blocks=kinds, vocab_size=tokenizer.vocab_size,
            tokenizer=tokenizer.kind, device=str(device), world_size=trainer.world_size,
            precision=cfg.train.precision, history=history, config=cfg.to_dict(),
        )
        # a diverged run is a result: its metrics are written, marked, and the run ends with one line
        step = divergence_step(history, trainer.global_step, model.vocab_size)
        failure = divergence(metrics["val_loss"], model.vocab_size, step, cfg.train.lr, measured_at=trainer.global_step)
        metrics.update(diverged=failure is not None, **({"diverged_step": step} if failure is not None else {}))
        architecture.write(out_dir / "architecture.json", record)
        write_json_atomic(out_dir / "metrics.json", metrics)
    if failure is not None:
        raise failure
    return metrics

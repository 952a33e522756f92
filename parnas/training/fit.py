"""Train a fixed Transformer-XL with Lightning: data module, trainer, callbacks, final metrics.

:func:`fit` is the one training path for a fixed model: ``parnas train``
(:func:`train`, the layout from ``model.blocks``) and ``parnas retrain`` (the
model built from an architecture JSON by the search space) both call it. The
pieces (``SegmentData``, ``build_trainer``) are reused by the search.

DDP: Lightning's distributed sampler is switched off, because the streams, not
the segments, are what ranks divide: rank r of W reads streams
[r*B/W, (r+1)*B/W) of every segment, so each rank's memory stays contiguous.

Resume: ``<out_dir>/checkpoints/last.ckpt`` is written every ``ckpt_every``
steps, at the end, and when SIGINT or SIGTERM stops the run after the step in
flight (:mod:`parnas.training.interrupt`); the task restores the data position and
memory from it and the training sampler starts where it stopped.
A run without ``--resume`` refuses a folder that holds a run, and everything
(folder, settings, data, resumability) is checked before any file is written.

Output: Lightning's progress bar only on a terminal; otherwise (pipes, nnictl's
trial.log) one plain line every ``log_every`` steps and after each validation.
Lightning's and NNI's info messages only with ``parnas --verbose``.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Sampler

from parnas import architecture
from parnas.architecture import legend
from parnas.config import Config, TrainConfig
from parnas.data.corpora import ContextBatches, load_splits
from parnas.data.tokenizer import Tokenizer
from parnas.files import check_run_dir, hold_run_dir, resume_source, write_json_atomic
from parnas.nn.model import TransformerXL, build_fixed_model
from parnas.training import checkpoint as ckpt
from parnas.training.devices import check_devices, pinned
from parnas.training.evaluation import final_metrics, peak_memory_mb
from parnas.training.interrupt import StopOnSignal, finishing
from parnas.training.memory import check_memory
from parnas.training.resume import check_resumable, load_to_resume, take_over
from parnas.training.task import LanguageModelTask, compile_model, with_target_groups


class ResumableSampler(Sampler[int]):
    """0..n-1 in order; the first pass starts at ``start`` (a resumed run's data position)."""

    def __init__(self, n: int, start: int = 0) -> None:
        self.n, self.start = n, start

    def __iter__(self) -> Iterator[int]:
        def indices() -> Iterator[int]:  # runs at the first draw, not when the iterator is made
            start, self.start = self.start, 0
            yield from range(start, self.n)
        return indices()

    def __len__(self) -> int:
        return self.n


class SegmentData(pl.LightningDataModule):
    """Contiguous segments of each split; rank and world size are read at ``setup``.

    ``task``: the :class:`LanguageModelTask` whose model the batches are for and whose data position a resumed
    run starts at. Left out, it is the module Lightning trains; a loop that wraps the task (a one-shot search)
    names it, here or by setting ``task`` before training."""

    def __init__(self, splits: dict[str, np.ndarray], batch_size: int, eval_batch_size: int, seg_len: int,
                 task: LanguageModelTask | None = None) -> None:
        super().__init__()
        self.splits, self.batch_size, self.eval_batch_size, self.seg_len = splits, batch_size, eval_batch_size, seg_len
        self.task = task

    def batches(self, split: str, rank: int = 0, world_size: int = 1) -> ContextBatches:
        train = split == "train"
        return ContextBatches(self.splits[split], self.batch_size if train else self.eval_batch_size, self.seg_len,
                              rank=rank, world_size=world_size, drop_last=train)

    def trained_task(self) -> Any:
        """The task being trained: ``task``, or the module Lightning trains (None outside a trainer)."""
        if self.task is not None:
            return self.task
        return self.trainer.lightning_module if self.trainer is not None else None

    def _loader(self, split: str) -> DataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        dataset = self.batches(split, rank, world)
        start = 0
        if split == "train" and self.trainer is not None:  # a resumed task knows where its pass stopped
            start = getattr(self.trained_task(), "data_position", 0) % len(dataset)
        return DataLoader(dataset, batch_size=None, sampler=ResumableSampler(len(dataset), start))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Each batch, still on the host: its targets grouped for the model's output head
        (:func:`with_target_groups`), so the step reads no cluster size back from the device, and bound for a GPU,
        pinned (:func:`pinned`), so that moving it does not wait for the GPU."""
        if self.trainer is None:
            return batch
        model = getattr(self.trained_task(), "model", None)
        return pinned(with_target_groups(model, batch), self.trainer.strategy.root_device)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")


class StepCheckpoint(pl.Callback):
    """Write ``path`` every ``every`` optimiser steps and when training ends (all ranks take part).

    At a step that also validates (a multiple of ``eval_every``) the checkpoint is written once
    that validation has ended, so it holds the validation's result and a resumed run neither
    repeats nor loses it."""

    def __init__(self, path: Path, every: int, eval_every: int = 0) -> None:
        self.path, self.every, self.eval_every, self.saved_at = Path(path), every, eval_every, -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.saved_at = trainer.global_step  # a resumed run does not rewrite the checkpoint it started from

    def validates(self, trainer: pl.Trainer) -> bool:
        """Whether the optimiser step that just ended is followed by a validation."""
        return bool(self.eval_every) and trainer.global_step % self.eval_every == 0 \
            and not trainer.fit_loop._should_accumulate()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step != self.saved_at and not self.validates(trainer) and (step % self.every == 0
                                                                      or step >= trainer.max_steps):
            self.save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if not trainer.sanity_checking and step != self.saved_at and (step % self.every == 0
                                                                      or step >= trainer.max_steps):
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self.saved_at:
            self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)  # everything, not only the weights
        self.saved_at = trainer.global_step


class Throughput(pl.Callback):
    """Training tokens per second over all ranks, timing training batches only (no evaluation, no saving).

    On CUDA two events bracket each batch and their times are read back every ``FOLD_EVERY`` batches
    (and at a checkpoint or the end): a synchronize around every batch would stop the host from queuing
    the next step's kernels while the GPU runs this one. Elsewhere the host's clock brackets the batch.
    Its totals travel in checkpoints, so a resumed run reports the speed of all its steps."""

    FOLD_EVERY = 100

    def __init__(self) -> None:
        self.tokens, self.seconds = 0, 0.0
        self._start: float | torch.cuda.Event = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # batches not yet read back

    def state_dict(self) -> dict[str, Any]:
        self._fold()
        return {"tokens": self.tokens, "seconds": self.seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens, self.seconds = int(state["tokens"]), float(state["seconds"])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           *args: Any) -> None:
        if isinstance(self._start, float):
            self.seconds += time.perf_counter() - self._start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
            if len(self._pending) >= self.FOLD_EVERY:
                self._fold()
        self.tokens += _input_tokens(batch) * trainer.world_size

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fold()

    def _fold(self) -> None:
        """Add the pending batches' GPU times (one wait, for the last of them)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._pending) / 1000  # ms -> s
            self._pending.clear()

    @property
    def tokens_per_s(self) -> float:
        self._fold()
        return self.tokens / self.seconds if self.seconds else 0.0


class StepsTakenLogger(TensorBoardLogger):
    """TensorBoard with steps counted as optimiser steps taken, as history.jsonl, metrics.json and NNI count
    them: Lightning logs a batch's metrics (and a validation after step N) under the count of steps
    finished before that batch, one less (N-1)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, None if step is None else step + 1)


class PlainProgress(pl.Callback):
    """Progress without a terminal: a line after the first optimiser step (a log such as nnictl's
    trial stdout shows at once that the run is alive), then one every ``every`` steps and one after
    each validation, on rank 0, flushed, instead of a progress bar's escape codes."""

    def __init__(self, every: int) -> None:
        self.every, self._printed = every, -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step < 1 or (step % self.every and step != 1) or step == self._printed or not trainer.is_global_zero:
            return  # (a step repeats while gradients accumulate)
        self._printed = step
        metrics = trainer.callback_metrics
        parts = [f"step {step:,}/{trainer.max_steps:,}"]
        for key, name in (("train/loss", "train loss"), ("search/tau", "tau")):
            if key in metrics:
                parts.append(f"{name} {float(metrics[key]):.3f}")
        print(", ".join(parts), flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        ppl = metrics.get("val/ppl")
        if trainer.sanity_checking or not trainer.is_global_zero or ppl is None:
            return
        if "val/ppl_exported" in metrics:  # a search: the exported architecture's own, and the supernet's
            found = getattr(pl_module, "last_evaluation", None)  # the search's: what it would export now
            print(f"step {trainer.global_step:,}: validation perplexity {float(metrics['val/ppl_exported']):.2f} "
                  f"exported architecture{f' {found.architecture}' if found else ''}, {float(ppl):.2f} supernet",
                  flush=True)
        else:
            print(f"step {trainer.global_step:,}: validation perplexity {float(ppl):.2f}", flush=True)


def quiet_libraries() -> None:
    """Lightning's and NNI's info messages (devices found, tips, "fit stopped") only when the
    ``parnas`` logger asks for info (``parnas --verbose``). Called once they are imported,
    because importing them resets their levels."""
    verbose = 0 < logging.getLogger("parnas").level <= logging.INFO
    for name in ("pytorch_lightning", "lightning_fabric", "lightning", "nni"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


def _input_tokens(batch: Any) -> int:
    """Tokens in a batch: ``(x, y)``, or the search's ``{"train": (x, y), "val": (x, y)}`` (its train stream)."""
    if isinstance(batch, dict):
        return _input_tokens(batch["train"]) if "train" in batch else sum(map(_input_tokens, batch.values()))
    return batch[0].numel() if isinstance(batch, (list, tuple)) and batch else 0


def build_trainer(cfg: TrainConfig, out_dir: Path, trainer_cls: type[pl.Trainer] = pl.Trainer,
                  **overrides: Any) -> pl.Trainer:
    """A Trainer that validates every ``eval_every`` optimiser steps, across epoch boundaries, and writes
    ``<out_dir>/checkpoints/last.ckpt`` every ``ckpt_every`` steps and at the end (weights-only loadable).
    ``trainer_cls``: the search passes NNI's traced ``Trainer``, which NNI's evaluator requires.
    A progress bar only when stdout is a terminal; otherwise plain lines (:class:`PlainProgress`)."""
    quiet_libraries()
    out_dir = Path(out_dir)
    progress: pl.Callback = TQDMProgressBar() if sys.stdout.isatty() else PlainProgress(cfg.log_every)
    checkpoint = StepCheckpoint(out_dir / "checkpoints" / "last.ckpt", cfg.ckpt_every, cfg.eval_every)
    kwargs: dict[str, Any] = dict(
        max_steps=cfg.stop_at or cfg.max_steps, max_epochs=-1,
        val_check_interval=cfg.eval_every * cfg.accumulate, check_val_every_n_epoch=None,
        accumulate_grad_batches=cfg.accumulate, gradient_clip_val=cfg.clip or None,
        accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, precision=cfg.precision,
        # adaptive softmax leaves a tail cluster unused when no target of a batch falls in it
        strategy="ddp_find_unused_parameters_true" if cfg.devices * cfg.num_nodes > 1 else "auto",
        use_distributed_sampler=False,
        logger=StepsTakenLogger(out_dir, name="tensorboard", version=""),
        callbacks=[Throughput(), checkpoint, progress, StopOnSignal(checkpoint)],
        enable_progress_bar=isinstance(progress, TQDMProgressBar),
        plugins=[ckpt.SafeCheckpointIO()], enable_checkpointing=False,
        log_every_n_steps=cfg.log_every, num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    kwargs.update(overrides)
    return trainer_cls(**kwargs)


@contextmanager
def position_restored_by_task() -> Iterator[None]:
    """Lightning warns when it resumes inside a pass with a plain dataloader; it cannot see that the
    task keeps the data position and ``SegmentData`` starts the pass there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*")
        yield


def tokenizer_meta(tokenizer: Tokenizer) -> dict[str, Any]:
    """What a checkpoint keeps of the tokenizer: its identity and its file, so sampling needs no corpus, and
    the sha256 of the train split it was built from, so evaluation can refuse another corpus."""
    data = bytearray(tokenizer.path.read_bytes())
    corpus = {"corpus_sha256": tokenizer.corpus_sha256} if tokenizer.corpus_sha256 else {}
    return {**tokenizer.identity(), "filename": tokenizer.path.name,
            "file": torch.frombuffer(data, dtype=torch.uint8).clone(), **corpus}


def end_process_group() -> None:
    """After a distributed fit, once every rank is past it: close the process group. A rank that exits
    while its group is open (the others still evaluating) can abort in gloo's threads at interpreter exit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def train(cfg: Config, resume: bool | str | Path = False) -> dict[str, Any]:
    """``parnas train``: train ``cfg.model.layout`` from scratch (or resume), then evaluate; returns the metrics."""
    check_devices(cfg.train)
    check_run_dir(cfg.train.out_dir, resume)
    tokenizer, splits = load_splits(cfg.data)
    layout = cfg.model.layout
    cfg = replace(cfg, model=replace(cfg.model, blocks=tuple(layout)))
    record = architecture.make_record({architecture.label(i): k for i, k in enumerate(layout)},
                                      replace(cfg.model, blocks=()), tokenizer.vocab_size,
                                      tokenizer=tokenizer.identity(), search={"layout": "model.blocks"})
    check_segments(cfg, splits)
    check_memory(cfg, tokenizer.vocab_size, [[kind] for kind in layout])  # before the model is allocated
    pl.seed_everything(cfg.train.seed, verbose=False)
    model = build_fixed_model(cfg.model, tokenizer.vocab_size)
    return fit(cfg, model, tokenizer, splits, record, resume=resume)


def check_segments(cfg: Config, splits: dict[str, np.ndarray]) -> SegmentData:
    """The run's data, once every split holds a segment for every process (DataError otherwise)."""
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    for split in splits:
        data.batches(split, 0, cfg.train.devices * cfg.train.num_nodes)
    return data


def fit(cfg: Config, model: TransformerXL, tokenizer: Tokenizer, splits: dict[str, np.ndarray],
        record: dict[str, Any], *, resume: bool | str | Path = False,
        callbacks: Sequence[pl.Callback] = ()) -> dict[str, Any]:
    """Train ``model`` (built by the caller, seeded) with ``cfg``; on rank 0 evaluate and write metrics.json.

    ``record`` is the architecture record written into every checkpoint. With ``resume`` the run
    continues from ``<out_dir>/checkpoints/last.ckpt`` (or the checkpoint ``resume`` names), which must
    exist and match ``cfg``; without it ``out_dir`` must hold no run. The run holds ``out_dir``
    (:func:`parnas.files.hold_run_dir`) and checks everything before a file is written.
    Returns the metrics on rank 0, ``{}`` on other ranks.
    """
    with hold_run_dir(cfg.train.out_dir):
        return _fit(cfg, model, tokenizer, splits, record, resume, callbacks)


def _fit(cfg: Config, model: TransformerXL, tokenizer: Tokenizer, splits: dict[str, np.ndarray],
         record: dict[str, Any], resume: bool | str | Path, callbacks: Sequence[pl.Callback]) -> dict[str, Any]:
    out_dir = check_run_dir(cfg.train.out_dir, resume)
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
        metrics = final_metrics(model, data, cfg.train.precision)
        kinds = model.block_kinds
        metrics.update(
            steps=trainer.global_step, train_seconds=round(seconds, 2),
            train_tokens_per_s=round(throughput.tokens_per_s, 1) if throughput.tokens else None,  # None: none timed
            peak_memory_mb=round(peak_memory_mb(device), 1),
            peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss",
            parameters=sum(p.numel() for p in model.parameters()), attention_blocks=kinds.count("attention"),
            architecture=architecture.layout_string(kinds), blocks=kinds, vocab_size=tokenizer.vocab_size,
            tokenizer=tokenizer.kind, device=str(device), world_size=trainer.world_size,
            precision=cfg.train.precision, history=task.val_history, config=cfg.to_dict(),
        )
        architecture.write(out_dir / "architecture.json", record)
        write_json_atomic(out_dir / "metrics.json", metrics)
    return metrics


def summary(metrics: dict[str, Any], out_dir: str) -> str:
    """The few figures a finished training run is judged by, rounded, in one short block."""
    tps, params = metrics.get("train_tokens_per_s"), metrics.get("parameters")
    ppl = ", ".join(f"{name} perplexity {metrics[key]:.2f}" for name, key in (("validation", "val_ppl"),
                                                                              ("test", "test_ppl"))
                    if metrics.get(key) is not None)
    lines = [f"{metrics['architecture']} after {metrics['steps']:,} steps: {ppl or 'no perplexity (not finite)'}"]
    speed = [f"{params:,} parameters" if params else None,
             f"{metrics['attention_blocks']} attention blocks" if "attention_blocks" in metrics else None,
             f"{tps:,.0f} train tokens/s" if tps else None,
             f"{metrics['eval_tokens_per_s']:,.0f} eval tokens/s" if metrics.get("eval_tokens_per_s") else None,
             f"peak memory {metrics['peak_memory_mb']:,.0f} MB" if metrics.get("peak_memory_mb") else None]
    lines.append("  " + ", ".join(s for s in speed if s))
    lines.append(f"  metrics in {out_dir}/metrics.json ({legend(metrics['architecture'])})")
    return "\n".join(lines)

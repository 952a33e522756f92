"""The Lightning trainer as parnas sets it up, and its callbacks: periodic checkpoints, throughput, the steps
logged to TensorBoard, and a plain progress line (every ``log_every`` steps and after each validation) where no
terminal shows Lightning's bar.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.loggers import TensorBoardLogger

from parnas.config import TrainConfig
from parnas.training import checkpoint as ckpt
from parnas.training.compiling import compile_counts, compiled_since
from parnas.training.interrupt import StopOnSignal


class StepCheckpoint(pl.Callback):
    """Write ``path`` every ``every`` optimiser steps and when training ends (all ranks take part); at a step that
    also validates, once that validation has ended, so a resumed run neither repeats nor loses it."""

    def __init__(self, path: Path, every: int, eval_every: int = 0) -> None:
        self.path, self.every, self.eval_every, self.saved_at = Path(path), every, eval_every, -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.saved_at = trainer.global_step  # a resumed run does not rewrite the checkpoint it started from

    def validates(self, trainer: pl.Trainer) -> bool:
        """Whether the optimiser step that just ended is followed by a validation."""
        return bool(self.eval_every) and trainer.global_step % self.eval_every == 0

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
    """Training tokens per second over all ranks, timing training batches only. On CUDA two events bracket each
    batch, read back every ``FOLD_EVERY`` batches: a synchronize every batch would keep the host from queuing the
    next step while the GPU runs this one. Its totals travel in checkpoints, so a resume reports all its steps."""

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
    finished before that batch, one less (N-1). Lightning's "epoch" scalar is left out: the runs count steps."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        metrics = {k: v for k, v in metrics.items() if k != "epoch"}  # Lightning's own: a card no one reads first
        if metrics:
            super().log_metrics(metrics, None if step is None else step + 1)


def prints_progress(step: int, every: int) -> bool:
    """Whether the plain progress lines print after optimiser step ``step``: the first, then every ``every``."""
    return step == 1 or (every > 0 and step % every == 0)


class PlainProgress(pl.Callback):
    """Progress without a terminal: a line after the first optimiser step (a log such as nnictl's
    trial stdout shows at once that the run is alive), then one every ``every`` steps and one after
    each validation, on rank 0, flushed, instead of a progress bar's escape codes."""

    def __init__(self, every: int) -> None:
        self.every, self._printed = every, -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if not prints_progress(step, self.every) or step == self._printed or not trainer.is_global_zero:
            return
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
            part = getattr(found, "valid_fraction", 1.0)  # a mid-search evaluation reads a part of the split
            print(f"step {trainer.global_step:,}: validation perplexity {float(metrics['val/ppl_exported']):.2f} "
                  f"exported architecture{f' {found.architecture}' if found else ''}, {float(ppl):.2f} supernet"
                  + (f" ({part:g} of the split)" if part < 1 else ""), flush=True)
        else:
            print(f"step {trainer.global_step:,}: validation perplexity {float(ppl):.2f}", flush=True)


class CompileNotice(pl.Callback):
    """Compiling takes the first training step and validation batch with a full memory: minutes at a large shape,
    which no progress line covers. One line says so before training, and one after each says how long it took and
    what it compiled (:func:`compiled_since`), on rank 0."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.before: dict[str, tuple[float, tuple[int, int, int]]] = {}  # stage -> its batch's start, counts
        self.said: set[str] = set()  # the stages whose compile has been said

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            graphs = "CUDA graphs" if self.mode == "reduce-overhead" else "kernels"
            print(f"compiling the model (train.compile={self.mode}): the first step with a full memory builds its "
                  f"{graphs} (often tens of seconds), the first validation batch with one its evaluation's; the "
                  "batches that fill the memory run eager", flush=True)

    def _start(self, stage: str) -> None:
        if stage not in self.said:
            self.before[stage] = time.perf_counter(), compile_counts()

    def _end(self, trainer: pl.Trainer, stage: str, what: str) -> None:
        if stage in self.said or compile_counts()[0] == self.before[stage][1][0]:
            return  # said already, or this batch compiled nothing
        if trainer.is_global_zero:
            start, counts = self.before[stage]
            print(f"compiled: {what} took {time.perf_counter() - start:.1f} s ({compiled_since(counts, self.mode)})",
                  flush=True)
        self.said.add(stage)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start("train")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._end(trainer, "train", f"step {trainer.global_step:,}")

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start("validation")

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end(trainer, "validation", f"validation batch {batch_idx + 1:,} at step {trainer.global_step:,}")


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
    """A Trainer that validates every ``eval_every`` optimiser steps and writes ``<out_dir>/checkpoints/last.ckpt``
    every ``ckpt_every`` steps and at the end. ``trainer_cls``: the search passes NNI's traced ``Trainer``."""
    quiet_libraries()
    out_dir = Path(out_dir)
    progress: pl.Callback = TQDMProgressBar() if sys.stdout.isatty() else PlainProgress(cfg.log_every)
    checkpoint = StepCheckpoint(out_dir / "checkpoints" / "last.ckpt", cfg.ckpt_every, cfg.eval_every)
    kwargs: dict[str, Any] = dict(
        max_steps=cfg.stop_at or cfg.max_steps, max_epochs=-1,
        val_check_interval=cfg.eval_every, check_val_every_n_epoch=None,
        gradient_clip_val=cfg.clip or None,
        accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, precision=cfg.precision,
        # adaptive softmax leaves a tail cluster unused when no target of a batch falls in it
        strategy="ddp_find_unused_parameters_true" if cfg.devices * cfg.num_nodes > 1 else "auto",
        use_distributed_sampler=False,
        logger=StepsTakenLogger(out_dir, name="tensorboard", version=""),
        callbacks=[Throughput(), checkpoint, progress, StopOnSignal(checkpoint),
                   *([CompileNotice(cfg.compile)] if cfg.compile != "none" else [])],
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


def end_process_group() -> None:
    """After a distributed fit, once every rank is past it: close the process group. A rank that exits
    while its group is open (the others still evaluating) can abort in gloo's threads at interpreter exit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()

"""Ctrl-C, SIGTERM and SIGHUP during training: finish the step in flight, save, stop, say how to resume.

Lightning turns a ``KeyboardInterrupt`` into ``sys.exit(1)``, SIGTERM into a stop that writes nothing, and SIGHUP
ends the process silently: work since the last checkpoint was lost. :class:`StopOnSignal` takes the three over
while the loop runs; its handler only records the signal, which the loop reads once per optimiser step:

- after a step that does not validate, the checkpoint is written there;
- during a validation, it stops at its next batch and the checkpoint is written as at that validation's first
  batch, so ``--resume`` runs it again (a validation may outlast a scheduler's grace before SIGKILL: NNI's is
  5 s); only the last step's validation ends first, since Lightning would not run it again on resuming;

then :class:`parnas.errors.Interrupted` is raised, so nothing after ``fit`` runs as if the run had finished.
``Trainer.should_stop`` is not used: Lightning runs a validation when it is set. :func:`finishing` covers the work
after the last step; a second signal ends the process at once. Under DDP the ranks agree on the signal (a max,
once per step) over a gloo group on host tensors: over NCCL, reading the scalar back would sync the host with
the GPU every step.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

import pytorch_lightning as pl
import torch

from parnas.errors import STOP_SIGNALS, Interrupted, stop_at_once_from_now

SIGNALS = STOP_SIGNALS


class Checkpointer(Protocol):
    """What :class:`StopOnSignal` needs of :class:`parnas.training.trainer.StepCheckpoint`."""

    path: Any
    saved_at: int

    def validates(self, trainer: pl.Trainer) -> bool: ...

    def save(self, trainer: pl.Trainer) -> None: ...


class StopOnSignal(pl.Callback):
    """On SIGINT, SIGTERM or SIGHUP: checkpoint through ``checkpoint`` at the end of the step in flight, then
    raise :class:`Interrupted` (see the module docstring)."""

    def __init__(self, checkpoint: Checkpointer) -> None:
        self.checkpoint = checkpoint
        self.signum: int | None = None  # the first signal received; read once per optimiser step
        self.group: Any = None  # the ranks' host (gloo) group under DDP

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1:
            self.group = torch.distributed.new_group(backend="gloo")  # collective: every rank is here
        if threading.current_thread() is threading.main_thread():  # the only thread Python lets set handlers
            for signum in SIGNALS:
                signal.signal(signum, self.record)

    def record(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: remember the signal; a further one ends the process at once, in one line."""
        if self.signum is None:
            self.signum = signum
        stop_at_once_from_now()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        signum = self._agreed(trainer)
        if signum and not self.checkpoint.validates(trainer):
            self._stop(trainer, signum)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.sanity_checking or trainer.global_step >= trainer.max_steps:
            return  # the last step's validation ends first: a run resumed there would not run it again
        signum = self._agreed(trainer)
        if signum:
            # the validation's batch counters as at its first batch, started and not processed (here, before
            # Lightning counts this batch started): Lightning resumes such a checkpoint by running that
            # validation again from its first batch
            progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
            done = progress.current.completed  # batches of this validation already processed
            for counts in (progress.total, progress.current):
                counts.processed, counts.completed = counts.processed - done, counts.completed - done
                counts.ready = counts.started = counts.completed + 1
            self._stop(trainer, signum)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            signum = self._agreed(trainer)
            if signum:
                self._stop(trainer, signum)

    def _agreed(self, trainer: pl.Trainer) -> int:
        """The signal to stop for (0: none); under DDP the largest any rank received, the same on all."""
        if trainer.world_size == 1:
            return self.signum or 0
        signum = torch.tensor(self.signum or 0)  # on the host, whatever device the model is on
        torch.distributed.all_reduce(signum, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(signum)

    def _stop(self, trainer: pl.Trainer, signum: int) -> None:
        if self.checkpoint.saved_at != trainer.global_step:
            self.checkpoint.save(trainer)
        raise Interrupted(signum, trainer.global_step, str(self.checkpoint.path), trainer.global_rank)


@contextmanager
def finishing(trainer: pl.Trainer, what: str) -> Iterator[None]:
    """Around ``what`` (e.g. "the final evaluation"), the work after a finished ``fit``: a stop signal, now or
    recorded since the loop last looked, raises :class:`Interrupted` naming ``what`` and the last step's checkpoint,
    from which ``--resume`` finishes it. The handlers in place before are put back on leaving."""
    stop = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
    step, path, rank = trainer.global_step, str(stop.checkpoint.path), trainer.global_rank
    if stop.signum:
        raise Interrupted(stop.signum, step, path, rank, during=what)

    def handler(signum: int, frame: FrameType | None) -> None:
        stop_at_once_from_now()  # a second signal ends the process at once
        raise Interrupted(signum, step, path, rank, during=what)

    main = threading.current_thread() is threading.main_thread()  # the only thread Python lets set handlers
    saved = [signal.getsignal(s) for s in SIGNALS] if main else []
    try:
        for signum in SIGNALS if main else ():
            signal.signal(signum, handler)
        yield
    finally:
        for signum, old in zip(SIGNALS, saved):
            signal.signal(signum, old)

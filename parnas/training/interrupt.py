"""Ctrl-C, SIGTERM and SIGHUP during training: finish the step in flight, save, stop, say how to resume.

Lightning turns a ``KeyboardInterrupt`` into ``sys.exit(1)`` and SIGTERM into a stop that writes
nothing, and a closed terminal's SIGHUP ends the process silently, so work since the last periodic
checkpoint was lost and nothing said how to go on. :class:`StopOnSignal` takes the three
(:data:`parnas.errors.STOP_SIGNALS`) over while the training loop runs (from
``on_train_start``, after Lightning has set its own handlers, which it restores when ``fit`` ends).
The handler only records the signal; the loop reads that record once per optimiser step:

- at the end of a step that does not validate, the checkpoint is written there (the state
  :class:`parnas.training.trainer.StepCheckpoint` writes at its periodic steps);
- during a validation (or at the end of a step that validates), the validation stops at its next batch
  and the checkpoint is written as Lightning writes one at that validation's first batch: ``--resume``
  then runs the whole validation again (Lightning restarts a validation saved mid-way) and goes on, so
  the resumed run neither repeats nor loses it. A validation may last longer than the grace a scheduler
  gives before SIGKILL (NNI's ``nnictl stop``: 5 s), so it is not waited for, except the last step's:
  Lightning does not run a validation again on resuming a run whose steps are all done, so that one ends
  first and the checkpoint is written after it;

then :class:`parnas.errors.Interrupted` is raised. Lightning tears the trainer down and passes it
on, so nothing after ``fit`` (final evaluation, ``metrics.json``, a search's export) runs as if the
run had finished. ``Trainer.should_stop`` is not used: Lightning 2.6 runs a validation when it is
set (as for early stopping), which would cost a whole pass and log an evaluation the uninterrupted
run never made.

After the last step, :func:`finishing` covers the work that ends a run (a fixed model's final evaluation,
a search's export): a signal there stops it at once with :class:`Interrupted` naming what was cut, and
``--resume`` finishes it from the checkpoint of the last step. Before the first step the CLI's own
handler (:func:`parnas.cli.main`) raises :class:`Interrupted` with nothing saved.

After the first signal, a second one (a burst of Ctrl-C) ends the process at once, dying by the signal, after
one line that says so (:func:`parnas.errors.stop_at_once`). Under DDP every rank records its own signals and
the ranks agree (a max over ranks, one scalar per optimiser step, only when there is more than one process)
before any of them saves, since saving is collective. They agree over a gloo group of their own, on host
tensors: an all-reduce over NCCL would put the scalar on the GPU, and reading it back would wait for every
kernel queued before it, a host sync in each step that leaves the GPU idle while the next step is launched. A
host collective only waits for the other ranks' hosts, which run ahead of their GPUs.
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
    """Around ``what`` (e.g. "the final evaluation"), the work after a finished ``fit``: a stop signal, or one
    that came after the loop last looked (the run's :class:`StopOnSignal` recorded it), raises
    :class:`Interrupted` naming ``what`` and the checkpoint of the last step, from which ``--resume`` finishes it.
    The handlers in place before are put back on leaving."""
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

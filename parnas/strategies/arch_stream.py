"""The architecture stream of NNI's own DARTS strategies: the validation segments their logits step on, and that
stream's memory.

NNI's DARTS modules (DARTS, GumbelDARTS, Proxyless) step the weights on the training stream and the logits on the
validation stream. Both are Transformer-XL streams, so each keeps its own memory: the training task keeps the
training stream's, :class:`ArchStream` this one's. NNI's modules call the task's ``training_step`` twice per step, on
the validation batch with ``batch_idx`` 2i, then on the training batch with 2i+1, and Lightning's ``CombinedLoader``
cycles the shorter loader without saying so: :class:`NNIDartsTask` routes the first to this stream and counts where it
starts over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nni.nas.oneshot.pytorch.differentiable import DartsLightningModule
from torch import Tensor

from parnas.nn.model import Memory
from parnas.training.task import LanguageModelTask, scalars_read

ARCH_DROPOUT_SEED_OFFSET = 7919
"""Added to ``train.seed`` for the architecture stream's dropout (:meth:`LanguageModelTask.seed_for_step`), so its
segments draw other numbers than the training segment of the same step: distinct from the search's other offsets and
above the seeds people pick, so that no stream replays one of a run with a nearby seed (a prime only to be easy to
tell apart)."""


class ArchStream:
    """The architecture stream's memory and place: where it restarts."""

    def __init__(self) -> None:
        self.memory: Memory | None = None
        self.position = 0  # segments done in this pass over the stream

    def restart(self) -> None:
        """The stream starts over: its first segment sees no memory."""
        self.memory, self.position = None, 0

    def nll(self, task: LanguageModelTask, batch: Sequence[Any]) -> Tensor:
        """Per-token NLL (B, L) of the stream's next segment, with its own memory and dropout seed."""
        nll, self.memory = task.side_stream_nll(batch, self.memory, ARCH_DROPOUT_SEED_OFFSET)
        self.position += 1
        return nll


class NNIDartsTask(LanguageModelTask):
    """The task for NNI's own one-shot strategies: under NNI's DARTS modules (DARTS, GumbelDARTS, Proxyless) a
    ``training_step`` with an even ``batch_idx`` is the validation batch the logits step on, which runs on the
    architecture stream (``arch_stream``); every other call, and every other wrapper, is a training batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arch_stream = ArchStream()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if batch_idx % 2 or not isinstance(self.trainer.lightning_module, DartsLightningModule):
            return super().training_step(batch, batch_idx)
        loaders = self.trainer.train_dataloader
        length = len(loaders["val"]) if isinstance(loaders, dict) and "val" in loaders else 0
        if length and self.arch_stream.position >= length:  # the CombinedLoader cycled the validation loader
            self.arch_stream.restart()
        loss = self.arch_stream.nll(self, batch).mean()
        if scalars_read(self.trainer, self.train_cfg.log_every):
            self.log("search/arch_loss", loss.detach())
        return loss + self.aux_loss()

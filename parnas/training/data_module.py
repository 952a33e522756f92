"""The data a fixed model trains on, as Lightning takes it: B contiguous streams cut into segments.

DDP: Lightning's distributed sampler is switched off, because the streams, not
the segments, are what ranks divide: rank r of W reads streams
[r*B/W, (r+1)*B/W) of every segment, so each rank's memory stays contiguous.
A resumed run's training sampler starts where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader, Sampler

from parnas.config import Config
from parnas.data.corpora import ContextBatches
from parnas.training.devices import pinned
from parnas.training.task import LanguageModelTask, with_target_groups


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


def check_segments(cfg: Config, splits: dict[str, np.ndarray]) -> SegmentData:
    """The run's data, once every split holds a segment for every process (DataError otherwise)."""
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    for split in splits:
        data.batches(split, 0, cfg.train.devices * cfg.train.num_nodes)
    return data

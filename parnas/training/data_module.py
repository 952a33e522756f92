"""The data a fixed model trains on, as Lightning takes it: B contiguous streams cut into segments.

Lightning's distributed sampler is off: ranks divide the streams, not the segments (rank r of W reads streams
[r*B/W, (r+1)*B/W)), so each rank's memory stays contiguous. A resumed run's sampler starts where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
from torch.utils.data import DataLoader, Sampler

from parnas.config import Config
from parnas.data.corpora import ContextBatches
from parnas.nn.adaptive import TargetCapacity
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
    """Contiguous segments of each split. ``task``: the :class:`LanguageModelTask` the batches are for (whose data
    position a resume starts at); left out, the module Lightning trains (a one-shot search wrapping it names it)."""

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
        """Each batch, still on the host: its targets grouped (:func:`with_target_groups`) and, bound for a GPU,
        pinned (:func:`pinned`); a compiled model's capacities are fitted before its first training batch."""
        if self.trainer is None:
            return batch
        model = getattr(self.trained_task(), "model", None)
        capacity = getattr(model, "target_capacity", None)
        if self.trainer.training and capacity is not None and not capacity.by_rows:
            self.fit_capacity(capacity, model.cfg.cutoffs)
        return pinned(with_target_groups(model, batch, self.trainer.training), self.trainer.strategy.root_device)

    def fit_capacity(self, capacity: TargetCapacity, cutoffs: Sequence[int]) -> None:
        """``capacity`` grown to hold every segment of the training and validation splits on every rank: the same
        capacities on every rank and in a resumed run, and no training batch grows them (compiling the loss again)."""
        world = self.trainer.world_size
        for split in ("train", "valid"):
            for rank in range(world if split in self.splits else 0):
                capacity.hold(most_targets_per_cluster(self.batches(split, rank, world), cutoffs))

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")


def most_targets_per_cluster(batches: ContextBatches, cutoffs: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The most targets a segment of ``batches`` has in each cluster (the shortlist first), by the segment's
    number of targets (a last, shorter segment of an evaluation split has its own), a few million at a time."""
    streams, L = batches.streams, batches.seg_len
    n_streams, n_clusters = streams.shape[0], len(cutoffs) + 1
    edges = np.asarray(cutoffs)
    full = min(batches.n_segments, (batches.stream_len - 1) // L)  # segments of L targets
    most: dict[int, tuple[int, ...]] = {}

    def held(rows: int, counts: np.ndarray) -> None:  # counts (segments, clusters)
        before = most.get(rows, (0,) * n_clusters)
        most[rows] = tuple(int(max(a, b)) for a, b in zip(before, counts.max(0)))

    step = max(1, (1 << 22) // max(1, n_streams * L))  # segments a pass
    for start in range(0, full, step):
        stop = min(full, start + step)
        cluster = np.searchsorted(edges, streams[:, 1 + start * L:1 + stop * L], side="right")  # (B, k * L)
        index = cluster.reshape(n_streams, stop - start, L) + n_clusters * np.arange(stop - start)[:, None]
        held(n_streams * L, np.bincount(index.ravel(), minlength=(stop - start) * n_clusters).reshape(-1, n_clusters))
    if full < batches.n_segments:  # the last, shorter segment
        last = np.searchsorted(edges, streams[:, 1 + full * L:batches.stream_len], side="right")  # (B, < L)
        held(last.size, np.bincount(last.ravel(), minlength=n_clusters)[None])
    return most


def check_segments(cfg: Config, splits: dict[str, np.ndarray]) -> SegmentData:
    """The run's data, once every split holds a segment for every process (DataError otherwise)."""
    data = SegmentData(splits, cfg.data.batch_size, cfg.data.eval_batch_size, cfg.data.seg_len)
    for split in splits:
        data.batches(split, 0, cfg.train.devices * cfg.train.num_nodes)
    return data

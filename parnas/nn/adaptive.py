"""Adaptive input and a projected adaptive softmax that can share its weights with it (Dai et al.'s layout).

Cluster i is ``d_model // div_value**i`` wide, projected to ``d_model``; tied, each cluster's output weight is its
embedding and (``tie_projs``) its projection the embedding's. Written here because torch's
``nn.AdaptiveLogSoftmaxWithLoss`` has no handle to share with an embedding; the parameters follow Dai et al.'s
one for one, so counts match theirs and their weights load by name.

Neither waits for the device: the softmax scores each tail cluster on its own rows, whose counts
:func:`group_targets` makes on the host with the batch (:class:`TargetGroups`; without them, one read-back). A
:class:`TargetCapacity` pads each tail cluster to a fixed row count, so a compiled loss keeps its shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.config import cluster_widths
from parnas.nn.alignment import padded_logits


class TargetGroups(NamedTuple):
    """A batch's targets grouped by adaptive-softmax cluster, made on the host by :func:`group_targets`.

    ``order``: the flattened targets' rows grouped by cluster, each cluster's rows in their order (moved to the
    device with the batch); ``sizes``: how many of ``order``'s entries each cluster has, the shortlist's first, as
    Python numbers. ``valid``, where given, marks which of ``order``'s entries are rows (fixed capacities,
    :class:`TargetCapacity`): the others are padding, row 0 standing in, and ``sizes`` are the capacities (the
    shortlist's 0: the head scores every row, and the loss reads no shortlist rows)."""
    order: Tensor
    sizes: tuple[int, ...]
    valid: Tensor | None = None

    def to(self, device: torch.device) -> TargetGroups:
        """On ``device``, without waiting for its queue: from pinned memory (``parnas.training.devices.pinned``),
        the copy is queued behind the GPU's work."""
        non_blocking = device.type == "cuda"
        return TargetGroups(self.order.to(device, non_blocking=non_blocking), self.sizes,
                            None if self.valid is None else self.valid.to(device, non_blocking=non_blocking))


class TargetCapacity:
    """Fixed row capacities for the tail clusters, so that a loss's shapes do not change from batch to batch.

    A cluster's capacity is the largest count it was fitted to, rounded up to a sixteenth of the batch's rows (in
    multiples of 8, at most all of them), for each number of rows a batch has; it only grows, and by that quantum.
    Host state, kept with the model it pads for: a run's data module fits it to every segment of its splits
    before the first step (``parnas.training.data_module``), so that no batch grows it (which would compile the
    loss again) and a resumed run pads as the first did."""

    def __init__(self) -> None:
        self.by_rows: dict[int, tuple[int, ...]] = {}

    def fit(self, n_rows: int, counts: Sequence[int]) -> tuple[int, ...]:
        """The capacities for a batch of ``n_rows`` rows whose tail clusters hold ``counts`` rows, grown to hold
        them where they did not."""
        quantum = max(8, -(-n_rows // 16 // 8) * 8)
        held = self.by_rows.get(n_rows, (0,) * len(counts))
        grown = tuple(cap if count <= cap else min(n_rows, -(-count // quantum) * quantum)
                      for cap, count in zip(held, counts, strict=True))
        self.by_rows[n_rows] = grown
        return grown

    def hold(self, most: Mapping[int, Sequence[int]]) -> None:
        """Grown to hold the most rows a batch has in each cluster (the shortlist first), by the batch's number of
        rows: what ``parnas.training.data_module.most_targets_per_cluster`` counts over a split."""
        for n_rows, counts in most.items():
            self.fit(n_rows, counts[1:])


def group_by_cluster(ids: Tensor, cutoffs: Tensor, groups: TargetGroups | None = None) -> tuple[Tensor, TargetGroups]:
    """Each id's cluster (N,) (cluster i > 0 holds ids in [cutoffs[i-1], cutoffs[i]), cluster 0 those below
    cutoffs[0]) and the rows grouped by cluster (each cluster's rows in their order, with the clusters' sizes).
    ``groups`` made on the host are the second; without them the sizes are read back in one copy. ``cutoffs``
    is a tensor on the ids' device (a module's buffer): made from a list in the step, it would be an upload,
    which on a GPU waits for the stream."""
    cluster = torch.bucketize(ids, cutoffs, right=True)  # (N,)
    if groups is not None:
        if groups.valid is None and groups.order.shape != ids.shape:
            raise ValueError(f"target groups of {groups.order.numel()} rows for {ids.numel()} targets")
        return cluster, groups
    # counted by comparison, not torch.bincount: on CUDA bincount reads the ids' min and max back to size its output
    counts = (cluster[:, None] == torch.arange(len(cutoffs) + 1, device=ids.device)).sum(0)  # (clusters,)
    return cluster, TargetGroups(cluster.argsort(stable=True), tuple(counts.tolist()))


def group_targets(y: Tensor, cutoffs: Sequence[int], capacity: TargetCapacity | None = None) -> TargetGroups:
    """``y``'s rows (flattened) grouped by cluster, on ``y``'s device: on the host, where the data loader made the
    batch, it waits for no device. The stable sort makes the order the one the device would compute. With a
    ``capacity``, each tail cluster's rows padded to its capacity (row 0 standing in, marked not ``valid``)."""
    flat = y.reshape(-1)
    _, groups = group_by_cluster(flat, torch.tensor(list(cutoffs), dtype=flat.dtype, device=flat.device))
    if capacity is None:
        return groups
    counts, parts = groups.sizes[1:], groups.order.split(groups.sizes)[1:]  # the tail clusters' rows
    sizes = capacity.fit(flat.numel(), counts)
    order = torch.cat([F.pad(rows, (0, size - len(rows))) for rows, size in zip(parts, sizes)])  # (sum(sizes),)
    valid = torch.cat([torch.arange(size) < count for count, size in zip(counts, sizes)])  # (sum(sizes),)
    return TargetGroups(order, (0, *sizes), valid)


def add_tail_nll(nll: Tensor, h: Tensor, y: Tensor, groups: TargetGroups, edges: Sequence[int],
                 tail_logits: Callable[[int, Tensor], Tensor], target_nll: type[torch.autograd.Function]) -> Tensor:
    """``nll`` with each tail cluster's NLL added to its rows: tail cluster i (its ids in [edges[i], edges[i+1]))
    scored on its own rows by ``tail_logits(i, h_rows)``, ``target_nll`` giving -log_softmax(logits)[target] per
    row. Padded entries (``groups.valid``) score row 0 against a target in range and add 0 to it.
    nll (N,), h (N, D), y (N,) -> (N,)"""
    start = groups.sizes[0]
    for i, size in enumerate(groups.sizes[1:], 1):
        if size:
            rows = groups.order[start:start + size]  # (size,)
            target = y.index_select(0, rows) - edges[i]  # (size,)
            if groups.valid is not None:  # a padded entry's target is another cluster's
                target = target.clamp(0, edges[i + 1] - edges[i] - 1)
            tail = target_nll.apply(tail_logits(i, h.index_select(0, rows)), target)  # (size,)
            if groups.valid is not None:
                tail = torch.where(groups.valid[start:start + size], tail, 0.0)
            nll = nll.index_add(0, rows, tail)
        start += size
    return nll


def cutoffs_buffer(module: nn.Module, cutoffs: Sequence[int]) -> None:
    """``module.cutoffs_on_device``: the cutoffs as a tensor that moves with the module (not saved: it is config)."""
    module.register_buffer("cutoffs_on_device", torch.tensor(list(cutoffs), dtype=torch.long), persistent=False)


def _projection(d_model: int, width: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(d_model, width).normal_(std=0.02))


class AdaptiveEmbedding(nn.Module):
    """Token ids (...) -> (..., d_model): cluster i's ``Embedding(size_i, d_i)`` then its ``d_model x d_i``
    projection. At div_value 1 one ``Embedding(vocab, d_model)`` and no projection (Dai et al.'s layout)."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int], div_value: float) -> None:
        super().__init__()
        self.d_model, self.cutoffs = d_model, list(cutoffs)
        cutoffs_buffer(self, cutoffs)
        edges = [0, *cutoffs, vocab_size]
        widths = cluster_widths(d_model, len(edges) - 1, div_value)
        if div_value == 1:
            self.layers = nn.ModuleList([nn.Embedding(vocab_size, d_model)])
            self.projs = nn.ParameterList()
        else:
            self.layers = nn.ModuleList([nn.Embedding(b - a, w) for a, b, w in zip(edges, edges[1:], widths)])
            self.projs = nn.ParameterList([_projection(d_model, w) for w in widths])

    @property
    def weight(self) -> Tensor:
        """The first cluster's table (the whole vocabulary's at div_value 1)."""
        return self.layers[0].weight

    def forward(self, ids: Tensor) -> Tensor:
        if not len(self.projs):
            return self.layers[0](ids)
        flat = ids.reshape(-1)
        cluster = torch.bucketize(flat, self.cutoffs_on_device, right=True)  # (N,)
        out: Tensor | None = None
        for i, (layer, proj, low) in enumerate(zip(self.layers, self.projs, [0, *self.cutoffs])):
            mine = (cluster == i)[:, None]  # (N, 1)
            rows = torch.where(mine, layer(torch.where(mine[:, 0], flat - low, 0)), 0)  # (N, d_i): others zero
            part = F.linear(rows, proj)  # (N, D), zero rows where the id is another cluster's
            out = part if out is None else out + part
        return out.view(*ids.shape, self.d_model)


class ProjectedAdaptiveSoftmax(nn.Module):
    """Adaptive softmax whose clusters are ``Linear(d_i, size_i)`` after a ``d_model x d_i`` projection; the head
    scores the shortlist and one entry per tail cluster (``cluster_weight``, ``cluster_bias``), the last entry
    standing for the first tail cluster (Dai et al.'s order). At div_value 1 one ``Linear(d_model, vocab)``
    sliced by cluster and no projection. :meth:`tie` shares weights and projections with an embedding."""

    def __init__(self, vocab_size: int, d_model: int, cutoffs: Sequence[int], div_value: float) -> None:
        super().__init__()
        self.cutoffs, self.vocab_size = list(cutoffs), vocab_size
        cutoffs_buffer(self, cutoffs)
        self.edges = [0, *cutoffs, vocab_size]
        n_tails = len(cutoffs)
        widths = cluster_widths(d_model, n_tails + 1, div_value)
        self.cluster_weight = nn.Parameter(torch.zeros(n_tails, d_model))
        self.cluster_bias = nn.Parameter(torch.zeros(n_tails))
        if div_value == 1:
            self.out_layers = nn.ModuleList([nn.Linear(d_model, vocab_size)])
            self.out_projs: list[nn.Parameter | None] = [None] * (n_tails + 1)
        else:
            self.out_layers = nn.ModuleList([nn.Linear(w, b - a) for a, b, w in zip(self.edges, self.edges[1:],
                                                                                     widths)])
            self.out_projs = nn.ParameterList([_projection(d_model, w) for w in widths])

    def tie(self, embedding: nn.Module, tie_projs: Sequence[bool]) -> None:
        """Each cluster's output weight becomes ``embedding``'s (an ``AdaptiveEmbedding``, or a full ``nn.Embedding``
        at div_value 1); cluster i's projection becomes the embedding's where ``tie_projs[i]``."""
        tables = list(embedding.layers) if isinstance(embedding, AdaptiveEmbedding) else [embedding]
        for out, table in zip(self.out_layers, tables, strict=True):
            out.weight = table.weight
        projs = list(getattr(embedding, "projs", []))
        for i, tied in enumerate(tie_projs):
            if tied and i < len(projs) and self.out_projs[i] is not None:
                self.out_projs[i] = projs[i]

    def _logits(self, i: int, h: Tensor, multiple: int = 1) -> Tensor:
        """Cluster i's scores (the head's for i = 0, with the tail clusters' entries after the shortlist's; the head's
        padded with -inf to a multiple of ``multiple``: :func:`parnas.nn.alignment.padded_logits`).
        h (N, D) -> (N, size)"""
        if len(self.out_layers) == 1:
            low, high = self.edges[i], self.edges[i + 1]
            weight, bias = self.out_layers[0].weight[low:high], self.out_layers[0].bias[low:high]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        proj = self.out_projs[i]
        h = h if proj is None else h @ proj
        if i:
            return F.linear(h, weight, bias)
        return padded_logits(h, torch.cat([weight, self.cluster_weight]), torch.cat([bias, self.cluster_bias]),
                             multiple)

    def nll(self, h: Tensor, y: Tensor, target_nll: type[torch.autograd.Function],
            groups: TargetGroups | None = None, multiple: int = 1) -> Tensor:
        """Per-token negative log-likelihood; ``target_nll`` computes -log_softmax(logits)[target] per row;
        ``groups``: y's, made on the host (else one host sync); ``multiple``: the head's logits padded to a multiple
        of it. h (N, D), y (N,) -> (N,)"""
        head_size = self.cutoffs[0] + len(self.cutoffs)
        cluster, groups = group_by_cluster(y, self.cutoffs_on_device, groups)  # (N,): 0 shortlist, i tail i
        head_target = torch.where(cluster == 0, y, head_size - cluster)  # tail i scored by head entry -i
        nll = target_nll.apply(self._logits(0, h, multiple), head_target)  # (N,)
        return add_tail_nll(nll, h, y, groups, self.edges, self._logits, target_nll)

    def log_prob(self, h: Tensor) -> Tensor:
        """Log-probabilities over the whole vocabulary. (N, D) -> (N, V)"""
        head = self._logits(0, h).float().log_softmax(-1)  # (N, shortlist + tails)
        parts = [head[:, :self.cutoffs[0]]]
        for i in range(1, len(self.edges) - 1):
            parts.append(head[:, -i, None] + self._logits(i, h).float().log_softmax(-1))
        return torch.cat(parts, dim=-1)

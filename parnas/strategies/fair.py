"""``forward: fair``: strict-fair supernet training (FairNAS, Chu et al. 2021): every candidate of every block is
trained once a step, on the same batch.

Why: a supernet is worth its cost only if the weights it leaves rank layouts as retraining does. Trained ``gumbel``
or ``sampled``, the candidates the logits favour early get more and larger updates, their inherited perplexity
improves because they were trained more, and the logits favour them further: the ranking measures training
received, not quality (in PLANER's space such a supernet ranked layouts at chance, docs/results.md). Here a step
runs ``K`` sub-steps (``K`` candidates), each picking one candidate per block, each block's picks a random
permutation of its candidates (:func:`fair_picks`); the sub-steps see the same batch and starting memory, their
losses are averaged and the weights take one optimiser step. A step costs ``K`` single-path forwards and backwards,
about what a ``gumbel`` step costs, and holds as many activations.

What the logits learn from: block b's logits descend ``sum_k softmax(alpha_b)[k] x (L_(b,k) - mean L)``, with
``L_(b,k)`` the loss of the sub-step that ran candidate ``k`` in block b: the expected measured loss under the
block's distribution (:func:`fair_surrogate`). The picks are not drawn from softmax(alpha), so no score-function
estimator is needed, and no Gumbel sample is drawn: tau is not read.

The training stream's bookkeeping (memory, data position, micro-batch count) advances once a step, through the last
sub-step, the task's own ``train_nll``; the picks and dropout are seeded by the step, so a resumed search draws the
same. Stacked (``train.compile``), the sub-steps run as one forward of ``K`` copies of the batch, each block's
candidate ``k`` on the copy its permutation gives it (:class:`RoutedMixedLayer`'s ``routes``): one static graph to
compile, where ``K`` forwards would need a graph per permutation. The two compute the same, to rounding, but for the
copies' random draws (one seed) and a compressive block's reconstruction loss (computed once, on the copy carried on).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from parnas.nn.adaptive import TargetGroups
from parnas.strategies.sampled import RoutedMixedLayer, clear_picks
from parnas.training.devices import pinned
from parnas.training.task import segment_nll

FAIR_SEED_OFFSET = 151_051
"""Added to ``train.seed`` for a step's permutations (and, plus the sub-step's index, for the dropout of the
sub-steps other than the last): distinct from the other streams' offsets, a prime only to be easy to tell apart."""


def fair_picks(n_blocks: int, n_candidates: int, seed: int) -> list[list[int]]:
    """``n_candidates`` rows of picks, one per sub-step; column b is a random permutation of block b's candidates,
    so every candidate of every block is picked exactly once. Drawn by Python's generator seeded with ``seed``:
    no tensor is made, so nothing is read back from a device."""
    generator = random.Random(seed)
    columns = [generator.sample(range(n_candidates), n_candidates) for _ in range(n_blocks)]
    return [[column[j] for column in columns] for j in range(n_candidates)]


def fair_surrogate(layers: Sequence[RoutedMixedLayer], picks: Sequence[Sequence[int]], losses: Tensor) -> Tensor:
    """``sum_b sum_j softmax(alpha_b)[picks[j][b]] x (losses[j] - mean)``, the losses' values only: its gradient in
    block b's logits is that of the block's expected measured loss (see module docstring). The advantages are
    laid out by candidate from the device's own values, so no index is uploaded: on a GPU an upload from the
    host waits for the stream."""
    advantage = (losses.detach() - losses.detach().mean()).float().unbind()  # K scalars, sub-step j's at j
    by_candidate = [[0] * len(picks) for _ in layers]  # by_candidate[b][k]: the sub-step that ran k in block b
    for j, row in enumerate(picks):
        for b, k in enumerate(row):
            by_candidate[b][k] = j
    measured = torch.stack([advantage[j] for column in by_candidate for j in column]).view(len(layers), -1)  # (B, K)
    probs = torch.stack([layer._arch_alpha for layer in layers]).softmax(-1)  # (B, K)
    return (probs.to(measured) * measured).sum()


def merged_block_metrics(sub_steps: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The model's ``block_metrics`` of a step's sub-steps as one forward of every candidate would report them:
    each block's own (``act/steps/block_3``), from the sub-step that ran the candidate reporting it, and each
    name's mean over those blocks (``act/steps``). A sub-step alone reports only the candidates it picked."""
    per_block = {k: v for metrics in sub_steps for k, v in metrics.items() if "/block_" in k}
    names: dict[str, list[Tensor]] = {}
    for key, value in per_block.items():
        names.setdefault(key.rsplit("/", 1)[0], []).append(value)
    return {name: torch.stack(values).mean() for name, values in names.items()} | per_block


def stacked_groups(groups: TargetGroups | None, copies: int, n_targets: int) -> TargetGroups | None:
    """``groups`` of a batch's ``n_targets`` targets as the groups of ``copies`` copies of it stacked: each
    cluster's rows of every copy in turn, so each cluster's rows stay in their order. Index arithmetic where the
    groups are: nothing is read back."""
    if groups is None:
        return None
    parts = groups.order.split(list(groups.sizes))  # each cluster's rows (padded entries too: row 0 of a copy)
    order = torch.cat([part + j * n_targets for part in parts for j in range(copies)])
    valid = None if groups.valid is None else torch.cat([part for part in groups.valid.split(list(groups.sizes))
                                                         for _ in range(copies)])
    return TargetGroups(order, tuple(size * copies for size in groups.sizes), valid)


def stacked_nll(copies: int) -> Callable[..., tuple[Tensor, Any]]:
    """``segment_nll``'s call for ``copies`` copies of the segment stacked on the batch axis, all from the same
    memory: NLL (copies, B, L) and the memory after the last copy (the model's body carries that one on)."""
    def forward(model: torch.nn.Module, x: Tensor, y: Tensor, mems: Any, groups: TargetGroups | None
                ) -> tuple[Tensor, Any]:
        if mems is None:  # B rows of memory, not copies x B
            mems = model.init_memory(x.size(0), x.device)
        nll, mems = segment_nll(model, x.repeat(copies, 1), y.repeat(copies, 1), mems,
                                stacked_groups(groups, copies, y.numel()))  # (copies x B, L)
        return nll.view(copies, *y.shape), mems
    return forward


def copies_aux_loss(layers: Sequence[RoutedMixedLayer], picks: Sequence[Sequence[int]], zero: Tensor
                    ) -> Tensor | float:
    """Each copy's auxiliary loss after a stacked forward (what the blocks it ran left, as its sub-step's own would
    be), ``zero`` where nothing was left: (K,), or 0.0 where no candidate keeps anything (PAR's kinds)."""
    if not any(keepers for layer in layers for keepers in layer.candidate_keepers):
        return 0.0
    left = [[[m.aux_loss for m in keepers if m.aux_loss is not None] for keepers in layer.candidate_keepers]
            for layer in layers]  # [block][candidate]: the losses its keepers left
    return torch.stack([sum((a for b, k in enumerate(row) for a in left[b][k]), start=zero) for row in picks])


def set_routes(layers: Sequence[RoutedMixedLayer], picks: Sequence[Sequence[int]]) -> None:
    """Each layer's ``routes`` for a stacked step whose copy j runs ``picks[j]``, copied in place from pinned
    memory: on a GPU the copies queue behind its work, and the host does not wait."""
    by_copy = torch.tensor(picks).T  # (n_blocks, K): the candidate each copy runs
    routes = pinned(torch.stack([by_copy.argsort(-1), by_copy], dim=1), layers[0].routes.device)  # (n_blocks, 2, K)
    for layer, route in zip(layers, routes, strict=True):
        layer.routes.copy_(route, non_blocking=True)


def fair_loss(layers: Sequence[RoutedMixedLayer], task: Any, batch: Sequence[Any], learns: bool,
              stacked: bool = False) -> tuple[Tensor, Tensor | float]:
    """One strict-fair step of the training stream: the mean of the ``K`` sub-steps' losses, whose one backward
    accumulates every sub-step's gradient, and the logits' surrogate (0.0 unless ``learns``); ``stacked``: the
    sub-steps as one forward. The picks are cleared on return; ``block_metrics`` are every sub-step's."""
    if not layers:
        return task.train_nll(batch).mean() + task.aux_loss(), 0.0
    n_candidates = len(layers[0].names)
    picks = fair_picks(len(layers), n_candidates, task.seed_for_step(FAIR_SEED_OFFSET))
    if stacked:
        set_routes(layers, picks)
        for layer in layers:
            layer.stacked = True
        try:
            nll = task.train_nll(batch, stacked_nll(n_candidates))  # (K, B, L)
        finally:
            for layer in layers:
                layer.stacked = False
        losses = nll.flatten(1).mean(1)  # (K,): sub-step j's loss at j, with what its blocks' keepers left
        losses = losses + copies_aux_loss(layers, picks, losses.new_zeros(()))
        return losses.mean(), fair_surrogate(layers, picks, losses) if learns else 0.0
    start = task.train_memory(batch[0])
    losses, metrics = [], []
    try:
        for j, row in enumerate(picks):
            for layer, pick in zip(layers, row, strict=True):
                layer.pick = pick
            if j < len(picks) - 1:
                nll, _ = task.side_stream_nll(batch, start, FAIR_SEED_OFFSET + 1 + j)
            else:  # the task's own step: bookkeeping and the memory carried on
                nll = task.train_nll(batch)
            losses.append(nll.mean() + task.aux_loss())
            metrics.append(dict(getattr(task.model, "block_metrics", {})))
    finally:
        clear_picks(layers)
    task.model.block_metrics = merged_block_metrics(metrics)
    stacked = torch.stack([torch.as_tensor(v) for v in losses])
    return stacked.mean(), fair_surrogate(layers, picks, stacked) if learns else 0.0

"""``search.par-gumbel-darts.forward: sampled``: each training step runs one sampled candidate per block, and the
logits learn from the loss that sample reached (REINFORCE with a moving-average baseline).

A Gumbel-DARTS step runs every candidate of every block: about twice a Transformer-XL step when attention and dense
are both candidates. Here each block draws one candidate from softmax(alpha) and runs only that one, so the step
costs one sampled architecture's, and the logits learn from the loss itself: the score-function gradient
(L - b) d log p(picks) / d alpha, with b a moving average of the loss (ENAS's estimator).

Why not a straight-through sample (GDAS)? Its gradient is the loss's slope along the pick's own output, one candidate
at a time: it cannot compare candidates, and it never credits identity (whose change of the stream is zero) while the
other kinds' slopes come out positive, so such a search drifts to all-identity (docs/results.md).

:class:`RoutedMixedLayer` is NNI's ``DifferentiableMixedLayer`` with a pick set from outside for one forward
(:func:`draw_picks`, all blocks at once, so the host reads the picks back in one copy a step); with no pick set, and
in evaluation, it is NNI's layer: every candidate, mixed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from nni.nas.oneshot.pytorch.supermodule.differentiable import DifferentiableMixedLayer
from torch import Tensor

from parnas.nn.blocks import Keeper

BASELINE_DECAY = 0.95  # the loss's moving average: b <- decay b + (1 - decay) L, over about 20 steps

PICK_SEED_OFFSET = 104_729
"""Added to ``train.seed`` for a step's picks (:func:`draw_picks`, seeded by the task's ``seed_for_step``): the
picks of a step draw other numbers than its dropout. Like the search's other offsets it need only be distinct and
above the seeds people pick; it is a prime only to be easy to tell apart."""


class RoutedMixedLayer(DifferentiableMixedLayer):
    """NNI's mixed layer whose candidates a step routes: every candidate weighted (no pick set: Gumbel-DARTS and
    evaluation), only a picked one (a sampled step, see module docstring), or, ``stacked``, each candidate on its own
    copy of the batch (a fair step's sub-steps in one forward: :mod:`parnas.strategies.fair`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pick: int | None = None  # the candidate the next training forward runs
        self.stacked = False  # the next training forwards run stacked copies, routed by ``routes``
        # routes[0, k]: the copy candidate k runs on; routes[1, j]: the candidate copy j gets. A buffer set in place
        # each step: a compiled forward reads it as an input, so new routes compile nothing
        self.register_buffer("routes", torch.zeros(2, len(self.names), dtype=torch.long), persistent=False)

    @functools.cached_property
    def candidate_keepers(self) -> list[list[Keeper]]:
        """Each candidate's modules that keep state or leave losses (``parnas.nn.blocks.Keeper``), found once: a
        stacked step reads what each candidate's left, every step."""
        return [[m for m in self[name].modules() if isinstance(m, Keeper)] for name in self.names]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and self.stacked:
            return self._stacked(*args, **kwargs)
        if self.pick is None or not self.training:
            return super().forward(*args, **kwargs)
        return self[self.names[self.pick]](*args, **kwargs)

    def _stacked(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        """h (K*B, L, D): K copies of the segment's states, one per candidate; mem (B, M, D), the memory they share.
        Candidate k runs on copy ``routes[0, k]`` alone; the outputs go back in the copies' order. (K*B, L, D)"""
        copies = h.unflatten(0, (len(self.names), -1))  # (K, B, L, D)
        outputs = torch.stack([self[name](copies.index_select(0, self.routes[0, k:k + 1]).squeeze(0), mem, pos)
                               for k, name in enumerate(self.names)])  # (K, B, L, D), by candidate
        return outputs.index_select(0, self.routes[1]).flatten(0, 1)  # (K*B, L, D), by copy


def draw_picks(layers: Sequence[RoutedMixedLayer], seed: int) -> list[int]:
    """Draw each layer's candidate from softmax(alpha) (Gumbel-max, a generator seeded with ``seed``, a function of
    the step) for its next forward; returns the picks, read back in one copy (the host must know what to run)."""
    if not layers:
        return []
    alphas = torch.stack([layer._arch_alpha.detach() for layer in layers])  # (n_blocks, n_candidates)
    generator = torch.Generator(alphas.device).manual_seed(seed)
    gumbel = -torch.empty_like(alphas).exponential_(generator=generator).log()
    picks = (alphas + gumbel).argmax(-1).tolist()  # (n_blocks,)
    for layer, pick in zip(layers, picks):
        layer.pick = pick
    return picks


def clear_picks(layers: Sequence[RoutedMixedLayer]) -> None:
    """Back to mixing every candidate."""
    for layer in layers:
        layer.pick = None


def reinforce(layers: Sequence[RoutedMixedLayer], picks: Sequence[int], loss: Tensor,
              baseline: Tensor | None) -> tuple[Tensor, Tensor]:
    """The score-function surrogate whose gradient in the logits is (L - b) d log p(picks) / d alpha, and the
    next baseline b (the loss's moving average, kept on the loss's device: nothing is read back). ``loss``: the
    step's mean loss (its value only is used); ``baseline``: None on the first step, where it starts at L."""
    loss = loss.detach().float()
    baseline = loss if baseline is None else baseline.to(loss)
    log_p = torch.stack([layer._arch_alpha.log_softmax(-1)[pick] for layer, pick in zip(layers, picks)]).sum()
    surrogate = (loss - baseline) * log_p
    return surrogate, BASELINE_DECAY * baseline + (1 - BASELINE_DECAY) * loss

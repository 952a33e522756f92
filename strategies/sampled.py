"""``search.forward: sampled``: each training step runs only the candidate a hard Gumbel sample picks in each block.

A mixed block of NNI's Gumbel-DARTS runs every candidate and sums their outputs by the sample's weights, so a
step of the supernet costs as much as every candidate of every block: about twice a Transformer-XL step when
attention and dense are both candidates. GDAS (Dong & Yang, 2019) draws a straight-through sample instead,
one-hot in value and relaxed in gradient, and runs only the candidate it picks, scaled by its weight (1 in
value): the step then costs one sampled architecture's. The logits still learn every step: the picked weight's
gradient is that of the relaxed sample, which reaches every logit of the block through the softmax. What is
lost is the gradient that would come through the candidates not run (their outputs are not known).

NNI's ``DifferentiableMixedLayer`` has no such mode; :class:`SampledMixedLayer` is it, with a sample set from
outside for one forward (:func:`draw_samples`): drawn for all blocks at once, so that the host, which must know
which candidate to run, reads the picks back in one copy a step. With no sample set, and in evaluation, it is
NNI's layer: every candidate, mixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from nni.nas.oneshot.pytorch.supermodule.differentiable import DifferentiableMixedLayer
from torch import Tensor


class SampledMixedLayer(DifferentiableMixedLayer):
    """NNI's mixed layer that, given a sample, runs only the candidate it picks (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sample: tuple[int, Tensor] | None = None  # (picked candidate, its straight-through weight ())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.sample is None or not self.training:
            return super().forward(*args, **kwargs)
        index, weight = self.sample
        return weight * self[self.names[index]](*args, **kwargs)


def draw_samples(layers: Sequence[SampledMixedLayer], tau: float, seed: int) -> list[int]:
    """Give every layer a straight-through Gumbel-softmax sample at temperature ``tau`` for its next forward and
    return the picks, read back in one copy (the host must know what to run: the one read-back this costs).

    What ``F.gumbel_softmax(hard=True)`` draws, from a generator seeded with ``seed`` (a function of the step, so
    that a resumed search draws the same samples), not from torch's global one."""
    if not layers:
        return []
    generator = torch.Generator(layers[0]._arch_alpha.device).manual_seed(seed)
    soft = []
    for layer in layers:
        alpha = layer._arch_alpha  # (n_candidates,)
        gumbel = -torch.empty_like(alpha).exponential_(generator=generator).log()
        soft.append(((alpha + gumbel) / tau).softmax(-1))
    picks = torch.stack([s.detach().argmax() for s in soft]).tolist()  # (n_blocks,)
    for layer, s, pick in zip(layers, soft, picks):
        layer.sample = (pick, 1.0 - s[pick].detach() + s[pick])  # 1 in value, the relaxed sample's gradient
    return picks


def clear_samples(layers: Sequence[SampledMixedLayer]) -> None:
    """Back to mixing every candidate (and no sample's graph kept alive past its step)."""
    for layer in layers:
        layer.sample = None

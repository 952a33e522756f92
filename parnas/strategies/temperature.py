"""The Gumbel-softmax temperature tau: its schedule over a search, and the softmax it sets.

A search anneals tau every optimiser step (:func:`tau_at`), not every epoch as NNI's GumbelDARTS does. The softmax
(:class:`GumbelSoftmax`) holds tau twice: as the Python number eager steps divide by, and in a tensor that a compiled
supernet reads, since a graph traced from a Python number is specialised on its value and would recompile every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nni.nas.oneshot.pytorch.supermodule.differentiable import GumbelSoftmax as NNIGumbelSoftmax
from torch import Tensor


def tau_at(step: int, total_steps: int, start: float, end: float) -> float:
    """Temperature at optimiser step ``step``: ``start`` at step 0, ``end`` at the last step, falling exponentially
    (the original TensorFlow PAR Transformer-XL's schedule)."""
    t = min(1.0, step / max(1, total_steps - 1))
    return start * (end / start) ** t


class GumbelSoftmax(NNIGumbelSoftmax):
    """Gumbel-softmax samples while training (relaxed, or straight-through when ``hard``); the plain softmax of the
    logits in eval mode, so evaluation is deterministic. Set tau with :meth:`set_tau` (see module docstring)."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__(dim)
        self.register_buffer("temperature", torch.ones(()), persistent=False)  # tau for compiled graphs; not saved

    def set_tau(self, tau: float) -> None:
        """The temperature of the next training forwards (their samples are soft: every candidate weighted)."""
        self.tau, self.hard = tau, False
        self.temperature.fill_(tau)  # in place: a compiled graph reads the tensor it was traced with

    def forward(self, logits: Tensor) -> Tensor:
        if self.training:
            tau = self.temperature if torch.compiler.is_compiling() else self.tau
            return F.gumbel_softmax(logits, tau=tau, hard=self.hard, dim=self.dim)  # type: ignore[arg-type]
        return logits.softmax(self.dim)

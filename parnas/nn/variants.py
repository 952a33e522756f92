"""Blocks from the Transformer variants PAR users compare against (registered in parnas.kinds).

Each keeps the one block call ``block(h, mem, pos) -> h'`` (parnas.nn.blocks), its residual
inside, and the existing blocks' norm placement: post-norm ``norm(h + f(h))``, as Transformer-XL's.

- ``conv`` (:class:`ConvBlock`): the Evolved Transformer's cheap local mixer (So et al. 2019):
  a gated linear unit, then a causal depthwise-separable convolution.
- ``glu`` (:class:`GLUBlock`): SwiGLU feed-forward (Shazeer 2020).
- ``sqrelu`` (:class:`SquaredReLUBlock`): Primer's squared-ReLU feed-forward (So et al. 2021).
- ``shared`` (:class:`UniversalBlock`): a whole Transformer-XL layer (attention, then the
  transition feed-forward) whose one set of weights every depth choosing it reuses, as in
  the Universal Transformer (Dehghani et al. 2019); :class:`DepthStep` adds its timestep signal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.nn.blocks import AttentionBlock, DenseBlock, sinusoid

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig


def _residual(block: nn.Module, h: Tensor, f) -> Tensor:
    """Post-norm ``norm(h + f(h))``, as the other blocks do."""
    return block.norm(h + f(h))


class ConvBlock(nn.Module):
    """Pointwise Linear D->2D, GLU, depthwise causal Conv1d (kernel k), pointwise Linear, dropout.

    The Evolved Transformer's cheap local mixing (So et al. 2019): its cells open with a gated
    linear unit and mix neighbouring positions with separable convolutions (9x1 in the
    encoder; causal, left-padded 11x1 and 7x1 in the decoder, hence ``model.conv_kernel`` = 7).
    Here the GLU and one depthwise-separable convolution share one residual, as in Wu et al.
    2019's lightweight-convolution block (ET gives each its own). The convolution is causal:
    position t sees t-k+1..t. Across segments its left context is the previous segment's
    tail: ``mem`` holds the states that entered the block before, and its last k-1 go through
    the same GLU (ET's decoder caches its previous inputs the same way), so segment A then B
    with memory equals one pass over A+B whenever ``mem_len >= k - 1`` (zeros stand where
    there is no past, as in one pass).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, self.k = cfg.d_model, cfg.settings_of("conv").kernel
        self.gate = nn.Linear(D, 2 * D)  # pointwise, split into value and gate by the GLU
        self.depthwise = nn.Conv1d(D, D, self.k, groups=D)  # no padding: the left context is prepended
        self.pointwise = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return _residual(self, h, lambda x: self._mix(x, mem))

    def _mix(self, x: Tensor, mem: Tensor) -> Tensor:
        C = min(self.k - 1, mem.size(1))
        past = mem[:, mem.size(1) - C:]  # (B, C, D): the last k-1 states that entered this block
        u = F.glu(self.gate(torch.cat([past, x], dim=1)), dim=-1)  # (B, C+L, D)
        u = F.pad(u.transpose(1, 2), (self.k - 1 - C, 0))  # (B, D, k-1+L): zeros where no past exists
        return self.drop(self.pointwise(self.depthwise(u).transpose(1, 2)))  # (B, L, D)


class GLUBlock(nn.Module):
    """SwiGLU feed-forward, ``(Swish(xW) * xV) W2`` without biases (Shazeer 2020, eq. 6).

    As in Shazeer's comparison, the hidden width is 2/3 of ``model.d_ff`` so that the three
    matrices hold as many weights as the dense block's two (dense's biases aside).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = max(1, 2 * cfg.d_ff // 3)
        self.wv = nn.Linear(cfg.d_model, 2 * hidden, bias=False)  # W and V in one matrix
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return _residual(self, h, self._ffn)

    def _ffn(self, x: Tensor) -> Tensor:
        a, b = self.wv(x).chunk(2, dim=-1)  # (B, L, hidden) each
        return self.drop(self.w2(self.drop(F.silu(a) * b)))


class SquaredReLUBlock(nn.Module):
    """The dense block with ReLU squared, ``W2 relu(W1 x + b1)^2 + b2`` (So et al. 2021, Primer).

    Same shapes (``model.d_ff``) and parameter count as ``dense``: only the activation differs.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return _residual(self, h, lambda x: self.drop(self.w2(self.drop(F.relu(self.w1(x)).square()))))


class UniversalBlock(nn.Module):
    """One Universal Transformer step: relative self-attention over [memory; segment], then the
    transition function (here the dense feed-forward), each with its residual and norm.

    Registered as ``shared``: every depth that holds a ``shared`` block calls this one module
    (through :class:`DepthStep`), so a search trades parameters for depth. Adaptive
    computation time (UT's optional halting) is not part of it.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = AttentionBlock(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.dropatt,
                                        cfg.attention_kernel)
        self.transition = DenseBlock(cfg.d_model, cfg.d_ff, cfg.dropout)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return self.transition(self.attention(h, mem, pos), mem, pos)


class DepthStep(nn.Module):
    """Depth ``step`` of a weight-shared block: adds the Universal Transformer's timestep signal,
    then calls the shared ``core``.

    Dehghani et al. (2019, eq. 5) add a coordinate embedding of position and timestep t before
    each step; Transformer-XL's positions are relative and live in the attention, so only the
    timestep sinusoid is added, to the segment and to the memory alike (the memory holds this
    depth's inputs, which had it too). It has no parameters: the core's are the only weights.
    """

    def __init__(self, core: nn.Module, step: int, d_model: int) -> None:
        super().__init__()
        self.core = core
        self.kind, self.uses_memory = core.kind, core.uses_memory
        t = step + 1  # UT counts steps from 1
        self.register_buffer("signal", sinusoid(t + 1, d_model)[0], persistent=False)  # (D,): the sinusoid of t

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        s = self.signal.to(h.dtype)
        return self.core(h + s, mem + s, pos)

"""Blocks from the Transformer variants PAR users compare against (registered in parnas.kinds).

Each keeps the one block call ``block(h, mem, pos) -> h'`` (parnas.nn.blocks) and post-norm ``norm(h + f(h))``:
``conv`` (:class:`ConvBlock`), ``glu`` (:class:`GLUBlock`), ``sqrelu`` (:class:`SquaredReLUBlock`) and ``shared``
(:class:`UniversalBlock`, behind a :class:`DepthStep` at each depth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.nn.blocks import build_attention, build_dense, sinusoid

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig


def _residual(block: nn.Module, h: Tensor, f) -> Tensor:
    """Post-norm ``norm(h + f(h))``, as the other blocks do."""
    return block.norm(h + f(h))


class ConvBlock(nn.Module):
    """Pointwise Linear D->2D, GLU, depthwise causal Conv1d (kernel k), pointwise Linear, dropout (the Evolved
    Transformer's local mixing, So et al. 2019, under one residual). Position t sees t-k+1..t: the last k-1 states
    of ``mem`` go through the same GLU, so segment A then B with memory equals one pass over A+B whenever
    ``mem_len >= k - 1``."""

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
    """SwiGLU feed-forward, ``(Swish(xW) * xV) W2`` without biases (Shazeer 2020, eq. 6), 2/3 of ``model.d_ff`` wide
    so that its three matrices hold as many weights as the dense block's two, as in Shazeer's comparison."""

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
    """The dense block with ReLU squared, ``W2 relu(W1 x + b1)^2 + b2`` (So et al. 2021, Primer): only the activation
    differs from ``dense``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return _residual(self, h, lambda x: self.drop(self.w2(self.drop(F.relu(self.w1(x)).square()))))


class UniversalBlock(nn.Module):
    """One Universal Transformer step (attention, then the dense transition): every depth that holds a ``shared``
    block calls this one module (through :class:`DepthStep`), so a search trades parameters for depth."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention, self.transition = build_attention(cfg), build_dense(cfg)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return self.transition(self.attention(h, mem, pos), mem, pos)


class DepthStep(nn.Module):
    """Depth ``step`` of a weight-shared block: the timestep sinusoid (Dehghani et al. 2019, eq. 5; positions are
    relative, in the attention) added to the segment and the memory alike, then the shared ``core``. No
    parameters of its own."""

    def __init__(self, core: nn.Module, step: int, d_model: int) -> None:
        super().__init__()
        self.core = core
        self.kind, self.uses_memory = core.kind, core.uses_memory
        t = step + 1  # UT counts steps from 1
        self.register_buffer("signal", sinusoid(t + 1, d_model)[0], persistent=False)  # (D,): the sinusoid of t

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        s = self.signal.to(h.dtype)
        return self.core(h + s, mem + s, pos)

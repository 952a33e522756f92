"""The three kinds of block a PAR Transformer-XL is built from.

Every block has the same call, ``block(h, mem, pos) -> h'``, with
``h`` (B, L, D) the segment entering the block, ``mem`` (B, M, D) the cached
states that entered it on earlier segments (M may be 0) and ``pos`` (M+L, D)
the sinusoid relative-position table, and returns a tensor shaped like ``h``.
One signature is what lets NNI call every candidate of a ``LayerChoice`` alike.
``uses_memory`` tells the body whether to keep a memory for the block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas import kinds
from parnas.config import ModelConfig


def sinusoid(klen: int, d_model: int, device: torch.device | None = None,
             dtype: torch.dtype = torch.float32) -> Tensor:
    """Relative-position table for distances klen-1, ..., 1, 0 (Dai et al., eq. 2). (K, D)"""
    distance = torch.arange(klen - 1, -1, -1.0, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=device) / d_model))
    angle = distance[:, None] * inv_freq[None, :]  # (K, D/2)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(dtype)  # (K, D)


def rel_shift(x: Tensor) -> Tensor:
    """Turn scores against the position table into scores against key positions.

    ``x[..., i, k]`` scores query i against distance K-1-k; the result's
    ``[..., i, j]`` scores it against key j, i.e. distance M+i-j (Dai et al.,
    appendix B). Entries with j > M+i are garbage and must be masked.
    """
    *batch, L, K = x.shape
    x = F.pad(x, (1, 0))  # (..., L, K+1)
    x = x.view(*batch, K + 1, L)[..., 1:, :]  # (..., K, L)
    return x.reshape(*batch, L, K)


class AttentionBlock(nn.Module):
    """Relative multi-head self-attention over [memory; segment], causal."""

    kind = "attention"
    uses_memory = True

    def __init__(self, d_model: int, n_heads: int, dropout: float, dropatt: float, pre_norm: bool) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.r = nn.Linear(d_model, d_model, bias=False)  # W_r: positions -> keys
        self.u = nn.Parameter(torch.zeros(n_heads, self.d_head))  # content bias
        self.v = nn.Parameter(torch.zeros(n_heads, self.d_head))  # position bias
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.dropatt, self.pre_norm = dropatt, pre_norm

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        B, L, D = h.shape
        M, H, Dh = mem.size(1), self.n_heads, self.d_head
        K = M + L
        c = torch.cat([mem, h], dim=1)  # (B, K, D)
        if self.pre_norm:
            c = self.norm(c)
        q = self.q(c[:, M:]).view(B, L, H, Dh).transpose(1, 2)  # (B, H, L, Dh)
        k, v = self.kv(c).view(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # 2 x (B, H, K, Dh)
        r = self.r(pos).view(K, H, Dh).permute(1, 2, 0)  # (H, Dh, K)
        scale = 1.0 / math.sqrt(Dh)
        position = rel_shift((q + self.v[:, None]) @ r)  # (B, H, L, K)
        future = torch.ones(L, K, dtype=torch.bool, device=h.device).triu_(M + 1)  # (L, K)
        bias = (position * scale).masked_fill_(future, float("-inf"))  # (B, H, L, K)
        a = F.scaled_dot_product_attention(q + self.u[:, None], k, v, attn_mask=bias,
                                           dropout_p=self.dropatt if self.training else 0.0, scale=scale)
        a = self.out(a.transpose(1, 2).reshape(B, L, D))  # (B, L, D)
        return h + self.drop(a) if self.pre_norm else self.norm(h + self.drop(a))


class DenseBlock(nn.Module):
    """Position-wise feed-forward sublayer with its residual and LayerNorm."""

    kind = "dense"
    uses_memory = False

    def __init__(self, d_model: int, d_ff: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(d_ff, d_model), nn.Dropout(dropout))
        self.norm = nn.LayerNorm(d_model)
        self.pre_norm = pre_norm

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return h + self.net(self.norm(h)) if self.pre_norm else self.norm(h + self.net(h))


class IdentityBlock(nn.Module):
    """Skips the block: PAR's way to spend no compute at a depth."""

    kind = "identity"
    uses_memory = False

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        return h


def make_block(kind: str, cfg: ModelConfig) -> nn.Module:
    """A fresh block of any registered ``kind`` (delegates to :func:`parnas.kinds.make_block`)."""
    return kinds.make_block(kind, cfg)

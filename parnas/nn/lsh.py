"""Reformer's LSH attention (Kitaev et al. 2020) as a block kind, ``lsh``.

Shared QK; every position of [memory; segment] is hashed by a random rotation (argmax over ``[xR; -xR]``),
sorted by (bucket, position) and cut into chunks of ``chunk_len``, each attending to itself and the chunk before:
cost K x chunk_len, not K^2. Causal; a query sees itself only when nothing else is visible (score -1e5, as in
the paper). ``n_hashes`` rounds are combined by the softmax of their log-sum-exps. What differs from the paper:
docs/reference.md, "Block kinds". Rotations come from torch's generator in training and a fixed seed in
evaluation (deterministic). The memory positions' outputs are computed (they sort with the segment) and dropped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.nn.blocks import Dropout

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig

SELF = -1e5  # a query's score against itself: used only when nothing else is visible
HIDDEN = -1e9  # a key in the query's future


class LSHAttentionBlock(nn.Module):
    """LSH self-attention over [memory; segment], with the residual and norm of the other blocks."""

    kind = "lsh"
    uses_memory = True

    def __init__(self, d_model: int, n_heads: int, dropout: float, dropatt: float,
                 n_buckets: int, n_hashes: int, chunk_len: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.n_buckets, self.n_hashes, self.chunk_len = n_buckets, n_hashes, chunk_len
        self.qk = nn.Linear(d_model, d_model, bias=False)  # shared query/key projection
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)
        self.drop, self.att_drop = Dropout(dropout), Dropout(dropatt)

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        B, L, D = h.shape
        M, H, Dh = mem.size(1), self.n_heads, self.d_head
        c = torch.cat([mem, h], dim=1) if M else h  # (B, K, D)
        K = c.size(1)
        qk = self.qk(c).view(B, K, H, Dh).transpose(1, 2)  # (B, H, K, Dh)
        v = self.v(c).view(B, K, H, Dh).transpose(1, 2)  # (B, H, K, Dh)
        outs, lses = [], []
        for buckets in self._hash(qk):  # (B, H, K) per round
            o, lse = self._chunked(qk, v, buckets)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            a = outs[0]
        else:  # rounds weighted by their share of the total probability mass: softmax over the log-sum-exps
            weights = torch.stack(lses).softmax(0)  # (R, B, H, K)
            a = (torch.stack(outs) * weights[..., None]).sum(0)
        a = self.out(a[:, :, M:].transpose(1, 2).reshape(B, L, D))  # (B, L, D): the segment's outputs
        return self.norm(h + self.drop(a))

    def _hash(self, qk: Tensor) -> list[Tensor]:
        """Each round's bucket of every position: argmax of [xR; -xR] for a random rotation R. (B, H, K)"""
        B, H, K, Dh = qk.shape
        if self.n_buckets < 2:
            return [qk.new_zeros(B, H, K, dtype=torch.long)] * self.n_hashes
        generator = None
        if not self.training:  # the same rotations at every evaluation
            generator = torch.Generator(device=qk.device).manual_seed(0)
        shape = (self.n_hashes, H, Dh, self.n_buckets // 2)
        rotations = torch.randn(shape, generator=generator, device=qk.device).to(qk.dtype)  # (R, H, Dh, nb/2)
        rotated = torch.einsum("bhkd,rhdn->rbhkn", qk.detach(), rotations)  # (R, B, H, K, nb/2)
        return list(torch.cat([rotated, -rotated], dim=-1).argmax(-1))  # R x (B, H, K)

    def _chunked(self, qk: Tensor, v: Tensor, buckets: Tensor) -> tuple[Tensor, Tensor]:
        """One round: sort by (bucket, position), attend within each chunk and the one before, unsort.
        qk, v (B, H, K, Dh), buckets (B, H, K) -> outputs (B, H, K, Dh) and log-sum-exps (B, H, K)"""
        B, H, K, Dh = qk.shape
        C = min(self.chunk_len, K)
        n, pad = -(-K // C), -K % C
        if pad:  # (one token at a time when generating) padded with positions after every real one: never seen
            qk, v = F.pad(qk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
            buckets = F.pad(buckets, (0, pad))
            K += pad
        positions = torch.arange(K, device=qk.device)
        order = (buckets * K + positions).argsort(-1)  # (B, H, K)
        undo = order.argsort(-1)
        index = order[..., None].expand(-1, -1, -1, Dh)
        q = qk.gather(2, index).view(B, H, n, C, Dh)
        k = F.normalize(q, dim=-1)  # shared QK: keys are the unit-length queries
        vs = v.gather(2, index).view(B, H, n, C, Dh)
        at = order.view(B, H, n, C)  # each sorted entry's position
        if n > 1:  # each chunk also sees the one before (the first, the last: causality masks it)
            k = torch.cat([k, k.roll(1, dims=2)], dim=3)  # (B, H, n, 2C, Dh)
            vs = torch.cat([vs, vs.roll(1, dims=2)], dim=3)
            key_at = torch.cat([at, at.roll(1, dims=2)], dim=3)  # (B, H, n, 2C)
        else:
            key_at = at
        scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)  # (B, H, n, C, 2C)
        query_at, key_at = at[..., :, None], key_at[..., None, :]
        scores = scores.masked_fill(key_at > query_at, HIDDEN).masked_fill(key_at == query_at, SELF)
        lse = scores.logsumexp(-1)  # (B, H, n, C)
        out = self.att_drop((scores - lse[..., None]).exp()) @ vs  # (B, H, n, C, Dh)
        out = out.view(B, H, K, Dh).gather(2, undo[..., None].expand(-1, -1, -1, Dh))
        K -= pad
        return out[:, :, :K], lse.view(B, H, K + pad).gather(2, undo)[:, :, :K]


def build_lsh(cfg: ModelConfig) -> LSHAttentionBlock:
    s = cfg.settings_of("lsh")
    return LSHAttentionBlock(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.dropatt, s.n_buckets, s.n_hashes, s.chunk_len)

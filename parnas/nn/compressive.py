"""Transformer-XL attention with a Compressive Transformer memory (Rae et al. 2019, arXiv:1911.05507).

States the plain memory evicts are cut into groups of c = ``model.compressive.rate``, oldest first, and each
group compressed by f_c (``model.compressive.fn``: mean, max or a stride-c convolution) into the compressed memory,
which keeps its newest ``model.compressive.length``. A learned f_c trains only on the attention-reconstruction loss
(sec. 3.1, alg. 2), left in ``aux_loss``. The memories travel by the :class:`parnas.nn.blocks.Keeper` contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.nn.blocks import AttentionBlock, Keeper, sinusoid

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig


class CompressiveBlock(AttentionBlock, Keeper):
    """Relative multi-head attention over [compressed memory; memory; segment], causal.

    Positions are relative over the concatenation: a compressed state counts as one step. Evicted states that do not
    fill a group of c yet (only when c does not divide what a segment evicts, e.g. token by token generation) wait in a
    pending memory, attended between the compressed and the plain memory, until the next segment completes the group.
    """

    n_memories = 2  # [compressed (B, Nc, D), pending (B, R < c, D)]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.dropatt, cfg.attention_kernel)
        s = cfg.settings_of("compressive")
        self.rate, self.compress_len, self.compress_fn = s.rate, s.length, s.fn
        self.compressor = nn.Conv1d(cfg.d_model, cfg.d_model, self.rate, stride=self.rate) \
            if self.compress_fn == "conv" else None
        self.pos_drop, self.clamp_len = nn.Dropout(cfg.dropout), cfg.clamp_len

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        compressed, pending = self.memory if self.memory is not None else (mem[:, :0], mem[:, :0])
        past = torch.cat([compressed, pending, mem], dim=1)  # (B, Nc+R+M, D)
        table = sinusoid(past.size(1) + h.size(1), h.size(-1), h.device, h.dtype, self.clamp_len)  # (Nc+R+M+L, D)
        pos = self.pos_drop(table)
        return super().forward(h, past, pos)

    def compress(self, x: Tensor) -> Tensor:
        """f_c: (B, n*c, D) -> (B, n, D), each group of c consecutive states to one."""
        x = x.transpose(1, 2)  # (B, D, n*c)
        if self.compress_fn == "mean":
            y = F.avg_pool1d(x, self.rate)
        elif self.compress_fn == "max":
            y = F.max_pool1d(x, self.rate)
        else:
            y = self.compressor(x)
        return y.transpose(1, 2)  # (B, n, D)

    def update_memory(self, memory: list[Tensor], mem: Tensor, h: Tensor, mem_len: int) -> list[Tensor]:
        """The next [compressed, pending]: compress what leaves the plain memory this segment.

        The body keeps the last ``mem_len`` of [mem; h]; the states before them are evicted. Pending states then evicted
        ones, in whole groups of c, become compressed states (appended; the newest ``compress_len`` are kept); the rest
        stays pending. Everything kept is detached, as Transformer-XL's memory is, so the language-model loss never
        reaches f_c: with a learned f_c, training sets ``aux_loss`` (else None).
        """
        compressed, pending = memory
        both = torch.cat([mem, h], dim=1)  # (B, M+L, D)
        old = torch.cat([pending, both[:, :max(0, both.size(1) - mem_len)]], dim=1).detach()  # (B, R+E, D)
        n = old.size(1) // self.rate * self.rate
        self.aux_loss = None
        if n:
            new = self.compress(old[:, :n])  # (B, n/c, D)
            if self.training and self.compressor is not None:
                self.aux_loss = self.reconstruction_loss(h.detach(), old[:, :n], new)
            compressed = torch.cat([compressed, new.detach()], dim=1)[:, -self.compress_len:]
        return [compressed, old[:, n:]]

    def reconstruction_loss(self, h: Tensor, old: Tensor, new: Tensor) -> Tensor:
        """Rae et al.'s attention-reconstruction loss: the content attention of the segment over the
        evicted states, against the same attention over their compression (mean squared error
        over heads' outputs). Stop-gradient on the segment, the old states and the attention's
        weights: only f_c learns from it. Relative positions are left out, as in alg. 2.
        """
        B, L, _ = h.shape
        H, Dh = self.n_heads, self.d_head

        def attend(m: Tensor) -> Tensor:
            q = F.linear(h, self.q_weight.detach()).view(B, L, H, Dh).transpose(1, 2)  # (B, H, L, Dh)
            k, v = F.linear(m, self.kv_weight.detach()).view(B, m.size(1), 2, H, Dh).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q + self.u.detach()[:, None], k, v)  # (B, H, L, Dh)

        return F.mse_loss(attend(new), attend(old))

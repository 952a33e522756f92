"""A switch-style mixture of feed-forward experts (Fedus et al. 2021), kind ``moe``: PLANER's way to buy
parameters without paying their latency.

A linear router (softmax in float32) sends each token to its ``top_k`` experts (feed-forwards of ``model.d_ff``)
and the block returns sum_i p_i E_i(x), so the router learns through the gates. Dispatch is tensor work, no
read-back. Many tokens: each expert takes at most C = ceil(capacity_factor x top_k x N / E) routings, queued
position by position so that a later position never pushes out an earlier one's (the model stays causal); the
rest are dropped (the token keeps its residual). Few tokens (N x top_k <= E, generating): each routing multiplies
its expert's weights gathered for it. The load-balancing loss E x sum_e f_e P_e (1 when balanced) joins the loss
x ``aux_weight``; ``moe/balance_loss``, ``moe/max_load`` and ``moe/dropped`` are logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parnas.nn.blocks import Dropout, Keeper, dropout

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig


class MoEBlock(Keeper):
    """The ``moe`` block: router, experts, residual and LayerNorm placed as the dense block's."""

    kind = "moe"
    uses_memory = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.settings = s = cfg.settings_of("moe")
        D, Fw, E = cfg.d_model, cfg.d_ff, s.n_experts
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, D, Fw) * 0.02)  # Transformer-XL's N(0, 0.02), expert by expert
        self.b_in = nn.Parameter(torch.zeros(E, Fw))
        self.w_out = nn.Parameter(torch.randn(E, Fw, D) * 0.02)
        self.b_out = nn.Parameter(torch.zeros(E, D))
        self.norm = nn.LayerNorm(D)
        self.drop, self.p = Dropout(cfg.dropout), cfg.dropout

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        x = h.transpose(0, 1)  # (L, B, D): position-major, for the queue
        y = self.drop(self.experts(x).transpose(0, 1))  # (B, L, D)
        return self.norm(h + y)

    def experts(self, x: Tensor) -> Tensor:
        """Route, dispatch, run and combine. x (L, B, D) -> (L, B, D)"""
        s, (L, B, D) = self.settings, x.shape
        E, k, N = s.n_experts, s.top_k, L * B
        x = x.reshape(N, D)
        probs = self.router(x).float().softmax(-1)  # (N, E)
        gate, expert = probs.topk(k, dim=-1)  # (N, k) each
        if N * k <= E:
            y, dropped = self._gathered(x, gate, expert), None
        else:
            y, dropped = self._dispatched(x, gate, expert, B, s.capacity(N))
        if self.training:
            first = F.one_hot(expert[:, 0], E).float().mean(0)  # (E,) share of first choices
            balance = E * (first * probs.mean(0)).sum()
            self.aux_loss = s.aux_weight * balance if s.aux_weight else None
            self.metrics = {"moe/balance_loss": balance.detach(), "moe/max_load": first.max() * E}
            if dropped is not None:
                self.metrics["moe/dropped"] = dropped
        else:
            self.aux_loss, self.metrics = None, {}
        return y.view(L, B, D)

    def _gathered(self, x: Tensor, gate: Tensor, expert: Tensor) -> Tensor:
        """Few tokens: each routing through its own expert's weights. (N, D), (N, k), (N, k) -> (N, D)"""
        N, k = expert.shape
        e = expert.reshape(-1)  # (N*k,) token-major
        rows = x.repeat_interleave(k, 0)[:, None]  # (N*k, 1, D)
        hidden = torch.baddbmm(self.b_in[e][:, None], rows, self.w_in[e])  # (N*k, 1, F)
        hidden = dropout(F.relu(hidden), self.p, self.training)
        out = torch.baddbmm(self.b_out[e][:, None], hidden, self.w_out[e]).view(N, k, -1)  # (N, k, D)
        return (out * gate[..., None].to(out.dtype)).sum(1)

    def _dispatched(self, x: Tensor, gate: Tensor, expert: Tensor, B: int, C: int) -> tuple[Tensor, Tensor]:
        """Many tokens, position-major (B a position): at most C routings an expert, the rest dropped. Returns the
        output (N, D) and the share of routings dropped. x (N, D), gate and expert (N, k)"""
        N, k = expert.shape
        E, D = self.settings.n_experts, x.size(1)

        def queue(t: Tensor) -> Tensor:  # (N, k) -> (k*N,) in queue order: position, then choice, then row
            return t.view(N // B, B, k).transpose(1, 2).reshape(-1)

        e = queue(expert)  # (k*N,)
        token = queue(torch.arange(N, device=x.device)[:, None].expand(N, k))  # (k*N,)
        chosen = F.one_hot(e, E)  # (k*N, E)
        place = (chosen.cumsum(0) * chosen).sum(1) - 1  # (k*N,) its place in its expert's queue
        kept = place < C
        slot = torch.where(kept, e * C + place, E * C)  # (k*N,) the last slot takes what is dropped
        buffer = x.new_zeros(E * C + 1, D).index_add(0, slot, x[token])[:-1].view(E, C, D)  # (E, C, D)
        hidden = dropout(F.relu(torch.baddbmm(self.b_in[:, None], buffer, self.w_in)), self.p, self.training)
        out = torch.baddbmm(self.b_out[:, None], hidden, self.w_out).view(E * C, D)  # (E*C, D)
        out = torch.cat([out, out.new_zeros(1, D)])  # a dropped routing adds nothing
        weight = (queue(gate) * kept).to(out.dtype)  # (k*N,)
        y = out.new_zeros(N, D).index_add(0, token, out[slot] * weight[:, None])  # (N, D), in the experts' dtype
        return y, 1.0 - kept.float().mean()

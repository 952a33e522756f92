"""Universal Transformer with adaptive computation time (Graves 2016; Dehghani et al. 2019), kind ``ut``.

One Transformer-XL layer applied again and again at one depth: after step t a sigmoid unit gives p_t, and a position
halts once its cumulative p would pass 1 - EPS, or after ``model.ut.max_steps`` steps, its last step weighted by the
remainder R. The output is the halting-weighted mean of the states; the ponder cost (mean N + R) joins the loss x
``model.ut.tau``, and ``act/steps`` is logged. Each step adds the timestep signal to the segment and the memory. The
loop stops once every position has halted: one read-back per step, the price of skipping the steps no position needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from parnas.nn.blocks import Keeper, build_attention, build_dense, sinusoid

if TYPE_CHECKING:  # annotations only: the kinds registry builds these blocks, so nothing here imports it
    from parnas.config import ModelConfig

EPS = 0.01  # a position halts once its cumulative halting probability passes 1 - EPS


class ACTBlock(Keeper):
    """The ``ut`` block: one attention + transition layer, applied until each position halts."""

    kind = "ut"
    uses_memory = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention, self.transition = build_attention(cfg), build_dense(cfg)
        self.halt = nn.Linear(cfg.d_model, 1)
        nn.init.constant_(self.halt.bias, 1.0)  # Graves: a positive bias, so early on a position ponders little
        s = cfg.settings_of("ut")
        self.max_steps, self.tau = s.max_steps, s.tau
        self.register_buffer("signals", sinusoid(s.max_steps + 1, cfg.d_model)[:-1].flip(0),
                             persistent=False)  # (steps, D): row t is the sinusoid of timestep t + 1

    def forward(self, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
        B, L, _ = h.shape
        halted = h.new_zeros(B, L)  # cumulative halting probability
        remainder, steps = h.new_zeros(B, L), h.new_zeros(B, L)
        out, state = torch.zeros_like(h), h
        for t in range(self.max_steps):
            signal = self.signals[t].to(h.dtype)
            running = halted < 1.0 - EPS  # (B, L)
            # every position halted: no step is left to pay (on the meta device, as --dry-run counts, no value is
            # known and every step is counted: the block's bound)
            if t and h.device.type != "meta" and not bool(running.any()):
                break
            p = torch.sigmoid(self.halt(state + signal)).squeeze(-1)  # (B, L)
            last = t == self.max_steps - 1
            stops = running & ((halted + p > 1.0 - EPS) | last)  # this step is the position's last
            continues = running & ~stops
            remainder = torch.where(stops, 1.0 - halted, remainder)
            weight = torch.where(continues, p, torch.where(stops, 1.0 - halted, torch.zeros_like(p)))
            halted = halted + weight
            steps = steps + running.to(h.dtype)
            state = self.transition(self.attention(state + signal, mem + signal, pos), mem, pos)
            out = out + weight[..., None] * state
        ponder = (steps + remainder).mean()
        self.aux_loss = self.tau * ponder if self.training and self.tau else None
        self.metrics = {"act/steps": steps.detach().mean()}
        return out

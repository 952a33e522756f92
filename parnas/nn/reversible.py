"""Reversible residuals (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020): ``model.reversible``.

Two streams (x1, x2) start as the embedding's output and are averaged at the top; block pairs (F, G) give
y1 = x1 + F(x2), y2 = x2 + G(y1), with F(x) = block(x, mem, pos) - x for any block. The inputs come back from the
outputs, so backward keeps only the top of the stack and recomputes each pair on the way down
(:class:`_ReversibleStack`): memory flat in depth for about one more forward. Each block's random and autocast
state is saved and replayed, so dropout draws the same numbers. Kinds with their own memory or loss, an odd
``n_blocks`` and a supernet are refused by the config and ``parnas search``. Each block's memory holds the states
that entered it (x2 for F, y1 for G).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


class _RandomState:
    """The random and autocast state a block ran under, to run it again identically."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device
        self.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def replay(self, block: nn.Module, *args: Tensor) -> Tensor:
        """``_residual(block, *args)`` under the saved random and autocast state."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices), \
                torch.autocast(self.device.type, dtype=self.autocast[1], enabled=self.autocast[0]):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            return _residual(block, *args)


def _residual(block: nn.Module, x: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
    return block(x, mem, pos) - x


class _ReversibleStack(torch.autograd.Function):
    """The whole reversible stack as one autograd node: only its outputs are kept for backward."""

    @staticmethod
    def forward(ctx: Any, x1: Tensor, x2: Tensor, blocks: list[nn.Module], mems: list[Tensor], pos: Tensor,
                *params: Tensor) -> tuple[Tensor, ...]:
        ctx.blocks, ctx.mems, ctx.pos, ctx.states = blocks, mems, pos, []
        inputs = []
        with torch.no_grad():
            for f, g, mem_f, mem_g in zip(blocks[::2], blocks[1::2], mems[::2], mems[1::2]):
                inputs.append(x2)  # what enters F
                ctx.states.append(_RandomState(x2.device))
                x1 = x1 + _residual(f, x2, mem_f, pos)
                inputs.append(x1)  # what enters G
                ctx.states.append(_RandomState(x2.device))
                x2 = x2 + _residual(g, x1, mem_g, pos)
        ctx.save_for_backward(x1, x2)
        entered = [t.detach() for t in inputs]  # what entered each block, for the memory
        ctx.mark_non_differentiable(*entered)
        return (x1, x2, *entered)

    @staticmethod
    def backward(ctx: Any, dy1: Tensor, dy2: Tensor, *unused: Tensor) -> tuple[Any, ...]:
        y1, y2 = ctx.saved_tensors
        blocks, mems, pos, states = ctx.blocks, ctx.mems, ctx.pos, ctx.states
        for i in reversed(range(0, len(blocks), 2)):
            f, g = blocks[i], blocks[i + 1]
            with torch.enable_grad():
                y1 = y1.detach().requires_grad_()
                g_y1 = states[i + 1].replay(g, y1, mems[i + 1], pos)
                torch.autograd.backward(g_y1, dy2)  # parameter gradients of G accumulate here
            with torch.no_grad():
                x2 = y2 - g_y1
                dy1 = dy1 + y1.grad
            with torch.enable_grad():
                x2 = x2.detach().requires_grad_()
                f_x2 = states[i].replay(f, x2, mems[i], pos)
                torch.autograd.backward(f_x2, dy1)
            with torch.no_grad():
                x1 = y1 - f_x2
                dy2 = dy2 + x2.grad
            y1, y2 = x1.detach(), x2.detach()
        return (dy1, dy2, None, None, None, *([None] * (len(ctx.needs_input_grad) - 5)))


def reversible_stack(blocks: Sequence[nn.Module], h: Tensor, mems: Sequence[Tensor], pos: Tensor, *,
                     recompute: bool = True) -> tuple[Tensor, list[Tensor]]:
    """The reversible body: h (B, L, D) -> ((y1 + y2) / 2, what entered each block). ``recompute=False`` runs the
    same computation under ordinary autograd (the reference the recomputation must match)."""
    blocks, mems = list(blocks), list(mems)
    if not recompute:
        x1, x2, entered = h, h, []
        for f, g, mem_f, mem_g in zip(blocks[::2], blocks[1::2], mems[::2], mems[1::2]):
            entered.append(x2.detach())
            x1 = x1 + _residual(f, x2, mem_f, pos)
            entered.append(x1.detach())
            x2 = x2 + _residual(g, x1, mem_g, pos)
        return (x1 + x2) / 2, entered
    params = [p for b in blocks for p in b.parameters() if p.requires_grad]
    y1, y2, *entered = _ReversibleStack.apply(h, h, blocks, mems, pos, *params)
    return (y1 + y2) / 2, entered

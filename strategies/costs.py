"""What a block costs, for the compute penalty and the Pareto plot.

NNI's FLOPs profiler cannot see through ``nn.Embedding``, custom attention or an
``nn.Identity`` candidate (NNI_NOTES.md, trap 8), so costs are counted here:
either forward FLOPs per token from the shapes (deterministic, the default), or
the measured time of a forward and backward pass of one block on the device in
use (what a user actually pays, but noisy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from parnas import kinds
from parnas.blocks import make_block, sinusoid
from parnas.config import ModelConfig


def flops_per_token(kind: str, cfg: ModelConfig, seg_len: int, batch_size: int) -> float:
    """Forward FLOPs per predicted token of one block (multiply-add = 2 FLOPs).

    Built-in kinds are counted from their shapes; a registered kind uses its own ``flops``
    formula, or else 2 FLOPs per parameter (the position-wise estimate of Kaplan et al. 2020).
    """
    D, L = cfg.d_model, seg_len
    if kind in ("attention", "compressive", "shared"):
        K = cfg.mem_len + seg_len + (cfg.compress_len if kind == "compressive" else 0)  # keys attended
        projections = 2 * D * D * (1 + 2 * K / L + 1)  # q on L positions, k and v on K, output
        positions = 2 * D * D * K / (L * batch_size)  # W_r on the K distances, shared by the batch
        scores = 3 * 2 * K * D  # content, position, weighted sum of values
        if kind == "compressive":  # f_c on the L states a segment evicts, in groups of c
            projections += 2 * D * D if cfg.compress_fn == "conv" else D
        if kind == "shared":  # a whole layer: attention then the transition feed-forward
            projections += 2 * 2 * D * cfg.d_ff
        return projections + positions + scores
    if kind in ("dense", "sqrelu"):
        return 2 * 2 * D * cfg.d_ff
    if kind == "glu":
        return 2 * 3 * D * (2 * cfg.d_ff // 3)
    if kind == "conv":  # D->2D, GLU (recomputed on k-1 past states per segment), depthwise k, D->D
        return 2 * 2 * D * D * (L + cfg.conv_kernel - 1) / L + 2 * cfg.conv_kernel * D + 2 * D * D
    if kind == "identity":
        return 0.0
    registered = kinds.get(kind)
    if registered.flops is not None:
        return float(registered.flops(cfg, seg_len, batch_size))
    return 2.0 * sum(p.numel() for p in make_block(kind, cfg).parameters())


def flops_costs(kinds: Sequence[str], cfg: ModelConfig, seg_len: int, batch_size: int) -> dict[str, float]:
    """MFLOP per token for each kind."""
    return {k: flops_per_token(k, cfg, seg_len, batch_size) / 1e6 for k in kinds}


def steady_memory(block: torch.nn.Module, h: Tensor, mem: Tensor, mem_len: int) -> list[tuple[torch.nn.Module, list]]:
    """For modules in ``block`` that keep their own memory (``n_memories``, e.g. compressive), the memory
    they hold once it stops growing on segments like ``h``: what a timing must give them to be fair."""
    out = []
    for keeper in (m for m in block.modules() if hasattr(m, "n_memories")):
        kept, most, still = [mem[:, :0]] * keeper.n_memories, [0] * keeper.n_memories, 0
        while still < 3:  # until no memory has grown for 3 segments (the compressed one is full)
            with torch.no_grad():
                kept = keeper.update_memory(kept, mem, h.detach(), mem_len)
            sizes = [max(m, k.size(1)) for m, k in zip(most, kept)]
            still, most = (still + 1 if sizes == most else 0), sizes
        out.append((keeper, kept))
    return out


def measured_costs(kinds: Sequence[str], cfg: ModelConfig, seg_len: int, batch_size: int,
                   device: torch.device | str = "cpu", repeats: int = 10) -> dict[str, float]:
    """Median milliseconds of one block's forward + backward on a (B, L) segment with a full memory
    (a block keeping its own memory gets it full too, and its update and auxiliary loss are timed)."""
    B, L, M, D = batch_size, seg_len, cfg.mem_len, cfg.d_model
    h = torch.randn(B, L, D, device=device, requires_grad=True)
    mem, pos = torch.randn(B, M, D, device=device), sinusoid(M + L, D, torch.device(device))
    costs = {}
    for kind in kinds:
        block = make_block(kind, cfg).to(device)
        keepers = steady_memory(block, h, mem, M)
        times = []
        for i in range(repeats + 3):
            if torch.cuda.is_available() and torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            aux = []
            for keeper, kept in keepers:
                keeper.update_memory(kept, mem, h, M)
                keeper.memory = kept
                aux += [] if keeper.aux_loss is None else [keeper.aux_loss]
            out = block(h, mem, pos)
            if out.requires_grad:
                (out.sum() + sum(aux)).backward()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:  # warm-up
                times.append((time.perf_counter() - start) * 1e3)
        costs[kind] = statistics.median(times)
    return costs

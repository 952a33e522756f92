"""Training throughput of the fixed model at the reference configuration.

Times full optimiser steps (forward, backward, clipping, Adam) with the memory
carried, on Zipf-distributed token ids (adaptive softmax cost depends on how
often the tail clusters are hit, so uniform ids would be unrealistically slow).
Prints train tokens/s and peak RSS for each layout.

    python benchmarks/train_step.py                 # both reference layouts
    python benchmarks/train_step.py --steps 50 --set model.d_model=256
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch

from parnas.config import load_config
from parnas.model import build_fixed_model

LAYOUTS = {
    "par-alternating (6 blocks: A D A D A D)": ["attention", "dense"] * 3,
    "transformer-xl (6 layers = 12 blocks: A D x 6)": ["attention", "dense"] * 6,
}


def zipf_ids(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    rank = np.arange(1, vocab_size + 1)
    p = 1.0 / rank
    return torch.from_numpy(np.random.default_rng(seed).choice(vocab_size, size=n, p=p / p.sum()))


def time_steps(model: torch.nn.Module, params: list[list[torch.nn.Parameter]], cfg, vocab_size: int,
               steps: int, warmup: int) -> float:
    """Seconds per optimiser step: forward, backward, clipping of ``params[0]``, one Adam per parameter list."""
    optimizers = [torch.optim.Adam(p, lr=cfg.train.lr, foreach=True) for p in params]
    B, L = cfg.data.batch_size, cfg.data.seg_len
    stream = zipf_ids(B * L * (steps + warmup) + 1, vocab_size)
    mems, start = None, 0.0
    for step in range(steps + warmup):
        if step == warmup:
            start = time.perf_counter()
        t = step * B * L
        x, y = stream[t:t + B * L].view(B, L), stream[t + 1:t + B * L + 1].view(B, L)
        h, mems = model(x, mems)
        loss = model.nll(h, y).mean()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params[0], cfg.train.clip)
        for opt in optimizers:
            opt.step()
    return (time.perf_counter() - start) / steps


def bench(layout: list[str], cfg, vocab_size: int, steps: int, warmup: int) -> float:
    """Train tokens/s of the fixed model with ``layout``."""
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, vocab_size, layout).train()
    seconds = time_steps(model, [list(model.parameters())], cfg, vocab_size, steps, warmup)
    return cfg.data.batch_size * cfg.data.seg_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="wt2-seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--vocab-size", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {cfg.data.batch_size} x "
          f"segment {cfg.data.seg_len}, memory {cfg.model.mem_len}, d_model {cfg.model.d_model}, "
          f"heads {cfg.model.n_heads}, d_ff {cfg.model.d_ff}, vocab {args.vocab_size}, "
          f"cutoffs {list(cfg.model.cutoffs)}")
    for name, layout in LAYOUTS.items():
        tps = bench(layout, cfg, args.vocab_size, args.steps, args.warmup)
        print(f"{name:48s} {tps:9,.0f} train tokens/s")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak_mib:,.0f} MiB")


if __name__ == "__main__":
    main()

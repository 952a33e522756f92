"""Cost of a search step against a step of the fixed standard Transformer-XL, same width.

The supernet runs every candidate of every block (attention, dense, identity),
weights them by Gumbel-softmax samples, and steps both the weights and the
logits (joint mode); the baseline is the standard Transformer-XL, 6 layers of
attention then dense (12 blocks). Both carry their memory, on Zipf token ids.

    python benchmarks/search_step.py            # the wt2-seed configuration
"""

from __future__ import annotations

import argparse

import torch
from train_step import time_steps

from parnas.config import load_config
from parnas.nn.model import build_fixed_model
from search_spaces import PARTransformerXLSpace
from strategies.gumbel_darts import PARGumbelDARTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="wt2-seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--vocab-size", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    torch.manual_seed(0)

    strategy = PARGumbelDARTS(cfg.search, max_steps=1)
    supernet = strategy.mutate_model(PARTransformerXLSpace(cfg.model, args.vocab_size, cfg.search.candidates)).train()
    alphas = [p for name, p in supernet.named_parameters() if name.endswith("_arch_alpha")]
    weights = [p for name, p in supernet.named_parameters() if not name.endswith("_arch_alpha")]
    search = time_steps(supernet, [weights, alphas], cfg, args.vocab_size, args.steps, args.warmup)

    layout = ["attention", "dense"] * cfg.model.n_blocks
    fixed = build_fixed_model(cfg.model, args.vocab_size, layout).train()
    baseline = time_steps(fixed, [list(fixed.parameters())], cfg, args.vocab_size, args.steps, args.warmup)

    n = cfg.model.n_blocks
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {cfg.data.batch_size} x "
          f"{cfg.data.seg_len}, memory {cfg.model.mem_len}, d_model {cfg.model.d_model}, vocab {args.vocab_size}")
    print(f"search step, {n} blocks x {list(cfg.search.candidates)}: {search * 1e3:8.1f} ms")
    print(f"fixed Transformer-XL, {n} x (attention + dense):{'':7s}{baseline * 1e3:8.1f} ms")
    print(f"ratio search / fixed: {search / baseline:.2f}")


if __name__ == "__main__":
    main()

"""How well the latency table predicts a whole model's step time.

Times (or reads from the cache) the table at the config's shapes, then measures
random layouts' whole training steps (and inference steps) side by side in
alternating rounds and prints predicted against measured, with the mean and
max relative error.

    python benchmarks/latency_model.py --config wt2-par
    python benchmarks/latency_model.py --config wt2-par --layouts 12 --refresh   # time the table again
"""

from __future__ import annotations

import random
import statistics

import torch
from model_args import model_parser

from parnas.architecture import layout_string
from parnas.config import load_config, transformer_xl_layout
from parnas.training.latency import time_layouts
from parnas.training.latency_cache import latency_table


def main() -> None:
    parser = model_parser(__doc__, "wt2-par")
    parser.add_argument("--layouts", type=int, default=8, help="random layouts to check (default 8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--refresh", action="store_true", help="time the table again instead of reading the cache")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    kinds = list(dict.fromkeys([*cfg.search.candidates, "attention", "dense", "identity"]))
    table, cached = latency_table(cfg, args.vocab_size, kinds, refresh=args.refresh)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {table.key['device']}; batch "
          f"{cfg.data.batch_size} x segment {cfg.data.seg_len}, memory {cfg.model.mem_len}, d_model "
          f"{cfg.model.d_model}, {cfg.model.n_blocks} blocks; table {'from the cache' if cached else 'timed now'}")
    for mode in ("train", "inference"):
        costs = "  ".join(f"{k} {table.block_ms(k, mode):.2f}" for k in kinds)
        print(f"{mode:9s} constant {table.constant_ms[mode]:.2f} ms; per block: {costs}")
    rng = random.Random(args.seed)
    n = cfg.model.n_blocks
    layouts = [transformer_xl_layout(n)] + [[rng.choice(kinds) for _ in range(n)] for _ in range(args.layouts)]
    for mode in ("train", "inference"):
        measured = time_layouts(layouts, cfg, args.vocab_size, mode=mode, rounds=args.rounds)
        errors = []
        print(f"\n{mode}: layout, predicted ms, measured ms, error")
        for layout, ms in zip(layouts, measured):
            predicted = table.predict(layout, mode)
            errors.append(abs(predicted - ms) / ms)
            print(f"  {layout_string(layout)}  {predicted:8.2f}  {ms:8.2f}  {100 * (predicted - ms) / ms:+6.1f}%")
        print(f"{mode}: mean relative error {100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}% "
              f"over {len(layouts)} layouts")


if __name__ == "__main__":
    main()

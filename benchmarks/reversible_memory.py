"""Training memory against depth, ordinary residuals vs reversible pairs (``model.reversible``).

    python benchmarks/reversible_memory.py                         # wt2-seed widths, 4 to 32 blocks
    python benchmarks/reversible_memory.py --config wt2-par --set data.batch_size=16

For each depth both models take one training step (forward, loss, backward) on the same tokens. Reported:
the bytes autograd keeps for backward (saved tensors, counted on any device: the activation memory that
grows with depth) and, on CUDA, the step's peak allocated memory above the model's weights; and the step
time, for the recomputation's price.
"""

from __future__ import annotations

import sys
import time

import torch
from model_args import model_parser

from parnas.config import load_config
from parnas.nn.model import build_fixed_model


def main(argv: list[str] | None = None) -> int:
    parser = model_parser(__doc__, "wt2-seed")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(args.config, args.set)
    B, L = cfg.data.batch_size, cfg.data.seg_len
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}; torch {torch.__version__}; {args.config}: d_model {cfg.model.d_model}, batch {B} x {L}, "
          f"memory {cfg.model.mem_len}, vocabulary {args.vocab_size}; one training step, memory full")
    x = torch.randint(0, args.vocab_size, (B, L), device=device)
    for n in args.depths:
        line = []
        for reversible in (False, True):
            model_cfg = load_config(args.config, [*args.set, f"model.n_blocks={n}",
                                                  f"model.reversible={str(reversible).lower()}"]).model
            torch.manual_seed(0)
            model = build_fixed_model(model_cfg, args.vocab_size).to(device).train()
            with torch.no_grad():
                _, mems = model(x)
            kept = 0

            def pack(t: torch.Tensor) -> torch.Tensor:
                nonlocal kept
                kept += t.numel() * t.element_size()
                return t

            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h, _ = model(x, mems)
                loss = model.nll(h, x).mean()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            peak = f", peak {(torch.cuda.max_memory_allocated() - base) / 2**20:,.0f} MiB" \
                if device.type == "cuda" else ""
            line.append(f"{'reversible' if reversible else 'ordinary'} keeps {kept / 2**20:,.1f} MiB{peak}, "
                        f"{ms:,.0f} ms")
            del model, mems, h, loss
        print(f"  {n:3d} blocks: " + "; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())

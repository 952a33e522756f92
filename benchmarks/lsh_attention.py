"""Forward + backward time and memory of one ``lsh`` block against one ``attention`` block, as the segment grows.

    python benchmarks/lsh_attention.py                       # L = 512, 2048, 8192; memory 0 and L
    python benchmarks/lsh_attention.py --lengths 512 2048 --rounds 3

For each segment length L and memory M (0 and L), both blocks take the same (B, L, D) input and (B, M, D)
memory, in alternating rounds (median over rounds), forward and backward. Memory is reported two ways: the
bytes autograd keeps for the backward pass (saved tensors, counted on any device), and on CUDA the peak
allocated during the step. A length whose attention scores would not fit (``--max-gib``) is skipped and
said so. LSH settings: ``--buckets`` (default 2L/chunk, as Reformer sizes them), ``--hashes``, ``--chunk``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from parnas.nn.blocks import AttentionBlock
from parnas.nn.lsh import LSHAttentionBlock


def saved_bytes(step) -> int:
    """Bytes of the tensors autograd saves for backward during ``step()`` (forward only)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return total, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--buckets", type=int, default=None)
    parser.add_argument("--hashes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=8.0, help="skip a full attention whose scores exceed this")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B, D, H = args.batch, args.d_model, args.heads
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}; torch {torch.__version__}; batch {B}, d_model {D}, {H} heads; lsh: chunk {args.chunk}, "
          f"{args.hashes} hash rounds; median of {args.rounds} alternating rounds, forward + backward")
    for L in args.lengths:
        for M in (0, L):
            K = M + L
            buckets = args.buckets or max(2, 2 * K // args.chunk)
            blocks = {"attention": AttentionBlock(D, H, 0.0, 0.0),
                      "lsh": LSHAttentionBlock(D, H, 0.0, 0.0, buckets, args.hashes, args.chunk)}
            h = torch.randn(B, L, D, device=device, requires_grad=True)
            mem, pos = torch.randn(B, M, D, device=device), torch.randn(K, D, device=device)
            scores_gib = 4 * B * H * L * K * 3 / 2**30  # scores, weights and their gradient, float32
            if scores_gib > args.max_gib:
                del blocks["attention"]
                print(f"  L {L} M {M}: attention skipped (its scores need about {scores_gib:.1f} GiB)")
            for block in blocks.values():
                block.to(device)
            times = {name: [] for name in blocks}
            kept = {}
            peak = {}
            for r in range(args.rounds + 1):  # the first round warms up
                for name in (list(blocks) if r % 2 else list(blocks)[::-1]):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    kept[name], out = saved_bytes(lambda b=blocks[name], x=(h, mem, pos): b(*x))
                    out.sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        peak[name] = torch.cuda.max_memory_allocated() / 2**20
                    if r:
                        times[name].append((time.perf_counter() - start) * 1e3)
            line = []
            for name in blocks:
                cuda = f", peak {peak[name]:,.0f} MiB" if name in peak else ""
                line.append(f"{name} {statistics.median(times[name]):,.1f} ms, keeps {kept[name] / 2**20:,.1f} MiB"
                            f"{cuda}")
            ratio = ""
            if "attention" in blocks:
                speedup = statistics.median(times["lsh"]) / statistics.median(times["attention"])
                ratio = f"; lsh / attention time {speedup:.2f}"
            print(f"  L {L} M {M} (buckets {buckets}): " + "; ".join(line) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())

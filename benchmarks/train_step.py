"""Training throughput of the fixed model, side by side with its previous path and Dai et al.'s code.

Times full optimiser steps (forward, backward, clipping, Adam) with the memory
carried, on one Zipf-distributed token stream (adaptive softmax cost depends on
how often the tail clusters are hit, so uniform ids would be unrealistically
slow). Every implementation is built once; each round then runs ``--steps``
steps of each, in an order that rotates from round to round, so a busy machine
slows all of them alike. Prints each one's median tokens/s over the rounds and
the median over rounds of the same-round ratios.

Implementations:
  parnas            the library as it is
  previous          the same model through the path it replaced: torch's dropout, the
                    concatenating rel-shift and fresh causal mask with SDPA, memory by
                    concatenation, nn.AdaptiveLogSoftmaxWithLoss's forward (or, part
                    "clusters", the head's own with a nonzero per tail cluster), identity
                    blocks called, per-tensor Adam
  previous <part>   (--ablate) parnas with only <part> on its previous path: the ratio
                    parnas / this is what the change of <part> bought
  reference         (--peer-dir) Dai et al.'s MemTransformerLM, imported from a local checkout
                    of the pytorch/ folder of github.com/kimiyoung/transformer-xl, at the same
                    configuration (weights tied as model.tie_weights says: not with an adaptive
                    softmax), with its train.py's plain Adam and clipping

    python benchmarks/train_step.py                                  # parnas vs previous
    python benchmarks/train_step.py --peer-dir /tmp/txl-ref/pytorch  # + Dai et al.
    python benchmarks/train_step.py --ablate --rounds 7              # what each change bought
    python benchmarks/train_step.py --blocks ADADAD                  # another layout
    python benchmarks/train_step.py --variant 'model.adaptive_input=true;model.tie_weights=true'  # + a variant
"""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from model_args import model_parser
from step_profile import phase
from torch import Tensor, nn

from parnas.architecture import layout_string
from parnas.config import load_config
from parnas.data.corpora import ContextBatches
from parnas.nn.blocks import AttentionBlock, Dropout, ReLUDropout
from parnas.nn.model import TransformerXL, build_fixed_model
from parnas.training.data_module import most_targets_per_cluster
from parnas.training.task import adam

KINDS = {"A": "attention", "D": "dense", "I": "identity"}


def zipf_ids(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    rank = np.arange(1, vocab_size + 1)
    p = 1.0 / rank
    return torch.from_numpy(np.random.default_rng(seed).choice(vocab_size, size=n, p=p / p.sum()))


def training_step(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                  clipped: list[torch.nn.Parameter], clip: float,
                  context: Callable[[], Any] = contextlib.nullcontext) -> Callable[[Tensor], None]:
    """``step(tokens, groups=None)``: one optimiser step on a (B, L+1) segment, the memory carried from the last
    call: forward and loss inside ``context()`` (autocast, say), backward, clipping of ``clipped``, every
    optimiser. ``groups``: the targets' groups made on the host, as the training loop makes them (else the
    adaptive softmax groups them itself and reads their sizes back)."""
    mems = None

    def step(tokens: Tensor, groups: Any = None) -> None:
        nonlocal mems
        with context():
            with phase("forward"):
                h, mems = model(tokens[:, :-1], mems)
            with phase("loss"):
                loss = model.nll(h, tokens[:, 1:], groups).float().mean()
        descend(loss, optimizers, clipped, clip)
    return step


def descend(loss: Tensor, optimizers: Sequence[torch.optim.Optimizer], clipped: list[torch.nn.Parameter],
            clip: float) -> None:
    """The end of every timed step: gradients cleared, ``loss`` backward, ``clipped`` clipped, every optimiser."""
    with phase("backward"):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with phase("clip"):
        torch.nn.utils.clip_grad_norm_(clipped, clip)
    with phase("optimizer"):
        for optimizer in optimizers:
            optimizer.step()


def alternating_rounds(run: Callable[[str, int], float], names: Sequence[str], rounds: int, steps: int,
                       warmup: int) -> dict[str, list[float]]:
    """``run(name, n)`` takes n steps of implementation ``name`` and returns a figure (e.g. tokens/s). Every
    implementation first takes ``warmup`` untimed steps; then each round runs ``steps`` steps of each, the
    order rotating by one from round to round, so a machine that slows down slows all of them alike.
    Returns each implementation's figure per round."""
    names = list(names)
    for name in names:
        run(name, warmup)
    figures: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            figures[name].append(run(name, steps))
    return figures


def segment_runner(steps: Mapping[str, Callable[..., None]], stream: Tensor, seg_len: int,
                   grouping: Mapping[str, Callable[[Tensor], Any]] | None = None) -> Callable[[str, int], float]:
    """``run(name, n)`` for :func:`alternating_rounds`: n calls of ``steps[name]``, each on that step's next
    (B, L+1) segment of ``stream`` (B streams, read segment by segment); returns tokens/s. ``grouping[name]``,
    where given, groups each segment's targets for the step (on the host, in the timed loop, as the data module
    does); else the step's loss groups them."""
    position = dict.fromkeys(steps, 0)

    def run(name: str, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            t = position[name]
            segment = stream[:, t:t + seg_len + 1]
            if grouping is None:
                steps[name](segment)
            else:
                steps[name](segment, grouping[name](segment[:, 1:]))
            position[name] = t + seg_len
        return n * stream.size(0) * seg_len / (time.perf_counter() - start)
    return run


def fit_capacity(model: torch.nn.Module, stream: Tensor, seg_len: int) -> None:
    """A compiled model's target capacities (``model.target_capacity``, where it has them) fitted to every segment
    of ``stream`` (B streams on the host), as the data module fits them before a run: no timed step grows them,
    which would compile the loss again inside a timed round."""
    capacity = getattr(model, "target_capacity", None)
    if capacity is not None:
        segments = ContextBatches(stream.reshape(-1).numpy(), stream.size(0), seg_len)  # the same B streams
        capacity.hold(most_targets_per_cluster(segments, model.cfg.cutoffs))


def host_grouping(model: torch.nn.Module) -> Callable[[Tensor], Any]:
    """A segment's targets grouped on the host, as the data module groups a training batch (a compiled model's
    tail clusters padded to its capacities, so that its loss is compiled too). ``model`` may wrap the supernet
    (``.supernet``)."""
    net = getattr(model, "supernet", model)
    return partial(net.group_targets, capacity=net.target_capacity)


def ratio_line(a: str, b: str, figures: dict[str, list[float]], label: str = "") -> str:
    """The median over rounds of ``a``'s figure over ``b``'s in the same round, and their range."""
    same_round = [x / y for x, y in zip(figures[a], figures[b])]
    return (f"{label or f'ratio {a} / {b}'}: {statistics.median(same_round):.2f}x "
            f"(median of same-round ratios; range {min(same_round):.2f}-{max(same_round):.2f})")


# --- parnas's previous path, part by part (the library's code before it was replaced) -------------

def _old_rel_shift(x: Tensor) -> Tensor:
    *batch, L, K = x.shape
    x = F.pad(x, (1, 0))  # (..., L, K+1)
    x = x.view(*batch, K + 1, L)[..., 1:, :]  # (..., K, L)
    return x.reshape(*batch, L, K)


def _old_attention(self: AttentionBlock, h: Tensor, mem: Tensor, pos: Tensor) -> Tensor:
    B, L, D = h.shape
    M, H, Dh = mem.size(1), self.n_heads, self.d_head
    K = M + L
    c = torch.cat([mem, h], dim=1)  # (B, K, D)
    q = F.linear(c[:, M:], self.q_weight).view(B, L, H, Dh).transpose(1, 2)  # (B, H, L, Dh)
    k, v = F.linear(c, self.kv_weight).view(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # 2 x (B, H, K, Dh)
    r = self.r(pos).view(K, H, Dh).permute(1, 2, 0)  # (H, Dh, K)
    scale = 1.0 / math.sqrt(Dh)
    position = _old_rel_shift((q + self.v[:, None]) @ r)  # (B, H, L, K)
    future = torch.ones(L, K, dtype=torch.bool, device=h.device).triu_(M + 1)  # (L, K)
    bias = (position * scale).masked_fill_(future, float("-inf"))  # (B, H, L, K)
    a = F.scaled_dot_product_attention(q + self.u[:, None], k, v, attn_mask=bias,
                                       dropout_p=self.dropatt if self.training else 0.0, scale=scale)
    a = self.out(a.transpose(1, 2).reshape(B, L, D))  # (B, L, D)
    return self.norm(h + self.drop(a))


def _old_dropout(self: nn.Dropout, x: Tensor) -> Tensor:
    return F.dropout(x, self.p, self.training)


def _old_relu_dropout(self: nn.Dropout, x: Tensor) -> Tensor:
    return F.dropout(F.relu(x), self.p, self.training)


def _old_update(self: TransformerXL, mem: Tensor, h: Tensor) -> Tensor:
    both = torch.cat([mem, h], dim=1)  # (B, M+L, D)
    return both[:, max(0, both.size(1) - self.mem_len):].detach()


def _old_nll(self: nn.Module, h: Tensor, y: Tensor, groups: Any = None) -> Tensor:  # groups: the old path has none
    flat_h, flat_y = h.reshape(-1, h.size(-1)), y.reshape(-1)
    return -self.adaptive(flat_h, flat_y).output.view(y.shape)


def _old_adaptive_nll(self: nn.Module, h: Tensor, y: Tensor, groups: Any = None, multiple: int = 1) -> Tensor:
    """The head's own NLL as it was: a ``nonzero`` (a host sync) per tail cluster (``groups`` and ``multiple``
    unused: its logits unpadded)."""
    from parnas.nn.model import _TargetNLL

    asm = self.adaptive
    head_target = y.clone()
    nll = h.new_zeros(y.shape, dtype=torch.float32)
    for i, (low, high) in enumerate(zip(asm.cutoffs, asm.cutoffs[1:])):
        rows = ((y >= low) & (y < high)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        head_target.index_fill_(0, rows, asm.shortlist_size + i)
        logits = asm.tail[i](h.index_select(0, rows))
        nll = nll.index_add(0, rows, _TargetNLL.apply(logits, y.index_select(0, rows) - low))
    return nll + _TargetNLL.apply(asm.head(h), head_target)


def _patch(modules: list[nn.Module], name: str, fn: Callable) -> None:
    for m in modules:
        setattr(m, name, types.MethodType(fn, m))


def use_previous(model: TransformerXL, part: str) -> None:
    """Put ``part`` of ``model`` back on its previous path (adam is chosen in :func:`parnas_step`)."""
    mods = list(model.modules())
    if part == "dropout":
        _patch([m for m in mods if type(m) is Dropout], "forward", _old_dropout)
        _patch([m for m in mods if type(m) is ReLUDropout], "forward", _old_relu_dropout)
    elif part == "attention":
        _patch([m for m in mods if isinstance(m, AttentionBlock)], "forward", _old_attention)
    elif part == "memory":
        _patch([model], "_update", _old_update)
    elif part == "head":
        if hasattr(model.head, "adaptive"):
            _patch([model.head], "nll", _old_nll)
    elif part == "clusters":
        if hasattr(model.head, "adaptive"):
            _patch([model.head], "_adaptive_nll", _old_adaptive_nll)
    elif part == "identity":
        model._skipped = [False] * len(model.blocks)  # identity blocks called


PARTS = ("dropout", "attention", "memory", "head", "clusters", "identity", "adam")


def parnas_step(cfg, vocab_size: int, layout: list[str], previous: tuple[str, ...]) -> Callable[[Tensor], None]:
    """One training step of the fixed model, ``previous`` parts on their old paths."""
    torch.manual_seed(0)
    model = build_fixed_model(cfg.model, vocab_size, layout).train()
    for part in previous:
        use_previous(model, part)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.train.lr) if "adam" in previous else adam(params, lr=cfg.train.lr)
    return training_step(model, [optimizer], params, cfg.train.clip)


# --- Dai et al.'s reference, imported from a local checkout --------------------------------------

def reference_step(peer_dir: Path, cfg, vocab_size: int, n_layer: int) -> Callable[[Tensor], None]:
    """A training step of Dai et al.'s MemTransformerLM as its train.py takes it (adaptive softmax,
    and its adaptive input with the same div_value; plain Adam; clip), time-major (L, B)."""
    model = reference_model(peer_dir, cfg, vocab_size, n_layer)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    mems: tuple = ()

    def step(tokens: Tensor) -> None:  # tokens (B, L+1)
        nonlocal mems
        data, target = tokens[:, :-1].t().contiguous(), tokens[:, 1:].t().contiguous()  # (L, B)
        model.zero_grad()
        ret = model(data, target, *mems)
        loss, mems = ret[0], tuple(ret[1:])
        loss.float().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
        optimizer.step()
    return step


def reference_model(peer_dir: Path, cfg, vocab_size: int, n_layer: int) -> torch.nn.Module:
    """Dai et al.'s MemTransformerLM at ``cfg``'s configuration, initialised as its train.py does, in training."""
    if str(peer_dir) not in sys.path:
        sys.path[:0] = [str(peer_dir), str(peer_dir / "utils")]
    if torch.version.cuda is None:  # read at import for a branch the file has commented out
        torch.version.cuda = "0.0"
        from mem_transformer import MemTransformerLM
        torch.version.cuda = None
    else:
        from mem_transformer import MemTransformerLM
    m = cfg.model
    torch.manual_seed(0)
    model = MemTransformerLM(vocab_size, n_layer, m.n_heads, m.d_model, m.d_model // m.n_heads, m.d_ff,
                             m.dropout, m.dropatt, tie_weight=m.tie_weights, d_embed=m.d_model,
                             div_val=int(m.div_value), tie_projs=[False] + [m.tie_weights] * len(m.cutoffs),
                             pre_lnorm=False,
                             tgt_len=cfg.data.seg_len, ext_len=0, mem_len=m.mem_len, cutoffs=list(m.cutoffs),
                             same_length=False, attn_type=0, clamp_len=-1, sample_softmax=-1).train()
    for name, p in model.named_parameters():  # its train.py initialises; several are torch.Tensor(...) garbage
        with torch.no_grad():
            if "layer_norm.weight" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    for layer in model.layers:  # it builds uint8 masks, which masked_fill no longer takes
        attn = layer.dec_attn
        attn.forward = types.MethodType(
            lambda self, w, r, rw, rr, attn_mask=None, mems=None, inner=attn.forward:
            inner(w, r, rw, rr, attn_mask=None if attn_mask is None else attn_mask.bool(), mems=mems), attn)
    return model


def main() -> None:
    parser = model_parser(__doc__, "wt2-seed")
    parser.add_argument("--blocks", default="", help="letter code, e.g. ADADAD (default: the standard "
                        "Transformer-XL, attention and dense alternating, 12 blocks)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-dir", type=Path, help="local checkout of transformer-xl's pytorch/ folder")
    parser.add_argument("--ablate", action="store_true", help="also time parnas with one part on its previous path")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                        help="also time parnas with these settings added (repeatable), e.g. "
                             "'model.adaptive_input=true;model.tie_weights=true'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.set)
    layout = [KINDS[c] for c in args.blocks.upper()] or ["attention", "dense"] * 6
    B, L = cfg.data.batch_size, cfg.data.seg_len

    steps: dict[str, Callable[[Tensor], None]] = {
        "parnas": parnas_step(cfg, args.vocab_size, layout, ()),
        "previous": parnas_step(cfg, args.vocab_size, layout, PARTS),
    }
    if args.ablate:
        steps.update({f"previous {p}": parnas_step(cfg, args.vocab_size, layout, (p,)) for p in PARTS})
    for variant in args.variant:
        steps[f"parnas {variant}"] = parnas_step(load_config(args.config, [*args.set, *variant.split(";")]),
                                                 args.vocab_size, layout, ())
    if args.peer_dir:
        if layout != ["attention", "dense"] * (len(layout) // 2):
            parser.error("--peer-dir compares the standard layout only (attention, dense, ...): drop --blocks")
        steps["reference"] = reference_step(args.peer_dir, cfg, args.vocab_size, len(layout) // 2)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {layout_string(layout)} "
          f"({len(layout)} blocks), batch {B} x segment {L}, memory {cfg.model.mem_len}, d_model {cfg.model.d_model}, "
          f"heads {cfg.model.n_heads}, d_ff {cfg.model.d_ff}, dropout {cfg.model.dropout}, vocab {args.vocab_size}, "
          f"cutoffs {list(cfg.model.cutoffs)} div {cfg.model.div_value:g}")
    print(f"{args.rounds} rounds x {args.steps} steps per implementation (after {args.warmup} warm-up steps), "
          f"order rotating")
    names = list(steps)
    n_tokens = B * (L * (args.warmup + args.rounds * args.steps) + 1)
    stream = zipf_ids(n_tokens, args.vocab_size).view(B, -1)  # B streams, read segment by segment
    tps = alternating_rounds(segment_runner(steps, stream, L), names, args.rounds, args.steps, args.warmup)
    for name in names:
        rounds = ", ".join(f"{t:,.0f}" for t in tps[name])
        print(f"{name:20s} {statistics.median(tps[name]):9,.0f} train tokens/s   (rounds: {rounds})")
    if "reference" in steps:
        print(ratio_line("parnas", "reference", tps))
    for name in names:
        if name.startswith(("previous", "parnas ")):
            print(ratio_line("parnas", name, tps))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(f"peak RSS {peak_mib:,.0f} MiB (the whole process, every implementation)")


if __name__ == "__main__":
    main()

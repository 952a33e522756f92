"""A training step on a GPU: tokens/s, step time, peak memory and MFU, for a fixed Transformer-XL and for
the supernet (the search's training step), at named shapes.

    python benchmarks/gpu_step.py                                      # every shape, bf16-mixed
    python benchmarks/gpu_step.py --shape wt103-base --precision tf32  # one shape, fp32 weights, TF32 matmuls
    python benchmarks/gpu_step.py --shape long --peak-tflops 989.4     # MFU against a peak you give
    python benchmarks/gpu_step.py --shape wt103-base --compile default  # + Transformer-XL under torch.compile
    python benchmarks/gpu_step.py --shape wt2-par --layout AIAIIIAIIDDD --layout ADADAD  # + fixed layouts
    python benchmarks/gpu_step.py --shape wt103-base --groups-on-device  # + the loss grouping its own targets
    python benchmarks/gpu_step.py --shape wt103-base --unpadded-heads    # + heads of 41 as they are
    python benchmarks/gpu_step.py --shape wt103-base --flex              # + attention by FlexAttention
    python benchmarks/gpu_step.py --shape wt2-par --sampled              # + the supernet running one pick a block
    python benchmarks/gpu_step.py --shape wt103-base --tf32              # + the Transformer-XL in TF32, beside bf16
    python benchmarks/gpu_step.py --shape wt2-par --layout AIAIIIAIIDDD --twin  # + AAADDD: its identities dropped

Each step is what training takes: forward with the memory carried, the adaptive (or full) softmax loss,
backward, clipping, Adam (parnas's: fused unless fp16's gradient scaler is in use), on a Zipf token stream
(how often the tail clusters are hit decides their cost), the targets grouped by cluster on the host each step
and moved with it, as the data module does (``--groups-on-device`` adds a Transformer-XL whose loss groups
them on the device and reads their sizes back, the one host sync a step this replaced; ``--unpadded-heads``
one whose heads reach SDPA unpadded, where their size is not a multiple of 8, as before they were padded for
its fused kernels; ``--flex`` one with ``model.attention_kernel=flex``, the position scores added inside a
FlexAttention kernel instead of passed to SDPA as a bias, eager and, with ``--compile``, compiled; ``--tf32``
one in fp32 with TF32 matmuls, eager, beside the bf16 ones in the same rounds, its MFU against the TF32 peak).
The supernet's step is the search's, joint mode: every block runs all its candidates mixed by Gumbel-softmax
weights, and the weights' and the logits' Adam both step. ``--compile MODE`` adds the Transformer-XL compiled
as ``train.compile=MODE`` compiles it, and each ``--layout`` a fixed model of that layout (A, D, I: attention,
dense, identity); with ``--twin``, also its shallower twin, the same layout with the identity blocks dropped
(an identity block should cost nothing: the two should step alike). Lightning's bookkeeping (logging,
progress) is left out. The models of a shape take ``--steps`` steps each per round, in alternating order, over
``--rounds`` rounds (benchmarks/train_step.py's rounds), after a warm-up that fills the memory; figures are
medians over rounds. A line as each model is built and warmed up says how long that took (a compile's time),
so a run stopped early still shows how far it got. Peak memory is what a model's steps allocated above what
was allocated before it was built.

FLOPs (MFU = FLOPs per trained token x tokens/s / the GPU's dense peak). Matrix products only, a
multiply-add = 2 FLOPs, training = forward + backward; a product whose operands both need gradients costs
3x its forward (6 x multiply-adds). Per trained token, with D = d_model, F = d_ff, L = seg_len,
M = mem_len, K = M + L keys, B = batch, n_A attention and n_D dense blocks:

    attention block   12 D^2 (1 + K/L)     q and out on the L new positions; k, v on all K (the memory is
                                           projected again every step)
                    +  4 D^2 K / (B L)     W_r on the K distances, once per segment for the whole batch; the
                                           sinusoid table needs no gradient, so forward + weight gradient
                    +  6 D (3K + 1)        content scores q.k (K keys), position scores (q+v).r (K+1 columns:
                                           the rel-shift's zero column) and weights.v, all of L x K computed
    dense block       12 D F
    output            6 D V                full softmax; adaptive: 6 [D (c_1 + n) + sum_i p_i (D d_i + d_i s_i)]
                                           with n tail clusters, cluster i of s_i ids and projection
                                           d_i = floor(D / div^i), taken by the fraction p_i of targets in it

    FLOPs/token = n_A x attention + n_D x dense + output

(Dai et al.'s 6 x parameters + 12 n_layers (L+M) D undercounts this model by the memory's k, v projections
and the position scores.) The supernet runs attention and dense in every block (identity costs nothing):
n_A = n_D = n_blocks. Embedding lookups, norms, softmaxes, dropout and the optimiser are not counted.
Peaks are dense (no sparsity) figures from NVIDIA's data sheets, for the arithmetic the precision uses:
bf16 tensor cores, TF32 tensor cores, or plain fp32 for ``32-true``.

Without a CUDA device it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor
from train_step import alternating_rounds, ratio_line, training_step, zipf_ids

from parnas.cli import ArgumentParser
from parnas.config import COMPILE_MODES, Config, DataConfig, ModelConfig, TrainConfig, transformer_xl_layout
from parnas.nn.blocks import AttentionBlock
from parnas.nn.model import build_fixed_model
from parnas.training.devices import pinned
from parnas.training.latency import full_memory_steps
from parnas.training.task import adam, compile_model

PRECISIONS = ("bf16-mixed", "32-true", "tf32")


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: a Transformer-XL of ``n_layers`` layers (an attention and a dense block each)."""

    what: str
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    batch: int
    seg_len: int
    mem_len: int
    vocab: int
    cutoffs: tuple[int, ...]
    div_value: float = 1.0
    dropout: float = 0.1

    def config(self, precision: str = "bf16-mixed") -> Config:
        model = ModelConfig(n_blocks=2 * self.n_layers, d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff,
                            mem_len=self.mem_len, dropout=self.dropout, cutoffs=self.cutoffs,
                            div_value=self.div_value, tie_weights=False)
        data = DataConfig(vocab_size=self.vocab, batch_size=self.batch, eval_batch_size=self.batch,
                          seg_len=self.seg_len)
        train = TrainConfig(precision="32-true" if precision == "tf32" else precision, clip=0.25, lr=2.5e-4)
        model.check_vocab(self.vocab)
        return Config(model=model, data=data, train=train)


SHAPES: dict[str, Shape] = {
    "wt2-par": Shape("the wt2-par preset at its GPU length", 6, 128, 4, 512, 32, 128, 128, 12000, (250, 2500), 4.0),
    "wt103-base": Shape("Dai et al.'s WikiText-103 base", 16, 410, 10, 2100, 60, 150, 150, 267735,
                        (20000, 40000, 200000)),
    "nvidia-base": Shape("NVIDIA's Transformer-XL base (WikiText-103, one GPU's batch)", 16, 512, 8, 2048, 32, 192,
                         192, 267735, (20000, 40000, 200000)),
    "long": Shape("a long context, 32k vocabulary, full softmax", 16, 512, 8, 2048, 8, 512, 512, 32000, ()),
}

# Dense peak TFLOP/s (bf16, TF32, fp32), NVIDIA data sheets; the first name found in the device's name wins.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16-mixed": 756.5, "tf32": 378.0, "32-true": 51.2}),
    ("H100 NVL", {"bf16-mixed": 835.5, "tf32": 417.5, "32-true": 60.0}),
    ("GH200", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),
    ("H200", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),
    ("H100", {"bf16-mixed": 989.4, "tf32": 494.7, "32-true": 66.9}),  # SXM ("H100 80GB HBM3")
    ("A100", {"bf16-mixed": 312.0, "tf32": 156.0, "32-true": 19.5}),
    ("L40S", {"bf16-mixed": 362.1, "tf32": 183.0, "32-true": 91.6}),
    ("L4", {"bf16-mixed": 121.0, "tf32": 60.0, "32-true": 30.3}),
    ("A10", {"bf16-mixed": 125.0, "tf32": 62.5, "32-true": 31.2}),
    ("RTX 4090", {"bf16-mixed": 165.2, "tf32": 82.6, "32-true": 82.6}),
    ("RTX 3090", {"bf16-mixed": 71.0, "tf32": 35.6, "32-true": 35.6}),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of ``device_name`` for ``precision``'s arithmetic, None for a GPU not in the table."""
    for key, peaks in PEAKS:
        if key.lower() in device_name.lower():
            return peaks[precision]
    return None


def cluster_fractions(targets: Tensor, vocab: int, cutoffs: Sequence[int]) -> list[float]:
    """The fraction of ``targets`` in each tail cluster (ids in [c_i, c_i+1), the last up to ``vocab``)."""
    edges = [*cutoffs, vocab]
    return [((targets >= a) & (targets < b)).double().mean().item() for a, b in zip(edges, edges[1:])]


def train_flops_per_token(model: ModelConfig, kinds: Sequence[str], batch: int, seg_len: int, vocab: int,
                          fractions: Sequence[float] = ()) -> float:
    """Matrix-product FLOPs of one training step per token (module docstring); ``kinds``: the blocks
    (``choice`` for a supernet block, which runs attention and dense; ``sampled`` for one that runs one of
    attention, dense and identity at even odds, a third of each on average); ``fractions``: targets per tail
    cluster."""
    D, F, L, K = model.d_model, model.d_ff, seg_len, model.mem_len + seg_len
    attention = 12 * D * D * (1 + K / L) + 4 * D * D * K / (batch * L) + 6 * D * (3 * K + 1)
    dense = 12 * D * F
    n_attention = sum(k in ("attention", "choice") for k in kinds) + sum(k == "sampled" for k in kinds) / 3
    n_dense = sum(k in ("dense", "choice") for k in kinds) + sum(k == "sampled" for k in kinds) / 3
    if not model.cutoffs:
        output = 6 * D * vocab
    else:
        sizes = [b - a for a, b in zip(model.cutoffs, [*model.cutoffs[1:], vocab])]
        tails = 0.0
        for i, (size, p) in enumerate(zip(sizes, fractions, strict=True), start=1):
            d_i = int(D // model.div_value ** i)  # as torch's AdaptiveLogSoftmaxWithLoss sizes it
            tails += p * (D * d_i + d_i * size)
        output = 6 * (D * (model.cutoffs[0] + len(sizes)) + tails)
    return n_attention * attention + n_dense * dense + output


# --- the two steps ------------------------------------------------------------------------------------

def precision_context(precision: str) -> Any:
    """bf16 autocast for bf16-mixed; TF32 matmuls on or off (set globally) for tf32 and 32-true."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    return torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()


def fixed_step(cfg: Config, vocab: int, precision: str, kinds: Sequence[str] | None = None,
               compile_mode: str = "none", head_multiple: int | None = None, attention_kernel: str = "sdpa"
               ) -> tuple[torch.nn.Module, Callable[[Tensor], None]]:
    """A fixed model (the standard Transformer-XL by default) and one training step of it; ``head_multiple``: the
    multiple its attention pads heads to for SDPA, if not the library's."""
    model_cfg = replace(cfg.model, attention_kernel=attention_kernel)
    model = build_fixed_model(model_cfg, vocab, kinds or transformer_xl_layout(cfg.model.n_blocks)).cuda().train()
    if head_multiple is not None:
        for block in model.modules():
            if isinstance(block, AttentionBlock):
                block.head_multiple = head_multiple
    compile_model(model, compile_mode)
    return model, _step(model, [list(model.parameters())], cfg, precision)


def supernet_step(cfg: Config, vocab: int, precision: str, sampled: bool = False
                  ) -> tuple[torch.nn.Module, Callable[[Tensor], None]]:
    """The search's supernet and its joint training step: weights and logits. Every candidate runs in every
    block; with ``sampled`` (``search.forward: sampled``), one drawn from softmax(alpha), the logits as
    initialised (even odds: the search's start)."""
    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.gumbel_darts import PARGumbelDARTS
    from search_step import Sampling

    strategy = PARGumbelDARTS(cfg.search, max_steps=1)
    supernet = strategy.mutate_model(PARTransformerXLSpace(cfg.model, vocab, cfg.search.candidates)).cuda().train()
    alphas = [p for name, p in supernet.named_parameters() if name.endswith("_arch_alpha")]
    weights = [p for name, p in supernet.named_parameters() if not name.endswith("_arch_alpha")]
    model = Sampling(supernet) if sampled else supernet
    return supernet, _step(model, [weights, alphas], cfg, precision)


def _step(model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], cfg: Config,
          precision: str) -> Callable[[Tensor], None]:
    """Forward, loss, backward, clipping of ``groups[0]``, one Adam per group (the logits': betas 0.5, 0.999)."""
    optimizers = [adam(groups[0], lr=cfg.train.lr, precision=cfg.train.precision)]
    optimizers += [torch.optim.Adam(g, lr=cfg.search.arch_lr, betas=(0.5, 0.999)) for g in groups[1:]]
    return training_step(model, optimizers, groups[0], cfg.train.clip, lambda: precision_context(precision))


# --- running -------------------------------------------------------------------------------------------

LAYOUT_LETTERS = {"A": "attention", "D": "dense", "I": "identity"}
ONE_SYNC = "txl, 1 sync"  # --groups-on-device's model
UNPADDED = "txl, unpadded"  # --unpadded-heads's model
FLEX = "txl, flex"  # --flex's model
SAMPLED = "supernet, sampled"  # --sampled's model
TF32 = "txl, tf32"  # --tf32's model


def _shape(name: str) -> str:
    if name not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    return name


def _layout(text: str) -> str:
    if not text or set(text) - set(LAYOUT_LETTERS):
        raise argparse.ArgumentTypeError(f"layout {text!r} is not a string of {', '.join(LAYOUT_LETTERS)} "
                                         "(attention, dense, identity)")
    return text


def twins(layouts: Sequence[str]) -> dict[str, str]:
    """Each layout that has identity blocks and another kind, and its shallower twin: the layout without its
    identity blocks (AIAIIIAIIDDD: AAADDD), which it should step like if an identity block costs nothing."""
    return {layout: layout.replace("I", "") for layout in layouts if layout.replace("I", "") not in ("", layout)}


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = ArgumentParser(prog="gpu_step.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", type=_shape, metavar="NAME",
                        help=f"repeatable; default all: {', '.join(SHAPES)}")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model per round (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (at least until the memory "
                        "is full)")
    parser.add_argument("--compile", default="none", choices=COMPILE_MODES,
                        help="also time the Transformer-XL under torch.compile in this mode (default none)")
    parser.add_argument("--layout", action="append", type=_layout, default=[], metavar="LAYOUT",
                        help="repeatable: also time a fixed model of this layout, e.g. AIAIIIAIIDDD")
    parser.add_argument("--groups-on-device", action="store_true",
                        help="add the Transformer-XL whose loss groups its targets by cluster on the device and "
                             "reads their sizes back (one host sync a step), as it did before the data module "
                             "grouped them on the host")
    parser.add_argument("--unpadded-heads", action="store_true",
                        help="add the Transformer-XL whose heads reach SDPA as they are where their size is not a "
                             "multiple of 8 (wt103-base's 41: SDPA's unfused math path), as before they were padded")
    parser.add_argument("--sampled", action="store_true",
                        help="add the supernet whose step runs one sampled candidate per block (search.forward: "
                             "sampled), at even odds")
    parser.add_argument("--flex", action="store_true",
                        help="add the Transformer-XL with model.attention_kernel=flex (and, with --compile, it "
                             "compiled too)")
    parser.add_argument("--tf32", action="store_true",
                        help="add the Transformer-XL in fp32 with TF32 matmuls, eager, timed beside --precision's "
                             "models (bf16's speed-up over TF32 in the same rounds); its MFU against the data "
                             "sheet's TF32 peak")
    parser.add_argument("--twin", action="store_true",
                        help="add each --layout's shallower twin, its blocks without the identity ones (AIAIIIAIIDDD:"
                             " AAADDD), and the layout's step time over the twin's")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense peak for this precision, TFLOP/s (default: looked up by its name)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.tf32 and args.precision == "tf32":
        parser.error("--tf32 adds a TF32 Transformer-XL beside --precision's models; with --precision tf32 it is the "
                     "Transformer-XL itself: drop one")
    if args.twin and not twins(args.layout):
        parser.error("--twin adds each --layout's twin without identity blocks: give a --layout with an I and "
                     "another block, e.g. --layout AIAIIIAIIDDD")
    return args


class Timed(NamedTuple):
    """A model a shape times: its blocks (for the FLOP count), ``build(cfg, vocab) -> (model, step)``, and the
    precision its step runs in."""

    kinds: list[str]
    build: Callable[[Config, int], tuple[torch.nn.Module, Callable[..., None]]]
    precision: str


def timed_models(shape: Shape, args: Any) -> dict[str, Timed]:
    """The models ``args`` times at ``shape``, by name, in the order they are built: the Transformer-XL and the
    supernet first (the ratio lines divide by the Transformer-XL), then what each flag adds."""
    n, precision = 2 * shape.n_layers, args.precision
    standard = list(transformer_xl_layout(n))

    def fixed(layout: str | None = None, precision: str = precision, **options: Any) -> Timed:
        kinds = [LAYOUT_LETTERS[c] for c in layout] if layout else standard
        return Timed(kinds, lambda cfg, vocab: fixed_step(cfg, vocab, precision, kinds, **options), precision)

    def supernet(sampled: bool) -> Timed:
        return Timed(["sampled" if sampled else "choice"] * n,
                     lambda cfg, vocab: supernet_step(cfg, vocab, precision, sampled), precision)

    models = {"transformer-xl": fixed(), "supernet": supernet(False)}
    if args.groups_on_device and shape.cutoffs:
        models[ONE_SYNC] = fixed()  # its loss groups the targets: bench_shape hands it none
    if args.unpadded_heads and (shape.d_model // shape.n_heads) % 8:
        models[UNPADDED] = fixed(head_multiple=1)
    if args.sampled:
        models[SAMPLED] = supernet(True)
    if args.flex:
        models[FLEX] = fixed(attention_kernel="flex")
    if args.tf32:
        models[TF32] = fixed(precision="tf32")
    if args.compile != "none":
        models[f"compiled ({args.compile})"] = fixed(compile_mode=args.compile)
        if args.flex:
            models[f"{FLEX}, compiled"] = fixed(compile_mode=args.compile, attention_kernel="flex")
    for layout in args.layout:
        models[layout] = fixed(layout)
    for twin in twins(args.layout).values() if args.twin else ():
        models.setdefault(twin, fixed(twin))
    return models


def bench_shape(name: str, args: Any, peaks: dict[str, float | None]) -> None:
    """Times ``args``'s models at shape ``name`` and prints a line each and their ratios; ``peaks``: the GPU's
    dense peak TFLOP/s for each precision a model runs in."""
    shape = SHAPES[name]
    cfg = shape.config(args.precision)
    B, L = shape.batch, shape.seg_len
    warmup = max(args.warmup, full_memory_steps(cfg))
    n_tokens = B * (L * (warmup + args.rounds * args.steps) + 1)
    host = zipf_ids(n_tokens, shape.vocab).view(B, -1)  # B streams, read segment by segment
    stream = host.cuda()
    fractions = cluster_fractions(stream, shape.vocab, shape.cutoffs) if shape.cutoffs else []
    models = timed_models(shape, args)
    kinds = {model: timed.kinds for model, timed in models.items()}
    flops = {k: train_flops_per_token(cfg.model, v, B, L, shape.vocab, fractions) for k, v in kinds.items()}
    steps: dict[str, Callable[..., None]] = {}
    group: dict[str, Callable[[Tensor], Any]] = {}  # each model's target grouping, on the host
    peak_bytes: dict[str, int] = {}
    position = dict.fromkeys(kinds, 0)

    def run(model: str, n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            t = position[model]
            groups = group[model](host[:, t + 1:t + L + 1])  # as the data module does before the batch moves
            groups = None if groups is None else pinned(groups, stream.device).to(stream.device)
            steps[model](stream[:, t:t + L + 1], groups)
            position[model] = t + L
        torch.cuda.synchronize()
        return n * B * L / (time.perf_counter() - start)

    print(f"\n{name}: building and warming up {len(models)} models", flush=True)
    for model, timed in models.items():
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        net, steps[model] = timed.build(cfg, shape.vocab)
        group[model] = (lambda y: None) if model == ONE_SYNC else net.group_targets
        run(model, warmup)  # the memory fills; the peak of a full step is reached
        peak_bytes[model] = torch.cuda.max_memory_allocated() - before
        print(f"  {model}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    tps = alternating_rounds(run, list(kinds), args.rounds, args.steps, 0)

    print(f"{name}: {shape.what}; {shape.n_layers} layers, d_model {shape.d_model}, {shape.n_heads} heads, "
          f"d_ff {shape.d_ff}, batch {B} x segment {L}, memory {shape.mem_len}, vocab {shape.vocab:,}, "
          f"cutoffs {list(shape.cutoffs) or 'none (full softmax)'}, {args.precision}")
    for model in kinds:
        median = statistics.median(tps[model])
        achieved = flops[model] * median / 1e12
        peak = peaks[models[model].precision]
        mfu = f"MFU {100 * achieved / peak:.1f}%" if peak else "MFU - (unknown peak: --peak-tflops)"
        rounds = ", ".join(f"{t:,.0f}" for t in tps[model])
        print(f"  {model:20s} {median:10,.0f} tokens/s  {B * L / median * 1e3:8.1f} ms/step  "
              f"peak {peak_bytes[model] / 2**30:6.2f} GiB  {flops[model] / 1e6:7.1f} MFLOP/token  "
              f"{achieved:7.1f} TFLOP/s  {mfu}   (rounds: {rounds})")
    # tokens/s of the fixed model over the supernet's, round by round: the supernet's step time over the fixed one's
    print("  " + ratio_line("transformer-xl", "supernet", tps, label="step time supernet / transformer-xl"))
    for model in list(kinds)[2:]:
        print("  " + ratio_line("transformer-xl", model, tps, label=f"step time {model} / transformer-xl"))
    if TF32 in models and args.compile != "none":
        compiled = f"compiled ({args.compile})"
        print("  " + ratio_line(compiled, TF32, tps, label=f"step time {TF32} / {compiled}"))
    for layout, twin in twins(args.layout).items() if args.twin else ():
        print("  " + ratio_line(twin, layout, tps, label=f"step time {layout} / {twin}, its twin without identity"))
    steps.clear()  # the models go; their memory with them
    torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(f"gpu_step.py: no CUDA device here (torch {torch.__version__}, {build}); it times GPU training "
              "steps: run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    peak = args.peak_tflops or peak_tflops(device, args.precision)
    peaks = {"tf32": peak_tflops(device, "tf32"), args.precision: peak}  # --tf32's model's, then --peak-tflops
    source = "--peak-tflops" if args.peak_tflops else "data sheet" if peak else "not in the table"
    print(f"{device}; torch {torch.__version__}, CUDA {torch.version.cuda}; {args.precision}; peak "
          f"{f'{peak:g} TFLOP/s' if peak else '-'} ({source}); {args.rounds} rounds x {args.steps} steps per "
          "model, order alternating")
    for name in args.shape or SHAPES:
        bench_shape(name, args, peaks)
    return 0


if __name__ == "__main__":
    sys.exit(main())

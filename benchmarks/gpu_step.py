"""A training step on a GPU: tokens/s, step time, peak memory and MFU, for a fixed Transformer-XL and for
the supernet (the search's training step), at named shapes.

    python benchmarks/gpu_step.py                                      # every shape, bf16-mixed
    python benchmarks/gpu_step.py --shape wt103-base --precision tf32  # one shape, fp32 weights, TF32 matmuls
    python benchmarks/gpu_step.py --shape long --peak-tflops 989.4     # MFU against a peak you give
    python benchmarks/gpu_step.py --shape wt103-base --compile default  # + Transformer-XL under torch.compile
    python benchmarks/gpu_step.py --shape wt2-par --layout AIAIIIAIIDDD --layout ADADAD  # + fixed layouts
    python benchmarks/gpu_step.py --shape wt103-base --groups-on-device  # + the loss grouping its own targets
    python benchmarks/gpu_step.py --shape wt103-base --unpadded          # + operands unpadded (heads of 41 ...)
    python benchmarks/gpu_step.py --shape wt103-base --flex              # + attention by FlexAttention
    python benchmarks/gpu_step.py --shape wt2-par --sampled              # + the supernet running one pick a block
    python benchmarks/gpu_step.py --shape wt2-par --fair                 # + the supernet's fair step
    python benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --compile-supernet  # + both compiled
    python benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --eager-loss  # + its loss eager
    python benchmarks/gpu_step.py --shape wt103-base --tf32              # + the Transformer-XL in TF32, beside bf16
    python benchmarks/gpu_step.py --shape wt2-par --layout AIAIIIAIIDDD --twin  # + AAADDD: its identities dropped
    python benchmarks/gpu_step.py --shape wt103-base --no-supernet      # the Transformer-XL alone, eager
    python benchmarks/gpu_step.py --shape wt103-base --no-supernet --profile  # + where its step's time goes

Each step is what training takes: forward with the memory carried, the adaptive (or full) softmax loss, backward,
clipping, Adam (parnas's: fused unless fp16's gradient scaler is in use), on a Zipf token stream (how often the tail
clusters are hit decides their cost), the targets grouped by cluster on the host each step and moved with it, as the
data module does (``--groups-on-device`` adds a Transformer-XL whose loss groups them on the device and reads their
sizes back, the one host sync a step this replaced; ``--unpadded`` one whose matrix operands are not padded to
multiples of 8 (parnas.nn.alignment): heads of 41 reach SDPA as they are, the position scores and the head's logits
keep their own widths (wt2-par: 257 and 252 columns), as before; ``--flex`` one with
``model.attention_kernel=flex``, the position scores added inside a FlexAttention kernel instead of passed to SDPA
as a bias, eager and, with ``--compile``, compiled; ``--tf32`` one in fp32 with TF32 matmuls, eager, beside the bf16
ones in the same rounds, its MFU against the TF32 peak). The supernet's step is the search's, joint mode: every
block runs all its candidates mixed by Gumbel-softmax weights, and the weights' and the logits' Adam both step.
``--compile MODE`` adds the Transformer-XL compiled as ``train.compile=MODE`` compiles it, and each ``--layout`` a
fixed model of that layout (A, D, I: attention, dense, identity); with ``--twin``, also its shallower twin, the same
layout with the identity blocks dropped (an identity block should cost nothing: the two should step alike).
Lightning's bookkeeping (logging, progress) is left out. The models of a shape take ``--steps`` steps each per
round, in alternating order, over ``--rounds`` rounds (benchmarks/train_step.py's rounds), after a warm-up that
fills the memory; figures are medians over rounds. A line as each model is built and warmed up says how long that
took (a compile's time), so a run stopped early still shows how far it got. Peak memory is what a model's steps
allocated above what was allocated before it was built.

MFU = FLOPs per trained token x tokens/s / the GPU's dense peak. The shapes, the FLOP count and the peaks are
benchmarks/gpu_shapes.py's; ``--help`` prints how the FLOPs are counted after this.

Without a CUDA device it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, NamedTuple

import gpu_shapes
import step_profile
import torch
from gpu_shapes import PRECISIONS, SHAPES, Shape, cluster_fractions, peak_tflops, train_flops_per_token
from torch import Tensor
from train_step import alternating_rounds, fit_capacity, host_grouping, ratio_line, training_step, zipf_ids

from parnas.cli import ArgumentParser
from parnas.config import COMPILE_MODES, Config, transformer_xl_layout
from parnas.nn.alignment import set_pad_multiple
from parnas.nn.model import build_fixed_model, full_memory_steps
from parnas.training.compiling import compile_counts, compile_model, compiled_since
from parnas.training.devices import pinned
from parnas.training.task import adam

# --- the two steps ------------------------------------------------------------------------------------

def precision_context(precision: str) -> Any:
    """bf16 autocast for bf16-mixed; TF32 matmuls on or off (set globally) for tf32 and 32-true."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    return torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()


def fixed_step(cfg: Config, vocab: int, precision: str, kinds: Sequence[str] | None = None,
               compile_mode: str = "none", pad_multiple: int | None = None, attention_kernel: str = "sdpa",
               eager_loss: bool = False) -> tuple[torch.nn.Module, Callable[[Tensor], None]]:
    """A fixed model (the standard Transformer-XL by default) and one training step of it; ``pad_multiple``: the
    multiple its attention and output head pad their operands to, if not the library's (1: none); ``eager_loss``:
    compiled without target capacities, its adaptive softmax's targets then grouped as they come and its loss
    run eager."""
    model_cfg = replace(cfg.model, attention_kernel=attention_kernel)
    model = build_fixed_model(model_cfg, vocab, kinds or transformer_xl_layout(cfg.model.n_blocks)).cuda().train()
    set_pad_multiple(model, pad_multiple)
    compile_model(model, compile_mode)
    if eager_loss:
        model.target_capacity = None
    return model, _step(model, [list(model.parameters())], cfg, precision)


def supernet_step(cfg: Config, vocab: int, precision: str, forward: str = "gumbel", compile_mode: str = "none"
                  ) -> tuple[torch.nn.Module, Callable[[Tensor], None]]:
    """The search's supernet and its joint training step: weights and logits, by
    ``search.par-gumbel-darts.forward``: ``gumbel``, every candidate runs in every block, weighted; ``sampled``, one
    drawn from softmax(alpha), the logits as initialised (even odds: the search's start); ``fair``, every candidate
    of every block once, in as many forwards as a block has candidates, with one backward. ``compile_mode``: the
    supernet compiled as ``train.compile`` compiles it in a search (a fair step's sub-steps then stacked in one
    forward)."""
    from search_step import Sampling, fair_step

    from parnas.search_spaces import PARTransformerXLSpace
    from parnas.strategies.gumbel_darts import PARGumbelDARTS

    strategy = PARGumbelDARTS(cfg.search, cfg.search.settings, max_steps=1)
    supernet = strategy.mutate_model(PARTransformerXLSpace(cfg.model, vocab, cfg.search.candidates)).cuda().train()
    compile_model(supernet, compile_mode)
    alphas = [p for name, p in supernet.named_parameters() if name.endswith("_arch_alpha")]
    weights = [p for name, p in supernet.named_parameters() if not name.endswith("_arch_alpha")]
    if forward == "fair":
        optimizers = _optimizers([weights, alphas], cfg)
        return supernet, fair_step(supernet, optimizers, weights, cfg.train.clip, lambda: precision_context(precision),
                                   stacked=compile_mode != "none")  # compiled: the sub-steps as one forward
    model = Sampling(supernet) if forward == "sampled" else supernet
    return supernet, _step(model, [weights, alphas], cfg, precision)


def _step(model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], cfg: Config,
          precision: str) -> Callable[[Tensor], None]:
    """Forward, loss, backward, clipping of ``groups[0]``, one Adam per group (the logits': betas 0.5, 0.999)."""
    return training_step(model, _optimizers(groups, cfg), groups[0], cfg.train.clip,
                         lambda: precision_context(precision))


def _optimizers(groups: list[list[torch.nn.Parameter]], cfg: Config) -> list[torch.optim.Optimizer]:
    optimizers = [adam(groups[0], lr=cfg.train.lr, precision=cfg.train.precision)]
    return optimizers + [torch.optim.Adam(g, lr=cfg.search.arch_lr, betas=(0.5, 0.999)) for g in groups[1:]]


# --- running -------------------------------------------------------------------------------------------

LAYOUT_LETTERS = {"A": "attention", "D": "dense", "I": "identity"}
ONE_SYNC = "txl, 1 sync"  # --groups-on-device's model
UNPADDED = "txl, unpadded"  # --unpadded's model
FLEX = "txl, flex"  # --flex's model
SAMPLED = "supernet, sampled"  # --sampled's model
FAIR = "supernet, fair"  # --fair's model
TF32 = "txl, tf32"  # --tf32's model
EAGER_LOSS = "compiled, loss eager"  # --eager-loss's model


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


ADDED_BY_FLAG = {  # the store_true flags: the model each adds to those timed (or, last, leaves out)
    "--groups-on-device":
        "add the Transformer-XL whose loss groups its targets by cluster on the device and reads their sizes back"
        " (one host sync a step), as it did before the data module grouped them on the host",
    "--unpadded":
        "add the Transformer-XL whose matrix operands are not padded to multiples of 8 (the heads, SDPA's unfused "
        "math path where they are not: wt103-base's 41; the position scores' 1+K columns; the output head's "
        "logits), as before they were padded",
    "--sampled":
        "add the supernet whose step runs one sampled candidate per block (search.par-gumbel-darts.forward: "
        "sampled), at even odds",
    "--fair":
        "add the supernet whose step runs every candidate of every block once, in as many forwards as a block has"
        " candidates (search.par-gumbel-darts.forward: fair, the default of a one-process search)",
    "--flex":
        "add the Transformer-XL with model.attention_kernel=flex (and, with --compile, it compiled too)",
    "--tf32":
        "add the Transformer-XL in fp32 with TF32 matmuls, eager, timed beside --precision's models (bf16's "
        "speed-up over TF32 in the same rounds); its MFU against the data sheet's TF32 peak",
    "--twin":
        "add each --layout's shallower twin, its blocks without the identity ones (AIAIIIAIIDDD: AAADDD), and the"
        " layout's step time over the twin's",
    "--eager-loss":
        "with --compile, add the Transformer-XL compiled but its loss eager (its targets grouped as they come, not "
        "padded to fixed capacities), as train.compile ran it before the loss was compiled: what that buys",
    "--compile-supernet":
        "with --compile, add the gumbel and the fair supernet compiled in that mode, as train.compile compiles them "
        "in a search (the fair step's sub-steps stacked in one forward)",
    "--no-supernet":
        "leave the supernet out (a quick look at the Transformer-XL and what flags add)",
}


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = ArgumentParser(prog="gpu_step.py", description=f"{__doc__}\n{gpu_shapes.__doc__}",
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
    for flag, text in ADDED_BY_FLAG.items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, profile 3 steps of each model: the GPU's busy time against the wall "
                        "time, and the kernels that took the most (benchmarks/step_profile.py)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense peak for this precision, TFLOP/s (default: looked up by its name)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.tf32 and args.precision == "tf32":
        parser.error("--tf32 adds a TF32 Transformer-XL beside --precision's models; with --precision tf32 it is the "
                     "Transformer-XL itself: drop one")
    if args.eager_loss and args.compile == "none":
        parser.error("--eager-loss adds the Transformer-XL compiled with its loss eager: give --compile default or "
                     "--compile reduce-overhead")
    if args.compile_supernet and args.compile == "none":
        parser.error("--compile-supernet compiles the supernet in --compile's mode: give --compile default or "
                     "--compile reduce-overhead")
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

    def supernet(forward: str, compile_mode: str = "none") -> Timed:
        return Timed([{"gumbel": "choice"}.get(forward, forward)] * n,
                     lambda cfg, vocab: supernet_step(cfg, vocab, precision, forward, compile_mode), precision)

    models = {"transformer-xl": fixed()} | ({} if args.no_supernet else {"supernet": supernet("gumbel")})
    if args.groups_on_device and shape.cutoffs:
        models[ONE_SYNC] = fixed()  # its loss groups the targets: bench_shape hands it none
    if args.unpadded:
        models[UNPADDED] = fixed(pad_multiple=1)
    if args.sampled:
        models[SAMPLED] = supernet("sampled")
    if args.fair:
        models[FAIR] = supernet("fair")
    if args.flex:
        models[FLEX] = fixed(attention_kernel="flex")
    if args.tf32:
        models[TF32] = fixed(precision="tf32")
    if args.compile != "none":
        models[f"compiled ({args.compile})"] = fixed(compile_mode=args.compile)
        if args.eager_loss:
            models[f"{EAGER_LOSS} ({args.compile})"] = fixed(compile_mode=args.compile, eager_loss=True)
        if args.flex:
            models[f"{FLEX}, compiled"] = fixed(compile_mode=args.compile, attention_kernel="flex")
        if args.compile_supernet:
            models[f"supernet, compiled ({args.compile})"] = supernet("gumbel", args.compile)
            models[f"{FAIR}, compiled ({args.compile})"] = supernet("fair", args.compile)
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
    warmup = max(args.warmup, full_memory_steps(cfg.model, cfg.data.seg_len))
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
        counts = compile_counts()
        net, steps[model] = timed.build(cfg, shape.vocab)
        fit_capacity(net, host, L)
        group[model] = (lambda y: None) if model == ONE_SYNC else host_grouping(net)
        run(model, warmup)  # the memory fills; the peak of a full step is reached
        peak_bytes[model] = torch.cuda.max_memory_allocated() - before
        made = compile_counts()[0] > counts[0]  # compiled: what, and whether CUDA graphs were skipped
        print(f"  {model}: ready in {time.perf_counter() - start:.1f} s"
              f"{f' ({compiled_since(counts, args.compile)})' if made else ''}", flush=True)
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
    if "supernet" in tps:
        print("  " + ratio_line("transformer-xl", "supernet", tps, label="step time supernet / transformer-xl"))
    for model in [m for m in kinds if m not in ("transformer-xl", "supernet")]:
        print("  " + ratio_line("transformer-xl", model, tps, label=f"step time {model} / transformer-xl"))
    if TF32 in models and args.compile != "none":
        compiled = f"compiled ({args.compile})"
        print("  " + ratio_line(compiled, TF32, tps, label=f"step time {TF32} / {compiled}"))
    if args.eager_loss:  # the same compiled model, its loss eager: what compiling the loss buys
        compiled = f"compiled ({args.compile})"
        print("  " + ratio_line(f"{EAGER_LOSS} ({args.compile})", compiled, tps,
                                label=f"step time {compiled} / {EAGER_LOSS} ({args.compile})"))
    if args.compile_supernet:  # each compiled in the same mode: what CUDA graphs leave of the supernet's extra cost
        compiled = f"compiled ({args.compile})"
        for supernet_name in (f"supernet, {compiled}", f"{FAIR}, {compiled}"):
            print("  " + ratio_line(compiled, supernet_name, tps,
                                    label=f"step time {supernet_name} / transformer-xl, {compiled}"))
    for layout, twin in twins(args.layout).items() if args.twin else ():
        print("  " + ratio_line(twin, layout, tps, label=f"step time {layout} / {twin}, its twin without identity"))
    for model in kinds if args.profile else ():
        profiled = step_profile.profile_steps(lambda n, model=model: run(model, n), 3, "cuda")
        print("\n".join(step_profile.summary(model, profiled, 3, "cuda")), flush=True)
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

"""``parnas plot`` and ``parnas cutoffs``. Only argparse here: matplotlib, numpy and torch load
inside the handlers, so ``parnas --help`` stays fast."""

from __future__ import annotations

import argparse
import time

TOKENIZER_KINDS = ("sentencepiece", "word", "char")


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a search: probabilities.gif, probabilities.png and architecture.png (plus pareto.png for an experiment).

    Give a search run directory (the one holding history.jsonl), or --experiment ID for every
    trial of an nnictl experiment, running or stopped ones drawn from their history so far;
    pareto.png (val ppl of the exported architecture, supernet weights, not retrained, against
    its predicted latency relative to Transformer-XL's or its cost; Pareto front marked; hollow
    markers for trials not finished) then goes into the experiment's folder. The final heat map
    is also logged to <run dir>/tensorboard (tag search/probabilities), in one events file that
    each plot replaces.
    """
    from parnas.errors import ParnasError
    from parnas.report.pareto import plot_experiment
    from parnas.report.plots import plot_run

    if bool(args.run_dir) == bool(args.experiment):
        raise ParnasError("give a run directory or --experiment ID (one of them)")
    if args.max_frames < 1:
        raise ParnasError(f"--max-frames must be >= 1, got {args.max_frames}")
    options = {"max_frames": args.max_frames, "tensorboard": not args.no_tensorboard}
    if args.experiment:
        paths = plot_experiment(args.experiment, args.experiments_dir, **options)
    else:
        paths = plot_run(args.run_dir, **options)
    for path in paths:
        print(path)
    return 0


def cmd_cutoffs(args: argparse.Namespace) -> int:
    """Optimal adaptive-softmax cutoffs for a tokenizer, from the train split's unigram counts.

    Minimises Grave et al.'s (2017) GPU cost model of torch's AdaptiveLogSoftmaxWithLoss for
    --clusters K tail clusters (K cutoffs, as in model.cutoffs: the original TensorFlow PAR Transformer-XL's
    [250, 2500] is K=2),
    exactly, in O(K N log N). The corpus, tokenizer, d_model, div_value and tokens per step
    (batch_size x seg_len) come from --config/--set, as for training. --tokenizer takes a kind
    (sentencepiece, word, char: same as --set data.tokenizer=KIND) or a tokenizer file (an
    spm.model, a vocab.txt, or a cached tokenizer folder), which then encodes the corpus' train split.
    """
    from parnas.config import load_config
    from parnas.data import cutoffs

    tok = args.tokenizer
    overrides = list(args.set) + ([f"data.tokenizer={tok}"] if tok in TOKENIZER_KINDS else [])
    cfg = load_config(args.config, overrides)
    tokens = float(args.tokens_per_step or cfg.data.batch_size * cfg.data.seg_len)
    model = cutoffs.SoftmaxCost(tokens=tokens, d_model=cfg.model.d_model, div_value=cfg.model.div_value,
                              min_macs=float(args.min_macs), projection=not args.no_projection)
    cutoffs.check_model(args.clusters, model)  # before any tokenizer is trained
    if cfg.data.tokenizer == "sentencepiece" and (tok is None or tok in TOKENIZER_KINDS):
        cutoffs.check_clusters(args.clusters, cfg.data.vocab_size)
    started = time.perf_counter()
    tokenizer, counts = cutoffs.train_counts(cfg.data, None if tok is None or tok in TOKENIZER_KINDS else tok)
    loaded = time.perf_counter() - started
    cutoffs.check_clusters(args.clusters, len(counts))
    probs = cutoffs.probabilities(counts)
    started = time.perf_counter()
    found = (cutoffs.exact_cutoffs if args.method == "exact" else cutoffs.optimal_cutoffs)(probs, args.clusters, model)
    took = time.perf_counter() - started
    full = model.cost(probs, [])
    print(f"{tokenizer.kind} tokenizer, {len(counts):,} ids ({tokenizer.path}); {int(counts.sum()):,} train tokens "
          f"counted in {loaded:.1f} s")
    print(f"cost model: {model.tokens:g} tokens/step, d_model {model.d_model}, "
          + (f"div_value {model.div_value:g}, " if model.projection else "no projections, ")
          + f"floor {model.min_macs:.3g} multiply-adds per product")
    print(f"optimal cutoffs for {args.clusters} tail cluster(s) ({args.method}, {took:.3f} s): "
          f"{list(found.cutoffs)}  cost {found.cost / 1e6:,.1f}M multiply-adds/step "
          f"({found.cost / full:.1%} of a full softmax, {full / 1e6:,.1f}M)")
    for i, (a, b, mass) in enumerate(cutoffs.cluster_table(probs, found.cutoffs)):
        name = "head" if i == 0 else f"tail {i}"
        width = model.d_model if i == 0 or not model.projection else model.hidden(i)
        print(f"  {name:7s} ids {a:>7,}..{b - 1:<7,} {b - a:>7,} ids  {mass:7.2%} of tokens  {width} features")
    configured = list(cfg.model.cutoffs)
    if configured and configured[-1] < len(counts):
        cost = model.cost(probs, configured)
        versus = f" ({cost / found.cost - 1:+.1%})" if len(configured) == args.clusters else ""
        print(f"configured model.cutoffs {configured}: cost {cost / 1e6:,.1f}M{versus}")
    print(f"use: --set model.cutoffs=[{','.join(str(c) for c in found.cutoffs)}]")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas.arguments import add_command, add_config_args

    p = add_command(sub, "plot", cmd_plot, "parnas plot runs/search")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a search run directory (holds history.jsonl)")
    p.add_argument("--experiment", metavar="ID",
                   help="every trial of this nnictl experiment, plus pareto.png (default: draw RUN_DIR instead)")
    p.add_argument("--experiments-dir", metavar="DIR",
                   help="NNI's experimentWorkingDirectory (default $NNI_EXPERIMENTS_DIR or ~/nni-experiments)")
    p.add_argument("--max-frames", type=int, default=100, help="frames in the animation at most (default 100)")
    p.add_argument("--no-tensorboard", action="store_true", help="do not log the heat map to TensorBoard")

    p = add_command(sub, "cutoffs", cmd_cutoffs, "parnas cutoffs --config wt2-seed --clusters 2")
    add_config_args(p)
    p.add_argument("--clusters", "-k", type=int, required=True, metavar="K",
                   help="number of tail clusters = number of cutoffs (the original TensorFlow PAR Transformer-XL's "
                        "[250, 2500] is 2)")
    p.add_argument("--tokenizer", metavar="KIND|PATH",
                   help="sentencepiece, word or char (as data.tokenizer), or an spm.model / vocab.txt / "
                        "tokenizer folder; default: the config's data.tokenizer")
    p.add_argument("--tokens-per-step", type=int, metavar="B",
                   help="target tokens per step (default data.batch_size x data.seg_len)")
    p.add_argument("--min-macs", type=float, default=50 * 500 * 512,
                   help="multiply-adds below which a GPU product costs the same (Grave et al.'s K40 floor "
                        "50 x 500 x 512 by default; 0 counts plain multiply-adds)")
    p.add_argument("--no-projection", action="store_true",
                   help="the paper's original cost: tail clusters at the full d_model, no div_value projections")
    p.add_argument("--method", choices=("fast", "exact"), default="fast",
                   help="fast: exact divide-and-conquer, O(K N log N) (default); exact: the O(K N^2) reference DP")

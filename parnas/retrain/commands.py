"""``parnas retrain | evaluate | generate | compare``. Only argparse is imported here: each handler checks its
arguments, config and output folder first, then imports what it needs, so ``parnas --help`` is fast and a mistake
fails at once, in one line."""

from __future__ import annotations

import argparse
import math
import sys


def cmd_retrain(args: argparse.Namespace) -> int:
    """Train the fixed model of an architecture JSON (or a named layout) from scratch, then evaluate it."""
    from parnas import reading
    from parnas.architecture import NAMED_LAYOUTS
    from parnas.config import load_config
    from parnas.overrides import as_given
    from parnas.owned_folders import take_run_dir

    overrides = list(args.set)
    for key in ("accelerator", "devices", "precision", "out_dir"):  # as given: --out "exp #2" or --out yes is a path
        if getattr(args, key) is not None:
            overrides.append(as_given(f"train.{key}", args.out_dir) if key == "out_dir" else
                             f"train.{key}={getattr(args, key)}")
    cfg = load_config(args.config, overrides)  # before torch is imported: a mistake fails at once
    if args.arch not in NAMED_LAYOUTS:
        reading.check_regular(args.arch)  # a FIFO would block its open while the run's folder is held
    if args.dry_run:
        from parnas.retrain.run import dry_run_retrain

        print(dry_run_retrain(args.arch, args.config, overrides))
        return 0
    with take_run_dir(cfg.train.out_dir, args.resume):  # held and checked once: another run into it is refused
        from parnas.report.summaries import training_summary
        from parnas.retrain.run import architecture_source, resolve_config, retrain
        from parnas.threads import use_threads

        cfg = resolve_config(architecture_source(args.arch), args.config, overrides)  # the architecture's own width
        use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
        metrics = retrain(args.arch, args.config, overrides, resume=args.resume)
    if metrics:
        from parnas.retrain.units import run_units

        units = run_units(metrics)
        print(training_summary(metrics, metrics["config"]["train"]["out_dir"]))
        if units:
            print(f"  perplexities {units} (not per word)")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Perplexity of a trained run (its folder or a checkpoint) on a whole split, exp of the total NLL with the
    memory carried, and evaluation tokens/s."""
    from pathlib import Path

    from parnas.errors import ParnasError
    from parnas.files import check_file_folder, write_json_atomic

    out = Path(args.out) if args.out else None  # checked before the evaluation, not after it
    if out is not None and out.is_dir():
        raise ParnasError(f"--out {out} is a folder; give a file name, e.g. {out / 'eval.json'}")
    check_file_folder(out if out is not None else args.checkpoint)
    from parnas.retrain.evaluate import evaluate_checkpoint, evaluation_divergence
    from parnas.retrain.load import device_for, load_trained, scratch_dir
    from parnas.retrain.units import perplexity_units
    from parnas.threads import use_threads

    device = device_for(args.accelerator)
    with scratch_dir() as tmp:
        trained = load_trained(args.checkpoint, device, Path(tmp))
        data = trained.config.data  # its tokens/s are timed with the threads its segments gain from
        use_threads(trained.config.model.d_model, data.eval_batch_size * data.seg_len)
        result = evaluate_checkpoint(trained, args.split, args.mem_len, args.data_path, args.clamp_len)
    result["checkpoint"] = str(args.checkpoint)
    out = out or Path(f"{args.checkpoint}.{args.split}-mem{result['mem_len']}.json")  # beside the checkpoint
    write_json_atomic(out, result)
    if result["diverged"]:  # written, marked; then the line its training ended with, and exit status 2
        raise evaluation_divergence(trained, args.split, result["loss"])
    speed = result["eval_tokens_per_s"]
    timing = f"{speed:,.0f} tokens/s over {result['eval_seconds']:.1f} s" if speed else "too quick to time"
    clamp = f", positions clamped at {result['clamp_len']}" if result["clamp_len"] else ""
    units = perplexity_units(trained.tokenizer.kind, trained.tokenizer.vocab_size)
    print(f"{args.split} perplexity {result['ppl']:.3f} ({units}) at step {result['step']:,} (memory "
          f"{result['mem_len']}{clamp}, {result['tokens']:,} tokens, {timing}); written to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Sample text from a trained run (its folder or a checkpoint) after a prompt, carrying the Transformer-XL
    memory, printed as it comes. Ctrl-C stops it: the text so far stays on stdout, one line on stderr says how far
    it got (exit 130)."""
    import signal
    from functools import partial
    from pathlib import Path

    from parnas.errors import Interrupted
    from parnas.retrain.evaluate import Sampling, TextStream, generate
    from parnas.retrain.load import device_for, load_trained, scratch_dir
    from parnas.threads import use_threads

    opts = Sampling(tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    mem_len=args.mem_len, clamp_len=args.clamp_len)
    device = device_for(args.accelerator)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    stream = None
    try:
        with scratch_dir() as tmp:
            trained = load_trained(args.checkpoint, device, Path(tmp))
            show = partial(print, file=sys.stderr) if args.verbose else None  # stdout: the text
            use_threads(trained.config.model.d_model, 1, show=show)
            stream = TextStream(trained.tokenizer, write)
            generate(trained, args.prompt, opts, stream)
    except (KeyboardInterrupt, Interrupted) as e:  # the CLI turns SIGINT and SIGTERM into Interrupted
        done = stream.generated if stream is not None else 0
        print(flush=True)  # ends the text's line
        signum = getattr(e, "signum", signal.SIGINT)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"parnas generate: stopped by {what} after {done:,} of {opts.tokens:,} tokens (the text so far is "
              "above)", file=sys.stderr)
        return 128 + signum
    print()
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """One table of finished runs: architecture, size, speed timed side by side here, memory and perplexity, then
    each run's own throughput (timed separately, in its own process)."""
    from pathlib import Path

    from parnas.errors import ParnasError
    from parnas.files import check_file_folder, write_text_atomic
    from parnas.retrain.compare import AUTO_TIME_PARAMETERS, markdown, read_run, rows, should_time, time_runs, to_csv

    runs = [read_run(run) for run in args.runs]
    if args.out:  # checked before anything is printed or written
        for target in (Path(f"{args.out}.md"), Path(f"{args.out}.csv")):
            if target.is_dir():
                raise ParnasError(f"{target} is a folder; give --out a file prefix")
        check_file_folder(f"{args.out}.md")
    timing, not_timed = None, ""
    if should_time(runs, args.time):
        from parnas.threads import use_threads

        configs = [m["config"] for m in runs if isinstance(m.get("config"), dict)]
        use_threads(max((c["model"]["d_model"] for c in configs), default=0),  # the largest: the train step's
                    max((c["data"]["batch_size"] * c["data"]["seg_len"] for c in configs), default=1), show=None)
        try:
            timing = time_runs(runs, args.rounds,
                               lambda stage, i, n, what: print(f"parnas compare: timing {what}", file=sys.stderr))
        except ParnasError as e:
            if args.time:
                raise
            not_timed = str(e)
    elif args.time is None:
        not_timed = f"a run is over {AUTO_TIME_PARAMETERS:,} parameters, or does not say (--time times them)"
    table = rows(runs, timing)
    text = markdown(table, timing, not_timed, runs)
    print(text, end="")
    if args.out:
        write_text_atomic(f"{args.out}.md", text)
        write_text_atomic(f"{args.out}.csv", to_csv(table))
        print(f"written to {args.out}.md and {args.out}.csv")
    return 0


def _number(kind: type, least: float, what: str) -> object:
    """An argparse type: a finite ``kind`` >= ``least`` (argparse reports a bad one in one line)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
        if not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
        return value
    return parse


def checkpoint_path(text: str) -> str:
    """An argparse type: a run folder (its checkpoints/last.ckpt) or a checkpoint file. Checked while the
    arguments are parsed, before torch loads, so a wrong path is refused at once."""
    from pathlib import Path

    path = Path(text)
    if path.is_dir():
        last = path / "checkpoints" / "last.ckpt"
        if last.is_file():
            return str(last)
        raise argparse.ArgumentTypeError(f"{text} holds no checkpoints/last.ckpt: give a run folder "
                                         "that parnas trained (e.g. runs/found) or a checkpoint file")
    if path.is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text} does not exist: give a run folder (e.g. runs/found) or a checkpoint "
                                     "file (RUN/checkpoints/last.ckpt)")


def run_folder(text: str) -> str:
    """An argparse type: a finished run's folder (holding metrics.json), or a checkpoint inside one
    (RUN/checkpoints/*.ckpt), refused before anything loads."""
    from pathlib import Path

    path = Path(text)
    if path.is_file() and path.parent.name == "checkpoints":
        path = path.parent.parent
    if (path / "metrics.json").is_file():
        return str(path)
    raise argparse.ArgumentTypeError(f"{text} is not a finished run: give the folder of a run parnas trained, "
                                     "holding metrics.json (e.g. runs/found)")


def add_run(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("checkpoint", type=checkpoint_path, metavar="RUN",
                   help=f"a run folder parnas trained (its checkpoints/last.ckpt is {what}) or a checkpoint file")


def add_accelerator(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu", "mps"), default="auto",
                   help="auto (a GPU when present, else the CPU), cpu, gpu (the first visible CUDA device; "
                        "CUDA_VISIBLE_DEVICES picks another) or mps, as retrain's --accelerator")


def add_clamp_len(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clamp-len", type=_number(int, 0, "must be an integer >= 0"), default=None, metavar="C",
                   help="relative distances beyond C read C's position, as Dai et al.'s clamp_len (0: none; "
                        "default: the checkpoint's model.clamp_len)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas.arguments import add_command, add_config_args, add_dry_run, add_resume

    p = add_command(sub, "retrain", cmd_retrain,
                    "parnas retrain --arch architecture.json --config wt2-cpu --out runs/found")
    p.add_argument("--arch", required=True, metavar="JSON|LAYOUT",
                   help="architecture JSON from a search, or a baseline at the same model.n_blocks: "
                        "transformer-xl (attention and dense blocks alternating, so 6 blocks = 3 Transformer-XL "
                        "layers) or all-attention")
    add_config_args(p)
    add_resume(p)
    p.add_argument("--accelerator", default=None,
                   help="auto (a GPU when present, else the CPU), gpu, cpu or mps (default: the config's "
                        "train.accelerator)")
    p.add_argument("--devices", type=int, default=None,
                   help="processes; > 1 trains with DDP (default: the config's train.devices)")
    p.add_argument("--precision", default=None,
                   help="e.g. bf16-mixed on a GPU, 32-true (default: the config's train.precision)")
    p.add_argument("--out", dest="out_dir", default=None, metavar="DIR",
                   help="run folder (default: the config's train.out_dir)")
    add_dry_run(p)

    p = add_command(sub, "evaluate", cmd_evaluate, "parnas evaluate runs/found --split test")
    add_run(p, "evaluated")
    p.add_argument("--split", default="valid", choices=["valid", "test"], help="which split (default valid)")
    p.add_argument("--mem-len", type=_number(int, 0, "must be an integer >= 0"), default=None, metavar="M",
                   help="memory length at evaluation (default: the checkpoint's model.eval_mem_len, else its "
                        "training one; longer is allowed)")
    add_clamp_len(p)
    p.add_argument("--data-path", default=None, help="corpus directory, if it moved since training (default: the "
                   "checkpoint's data.path)")
    add_accelerator(p)
    p.add_argument("--out", default=None, help="result JSON (default: beside the checkpoint, named "
                   "CKPT.SPLIT-memM.json)")

    p = add_command(sub, "generate", cmd_generate,
                    "parnas generate runs/found --prompt 'The album was' --tokens 200 --top-k 40")
    add_run(p, "sampled; it carries its tokenizer")
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a line); a prompt that "
                   "ends with a whole word is continued by a new one")
    p.add_argument("--tokens", type=_number(int, 1, "must be an integer > 0"), default=200,
                   help="how many tokens to sample")
    p.add_argument("--temperature", type=_number(float, 0, "must be a finite number >= 0"), default=1.0,
                   help="0 picks the most likely token")
    p.add_argument("--top-k", type=_number(int, 0, "must be an integer >= 0"), default=0,
                   help="sample among the K most likely tokens (0: all of them)")
    p.add_argument("--seed", type=int, default=0, help="same seed, checkpoint and device: same text")
    p.add_argument("--mem-len", type=_number(int, 0, "must be an integer >= 0"), default=None,
                   help="memory length (default: the checkpoint's model.eval_mem_len, else mem_len + seg_len)")
    add_clamp_len(p)
    add_accelerator(p)

    p = add_command(sub, "compare", cmd_compare, "parnas compare runs/found runs/txl --out runs/compare")
    p.add_argument("runs", nargs="+", type=run_folder, metavar="RUN",
                   help="finished runs: their folders (holding metrics.json) or their checkpoints")
    p.add_argument("--out", default="compare", metavar="PREFIX",
                   help="write PREFIX.md and PREFIX.csv (default: compare); '' writes nothing")
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=None,
                   help="time the runs' models side by side here, in alternating rounds, for the speed columns "
                        "(default: when every run has at most 20M parameters)")
    p.add_argument("--rounds", type=_number(int, 1, "must be an integer >= 1"), default=5,
                   help="alternating timing rounds; their spread is the speed columns' noise (default 5)")

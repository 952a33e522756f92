"""``parnas retrain | evaluate | generate | compare``.

Only argparse is imported here; each handler imports what it needs, so
``parnas --help`` stays fast. User mistakes raise ParnasError subclasses, which
the CLI turns into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json


def cmd_retrain(args: argparse.Namespace) -> int:
    """Train the fixed model of an architecture JSON (or a named layout) from scratch, then evaluate it."""
    from retrain.run import retrain

    overrides = list(args.set)
    for key in ("accelerator", "devices", "precision", "out_dir"):
        if getattr(args, key) is not None:
            overrides.append(f"train.{key}={getattr(args, key)}")
    metrics = retrain(args.arch, args.config, overrides, resume=args.resume)
    if metrics:
        keys = ("architecture", "steps", "val_ppl", "test_ppl", "train_tokens_per_s", "eval_tokens_per_s",
                "peak_memory_mb", "parameters", "attention_blocks")
        print(json.dumps({k: metrics[k] for k in keys}))
        out = metrics["config"]["train"]["out_dir"]
        print(f"{metrics['architecture']}: validation perplexity {metrics['val_ppl']:.2f}, "
              f"test {metrics['test_ppl']:.2f} after {metrics['steps']} steps (metrics in {out}/metrics.json)")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Perplexity of a checkpoint on a whole split (exp of total NLL, memory carried) and evaluation tokens/s."""
    from pathlib import Path

    from parnas.files import write_json_atomic
    from retrain.evaluate import default_output, evaluate_checkpoint
    from retrain.load import device_for, load_trained, scratch_dir

    device = device_for(args.device)
    with scratch_dir() as tmp:
        trained = load_trained(args.checkpoint, device, Path(tmp))
        result = evaluate_checkpoint(trained, args.split, device, args.mem_len, args.data_path)
    result["checkpoint"] = str(args.checkpoint)
    out = args.out or default_output(args.checkpoint, args.split, result["mem_len"])
    write_json_atomic(out, result)
    print(json.dumps(result))
    print(f"{args.split} perplexity {result['ppl']:.3f} at step {result['step']} (memory {result['mem_len']}, "
          f"{result['eval_tokens_per_s']:,.0f} tokens/s; written to {out})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Sample text from a checkpoint after a prompt, carrying the Transformer-XL memory."""
    from pathlib import Path

    from retrain.evaluate import Sampling, generate
    from retrain.load import device_for, load_trained, scratch_dir

    opts = Sampling(tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    mem_len=args.mem_len)
    device = device_for(args.device)
    with scratch_dir() as tmp:
        trained = load_trained(args.checkpoint, device, Path(tmp))
        text, _ = generate(trained, args.prompt, opts, device)
    print(text)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """One table of finished runs: architecture, size, speed, memory and perplexity."""
    from parnas.files import write_text_atomic
    from retrain.compare import markdown, rows, to_csv

    table = rows(args.runs)
    text = markdown(table)
    print(text, end="")
    if args.out:
        write_text_atomic(f"{args.out}.md", text)
        write_text_atomic(f"{args.out}.csv", to_csv(table))
        print(f"written to {args.out}.md and {args.out}.csv")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from parnas.cli import add_command, add_config_args

    p = add_command(sub, "retrain", cmd_retrain)
    p.add_argument("--arch", required=True, metavar="JSON|LAYOUT",
                   help="architecture JSON from a search, or a named layout: transformer-xl, all-attention")
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/checkpoints/last.ckpt")
    p.add_argument("--accelerator", default=None, help="auto (CUDA when present), gpu or cpu (train.accelerator)")
    p.add_argument("--devices", type=int, default=None, help="processes; > 1 trains with DDP (train.devices)")
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed on a GPU, 32-true (train.precision)")
    p.add_argument("--out", dest="out_dir", default=None, metavar="DIR", help="run directory (train.out_dir)")

    p = add_command(sub, "evaluate", cmd_evaluate)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by parnas, e.g. RUN/checkpoints/last.ckpt")
    p.add_argument("--split", default="valid", choices=["valid", "test"])
    p.add_argument("--mem-len", type=int, default=None, metavar="M",
                   help="memory length at evaluation (default: the training one; longer is allowed)")
    p.add_argument("--data-path", default=None, help="corpus directory, if it moved since training")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--out", default=None, help="result JSON (default: beside the checkpoint)")

    p = add_command(sub, "generate", cmd_generate)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a line)")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to sample")
    p.add_argument("--temperature", type=float, default=1.0, help="0 picks the most likely token")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="same seed, checkpoint and device: same text")
    p.add_argument("--mem-len", type=int, default=None, help="memory length (default: mem_len + seg_len)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")

    p = add_command(sub, "compare", cmd_compare)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.json")
    p.add_argument("--out", default="compare", metavar="PREFIX",
                   help="write PREFIX.md and PREFIX.csv (default: compare); '' writes nothing")

"""``parnas`` command line. User mistakes exit with status 2 and one line on stderr."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Callable, Sequence

from parnas.errors import ParnasError


def _quiet_imports() -> None:
    # NNI on torch 2.13 warns that some torch objects are "not a nn.Module"; harmless noise for users.
    warnings.filterwarnings("ignore", message=r".*is found to be not a nn\.Module.*")
    warnings.filterwarnings("ignore", message=r".*pkg_resources is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # Lightning 2.6 on torch 2.13


def cmd_train(args: argparse.Namespace) -> int:
    """Train a fixed Transformer-XL (``model.blocks``, default the standard layout) and print perplexity."""
    from parnas.config import load_config
    from parnas.train import train

    cfg = load_config(args.config, args.set)
    metrics = train(cfg, resume=args.resume)
    if metrics:
        summary = {k: metrics[k] for k in ("steps", "val_ppl", "test_ppl", "train_tokens_per_s", "parameters")}
        print(json.dumps(summary))
        print(f"validation perplexity {metrics['val_ppl']:.2f} after {metrics['steps']} steps "
              f"(metrics in {cfg.train.out_dir}/metrics.json)")
    return 0


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and repeatable ``--set``, shared by every command that reads a config."""
    p.add_argument("--config", default=None, help="YAML file or preset name (tiny, wt2-seed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set model.d_model=256 (repeatable)")


def add_command(sub: argparse._SubParsersAction, name: str, fn: Callable[[argparse.Namespace], int]
                ) -> argparse.ArgumentParser:
    """A sub-command whose help is ``fn``'s docstring; ``fn(args)`` returns the exit status."""
    p = sub.add_parser(name, help=(fn.__doc__ or "").splitlines()[0], description=fn.__doc__)
    p.set_defaults(fn=fn)
    return p


# Modules with ``add_commands(sub)``; they import only argparse at module level and load
# heavy code inside their handlers, so ``parnas --help`` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("strategies.commands", "parnas.plot_commands", "retrain.commands",
                                    "retrain.study_commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parnas", description="Find and retrain PAR Transformer-XL models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = add_command(sub, "train", cmd_train)
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/checkpoints/last.ckpt")
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_imports()
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ParnasError as e:
        print(f"parnas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `parnas ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"parnas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

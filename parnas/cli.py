"""``parnas`` command line. User mistakes exit with status 2 and one line on stderr.

Every command reads and checks its config and arguments before it imports torch,
Lightning or NNI (seconds to import), so a typo fails at once. Output is quiet by
default: Lightning's and NNI's info messages only with ``--verbose``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import shutil
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from parnas.arguments import ArgumentParser, add_command, add_config_args, add_dry_run, add_verbose
from parnas.errors import Interrupted, ParnasError


def _quiet_imports() -> None:
    # NNI on torch 2.13 warns that some torch objects are "not a nn.Module"; harmless noise for users.
    warnings.filterwarnings("ignore", message=r".*is found to be not a nn\.Module.*")
    warnings.filterwarnings("ignore", message=r".*pkg_resources is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # Lightning 2.6 on torch 2.13


def set_verbosity(verbose: bool) -> None:
    """Record the choice on the ``parnas`` logger; :func:`parnas.training.fit.build_trainer` applies it to
    Lightning and NNI once they are imported (they reset their own levels on import)."""
    logging.getLogger("parnas").setLevel(logging.INFO if verbose else logging.WARNING)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a fixed Transformer-XL (``model.blocks``, default the standard layout) and print perplexity."""
    from parnas.config import load_config
    from parnas.files import check_run_dir

    cfg = load_config(args.config, args.set)  # before torch is imported: a mistake fails at once
    if args.dry_run:
        from parnas.training.dry_run import dry_run

        print(dry_run(cfg, [[kind] for kind in cfg.model.layout], "train"))
        return 0
    check_run_dir(cfg.train.out_dir, args.resume)
    from parnas.training.fit import summary, train

    metrics = train(cfg, resume=args.resume)
    if metrics:
        print(summary(metrics, cfg.train.out_dir))
    return 0


# Modules with ``add_commands(sub)``; they import only argparse at module level and load
# heavy code inside their handlers, so ``parnas --help`` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("strategies.commands", "parnas.report.commands", "retrain.commands",
                                    "study.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="parnas", description="Find and retrain PAR Transformer-XL models.")
    add_verbose(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = add_command(sub, "train", cmd_train)
    add_config_args(p)
    add_dry_run(p)
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/checkpoints/last.ckpt")
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
    return parser


def resume_command(argv: Sequence[str] | None, takes_resume: bool, sets: Sequence[str] = ()) -> str:
    """The command line that continues an interrupted run, shell-quoted: the program as it was started
    (``parnas``, or ``python -m parnas.cli``), the same arguments, ``--set`` for each of ``sets`` (what a
    run inside an NNI trial got from outside its arguments) and ``--resume`` where the command takes it."""
    if argv is None:  # run as a program: sys.orig_argv is the interpreter, its options and the program
        argv = sys.argv[1:]
        program = sys.orig_argv[:len(sys.orig_argv) - len(argv)] or ["parnas"]
        script = Path(program[-1])
        if script.name == "parnas" and shutil.which("parnas") == str(script):  # the console script, on PATH
            program = ["parnas"]
        elif script.name == "parnas":
            program = [str(script)]
    else:  # main([...]) from Python
        program = ["parnas"]
    extra = [a for s in sets for a in ("--set", s)]
    resume = ["--resume"] if takes_resume and "--resume" not in argv else []
    return shlex.join([*program, *argv, *extra, *resume])


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for any user mistake, argument errors included)."""
    _quiet_imports()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or an argument error (2, its line already printed)
        return e.code if isinstance(e.code, int) else 2
    set_verbosity(args.verbose)
    try:
        return args.fn(args)
    except ParnasError as e:
        print(f"parnas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `parnas ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Interrupted as e:  # the checkpoint is written (parnas.training.interrupt)
        if e.rank == 0:
            again = resume_command(argv, getattr(args, "resume", None) is not None, getattr(args, "resume_sets", ()))
            print(f"parnas {args.command}: stopped by {signal.Signals(e.signum).name} after step {e.step:,}, "
                  f"saved in {e.checkpoint}; resume with: {again}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"parnas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``parnas`` command line. User mistakes exit with status 2 and one line on stderr.

Every command reads and checks its config and arguments before it imports torch, Lightning or NNI (seconds to import),
so a typo fails at once. Output is quiet by default: Lightning's and NNI's info messages only with ``--verbose``. Before
any of them loads, OpenMP is told to wait passively, and each command that computes chooses its threads
(:mod:`parnas.threads`) and says so in its first line.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import shutil
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from parnas.arguments import ArgumentParser, add_command, add_config_args, add_dry_run, add_resume, add_verbose
from parnas.errors import STOP_SIGNALS, Interrupted, ParnasError, path_error, stop_at_once_from_now
from parnas.files import out_of_space
from parnas.threads import use_threads, wait_passively


def _quiet_imports() -> None:
    # NNI on torch 2.13 warns that some torch objects are "not a nn.Module"; harmless noise for users.
    warnings.filterwarnings("ignore", message=r".*is found to be not a nn\.Module.*")
    warnings.filterwarnings("ignore", message=r".*pkg_resources is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # Lightning 2.6 on torch 2.13


def set_verbosity(verbose: bool) -> None:
    """Record the choice on the ``parnas`` logger; :func:`parnas.training.trainer.build_trainer` applies it to
    Lightning and NNI once they are imported (they reset their own levels on import)."""
    logging.getLogger("parnas").setLevel(logging.INFO if verbose else logging.WARNING)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a fixed Transformer-XL (``model.blocks``, default the standard layout) and print perplexity."""
    from parnas.config import load_config
    from parnas.owned_folders import take_run_dir

    cfg = load_config(args.config, args.set)  # before torch is imported: a mistake fails at once
    if args.dry_run:
        from parnas.training.dry_run import dry_run

        print(dry_run(cfg, [[kind] for kind in cfg.model.layout], "train"))
        return 0
    with take_run_dir(cfg.train.out_dir, args.resume):  # held and checked once: another run into it is refused
        use_threads(cfg.model.d_model, cfg.data.step_tokens, cfg.train.threads, cfg.train.devices)
        from parnas.report.summaries import training_summary
        from parnas.training.fit import train

        metrics = train(cfg, resume=args.resume)
    if metrics:
        print(training_summary(metrics, cfg.train.out_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    # The commands' modules import only argparse (and parnas's torch-free registries) at module level and load
    # heavy code inside their handlers, so ``parnas --help`` stays fast and a config is checked before torch loads.
    from parnas.report import commands as report_commands
    from parnas.retrain import commands as retrain_commands
    from parnas.strategies import commands as search_commands
    from parnas.study import commands as study_commands

    parser = ArgumentParser(prog="parnas", description="Find and retrain PAR Transformer-XL models.")
    add_verbose(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = add_command(sub, "train", cmd_train, "parnas train --config tiny --set train.out_dir=runs/tiny")
    add_config_args(p)
    add_dry_run(p)
    add_resume(p)
    for commands in (search_commands, report_commands, retrain_commands, study_commands):
        commands.add_commands(sub)
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
    if takes_resume:  # from last.ckpt now, whichever checkpoint the run started from (--resume=PATH)
        argv = [a for i, a in enumerate(argv) if not a.startswith("--resume")
                and not (argv[i - 1:i] == ["--resume"] and not a.startswith("-"))]
    return shlex.join([*program, *argv, *extra, *(["--resume"] if takes_resume else [])])


def stopped(command: str, e: Interrupted, again: str, takes_resume: bool) -> str:
    """The line a run stopped by a signal leaves: what was saved, and the command that goes on."""
    name = signal.Signals(e.signum).name
    if e.checkpoint is None and takes_resume:
        return f"parnas {command}: stopped by {name} before the first step, nothing new saved; run it again: {again}"
    if e.checkpoint is None:  # a study: its finished runs are kept, and a rerun skips them
        return f"parnas {command}: stopped by {name}; run it again to go on: {again}"
    if e.during:
        return (f"parnas {command}: stopped by {name} during {e.during}, after training to step {e.step:,} "
                f"(saved in {e.checkpoint}); {'--resume' if takes_resume else 'running it again'} finishes it: "
                f"{again}")
    return f"parnas {command}: stopped by {name} after step {e.step:,}, saved in {e.checkpoint}; resume with: {again}"


@contextmanager
def signals_stop() -> Iterator[None]:
    """While a command runs, the stop signals raise :class:`Interrupted` with nothing saved, so a signal before
    the first step ends in one line and 130 / 143 (Lightning would turn Ctrl-C into exit status 1, and SIGTERM
    would end the process silently). The training loop and the work after it take the signals over with what
    they have saved (:mod:`parnas.training.interrupt`). The handlers in place before are put back."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop_at_once_from_now()  # a second signal ends the process at once, in one line
        raise Interrupted(signum)

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        for s in saved:
            signal.signal(s, handler)
        yield
    finally:
        for s, old in saved.items():
            signal.signal(s, old)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for any user mistake, argument errors included)."""
    _quiet_imports()
    wait_passively()  # before torch loads its OpenMP runtime, which reads it once
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or an argument error (2, its line already printed)
        return e.code if isinstance(e.code, int) else 2
    set_verbosity(args.verbose)
    try:
        with signals_stop():
            return args.fn(args)
    except ParnasError as e:
        print(f"parnas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `parnas ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Interrupted as e:  # what was saved, if anything (parnas.training.interrupt)
        if e.rank == 0:
            takes_resume = getattr(args, "resume", None) is not None
            again = resume_command(argv, takes_resume and e.checkpoint is not None, getattr(args, "resume_sets", ()))
            try:
                print(stopped(args.command, e, again, takes_resume), file=sys.stderr)
            except OSError:  # SIGHUP: the terminal it would go to is gone
                pass
        return 128 + e.signum
    except Exception as e:  # a full disk anywhere (logs, plots, TensorBoard), a failed allocation: one line too
        full = out_of_space(e) or path_error(e)
        if full is None and (isinstance(e, (MemoryError, ImportError, OSError))
                             or "parnas.training.memory" in sys.modules):
            try:
                from parnas.training.memory import out_of_memory

                full = out_of_memory(e)
            except (MemoryError, ImportError):  # too little even to word it
                full = ParnasError("could not allocate memory (MemoryError): raise this process's memory limit")
        if full is None:
            raise
        print(f"parnas {args.command}: error: {full}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"parnas {args.command}: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The ``parnas`` command: :func:`main`, then the process's exit. Once the command has ended (its results
    written, its last line printed) the stop signals are ignored while the interpreter shuts down (Lightning's,
    TensorBoard's and NNI's threads ending), so a signal then cannot turn a finished run into a silent death by
    the signal; the exit status stays the command's."""
    code = main()
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()

"""What every ``parnas`` command's parser shares: one-line errors, ``--config``/``--set``, ``--verbose``.

The command modules (``parnas.strategies.commands``, ``parnas.retrain.commands``, ``parnas.study.commands``,
``parnas.report.commands``) build their sub-commands with these; :mod:`parnas.cli` collects them.
Only argparse is imported, so ``parnas --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from importlib import resources
from typing import Any, NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``parnas <cmd>: error: ...; see parnas <cmd> --help``), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def presets() -> list[str]:
    """The names ``--config`` takes as presets: the YAML files shipped in ``parnas/presets``."""
    return sorted(p.name.removesuffix(".yaml") for p in (resources.files("parnas") / "presets").iterdir()
                  if p.name.endswith(".yaml"))


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and repeatable ``--set``, shared by every command that reads a config."""
    p.add_argument("--config", default=None, help=f"YAML file or preset name ({', '.join(presets())})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set model.d_model=256 (repeatable)")


def add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print parameters, training FLOPs per token and a memory estimate (model on the meta "
                        "device), then exit: no data read, nothing allocated or written")


def add_resume(p: argparse.ArgumentParser, what: str = "<out_dir>") -> None:
    """``--resume`` (from ``last.ckpt``) or ``--resume=PATH`` (from another checkpoint, e.g. an older one kept
    beside a damaged ``last.ckpt``): ``args.resume`` is False, True or the path."""
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CKPT",
                   help=f"continue from {what}/checkpoints/last.ckpt, or from the checkpoint CKPT (--resume=CKPT)")


def add_verbose(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="show Lightning's and NNI's info messages")


def summary(doc: str) -> str:
    """A docstring's first sentence on one line, without reST's double backquotes: a sentence ends at a full
    stop before whitespace (so ``architecture.json``, ``127.0.0.1`` or "e.g. this" go on), or at the first
    paragraph's end."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    return re.split(r"(?<![ei]\.[eg]\.)(?<=[.!?])\s", paragraph, maxsplit=1)[0]


def add_command(sub: argparse._SubParsersAction, name: str, fn: Callable[[argparse.Namespace], int]
                ) -> argparse.ArgumentParser:
    """A sub-command whose summary in ``parnas --help`` is the first sentence of ``fn``'s docstring (whole, however
    many lines it takes) and whose own ``--help`` has the docstring; ``fn(args)`` returns the exit status."""
    p = sub.add_parser(name, help=summary(fn.__doc__ or ""), description=fn.__doc__)
    p.set_defaults(fn=fn)
    add_verbose(p, argparse.SUPPRESS)  # `parnas -v train` and `parnas train -v` both work
    return p

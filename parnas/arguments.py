"""What every ``parnas`` command's parser shares: one-line errors, ``--config``/``--set``, ``--verbose``, and
help that reads as plain text (no reST markup, every option's default, an example line at its end).

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

MARKUP = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``|`([^`]+)`")  # :func:`x`, ``x``, `x`


def plain(doc: str) -> str:
    """A docstring as the help shows it: its reST markup taken away, its paragraphs kept apart."""
    text = MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), doc)
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in text.strip().split("\n\n"))


class HelpFormatter(argparse.HelpFormatter):
    """Paragraphs filled one by one (argparse would run them together), an epilog's lines kept as written (the
    example), and every option's default said: appended as "(default: X)" unless its help says it already."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("Example:"):
            return text
        return "\n\n".join(super(HelpFormatter, self)._fill_text(paragraph, width, indent)
                             for paragraph in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required or action.default is None
                or action.default is argparse.SUPPRESS or action.dest == "help"):
            return text
        default = {False: "off", True: "on"}.get(action.default, action.default) if isinstance(
            action.default, bool) else action.default
        return f"{text} (default: {'none' if default == [] else default})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``parnas <cmd>: error: ...; see parnas <cmd> --help``), status 2, and
    whose help is :class:`HelpFormatter`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def presets() -> list[str]:
    """The names ``--config`` takes as presets: the YAML files shipped in ``parnas/presets``."""
    return sorted(p.name.removesuffix(".yaml") for p in (resources.files("parnas") / "presets").iterdir()
                  if p.name.endswith(".yaml"))


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and repeatable ``--set``, shared by every command that reads a config."""
    p.add_argument("--config", default=None,
                   help=f"YAML file or preset name ({', '.join(presets())}); default: the built-in settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set model.d_model=256 (repeatable)")


def add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print parameters, training FLOPs per token and a memory estimate (model on the meta "
                        "device), then exit: no data read, nothing allocated or written")


def add_resume(p: argparse.ArgumentParser) -> None:
    """``--resume`` (from ``last.ckpt``) or ``--resume=PATH`` (from another checkpoint, e.g. an older one kept
    beside a damaged ``last.ckpt``): ``args.resume`` is False, True or the path. Worded once for every command."""
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CKPT",
                   help="continue the run in its run folder from RUN/checkpoints/last.ckpt, or from the checkpoint "
                        "CKPT (--resume=CKPT)")


def add_verbose(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="show Lightning's and NNI's info messages (default: off)")


def summary(doc: str) -> str:
    """A docstring's first sentence on one line, without reST markup: a sentence ends at a full stop before
    whitespace (so ``architecture.json``, ``127.0.0.1`` or "e.g. this" go on), or at the first paragraph's end."""
    paragraph = plain(doc).split("\n\n")[0]
    return re.split(r"(?<![ei]\.[eg]\.)(?<=[.!?])\s", paragraph, maxsplit=1)[0]


def add_command(sub: argparse._SubParsersAction, name: str, fn: Callable[[argparse.Namespace], int],
                example: str) -> argparse.ArgumentParser:
    """A sub-command whose summary in ``parnas --help`` is the first sentence of ``fn``'s docstring (whole, however
    many lines it takes), whose own ``--help`` has the docstring as plain text and ends with ``example`` (one
    command line); ``fn(args)`` returns the exit status."""
    p = sub.add_parser(name, help=summary(fn.__doc__ or ""), description=plain(fn.__doc__ or ""),
                       epilog=f"Example:\n  {example}")
    p.set_defaults(fn=fn)
    add_verbose(p, argparse.SUPPRESS)  # `parnas -v train` and `parnas train -v` both work
    return p

"""The arguments every benchmark of a model shares: which config, its overrides, and a vocabulary size.

Imported as ``import model_args`` by the scripts beside it (run as ``python benchmarks/NAME.py``, so this
folder is first on ``sys.path``). The benchmarks build their models without reading a corpus, so the
vocabulary is a number, WikiText-103's 12,000 SentencePiece pieces by default (the adaptive softmax's cost
depends on it).
"""

from __future__ import annotations

import argparse


def model_parser(doc: str | None, config: str) -> argparse.ArgumentParser:
    """A parser with the script's docstring ``doc`` as its description, ``--config`` (default ``config``),
    repeatable ``--set KEY=VALUE`` and ``--vocab-size``; the script adds its own arguments."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=config, help=f"YAML file or preset name (default {config})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting (repeatable)")
    parser.add_argument("--vocab-size", type=int, default=12000, help="vocabulary size (default 12000)")
    return parser

"""JSON and YAML that a user gives parnas (architecture files, latency tables, configs, ``--set`` values, run
folders' metrics), read within limits.

Python's parsers recurse once per level of nesting: a few MB of ``[`` end in RecursionError, and a huge file
is read whole into memory. Both are refused here, before parsing, in one line naming the file. Every file
parnas writes or documents is far inside both limits (an architecture file is a few kB and nests 4 levels,
a config or latency table a few kB more). Parse errors themselves are the caller's to word: they propagate
as ``ValueError`` (JSON) and ``yaml.YAMLError``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from parnas.errors import ParnasError

MAX_BYTES = 4 * 2**20  # 4 MiB
MAX_DEPTH = 64  # lists and mappings inside each other

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def read_bytes(path: str | Path, what: str | None = None) -> bytes:
    """The file's bytes, refused (ParnasError) above :data:`MAX_BYTES` before it is read. OSError propagates."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise _too_large(what or str(path), size)
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:  # grew, or a special file that reports no size
        raise _too_large(what or str(path), len(data))
    return data


def read_text(path: str | Path, what: str | None = None) -> str:
    """:func:`read_bytes` decoded as UTF-8 (UnicodeDecodeError propagates)."""
    return read_bytes(path, what).decode()


def parse_json(text: str | bytes, what: str) -> Any:
    """``json.loads`` after the size and depth checks; ``what`` names the source in the one-line error."""
    if isinstance(text, bytes):
        text = text.decode()
    _check_size(text, what)
    depth = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise _too_deep(what)
    return json.loads(text)


def parse_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` after the size and depth checks. The depth is counted on the parser's event stream,
    which PyYAML produces without recursion; only building the objects recurses."""
    _check_size(text, what)
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(what)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.safe_load(text)


def read_json(path: str | Path, what: str | None = None) -> Any:
    """:func:`parse_json` of the file (OSError, UnicodeDecodeError and ValueError propagate)."""
    return parse_json(read_text(path, what), what or str(path))


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_BYTES:
        raise _too_large(what, len(text.encode()))


def _too_large(what: str, size: int) -> ParnasError:
    return ParnasError(f"{what} is {size / 2**20:.1f} MiB, above the {MAX_BYTES // 2**20} MiB parnas reads "
                       "from a JSON or YAML file: check that it is the file you meant")


def _too_deep(what: str) -> ParnasError:
    return ParnasError(f"{what} nests lists or mappings more than {MAX_DEPTH} levels deep, which no parnas file "
                       "does: check that it is the file you meant")

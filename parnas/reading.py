"""JSON and YAML that a user gives parnas (architecture files, latency tables, configs, ``--set`` values, run
folders' metrics), read within limits.

Python's parsers recurse once per level of nesting (a few MB of ``[`` end in RecursionError) and read a huge file
whole, and YAML's aliases let a few hundred bytes stand for billions of values ("billion laughs"): size, depth
and the values aliases add are refused before anything is built, in one line naming the file; every file
parnas writes is far inside the limits. A key given twice in one mapping is refused with both lines (the parsers
keep the last silently). Parse errors propagate as ``ValueError`` (JSON) and ``yaml.YAMLError``, for the caller.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from parnas.errors import ParnasError

MAX_BYTES = 4 * 2**20  # 4 MiB
MAX_DEPTH = 64  # lists and mappings inside each other
MAX_REPEATED = 100_000  # values YAML's aliases may add to those written out (no parnas file has any)
SHOWN = 80  # characters of a value an error message quotes

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")
_JSON_TOKEN = re.compile(r'("(?:[^"\\]|\\.)*")(\s*:)?|[\[\]{}]', re.S)
_MERGE = "tag:yaml.org,2002:merge"


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISREG, "a file"))


def kind_of(path: str | Path) -> str:
    """What is at ``path``, in words (``"a FIFO (named pipe)"``, ``"a symbolic link"``, ``"a file"``...); a link
    is named as such, not followed. ``"nothing"`` if nothing is there."""
    try:
        return _kind(os.lstat(path).st_mode)
    except OSError:
        return "nothing"


def _kind(mode: int) -> str:
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def _not_regular(what: str, mode: int) -> ParnasError:
    return ParnasError(f"{what} is {_kind(mode)}, not a file: give the path of a regular file")


def check_regular(path: str | Path, what: str | None = None) -> Path:
    """``path``, refused (ParnasError, one line naming what it is) if it exists and is not a regular file (after
    links): a FIFO blocks whoever opens it until a writer comes, a device or socket is never a file a user meant.
    Checked by ``stat`` before any ``open``; a missing file is left to the caller to word."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        return path
    if not stat.S_ISREG(mode):
        raise _not_regular(what or str(path), mode)
    return path


def read_bytes(path: str | Path, what: str | None = None) -> bytes:
    """The file's bytes, refused (ParnasError) if it is not a regular file (:func:`check_regular`: a FIFO would
    block the open) or above :data:`MAX_BYTES`, before it is read. OSError propagates."""
    path = check_regular(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in since the check: no hang
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(what or str(path), info.st_mode)
        size = info.st_size
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
    """``json.loads`` after the size and depth checks; ``what`` names the source in the one-line error. A key
    given twice in one object is refused (ParnasError naming the key and its line)."""
    if isinstance(text, bytes):
        text = text.decode()
    _check_size(text, what)
    depth = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise _too_deep(what)
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        built = dict(items)
        if len(built) < len(items) and not repeated:
            seen: set[str] = set()
            repeated.append(next(k for k, _ in items if k in seen or seen.add(k)))
        return built

    value = json.loads(text, object_pairs_hook=pairs)
    if repeated:
        raise _json_repeated(text, what)
    return value


def parse_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` after the size and depth checks, refusing a key given twice in one mapping and aliases
    that repeat more than :data:`MAX_REPEATED` values or nest deeper than :data:`MAX_DEPTH`. The depth is first
    counted on the parser's event stream, which PyYAML makes without recursion; nothing is built before every
    check has passed (:class:`_Measure` checks the composed node graph)."""
    _check_size(text, what)
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(what)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _Measure(loader, what).check(node)
        return loader.construct_document(node)
    except ValueError as e:  # a value Python will not build: an integer of thousands of digits, a 30 February
        if "digits" in str(e):
            raise ParnasError(f"{what}: a number of more than {sys.get_int_max_str_digits()} digits, which no "
                              "parnas setting takes") from None
        raise ParnasError(f"{what}: cannot read a value: {clipped(str(e), 200)}") from None
    finally:
        loader.dispose()


def read_json(path: str | Path, what: str | None = None) -> Any:
    """:func:`parse_json` of the file (OSError, UnicodeDecodeError and ValueError propagate)."""
    return parse_json(read_text(path, what), what or str(path))


class _Prefix(reprlib.Repr):
    """reprlib's bounded repr, but strings keep their start (reprlib keeps both ends of a long one)."""

    def repr_str(self, x: str, level: int) -> str:
        return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_REPR = _Prefix()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 4, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = SHOWN, SHOWN, SHOWN


def shown(value: Any, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to its first ``limit`` characters (then ``...``), computed without building the whole
    repr: what an error message quotes of a value that may be megabytes long, or a tree of millions."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clipped(text: str, limit: int = SHOWN) -> str:
    """``text`` cut to its first ``limit`` characters (then ``...``): a key or a word quoted in an error."""
    return text if len(text) <= limit else text[:limit] + "..."


class _Measure:
    """One pass over a composed YAML node graph: each distinct node once, so a graph of aliases costs its written
    size. It counts the values the aliases repeat and how deep they nest, and finds a key given twice."""

    def __init__(self, loader: yaml.SafeLoader, what: str) -> None:
        self.loader, self.what = loader, what
        self.done: dict[int, tuple[int, int]] = {}  # id(node) -> (values under it, expanded; collections deep)
        self.distinct = 0

    def check(self, root: yaml.Node) -> None:
        values, _ = self._visit(root, 1)
        if values - self.distinct > MAX_REPEATED:
            raise ParnasError(f"{self.what}: its aliases (*name) repeat more than {MAX_REPEATED:,} values, which no "
                              "parnas file does: write the values out, or check that it is the file you meant")

    def _visit(self, node: yaml.Node, depth: int) -> tuple[int, int]:
        """(values, collections deep) of ``node`` with every alias expanded; ``depth``: collections above + 1.
        Refuses as soon as the expansion nests too deep: an alias inside its own anchor never ends."""
        if isinstance(node, yaml.ScalarNode):
            if id(node) not in self.done:
                self.distinct += 1
                self.done[id(node)] = (1, 0)
            return self.done[id(node)]
        if depth > MAX_DEPTH:
            raise _too_deep(self.what, aliases=True)
        if id(node) in self.done:
            values, deep = self.done[id(node)]
            if depth - 1 + deep > MAX_DEPTH:
                raise _too_deep(self.what, aliases=True)
            return values, deep
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        values, deep = 1, 1
        for child in children:
            v, d = self._visit(child, depth + 1)
            values, deep = values + v, max(deep, d + 1)
            if values - self.distinct > MAX_REPEATED:  # stop counting once over: the count itself is unbounded
                break
        if isinstance(node, yaml.MappingNode):
            self._check_keys(node)
        self.distinct += 1
        self.done[id(node)] = values, deep
        return values, deep

    def _check_keys(self, node: yaml.MappingNode) -> None:
        """A key written twice in one mapping (``<<`` merges may be overridden: that is what they are for)."""
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE:
                continue
            key, line = self.loader.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in first:
                    raise ParnasError(f"{self.what}: key {shown(key)} is given twice in one mapping (lines "
                                      f"{first[key]} and {line}); YAML would keep the last silently: keep one")
                first[key] = line
            except TypeError:  # unhashable: the constructor refuses it in its own words
                continue


def _json_repeated(text: str, what: str) -> ParnasError:
    """The first key given twice in one object, with both lines (found again by a scan of the text, which the
    parser's hook cannot give)."""
    frames: list[dict[str, int] | None] = []
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            frames.append({} if token == "{" else None)
        elif token in "]}":
            frames.pop() if frames else None
        elif match.group(2) and frames and frames[-1] is not None:
            key, line = json.loads(match.group(1)), text.count("\n", 0, match.start()) + 1
            if key in frames[-1]:
                return ParnasError(f"{what}: key {shown(key)} is given twice in one object (lines {frames[-1][key]} "
                                   f"and {line}); JSON readers keep the last silently: keep one")
            frames[-1][key] = line
    return ParnasError(f"{what}: a key is given twice in one object; JSON readers keep the last silently: keep one")


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_BYTES:
        raise _too_large(what, len(text.encode()))


def _too_large(what: str, size: int) -> ParnasError:
    return ParnasError(f"{what} is {size / 2**20:.1f} MiB, above the {MAX_BYTES // 2**20} MiB parnas reads "
                       "from a JSON or YAML file: check that it is the file you meant")


def _too_deep(what: str, aliases: bool = False) -> ParnasError:
    how = " once its aliases (*name) are expanded" if aliases else ""
    return ParnasError(f"{what} nests lists or mappings more than {MAX_DEPTH} levels deep{how}, which no parnas file "
                       "does: check that it is the file you meant")

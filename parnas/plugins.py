"""Names that point at code, read without importing it: ``"module:attribute"`` targets and entry-point groups.

Both registries (block kinds, :mod:`parnas.kinds`; search strategies, :mod:`parnas.strategy_registry`) name
their built-ins' code as ``"module:attribute"`` strings and find plugins through Python entry points, so a
config is checked by name before torch, NNI or a plugin is imported; the code is imported the first time it runs.
"""

from __future__ import annotations

import functools
import importlib
import sys
from importlib import metadata
from typing import Any


def split_target(target: str) -> tuple[str, str] | None:
    """``"pkg.module:attr.sub"`` -> ``("pkg.module", "attr.sub")``; None if it is not of that form."""
    module, sep, attr = target.partition(":")
    ok = sep and all(p.isidentifier() for p in module.split(".")) and all(p.isidentifier() for p in attr.split("."))
    return (module, attr) if ok else None


def load_target(target: str) -> Any:
    """The object a ``"module:attribute"`` string names, importing its module (ImportError, AttributeError or
    ValueError for a string of another form: the caller says whose target it was)."""
    parts = split_target(target)
    if parts is None:
        raise ValueError(f"{target!r} is not a 'module:attribute' string")
    obj: Any = importlib.import_module(parts[0])
    for name in parts[1].split("."):
        obj = getattr(obj, name)
    return obj


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of ``group`` by name; reading them imports no plugin (read once per sys.path)."""
    return _scan(group, tuple(sys.path))


@functools.lru_cache(maxsize=16)
def _scan(group: str, path: tuple[str, ...]) -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=group)}

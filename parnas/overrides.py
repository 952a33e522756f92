"""Nested settings as YAML and ``--set key=value`` give them: parsed, merged, and built into frozen dataclasses with
every key checked (:class:`ConfigError` naming the key). Written by hand because OmegaConf, Hydra or pydantic
bring a config system of their own, and these few functions are all parnas needs.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from parnas import reading
from parnas.errors import ConfigError
from parnas.old_keys import old_key_message


def from_dict(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, recursing into nested sections; an unknown key or a value of the wrong
    type raises ConfigError naming the key (a key of an earlier version: :mod:`parnas.old_keys`' line)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(values).__name__}")
    built: dict[str, Any] = {}
    if hasattr(cls, "regroup"):  # sections named at run time (a kind's settings): the class builds them
        values, built = cls.regroup(values, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - set(built)
    unknown = sorted(set(values) - names)
    for key in unknown:
        if (message := old_key_message(f"{prefix}{key}")) is not None:
            raise ConfigError(message)
    if unknown:
        raise ConfigError(f"unknown config key {reading.clipped(prefix + str(unknown[0]))}; known keys: "
                          f"{', '.join(sorted(names))}")
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hint, f"{prefix}{key}")
    return cls(**kwargs, **built)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a simple type hint; ints widen to float, lists to tuples."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {reading.shown(value)}")
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)  # ints widen; YAML 1.1 reads "1e-3" as a string
        except (ValueError, OverflowError):
            pass
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{key} must be {hint.__name__}, got {reading.shown(value)}")
    return value


def unflatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """``{"search.tau_end": 0.1}`` -> ``{"search": {"tau_end": 0.1}}`` (NNI trial parameters, --set pairs)."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *parents, leaf = str(key).split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{reading.clipped(str(key))}: {reading.clipped(part)} is a value, not a section")
        node[leaf] = merge(node[leaf], value) if isinstance(value, Mapping) and leaf in node else value
    return nested


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``["model.d_model=256", "data.cutoffs=[100,1000]"]`` -> nested dict (values parsed as YAML)."""
    flat: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {reading.shown(pair)}")
        try:
            flat[key] = reading.parse_yaml(raw, f"--set {reading.clipped(key)}")
        except yaml.YAMLError:
            raise ConfigError(f"--set {reading.clipped(key)}: cannot parse {reading.shown(raw)} as a value") from None
    return unflatten(flat)


def as_given(key: str, text: str) -> str:
    """A ``--set`` pair whose value reads back as ``text`` exactly: what a path option (``--out DIR``) passes on.
    Written as a YAML double-quoted string, so ``#`` (a comment), ``yes``/``null`` (a bool, None) or ``: `` mean
    nothing; every character YAML may not hold as it is, a lone surrogate from an undecodable file name
    included, is escaped."""
    def escaped(ch: str) -> str:
        code = ord(ch)
        if ch in '"\\':
            return "\\" + ch
        if 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or code > 0xFFFF:
            return ch
        return f"\\u{code:04x}"

    return f'{key}="{"".join(map(escaped, text))}"'


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``extra`` into ``base`` (new dict; sections merge, values replace)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out

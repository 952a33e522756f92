"""The architecture JSON: the contract between search and retrain.

``architecture`` is exactly NNI's exported sample (``block_<i>`` -> candidate name), so
``model_context(record["architecture"])`` consumes it unchanged. ``model`` records every :class:`ModelConfig` setting
plus ``vocab_size``, so retrain rebuilds the searched model exactly unless told otherwise. :func:`validate` checks the
whole record before anything is built and raises :class:`ArchitectureError` with one line for anything it cannot honour.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from parnas import kinds, reading
from parnas.config import ModelConfig, transformer_xl_layout
from parnas.errors import ConfigError, ParnasError
from parnas.files import write_json_atomic
from parnas.overrides import from_dict

FORMAT, VERSION = "parnas.architecture", 1
NAMED_LAYOUTS = ("transformer-xl", "all-attention")


class ArchitectureError(ParnasError):
    """An architecture file that is not JSON, or not one parnas can honour."""


def label(index: int) -> str:
    return f"block_{index}"


def make_record(architecture: Mapping[str, str], model: ModelConfig, vocab_size: int, *,
                probabilities: Mapping[str, Mapping[str, float]] | None = None,
                tokenizer: Mapping[str, Any] | None = None, search: Mapping[str, Any] | None = None) -> dict:
    """A record in this module's format (validated before it is returned)."""
    model_fields = {k: v for k, v in model.to_dict().items() if k != "blocks"}
    record = {
        "format": FORMAT, "version": VERSION,
        "architecture": {label(i): architecture[label(i)] for i in range(model.n_blocks)},
        "probabilities": {k: dict(v) for k, v in (probabilities or {}).items()},
        "model": {**model_fields, "cutoffs": list(model.cutoffs), "vocab_size": vocab_size},
        "tokenizer": dict(tokenizer or {}),
        "search": dict(search or {}),
    }
    validate(record)
    return record


def named_layout(name: str, model: ModelConfig, vocab_size: int) -> dict:
    """Baselines: ``transformer-xl`` (attention, dense, ...) or ``all-attention``, at ``model.n_blocks``."""
    if name == "transformer-xl":
        kinds = list(transformer_xl_layout(model.n_blocks))
    elif name == "all-attention":
        kinds = ["attention"] * model.n_blocks
    else:
        raise ArchitectureError(f"unknown layout {name!r}; named layouts are {', '.join(NAMED_LAYOUTS)}")
    return make_record({label(i): k for i, k in enumerate(kinds)}, model, vocab_size, search={"layout": name})


def validate(record: Any, source: str = "architecture") -> dict:
    """Check format, version, block labels and kinds, and the model settings; returns the record."""
    def fail(message: str) -> None:
        raise ArchitectureError(f"{source}: {message}")

    if not isinstance(record, dict):
        fail("must be a JSON object")
    if record.get("format") != FORMAT:
        fail(f"format is {record.get('format')!r}, expected {FORMAT!r}")
    if not _is_int(record.get("version")) or record.get("version") != VERSION:  # true == 1 in Python
        fail(f"version {record.get('version')!r} is not supported (this parnas reads version {VERSION})")
    arch, model = record.get("architecture"), record.get("model")
    if not isinstance(arch, dict) or not arch:
        fail("'architecture' must map block labels to block kinds")
    if not isinstance(model, dict) or not _is_int(model.get("vocab_size")):
        fail("'model' must hold the model settings and an integer vocab_size")
    if "n_blocks" in model and not _is_int(model["n_blocks"]):
        fail(f"model.n_blocks must be int, got {reading.shown(model['n_blocks'])}")
    bad = {k: v for k, v in arch.items() if not isinstance(v, str) or not kinds.is_known(v)}
    if bad:
        key = next(iter(bad))
        fail(f"{key}: {kinds.unknown_message(bad[key])}")
    expected = [label(i) for i in range(len(arch))]
    if sorted(arch) != sorted(expected):
        fail(f"block labels {sorted(arch)} do not match the space's labels block_0..block_{len(arch) - 1}")
    if model.get("n_blocks", len(arch)) != len(arch):
        fail(f"{len(arch)} blocks in 'architecture' but model.n_blocks is {model.get('n_blocks')}")
    try:
        model_config(record)
    except ConfigError as e:
        fail(str(e))
    return record


def _is_int(value: Any) -> bool:
    """An int as JSON writes one: not ``4.0``, and not ``true`` (a bool is an int in Python), as ``--set`` takes."""
    return isinstance(value, int) and not isinstance(value, bool)


def model_config(record: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The record's model settings (``vocab_size`` aside), with ``overrides`` applied."""
    values = {k: v for k, v in record["model"].items() if k != "vocab_size"}
    values.update({"n_blocks": len(record["architecture"])} | dict(overrides or {}))
    return from_dict(ModelConfig, values, "model.")


def layout(record: Mapping[str, Any]) -> list[str]:
    """Block kinds in depth order."""
    return [record["architecture"][label(i)] for i in range(len(record["architecture"]))]


def layout_string(layout: Sequence[str]) -> str:
    """``['attention', 'dense', 'identity']`` -> ``'ADI'`` (each kind's registered letter)."""
    return "".join(kinds.letter(k) for k in layout)


def legend(layout: Sequence[str] | str) -> str:
    """What the letters of a layout mean: ``'ACD'`` or ``['attention', 'conv']`` -> ``'A attention, C conv, ...'``
    (each kind once, in order of appearance)."""
    if isinstance(layout, str):
        by_letter = {kinds.letter(k): k for k in kinds.names()}
        return ", ".join(f"{c} {by_letter.get(c, 'unknown kind')}" for c in dict.fromkeys(layout))
    return ", ".join(f"{kinds.letter(k)} {k}" for k in dict.fromkeys(layout))


def read(path: str | Path) -> dict:
    """Load and validate an architecture file."""
    try:
        text = reading.read_text(path)
    except OSError as e:
        raise ArchitectureError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ArchitectureError(f"{path} is not JSON (not UTF-8 text: give the architecture.json a search wrote, "
                                "or a named layout)") from None
    try:
        record = reading.parse_json(text, str(path))
    except json.JSONDecodeError as e:
        raise ArchitectureError(f"{path} is not JSON ({e.msg}: line {e.lineno}, column {e.colno})") from None
    return validate(record, str(path))


def write(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Validate, then write atomically."""
    validate(dict(record), str(path))
    return write_json_atomic(path, record)

"""A latency table: what each block kind costs on one device at one set of shapes, and the file that holds it.

A table prices a whole step as ``constant + sum of its blocks' costs`` for each latency target it was timed for.
It is JSON, format ``FORMAT`` (versions below). A table read from a file is checked whole before a run uses it
(:func:`load_table_for`); the device it was timed on may differ.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from parnas import kinds, reading
from parnas.config import LATENCY_TARGETS, Config, ModelConfig, generation_memory, transformer_xl_layout
from parnas.errors import ConfigError

MODES = LATENCY_TARGETS  # the latency targets a table prices (both names stay importable from here)
FORMAT = "parnas.latency"
# The format's versions, oldest first: 1 prices train and inference (still readable), 2 every target, 3 some of
# them. A table is written as 2 when it is whole, so that parnas before version 3 still reads it, else as 3.
WHOLE_VERSION, PARTIAL_VERSION = 2, 3
VERSION_MODES = {1: ("train", "inference"), WHOLE_VERSION: MODES}  # the targets a whole table of each version holds
READABLE_VERSIONS = (*VERSION_MODES, PARTIAL_VERSION)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu:{platform.processor() or platform.machine()}"


@dataclass(frozen=True)
class LatencyTable:
    """Per-kind block costs and the constant part, in milliseconds per step, for one device and shape set."""

    key: dict[str, Any]
    constant_ms: dict[str, float]  # mode -> ms
    kinds_ms: dict[str, dict[str, float]]  # kind -> mode -> ms per block
    n_reference: int  # blocks in the uniform models that were timed
    timing: dict[str, Any] | None = None  # how steady, under what load, when and where (None: an older table)

    @property
    def modes(self) -> tuple[str, ...]:
        """The targets this table prices (a version-1 table has no ``generate``)."""
        return tuple(m for m in MODES if m in self.constant_ms)

    def block_ms(self, kind: str, mode: str = "train") -> float:
        if kind not in self.kinds_ms:
            raise KeyError(f"no latency for block kind {kind!r} in this table ({sorted(self.kinds_ms)})")
        return self.kinds_ms[kind][mode]

    def predict(self, kinds: Sequence[str], mode: str = "train") -> float:
        """Predicted milliseconds of one step of a model with these blocks."""
        return self.constant_ms[mode] + sum(self.block_ms(k, mode) for k in kinds)

    def transformer_xl_ms(self, n_blocks: int, mode: str = "train") -> float:
        return self.predict(transformer_xl_layout(n_blocks), mode)

    def costs(self, mode: str = "train") -> dict[str, float]:
        return {k: v[mode] for k, v in self.kinds_ms.items()}

    def for_run(self, key: dict[str, Any]) -> LatencyTable:
        """This table's costs under a run's ``key``, restricted to the kinds that key lists."""
        return LatencyTable(key, self.constant_ms, {k: self.kinds_ms[k] for k in key["kinds"]}, self.n_reference,
                            self.timing)

    def to_dict(self) -> dict[str, Any]:
        """As a table file holds it: ``WHOLE_VERSION`` when it prices every target, else ``PARTIAL_VERSION``."""
        version = WHOLE_VERSION if set(self.modes) == set(MODES) else PARTIAL_VERSION
        return {"format": FORMAT, "version": version, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyTable:
        if d.get("format") != FORMAT or d.get("version") not in READABLE_VERSIONS:
            raise ValueError("not a parnas latency table")
        return cls(d["key"], d["constant_ms"], d["kinds_ms"], int(d["n_reference"]), d.get("timing"))


def table_key(cfg: Config, vocab_size: int, kinds: Sequence[str], device: torch.device) -> dict[str, Any]:
    """Everything a block's measured cost depends on (the memories ``model.mem_len`` and ``model.eval_mem_len``
    among the model's settings; the position clamp changes no cost)."""
    key = {"device": device_name(device), "device_type": device.type, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "precision": cfg.train.precision,
           "batch_size": cfg.data.batch_size, "seg_len": cfg.data.seg_len, "vocab_size": vocab_size,
           "clip": bool(cfg.train.clip), "model": model_key(cfg.model, kinds), "kinds": sorted(kinds)}
    return json.loads(json.dumps(key))  # as it reads back from the cache (tuples become lists)


def model_key(model: ModelConfig, kinds: Sequence[str]) -> dict[str, Any]:
    """The model settings a table's costs depend on: the body's, and the timed kinds' own (a ``<kind>`` section
    each; another kind's settings change no cost here)."""
    timed = set(kinds)
    return {k: v for k, v in model.to_dict().items()
            if k not in ("n_blocks", "blocks", "clamp_len") and (not isinstance(v, dict) or k in timed)}


def read_table(path: Path) -> LatencyTable:
    """A table written by :meth:`LatencyTable.to_dict` (a search pins its own in its run directory)."""
    return LatencyTable.from_dict(reading.read_json(path))


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))  # the model settings this version has
# Where and how a table was timed rather than what was timed: a table from another machine may differ in these.
DEVICE_FIELDS = ("device", "device_type", "torch", "threads", "precision")


def _kind_fields(kind: str) -> set[str]:
    """The settings this version's ``kind`` has."""
    settings = kinds.get(kind).settings_class()
    return {f.name for f in dataclasses.fields(settings)} if settings is not None else set()


def shape_differences(table_key: dict[str, Any], run_key: dict[str, Any]) -> list[str]:
    """``name table-value vs run-value`` for each shape (``model.<setting>`` for the model's) that differs.
    A model setting newer than the table counts as its default there (what the code that timed it built); one this
    version's model has no field for (a key of an earlier version: a kind's setting then kept flat, or one a kind
    has no more) is no shape of any run it builds, and is left out."""
    def flat(key: dict[str, Any], model_defaults: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in key.items() if k not in (*DEVICE_FIELDS, "kinds", "model")}
        model = {**model_defaults, **(key.get("model") or {})}
        for name, value in model.items():
            if isinstance(value, dict):  # a kind's settings: only the run's kinds' count, as the model's do
                own = _kind_fields(name) if name in run_key["kinds"] else set()
                out.update({f"model.{name}.{k}": v for k, v in value.items() if k in own})
            elif name in MODEL_FIELDS:
                out[f"model.{name}"] = value
        return out

    # as a key reads back (tuples become lists)
    defaults = json.loads(json.dumps(model_key(ModelConfig(), run_key.get("kinds", ()))))
    table, run = flat(table_key, {k: defaults[k] for k in defaults if k in run_key.get("model", {})}), flat(run_key, {})
    return [f"{k} {json.dumps(table.get(k, 'absent'))} (table) vs {json.dumps(run.get(k, 'absent'))} (run)"
            for k in sorted(set(table) | set(run)) if table.get(k, "absent") != run.get(k, "absent")]


def load_table_for(path: str | Path, run_key: dict[str, Any], setting: str = "search.latency_table",
                   target: str = "train") -> LatencyTable:
    """The table at ``path`` (timed anywhere) for a run whose own key is ``run_key``, restricted to its kinds: its
    shapes must be the run's, its device may differ. Anything else is a :class:`ConfigError` naming ``setting``."""
    path = Path(path)
    try:
        data = reading.read_json(path, f"{setting}: {path}")
    except OSError as e:
        raise ConfigError(f"{setting}: cannot read {path}: {e.strerror}") from None
    except ValueError:  # not UTF-8 or not JSON: a log, a binary file
        raise ConfigError(f"{setting}: {path} is not a parnas latency table (not JSON)") from None
    table = _valid_table(data)
    if table is None:
        raise ConfigError(f"{setting}: {path} is not a parnas latency table (format {FORMAT!r} version "
                          f"{' or '.join(map(str, READABLE_VERSIONS))}, as `parnas latency` writes)")
    problem = cost_problem(table)
    if problem:
        raise ConfigError(f"{setting}: {path} gives {problem}; time the table again with `parnas latency`")
    if target not in table.modes:
        raise ConfigError(f"{setting}: {path} has no {target} costs (it prices {', '.join(table.modes)}: format "
                          f"version {data.get('version')}); time it again with `parnas latency` on its device")
    differences = shape_differences(table.key, run_key)
    if differences:
        raise ConfigError(f"{setting}: {path} was timed at other shapes than this run's: {'; '.join(differences)}")
    missing = [k for k in run_key["kinds"] if k not in table.kinds_ms]
    if missing:
        raise ConfigError(f"{setting}: {path} has no cost for block kind(s) {', '.join(missing)} "
                          f"(it has {', '.join(sorted(table.kinds_ms))}); time one with `parnas latency` "
                          "for this run's candidates")
    return table.for_run({**run_key, **{k: table.key[k] for k in DEVICE_FIELDS if k in table.key}})


def cost_problem(table: LatencyTable) -> str | None:
    """What makes the table's costs unusable, or None: a constant that is not finite and positive, or a block
    cost that is not finite, negative, or zero for a kind other than ``identity`` (a search would take that kind
    for free). ``measure_table`` never writes one."""
    for mode in table.modes:
        a = "an" if mode[0] in "aeiou" else "a"  # an inference cost
        if not (math.isfinite(table.constant_ms[mode]) and table.constant_ms[mode] > 0):
            return f"{a} {mode} constant of {table.constant_ms[mode]} ms (it must be finite and positive)"
        for kind, costs in table.kinds_ms.items():
            cost = costs[mode]
            if not math.isfinite(cost) or cost < 0 or (cost == 0 and kind != "identity"):
                return (f"block kind {kind!r} {a} {mode} cost of {cost} ms (costs are finite and positive; only "
                        "identity may cost 0)")
    return None


def _valid_table(data: Any) -> LatencyTable | None:
    """``data`` as a table if it is a whole, well-typed table of a version this parnas reads, else None."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)  # finite and positive: cost_problem

    try:
        table = LatencyTable.from_dict(data)
        # a partial table prices the targets it was timed for: one at least, none unknown
        modes = VERSION_MODES.get(data["version"]) or (table.modes if set(table.constant_ms) == set(table.modes)
                                                       else ())
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not modes:
        return None
    ok = (isinstance(table.key, dict) and isinstance(table.key.get("device"), str)
          and isinstance(table.key.get("model"), dict) and isinstance(table.constant_ms, dict)
          and all(number(table.constant_ms.get(mode)) for mode in modes) and isinstance(table.kinds_ms, dict)
          and all(isinstance(v, dict) and all(number(v.get(mode)) for mode in modes)
                  for v in table.kinds_ms.values()))
    return table if ok else None

def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """The latency targets asked for, in table order; :class:`ConfigError` (one line) for none or an unknown one,
    before any model is built."""
    unknown = [t for t in targets if t not in MODES]
    if unknown or not targets:
        raise ConfigError(f"unknown latency target {', '.join(map(repr, unknown)) or '(none given)'}: the targets "
                          f"are {', '.join(MODES)}")
    return tuple(m for m in MODES if m in targets)


def target_memories(cfg: Config) -> dict[str, int]:
    """States the memory keeps while each target is timed: ``mem_len`` in a train step, the evaluation memory
    (``model.eval_mem_len``) in an inference segment, :func:`parnas.config.generation_memory` generating."""
    return {"train": cfg.model.mem_len, "inference": cfg.model.evaluation_memory,
            "generate": generation_memory(cfg.model, cfg.data.seg_len)}

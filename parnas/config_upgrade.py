"""The keys of earlier versions, read as today's: configs and checkpoints written before each block kind and each
search strategy owned its settings still load, with one note line on stderr for each old key.

``model.chunk_len`` is ``model.lsh.chunk_len`` now (:mod:`parnas.kinds`), and ``search.tau_end`` is
``search.par-gumbel-darts.tau_end`` (:mod:`parnas.strategy_registry`): a flat search key goes to the config's own
``search.strategy`` where that strategy has such a setting (NNI's ``gumbel-darts`` takes ``tau_start`` and
``tau_end``), else to ``par-gumbel-darts``, whose settings they all were. A setting given both ways keeps the
section's value.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from parnas import strategy_registry

# the flat keys of the kinds' settings before each kind owned its own: read, with a note, as model.<kind>.<setting>
FLAT_KIND_SETTINGS = {"conv_kernel": ("conv", "kernel"), "compress_rate": ("compressive", "rate"),
                      "compress_len": ("compressive", "length"), "compress_fn": ("compressive", "fn"),
                      "n_buckets": ("lsh", "n_buckets"), "n_hashes": ("lsh", "n_hashes"),
                      "chunk_len": ("lsh", "chunk_len"), "act_max_steps": ("ut", "max_steps"),
                      "act_tau": ("ut", "tau")}
# the flat search keys before each strategy owned its settings: read, with a note, as search.<strategy>.<key>
FLAT_SEARCH_SETTINGS = ("mode", "tau_start", "tau_end", "tau_schedule", "hard", "forward", "arch_weight_decay",
                        "arch_warmup_steps", "budget_hinge", "export_samples", "dual_lr")


def _move(section: dict[str, Any], old: str, owner: str, key: str, prefix: str, note: bool) -> None:
    """``section[old]`` moved to ``section[owner][key]`` (the owner's own value, if given, wins)."""
    if note:
        print(f"parnas: {prefix}{old} is deprecated: use {prefix}{owner}.{key}", file=sys.stderr)
    value, given = section.pop(old), section.get(owner)
    section[owner] = {key: value, **given} if isinstance(given, Mapping) else given or {key: value}


def upgrade_flat_settings(model: Mapping[str, Any], prefix: str = "model.", note: bool = True) -> dict[str, Any]:
    """A model section with the flat keys of earlier versions moved to their kinds' sections, with a one-line
    ``note`` on stderr for each."""
    model = dict(model)
    for old, (kind, key) in FLAT_KIND_SETTINGS.items():
        if old in model:
            _move(model, old, kind, key, prefix, note)
    return model


def upgrade_search_settings(search: Mapping[str, Any], prefix: str = "search.", note: bool = True) -> dict[str, Any]:
    """A search section with the flat keys of earlier versions moved to their strategy's section, with a one-line
    ``note`` on stderr for each."""
    search = dict(search)
    old = [key for key in FLAT_SEARCH_SETTINGS if key in search]
    chosen = search.get("strategy", strategy_registry.DEFAULT)
    own: set[str] = set()
    if old and isinstance(chosen, str) and strategy_registry.is_known(chosen):
        settings = strategy_registry.get(chosen).settings_class()
        own = {f.name for f in dataclasses.fields(settings)} if settings is not None else set()
    for key in old:
        _move(search, key, chosen if key in own else strategy_registry.DEFAULT, key, prefix, note)
    return search


def upgrade_config(values: Mapping[str, Any], note: bool = True) -> dict[str, Any]:
    """A whole config (a checkpoint's, say) with the model's and the search's old keys moved
    (:func:`parnas.overrides.from_dict` does this for a config it builds; this is for one compared as written)."""
    values = dict(values)
    for section, upgrade in (("model", upgrade_flat_settings), ("search", upgrade_search_settings)):
        if isinstance(values.get(section), Mapping):
            values[section] = upgrade(values[section], f"{section}.", note)
    return values

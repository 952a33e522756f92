"""Retrain: the fixed PAR model an architecture JSON describes, trained from scratch.

Order matters for the "nothing written" promise: the architecture is validated, the config resolved, the output
folder checked and the tokenizer checked against the architecture's vocabulary, all before the run directory is
touched. The model comes from the search space (``search_spaces.fixed_model``), so retrain and search share every
line of block code, and training is :func:`parnas.training.fit.fit`, as for ``parnas train``. Model settings: the
JSON's ``model`` section, then ``--set model.*``; a ``--config``'s ``model`` section counts only for the named
baselines, so they match a found architecture trained with the same config.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from parnas import architecture
from parnas.architecture import ArchitectureError
from parnas.config import Config, load_config
from parnas.data.corpora import load_splits
from parnas.errors import ConfigError
from parnas.overrides import parse_overrides
from parnas.owned_folders import take_run_dir
from parnas.training.data_module import check_segments
from parnas.training.devices import check_devices
from parnas.training.fit import fit
from parnas.training.memory import check_memory


def architecture_source(arch: str) -> dict[str, Any] | str:
    """A validated record for a JSON path, or the name of a baseline layout."""
    if arch in architecture.NAMED_LAYOUTS:
        return arch
    if not Path(arch).exists():
        raise ArchitectureError(f"no architecture file {arch}; give an architecture JSON or a named layout "
                                f"({', '.join(architecture.NAMED_LAYOUTS)})")
    return architecture.read(arch)


def resolve_config(arch: dict[str, Any] | str, config: str | None, overrides: Sequence[str]) -> Config:
    """The run's config; for a JSON, its model settings and ``model.blocks`` set to its layout."""
    cfg = load_config(config, overrides)
    model_overrides = parse_overrides(overrides).get("model", {})
    if "blocks" in model_overrides or (isinstance(arch, str) and cfg.model.blocks):
        raise ConfigError("model.blocks cannot be set for retrain: the layout comes from --arch")
    if isinstance(arch, str):
        return cfg  # the layout is made once the vocabulary is known
    model = architecture.model_config(arch, model_overrides)
    kinds = architecture.layout(arch)
    if model.n_blocks != len(kinds):
        raise ArchitectureError(f"model.n_blocks={model.n_blocks} does not match the {len(kinds)} blocks "
                                "of the architecture")
    return replace(cfg, model=replace(model, blocks=tuple(kinds)))


def dry_run_retrain(arch: str, config: str | None, overrides: Sequence[str]) -> str:
    """``parnas retrain --dry-run``: the fixed model of ``arch`` at the vocabulary the data settings give, nothing
    read; an architecture searched with another vocabulary or tokenizer is refused as the run refuses it."""
    from parnas.training.dry_run import dry_run, planned_vocabulary

    source = architecture_source(arch)
    cfg = resolve_config(source, config, overrides)
    if isinstance(source, str):
        kinds = architecture.layout(architecture.named_layout(source, cfg.model, cfg.data.vocab_size))
    else:
        kinds = architecture.layout(source)
        same_kind = (source.get("tokenizer") or {}).get("kind") in (None, cfg.data.tokenizer)
        vocab = planned_vocabulary(cfg.data, source["model"]["vocab_size"] if same_kind else None)
        check_searched_vocabulary(source, cfg.data.tokenizer, vocab, arch)
        cfg = replace(cfg, data=replace(cfg.data, vocab_size=vocab))
    return dry_run(cfg, [[kind] for kind in kinds], source if isinstance(source, str) else arch)


def check_searched_vocabulary(record: dict[str, Any], kind: str, vocab_size: int, source: str) -> None:
    """Refuse a tokenizer (built or planned) of another size or kind than the architecture was searched with."""
    searched = record["model"]["vocab_size"]
    recorded = record.get("tokenizer") or {}
    hint = "pass the data settings the search used (its --config, or --set data.tokenizer=... data.vocab_size=...)"
    if searched != vocab_size:
        raise ArchitectureError(f"{source} was searched with a vocabulary of {searched} but the data settings give "
                                f"a {kind} tokenizer of {vocab_size}; {hint}")
    if recorded.get("kind") not in (None, kind):
        raise ArchitectureError(f"{source} was searched with a {recorded['kind']} tokenizer, not {kind}; {hint}")


def retrain(arch: str, config: str | None = None, overrides: Sequence[str] = (), *,
            resume: bool | str | Path = False, callbacks: Sequence[pl.Callback] = ()) -> dict[str, Any]:
    """Validate everything, build the fixed model, train it from scratch (or resume: from ``last.ckpt``, or from
    the checkpoint ``resume`` names) and evaluate it. Returns the metrics written to ``metrics.json`` (``{}`` on DDP
    ranks other than 0). Takes ``train.out_dir`` (:func:`parnas.owned_folders.take_run_dir`) unless the caller has."""
    from parnas.search_spaces import fixed_model

    source = architecture_source(arch)
    cfg = resolve_config(source, config, overrides)
    with take_run_dir(cfg.train.out_dir, resume):
        check_devices(cfg.train)
        tokenizer, splits = load_splits(cfg.data)
        cfg.model.check_vocab(tokenizer.vocab_size)
        if isinstance(source, str):
            record = architecture.named_layout(source, cfg.model, tokenizer.vocab_size)
            record["tokenizer"] = tokenizer.identity()
            cfg = replace(cfg, model=replace(cfg.model, blocks=tuple(architecture.layout(record))))
        else:
            check_searched_vocabulary(source, tokenizer.kind, tokenizer.vocab_size, arch)
            if (source.get("tokenizer") or {}).get("sha256") not in (None, tokenizer.sha256):
                print(f"parnas retrain: note: the tokenizer differs from the search's (same kind and size, other "
                      f"pieces); training from scratch is unaffected, but token ids are not comparable with {arch}",
                      file=sys.stderr)
            record = source
        kinds = architecture.layout(record)
        check_segments(cfg, splits)
        check_memory(cfg, tokenizer.vocab_size, [[kind] for kind in kinds])  # before allocating
        pl.seed_everything(cfg.train.seed, verbose=False)
        model = fixed_model(replace(cfg.model, blocks=()), tokenizer.vocab_size, record["architecture"])
        if model.block_kinds != kinds:  # the space must honour the sample exactly
            raise RuntimeError(f"built {model.block_kinds}, expected {kinds}")
        return fit(cfg, model, tokenizer, splits, record, resume=resume, callbacks=callbacks)

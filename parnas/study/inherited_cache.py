"""The inherited-weight perplexities ``parnas table score`` reads, kept in the scored run's folder so that a second
score of the same checkpoint (another table, a rerun) evaluates only the layouts it has not seen.

One file per checkpoint and evaluation, ``<run>/inherited-ppl-<key>.json``, ``key`` beginning the sha256 of the
checkpoint's bytes and of every setting that changes an evaluation: a retrained or resumed checkpoint, or other
settings, get another key, so a stale figure is never read. A file that fails its checks (its key in full, the sha256
of its perplexities) is not read and is written anew; a folder that cannot be written costs the cache only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from parnas.config import Config

FORMAT, VERSION = "parnas.inherited-ppl", 1


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def evaluation_key(checkpoint: Path, cfg: Config, fraction: float) -> str:
    """The sha256 naming one checkpoint evaluated one way (see the module docstring)."""
    data = {k: v for k, v in asdict(cfg.data).items() if k != "path"}
    return _sha({"checkpoint": file_sha256(checkpoint), "data": data, "model": asdict(cfg.model),
                 "precision": cfg.train.precision, "valid_fraction": fraction})


def inherited_path(run_dir: Path, key: str) -> Path:
    return run_dir / f"inherited-ppl-{key[:16]}.json"


def read_cache(run_dir: Path, key: str) -> tuple[dict[str, float], str | None]:
    """The cached perplexities by layout ({} without a file) and, for a file that fails its checks, why."""
    path = inherited_path(run_dir, key)
    if not path.is_file():
        return {}, None
    try:
        data = json.loads(path.read_text())
        ppl = {str(k): float(v) for k, v in data["perplexities"].items()}
        ok = (data.get("format"), data.get("version"), data.get("key")) == (FORMAT, VERSION, key)
        ok = ok and data.get("sha256") == _sha(ppl)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok, ppl = False, {}
    return (ppl, None) if ok else ({}, f"{path} failed its checks: not read, written anew")


def write_cache(run_dir: Path, key: str, perplexities: Mapping[str, float]) -> str | None:
    """Write the cache atomically; None, or why it could not be written (the score goes on without it)."""
    from parnas.errors import ParnasError
    from parnas.files import write_json_atomic

    ppl = {k: float(v) for k, v in perplexities.items()}
    try:
        write_json_atomic(inherited_path(run_dir, key), {"format": FORMAT, "version": VERSION, "key": key,
                                                      "sha256": _sha(ppl), "perplexities": ppl})
    except (OSError, ParnasError) as e:
        return f"cache not written ({e}); the next score evaluates again"
    return None

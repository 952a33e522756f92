"""Whether a run may continue from a checkpoint: the run that wrote it, with at most bookkeeping changed.

Everything that moves a weight must be what it was (the architecture, the tokenizer, every setting but those in
``RESUMABLE_CHANGES``); a refusal is one line naming the setting, its old and new value.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

from parnas import architecture
from parnas.config import Config
from parnas.data.tokenizer import Tokenizer
from parnas.errors import ConfigError
from parnas.files import write_atomic
from parnas.pick_config import SelectConfig
from parnas.training import checkpoint as ckpt

# Settings a resumed run may change: they move no weight (search.* plays no part in training a fixed model).
# Anything else must match the checkpoint.
RESUMABLE_CHANGES = {"train.stop_at", "train.devices", "train.num_nodes", "train.accelerator", "train.precision",
                     "train.compile", "train.threads", "model.attention_kernel",
                     "train.out_dir", "train.log_every", "train.eval_every", "train.ckpt_every", "data.eval_batch_size",
                     "data.path"}
# A search may also move its run directory and log at another interval; its other search.* settings must match.
# The final pick runs after the supernet and replans when any of its settings changes.
SEARCH_RESUMABLE_CHANGES = RESUMABLE_CHANGES | {"search.out_dir", "search.log_every"} | {
    f"search.par-gumbel-darts.select.{f.name}" for f in fields(SelectConfig)}


def check_resumable(checkpoint: dict[str, Any], cfg: Config, record: dict[str, Any] | None, tokenizer: Tokenizer,
                    source: str) -> None:
    """A resumed run must be the run that wrote ``checkpoint``: same architecture, tokenizer and settings.
    ``record``: the fixed model's architecture, or None for a search (whose ``search.*`` settings must match)."""
    meta = checkpoint["parnas"]
    if record is not None:
        written = ckpt.fixed_model_record(checkpoint, source)[1]  # a search's checkpoint is refused here
        was, now = (architecture.layout_string(architecture.layout(r)) for r in (written, record))
        if was != now:
            raise ConfigError(f"{source} was trained with layout {was}, not {now}; resume with the same architecture")
    elif "space" not in meta["architecture"]:
        raise ckpt.CheckpointError(f"{source} is not a search's checkpoint (it holds a fixed model: continue it "
                                   "with parnas retrain --resume or parnas train --resume)")
    if meta["tokenizer"].get("sha256") != tokenizer.sha256:
        raise ConfigError(f"{source} was trained with another tokenizer; resume with the same data settings")
    may_change = RESUMABLE_CHANGES if record is not None else SEARCH_RESUMABLE_CHANGES
    # a setting newer than the checkpoint counts as its default (what the code that wrote it did)
    written = meta["config"]
    old, new = _flatten(Config().to_dict()) | _flatten(written), _flatten(cfg.to_dict())
    for key in sorted((set(old) | set(new)) - may_change):
        if (record is None or not key.startswith("search.")) and _plain(old.get(key)) != _plain(new.get(key)):
            raise ConfigError(f"{source} was trained with {key}={old.get(key)!r}, now {new.get(key)!r}; resume with "
                              f"the settings it was trained with (a resume may change {', '.join(sorted(may_change))})")


def load_to_resume(source: Path) -> dict[str, Any]:
    """The checkpoint a run resumes from, read and checked; if it is damaged, the refusal names the latest intact
    checkpoint beside it and the ``--resume=PATH`` that continues from it."""
    try:
        return ckpt.load(source)
    except ckpt.CheckpointError as e:
        older = latest_intact(Path(source).parent, but=Path(source))
        if older is None:
            raise
        path, step = older
        raise ckpt.CheckpointError(f"{e}; {path} (step {step:,}) is intact: resume from it with "
                                   f"--resume={shlex.quote(str(path))}") from None


def latest_intact(folder: Path, but: Path) -> tuple[Path, int] | None:
    """The ``*.ckpt`` in ``folder`` other than ``but`` that loads and checks, with the most steps, and its step."""
    best: tuple[Path, int] | None = None
    for path in sorted(folder.glob("*.ckpt")):
        if path.resolve() == but.resolve():
            continue
        try:
            step = int(ckpt.load(path).get("global_step", 0))
        except ckpt.CheckpointError:
            continue
        if best is None or step > best[1]:
            best = (path, step)
    return best


def take_over(source: Path, last: Path) -> None:
    """Once every check has passed, a run resumed from a checkpoint other than its ``last.ckpt`` (``--resume=PATH``)
    puts a copy of it there: the run saves over it from then on, and a later plain ``--resume`` follows on."""
    if source.resolve() == last.resolve():
        return
    with open(source, "rb") as src:
        write_atomic(last, lambda f: shutil.copyfileobj(src, f), "wb", stale_after=0, size=source.stat().st_size)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v

"""A search's run folder: what may be searched into, and what a fresh or resumed search clears first.

The folder (``search.out_dir``, or ``$NNI_OUTPUT_DIR`` inside a trial) holds ``architecture.json``,
``history.jsonl``, ``tensorboard/`` and ``checkpoints/``. Unlike a training folder
(:func:`parnas.files.check_run_dir`), a search's counts as taken once it holds a checkpoint or an exported
architecture, and a resumed search drops the history written after its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from parnas.strategies.nni_trial import in_nni_trial

from parnas.config import Config
from parnas.errors import ParnasError
from parnas.files import check_not_held, ensure_writable_dir, resume_source, write_text_atomic
from parnas.training.resume import take_over


def run_dir_of(cfg: Config) -> Path:
    """Where a search writes: ``$NNI_OUTPUT_DIR`` in an nnictl trial (each trial its own), else ``search.out_dir``."""
    return Path(os.environ["NNI_OUTPUT_DIR"]) if in_nni_trial() else Path(cfg.search.out_dir)


def check_search_dir(run_dir: Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint to resume from (``last.ckpt``, or the one ``--resume=PATH`` names), if any; touches nothing.
    A fresh search refuses a directory holding one, and any search a directory another process holds."""
    check_not_held(run_dir)
    last, source = run_dir / "checkpoints" / "last.ckpt", resume_source(run_dir, resume)
    if source is not None:
        if not source.is_file():
            raise ParnasError(f"nothing to resume: {source} does not exist")
        return source
    if (run_dir / "architecture.json").exists() or last.exists():
        raise ParnasError(f"{run_dir} already holds a search: pass --resume to continue it, "
                          "or set search.out_dir to a new directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise ParnasError(f"cannot write the search into {run_dir}: it is a file")
    return None


def prepare_run_dir(run_dir: Path, resumed_step: int | None, source: Path | None = None) -> None:
    """Once every check has passed: a fresh search (``resumed_step`` None) clears stale logs; a resumed one
    drops the history written after its checkpoint's step (about to be redone), and continues from a copy of
    its checkpoint in ``last.ckpt`` if it was another (``source``). Lines at that step were written before the
    checkpoint."""
    ensure_writable_dir(run_dir)
    if source is not None:
        take_over(source, run_dir / "checkpoints" / "last.ckpt")
    history = run_dir / "history.jsonl"
    if resumed_step is None:
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
        history.unlink(missing_ok=True)
        return
    if history.is_file():
        kept = [line for line in history.read_text().splitlines()
                if line and json.loads(line)["step"] <= resumed_step]
        write_text_atomic(history, "".join(line + "\n" for line in kept))


"""A search's run folder (``search.out_dir``, or ``$NNI_OUTPUT_DIR`` inside a trial): the one run-folder check
(:func:`parnas.owned_folders.check_run_dir`) with ``architecture.json`` as a finished search's result, and what a
fresh or resumed search clears first. Loads no torch: the command takes the folder (:func:`take_search_dir`) before
the heavy modules load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parnas.config import Config
from parnas.files import ensure_writable_dir, resume_source, write_text_atomic
from parnas.owned_folders import check_run_dir, is_taken, remove_own_tree, take_run_dir
from parnas.strategies.nni_trial import in_nni_trial

SEARCH_RESULTS = ("architecture.json",)  # what a finished search leaves: a fresh search refuses its folder
SEARCH_SETTING = "search.out_dir"
SELECT_DIR = "select"  # the final pick's retrains, beside checkpoints/ and tensorboard/


def run_dir_of(cfg: Config) -> Path:
    """Where a search writes: ``$NNI_OUTPUT_DIR`` in an nnictl trial (each trial its own), else ``search.out_dir``."""
    return Path(os.environ["NNI_OUTPUT_DIR"]) if in_nni_trial() else Path(cfg.search.out_dir)


@contextmanager
def take_search_dir(run_dir: str | Path, resume: bool | str | Path) -> Iterator[Path]:
    """``run_dir`` held and checked once for the search's life (:func:`parnas.owned_folders.take_run_dir`)."""
    with take_run_dir(run_dir, resume, results=SEARCH_RESULTS, setting=SEARCH_SETTING, folders=(SELECT_DIR,)) as folder:
        yield folder


def check_search_dir(run_dir: Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint to resume from (``last.ckpt``, or the one ``--resume=PATH`` names), if any; touches nothing.
    The folder is checked here (:func:`parnas.owned_folders.check_run_dir`) unless the command took it already."""
    if not is_taken(run_dir):
        check_run_dir(run_dir, resume, results=SEARCH_RESULTS, setting=SEARCH_SETTING, folders=(SELECT_DIR,))
    return resume_source(run_dir, resume)


def prepare_run_dir(run_dir: Path, resumed_step: int | None, source: Path | None = None) -> None:
    """Once every check has passed: a fresh search (``resumed_step`` None) clears its stale logs (never another run's
    folder); a resumed one drops the history after its checkpoint's step (about to be redone) and a second evaluation
    at that step (the whole-split one a search stopped mid-search ends with), and continues from a copy of its
    checkpoint in ``last.ckpt`` if it was another (``source``)."""
    from parnas.training.resume import take_over

    ensure_writable_dir(run_dir)
    if source is not None:
        take_over(source, run_dir / "checkpoints" / "last.ckpt")
    history = run_dir / "history.jsonl"
    if resumed_step is None:
        remove_own_tree(run_dir / "tensorboard", "TensorBoard logs")
        history.unlink(missing_ok=True)
        return
    if history.is_file():
        kept, evaluated = [], False
        for line in history.read_text().splitlines():
            entry = json.loads(line) if line else None
            if entry is None or entry["step"] > resumed_step:
                continue
            if entry["step"] == resumed_step and "val_ppl" in entry:
                if evaluated:  # a second evaluation at the checkpoint's step: a stopped search's whole-split one
                    continue
                evaluated = True
            kept.append(line)
        write_text_atomic(history, "".join(line + "\n" for line in kept))

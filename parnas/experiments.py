"""Where an nnictl experiment's trials keep their parnas run directories.

A search run inside an NNI trial writes into ``$NNI_OUTPUT_DIR``, which is
``<experiments root>/<experiment id>/trials/<trial id>/``. The root is NNI's
``experimentWorkingDirectory``: ``~/nni-experiments`` unless the experiment
config says otherwise (pass ``root`` then).
"""

from __future__ import annotations

import os
from pathlib import Path

from parnas.errors import ParnasError


def default_root() -> Path:
    return Path(os.environ.get("NNI_EXPERIMENTS_DIR") or "~/nni-experiments").expanduser()


def experiment_dir(experiment_id: str, root: str | Path | None = None) -> Path:
    folder = Path(root).expanduser() if root else default_root()
    path = folder / experiment_id
    if not experiment_id or not (path / "trials").is_dir() and not path.is_dir():
        raise ParnasError(f"no NNI experiment {experiment_id!r} under {folder} "
                          "(pass --experiments-dir if its experimentWorkingDirectory is elsewhere)")
    return path


def trial_run_dirs(experiment_id: str, root: str | Path | None = None) -> dict[str, Path]:
    """Trial id -> run directory, for every trial that left an ``architecture.json``."""
    trials = experiment_dir(experiment_id, root) / "trials"
    return {p.parent.name: p.parent for p in sorted(trials.glob("*/architecture.json"))}

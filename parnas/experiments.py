"""Where an nnictl experiment's trials keep their parnas run directories.

A search run inside an NNI trial writes into ``$NNI_OUTPUT_DIR``, which NNI 3.0's
local training service puts at
``<experiments root>/<experiment id>/environments/<env>/trials/<trial id>/``. The root is NNI's
``experimentWorkingDirectory``: ``~/nni-experiments`` unless the experiment
config says otherwise (pass ``root`` then).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from parnas.errors import ParnasError


def default_root() -> Path:
    return Path(os.environ.get("NNI_EXPERIMENTS_DIR") or "~/nni-experiments").expanduser()


def experiment_dir(experiment_id: str, root: str | Path | None = None) -> Path:
    folder = Path(root).expanduser() if root else default_root()
    path = folder / experiment_id
    if not experiment_id or not path.is_dir():
        raise ParnasError(f"no NNI experiment {experiment_id!r} under {folder} "
                          "(pass --experiments-dir if its experimentWorkingDirectory is elsewhere)")
    return path


def trial_run_dirs(experiment_id: str, root: str | Path | None = None) -> dict[str, Path]:
    """Trial id -> run directory, for every trial that left an ``architecture.json``."""
    folder = experiment_dir(experiment_id, root)
    found = sorted(folder.glob("environments/*/trials/*/architecture.json")) + sorted(
        folder.glob("trials/*/architecture.json"))
    return {p.parent.name: p.parent for p in found}


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def launch(config: str | Path, port: int) -> str:
    """``nnictl create --config config --port port``, checked first; returns the experiment id.

    Trials run ``parnas``, so the folder of this Python's executables goes first on
    their PATH (what activating the environment would do).
    """
    config = Path(config)
    if not config.is_file():
        raise ParnasError(f"no experiment config at {config}")
    if not 0 < port < 65536:
        raise ParnasError(f"port {port} is not a TCP port")
    if port_in_use(port):
        raise ParnasError(f"port {port} is already in use: pass --port with a free one "
                          "(nnictl serves its web UI there)")
    bin_dir = str(Path(sys.executable).parent)
    nnictl = shutil.which("nnictl", path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if nnictl is None:
        raise ParnasError("nnictl not found: install parnas's dependencies (make install)")
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run([nnictl, "create", "--config", str(config), "--port", str(port)],
                          capture_output=True, text=True, env=env)
    output = re.sub(r"\x1b\[\d+m", "", done.stdout + done.stderr)
    match = re.search(r"Experiment ID: (\w+)", output)
    if done.returncode != 0 or match is None:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        raise ParnasError(f"nnictl create failed: {last[0].strip()}")
    return match.group(1)

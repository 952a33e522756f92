"""An nnictl experiment's trials: where their parnas run directories are, whether each has finished, and the figures
a finished or running trial reports; and ``nnictl create`` made safe (:func:`launch`).

A search inside an NNI trial writes into ``$NNI_OUTPUT_DIR``, which NNI 3.0's local training service puts at
``<root>/<experiment id>/environments/<env>/trials/<trial id>/``; the root is NNI's ``experimentWorkingDirectory``
(``~/nni-experiments`` unless the experiment config says otherwise: pass ``root`` then).

A trial is *finished* once its ``architecture.json`` exists. Otherwise it is *running* or *stopped*, as NNI's own
record tells (``<experiment>/db/nni.sqlite``; a trial NNI still calls running is stopped when nnictl has stopped the
experiment); without that record, running.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parnas import reading
from parnas.errors import ParnasError


def default_root() -> Path:
    return Path(os.environ.get("NNI_EXPERIMENTS_DIR") or "~/nni-experiments").expanduser()


_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # what NNI makes (8 letters and digits); names a folder, never a path


def is_id(name: str) -> bool:
    """Whether ``name`` can be an NNI id: letters, digits, ``_`` and ``-`` only, so a path built from it stays put."""
    return _ID.fullmatch(name) is not None


def experiment_dir(experiment_id: str, root: str | Path | None = None) -> Path:
    """``<root>/<experiment_id>``, an existing folder; an id that is not an id (``../x``) is refused in one line."""
    folder = Path(root).expanduser() if root else default_root()
    if not is_id(experiment_id):
        raise ParnasError(f"{reading.clipped(experiment_id)!r} is not an NNI experiment id (letters, digits, _ and "
                          "- only): pass the id nnictl printed, as `nnictl experiment list` shows it")
    path = folder / experiment_id
    if not path.is_dir():
        raise ParnasError(f"no NNI experiment {experiment_id!r} under {folder} "
                          "(pass --experiments-dir if its experimentWorkingDirectory is elsewhere)")
    return path


FINISHED, RUNNING, STOPPED = "finished", "running", "stopped"
UNDECIDED_MARGIN = 0.1  # a block whose top probability leads the second by less is undecided
EXPORTED_PPL_LABEL = "val ppl of the exported architecture (supernet weights, not retrained)"
SUPERNET_PPL_LABEL = "supernet val ppl (candidates mixed by softmax(alpha))"
LETTER_CODE = "one letter per block, input first: A = attention, D = dense, I = identity"
_NNI_RUNNING = ("WAITING", "RUNNING", "UNKNOWN")
_NNI_STATUSES = (*_NNI_RUNNING, "SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED", "EARLY_STOPPED")


@dataclass(frozen=True)
class Trial:
    id: str
    run_dir: Path
    status: str  # FINISHED, RUNNING or STOPPED
    nni_status: str | None  # NNI's last recorded status of the trial (SUCCEEDED, FAILED, ...), if known


def experiment_trials(experiment_id: str, root: str | Path | None = None) -> dict[str, Trial]:
    """Every trial folder of the experiment, finished or not, in the order the trials started (NNI's record, else the
    folder's creation, then the id), so a trial's number ("trial k of n") never changes as trials come and go."""
    folder = experiment_dir(experiment_id, root)
    dirs: dict[str, Path] = {}
    found = [*folder.glob("environments/*/trials/*"), *folder.glob("trials/*")]
    for path in sorted(p for p in found if is_id(p.name) and p.is_dir() and not p.is_symlink()):
        dirs[path.name] = max(dirs.get(path.name, path), path, key=_run_dir_rank)  # the folder the search wrote
    nni, started = nni_trial_statuses(folder), nni_trial_order(folder)
    stopped = experiment_stopped(experiment_id, root)
    trials = {}
    for trial, run in sorted(dirs.items(), key=lambda item: (started.get(item[0], math.inf), _made(item[1]), item[0])):
        status = nni.get(trial)
        if (run / "architecture.json").is_file():
            kind = FINISHED
        elif status is None or status in _NNI_RUNNING:
            kind = STOPPED if stopped else RUNNING
        else:
            kind = STOPPED
        trials[trial] = Trial(trial, run, kind, status)
    return trials


def _run_dir_rank(path: Path) -> tuple[bool, bool]:
    return (path / "architecture.json").is_file(), (path / "history.jsonl").is_file()


def _made(path: Path) -> float:
    try:
        return path.stat().st_ctime
    except OSError:
        return math.inf


def nni_trial_order(folder: Path) -> dict[str, int]:
    """Trial id -> the place of its first event in ``<experiment>/db/nni.sqlite``: the order NNI started them."""
    rows = trial_events(folder, "select trialJobId, min(rowid) from TrialJobEvent group by trialJobId")
    return {trial: first for trial, first in rows if isinstance(first, int)}


def trial_events(folder: Path, query: str) -> list[tuple[Any, ...]]:
    """The rows of ``query`` over ``<experiment>/db/nni.sqlite``, read-only; none without a readable record."""
    db = folder / "db" / "nni.sqlite"
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2) as con:
            return con.execute(query).fetchall()
    except sqlite3.Error:
        return []


def status_counts(trials: Mapping[str, Trial]) -> str:
    """``"1 finished, 2 running, 0 stopped"``."""
    statuses = [t.status for t in trials.values()]
    return ", ".join(f"{statuses.count(s)} {s}" for s in (FINISHED, RUNNING, STOPPED))


def nni_trial_statuses(folder: Path) -> dict[str, str]:
    """Trial id -> the last status NNI recorded for it in ``<experiment>/db/nni.sqlite`` ({} without one)."""
    rows = trial_events(folder, "select trialJobId, event from TrialJobEvent order by rowid")
    return {trial: event for trial, event in rows if event in _NNI_STATUSES}


def experiment_stopped(experiment_id: str, root: str | Path | None = None) -> bool:
    """Whether nnictl's list of experiments (``.experiment`` in the root or in ``~/nni-experiments``) says
    this experiment is stopped, or names a manager process that no longer exists. False when unknown."""
    for folder in dict.fromkeys([Path(root).expanduser() if root else default_root(), default_root()]):
        try:
            entry = json.loads((folder / ".experiment").read_text()).get(experiment_id)
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(entry, dict):
            continue
        if entry.get("status") == "STOPPED":
            return True
        pid = entry.get("pid")
        if isinstance(pid, int) and pid > 0:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        return False
    return False


def perplexities(record: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """``(exported architecture's val ppl, supernet's val ppl)`` of an architecture.json ``search`` section or a history
    evaluation line; None where not recorded (a record without ``supernet_val_ppl`` holds only the supernet's)."""

    def number(key: str) -> float | None:
        value = record.get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    if "supernet_val_ppl" not in record:
        return None, number("val_ppl")
    return number("val_ppl"), number("supernet_val_ppl")


def margin(probs: Iterable[float]) -> float:
    """Top minus second of block probabilities (1.0 with one candidate), undecided under :data:`UNDECIDED_MARGIN`."""
    top = sorted((float(p) for p in probs), reverse=True)
    return top[0] - top[1] if len(top) > 1 else 1.0


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


LOOPBACK_JS = Path(__file__).with_name("loopback.js")


def loopback_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``NODE_OPTIONS`` (what it held kept) preloading :data:`LOOPBACK_JS` into every Node process
    started with it. NNI 3.0's manager (web UI and REST API, no login) calls ``app.listen(port)``, every interface,
    and has no setting for the address: the preload makes a listen without an address bind 127.0.0.1, and neither NNI
    nor its package is changed."""
    preload = f"--require {json.dumps(str(LOOPBACK_JS))}"  # quoted: Node reads the path as one word
    return {**env, "NODE_OPTIONS": f"{env.get('NODE_OPTIONS', '')} {preload}".strip()}


@contextmanager
def nni_on_loopback() -> Iterator[None]:
    """While inside, an NNI manager this process starts (``NasExperiment`` of a multi-trial strategy) listens
    on 127.0.0.1 only (:func:`loopback_env`); ``NODE_OPTIONS`` is restored after."""
    before = os.environ.get("NODE_OPTIONS")
    os.environ["NODE_OPTIONS"] = loopback_env(os.environ)["NODE_OPTIONS"]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NODE_OPTIONS", None)
        else:
            os.environ["NODE_OPTIONS"] = before


def training_platforms(config: Path) -> list[str]:
    """The ``trainingService`` platforms an NNI experiment config names (``[]`` if it names none or cannot be
    read: nnictl then says what is wrong with it)."""
    try:
        service = reading.parse_yaml(reading.read_text(config), str(config)).get("trainingService")
    except ParnasError:  # too large or deep, aliases without end, a key twice: nnictl would hang or keep the last
        raise
    except Exception:  # noqa: BLE001 - any unreadable config is nnictl's to report, in its own words
        return []
    services = service if isinstance(service, list) else [service]
    return [s["platform"] for s in services if isinstance(s, dict) and isinstance(s.get("platform"), str)]


def launch(config: str | Path, port: int, listen_all: bool = False) -> str:
    """``nnictl create --config config --port port``, checked first; returns the experiment id. NNI's web UI and
    REST API have no login, so they serve 127.0.0.1 only (:func:`loopback_env`) unless ``listen_all``, which trials
    on other machines need (they report to the manager's port). This Python's executables go first on the trials'
    PATH, as activating the environment would do."""
    config = Path(config)
    if not config.is_file():
        raise ParnasError(f"no experiment config at {config}")
    if not 0 < port < 65536:
        raise ParnasError(f"port {port} is not a TCP port")
    remote = [p for p in training_platforms(config) if p != "local"]
    if remote and not listen_all:
        raise ParnasError(f"{config} runs trials on other machines ({', '.join(remote)}), which report to NNI's port "
                          "over the network: pass --listen-all (NNI then serves every interface)")
    if port_in_use(port):
        raise ParnasError(f"port {port} is already in use: pass --port with a free one "
                          "(nnictl serves its web UI there)")
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("nnictl", path=path) is None:
        raise ParnasError("nnictl not found: install parnas's dependencies (make install)")
    env = dict(os.environ, PATH=path)
    root = working_root(config)
    experiment_id = new_experiment_id()  # named before nnictl starts: a failed start removes its folder, none other
    done = subprocess.run([sys.executable, "-c", CREATE_WITH_ID, experiment_id, "create", "--config", str(config),
                           "--port", str(port)],
                          capture_output=True, text=True, env=env if listen_all else loopback_env(env))
    output = re.sub(r"\x1b\[\d+m", "", done.stdout + done.stderr)
    printed = re.search(r"Experiment ID: (\w+)", output)
    if done.returncode != 0 or printed is None or not serves(port, experiment_id):
        # what it left, only: its folder, its _latest link and its line in nnictl's list of experiments; other
        # experiments (and whatever else a user keeps there) may appear beside it at any moment
        remove_experiment(root, experiment_id)
        from nni.tools.nnictl.config_utils import Experiments

        Experiments().remove_experiment(experiment_id)
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        if done.returncode == 0 and printed is not None or "EADDRINUSE" in output or "not idle" in output:
            raise ParnasError(f"port {port} was taken by another process while the experiment started (a second "
                              "launch?): pass --port with a free one; nothing was left behind")
        raise ParnasError(f"nnictl create failed: {last[0].strip()}")
    return experiment_id


# `nnictl create` with the experiment id given as the first argument. nnictl takes no id, and it makes the
# experiment's folder before it may fail (a port taken meanwhile) without printing the id it drew: a launch that
# names the id first knows which folder is its own, whatever else appears beside it.
CREATE_WITH_ID = ("import sys; from nni.experiment import management; experiment_id = sys.argv.pop(1); "
                  "management.generate_experiment_id = lambda: experiment_id; "
                  "from nni.tools.nnictl.nnictl import parse_args; sys.argv[0] = 'nnictl'; parse_args()")


def new_experiment_id() -> str:
    """An id as NNI draws them (8 lowercase letters and digits)."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def serves(port: int, experiment_id: str, wait_s: float = 10.0) -> bool:
    """Whether the manager answering on 127.0.0.1:``port`` is ``experiment_id``'s: of two launches racing for one port,
    the second manager dies on EADDRINUSE while nnictl's own check reaches the first's and reports success."""
    import time
    import urllib.request

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/experiment", timeout=3) as answer:
                return json.loads(answer.read()).get("id") == experiment_id
        except (OSError, ValueError, AttributeError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def working_root(config: Path) -> Path:
    """The experiment config's ``experimentWorkingDirectory``, where nnictl makes each experiment's folder."""
    try:
        root = reading.parse_yaml(reading.read_text(config), str(config)).get("experimentWorkingDirectory")
    except Exception:  # noqa: BLE001 - nnictl reads it too and says what is wrong; unreadable: the default
        root = None
    return Path(root).expanduser() if isinstance(root, str) else default_root()


def remove_experiment(root: Path, experiment_id: str, made: Iterable[Path | None] = ()) -> None:
    """Remove one experiment's folder (a link there: the link only) and ``_latest`` link under ``root``, then the
    folders of ``made`` (ones the caller made) where nothing else is left in them."""
    folder = root / experiment_id
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
    latest = root / "_latest"
    with suppress(OSError):
        if latest.is_symlink() and Path(os.readlink(latest)).name == experiment_id:
            latest.unlink()
    for empty in made:
        with suppress(OSError):
            if empty is not None:
                empty.rmdir()  # holds something else, or is gone: kept

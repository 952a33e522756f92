"""What every case of the campaign shares: its own folder, ``python -m parnas.cli`` as a real process, the micro
corpus, uninterrupted reference runs made once, and the checks of a one-line refusal.

A case is a function of the bench and its folder that returns what happened (one line) when the command answered
as it should, and raises :class:`Bad` saying what it did instead. Anything else a case raises is a bug of the case
or of the command: it is reported as BAD too, never swallowed.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "parnas.cli"]
# The micro corpus: a few kB of WikiText-2 per split, read byte by byte (char tokenizer), so a run of a few
# dozen steps takes seconds.
MICRO_CHARS = {"train": 12_000, "valid": 3_000, "test": 3_000}
MICRO = ["data.tokenizer=char", "model.cutoffs=[20, 40]"]
# What a resume command follows in the line a stopped run leaves (parnas.cli.stopped).
AGAIN = re.compile(r"(?:resume with|run it again|finishes it|run it again to go on): (.+)$")


class Bad(Exception):
    """The command answered this case badly; the message says how, in one line."""


class Skip(Exception):
    """The case cannot be tried on this machine; the message says why."""


@dataclass(frozen=True)
class Case:
    """One hostile try: ``check(bench, folder)`` returns what happened, or raises :class:`Bad`."""

    name: str
    check: Callable[[Bench, Path], str]
    quick: bool = False  # in ``--quick``: fast (no torch import in the command) and representative


class Bench:
    """The campaign's workshop under ``root``: a private cache, the micro corpus, reference runs, and the data
    folder the commands read (``PARNAS_DATA_DIR``)."""

    def __init__(self, root: Path, data_dir: Path, seed: int) -> None:
        self.root, self.data_dir, self.seed = root, data_dir, seed
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PARNAS_DATA_DIR": str(data_dir),
                    "PARNAS_CACHE_DIR": str(root / "cache"), "OMP_NUM_THREADS": "1",
                    "NNI_EXPERIMENTS_DIR": str(root / "nni-experiments")}
        self._made: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.cleanups: list[Callable[[], None]] = []

    def rng(self, name: str) -> random.Random:
        """The case's own random numbers: the same for a seed whatever else runs, and in whatever order."""
        return random.Random(f"{self.seed}:{name}")

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``'s result, made once for all cases (cases may run in threads)."""
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._made:
                self._made[key] = make()
            return self._made[key]

    def micro(self) -> Path:
        """The first kB of each WikiText-2 split, cut at a line's end."""
        def make() -> Path:
            folder = self.root / "micro"
            folder.mkdir(parents=True, exist_ok=True)
            for split, size in MICRO_CHARS.items():
                with open(self.data_dir / "wikitext-2" / f"{split}.txt") as f:
                    text = f.read(size)
                (folder / f"{split}.txt").write_text(text[:text.rindex("\n") + 1])
            return folder
        return self.once("micro", make)

    def micro_sets(self) -> list[str]:
        return sets(f"data.path={self.micro()}", *MICRO)

    def cli(self, args: Sequence[str], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess:
        """``python -m parnas.cli ARGS`` to its end: status, stdout and stderr."""
        return subprocess.run([*CLI, *args], cwd=cwd, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)

    def start(self, args: Sequence[str], cwd: Path, stderr: Path) -> subprocess.Popen:
        """``python -m parnas.cli ARGS`` in the background, its stdout a pipe read line by line, stderr a file."""
        with open(stderr, "w") as err:
            return subprocess.Popen([*CLI, *args], cwd=cwd, env=self.env, text=True, stdout=subprocess.PIPE,
                                    stderr=err, start_new_session=True)

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            cleanup()


def sets(*pairs: str) -> list[str]:
    return [a for pair in pairs for a in ("--set", pair)]


def last_words(text: str, n: int = 160) -> str:
    """The end of ``text`` on one line, for a BAD report."""
    flat = " | ".join(line for line in text.strip().splitlines() if line.strip())
    return flat if len(flat) <= n else "..." + flat[-n:]


def one_line(done: subprocess.CompletedProcess, status: int) -> str:
    """The single stderr line of a command that must exit ``status`` with one line and no traceback."""
    err = done.stderr.strip()
    if "Traceback" in err:
        raise Bad(f"exit {done.returncode} with a traceback: {last_words(err)}")
    if done.returncode != status:
        raise Bad(f"exit {done.returncode}, not {status}: {last_words(err or done.stdout) or 'nothing said'}")
    lines = err.splitlines()
    if len(lines) != 1:
        extra = " | ".join(line[:200] for line in lines[:-1])  # what came before the refusal: the surprise
        raise Bad(f"exit {status} but {len(lines)} lines on stderr: {extra + ' | ' if extra else ''}"
                  f"{last_words(err) or 'none'}")
    return lines[0]


def succeeded(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        raise Bad(f"{what}: exit {done.returncode}: {last_words(done.stderr or done.stdout)}")


def again_command(line: str) -> list[str]:
    """The command a stopped run's line says continues it (its program is ``python -m parnas.cli``)."""
    match = AGAIN.search(line)
    if match is None:
        raise Bad(f"the line names no command to continue: {line}")
    words = shlex.split(match.group(1))
    if words[:len(CLI)] != CLI:
        raise Bad(f"the line's command is not the one that was run: {match.group(1)}")
    return words[len(CLI):]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time: what "nothing written" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


def written(before: dict[str, tuple[int, int]], folder: Path) -> list[str]:
    after = snapshot(folder)
    return sorted(k for k in after if before.get(k) != after[k]) + sorted(f"-{k}" for k in before if k not in after)


def refused(name: str, args: Sequence[str], *needles: str, files: dict[str, Any] | None = None,
            env: dict[str, str] | None = None, status: int = 2, quick: bool = False) -> Case:
    """A case: ``parnas ARGS`` exits ``status`` with one line holding every needle, and writes nothing.

    In ``args``, ``{in}`` is the case's input folder (holding ``files``: name -> text, bytes, or a function of the
    bench returning either), ``{out}`` an output folder that must not appear, ``{micro}`` the micro corpus; the
    command runs in the case's folder, so a relative path it writes shows too."""
    def check(bench: Bench, folder: Path) -> str:
        inputs = folder / "in"
        inputs.mkdir(parents=True, exist_ok=True)
        for file, content in (files or {}).items():
            content = content(bench) if callable(content) else content
            (inputs / file).write_bytes(content.encode() if isinstance(content, str) else content)
        fill = {"{in}": str(inputs), "{out}": str(folder / "out"),
                "{micro}": str(bench.micro()) if any("{micro}" in a for a in args) else ""}
        words = [a for a in args]
        for key, value in fill.items():
            words = [w.replace(key, value) for w in words]
        before = snapshot(folder)
        extra = {k: v.replace("{in}", str(inputs)) for k, v in (env or {}).items()}
        line = one_line(bench.cli(words, folder, extra), status)
        missing = [n for n in needles if n.replace("{in}", str(inputs)) not in line]
        if missing:
            raise Bad(f"exit {status}, but its line lacks {missing[0]!r}: {line}")
        changed = written(before, folder)
        if changed:
            raise Bad(f"exit {status}, but it wrote {', '.join(changed[:4])}: {line}")
        return f"exit {status}: {line}"
    return Case(name, check, quick)


def signal_name(signum: int) -> str:
    return "kill -9" if signum == signal.SIGKILL else signal.Signals(signum).name

"""Ownership of run folders, as a user who nests runs deals it: a train whose folder is a search's ``tensorboard/``
and a search whose folder is a train's, a retrain started by hand in a study's ``retrain/``, each finished and live,
then the outer command; and a lock file planted as a link to a file of the user's. The outer command must refuse in
one line naming the inner run (its process while it is live) and leave it byte for byte; the link's target must
be left as it was.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
from pathlib import Path

from tools.campaign_cases.bench import Bad, Bench, Case, last_words, one_line, succeeded
from tools.campaign_cases.faults import run_args

STUDY = ["--seeds", "1", "--budgets", "none", "--steps", "4", "--random-orderings", "0"]


def digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes: what "left byte for byte" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def outer_args(bench: Bench, command: str, out: Path) -> list[str]:
    if command == "study":
        return ["study", "--config", "tiny", *bench.micro_sets(), "--out", str(out), *STUDY]
    return run_args(bench, command, out)


def start_live(bench: Bench, command: str, out: Path, folder: Path) -> subprocess.Popen:
    """``command`` into ``out``, paused (SIGSTOP) once it has begun to train: it holds its folder, costs no CPU."""
    proc = bench.start(run_args(bench, command, out, "train.max_steps=1000000"), folder,
                       folder / "live-stderr.txt")
    for line in proc.stdout:
        if line.startswith("step "):
            proc.send_signal(signal.SIGSTOP)
            return proc
    proc.wait()
    said = last_words((folder / "live-stderr.txt").read_text())
    raise Bad(f"the inner {command} ended before its first step: {said}")


def nested(inner: str, outer: str, sub: str, live: bool) -> Case:
    """``inner`` into ``<R>/<sub>`` (finished, or live and paused), then ``outer`` into ``<R>``."""
    name = f"ownership: a {outer} over a {'live' if live else 'finished'} {inner} in its {sub}/"

    def check(bench: Bench, folder: Path) -> str:
        root = folder / "R"
        inside = root / sub
        proc = None
        if live:
            proc = start_live(bench, inner, inside, folder)
        else:
            succeeded(bench.cli(run_args(bench, inner, inside), folder), f"the inner {inner}")
        try:
            before = digest(root)
            line = one_line(bench.cli(outer_args(bench, outer, root), folder), 2)
            if str(inside) not in line or (proc is not None and f"(process {proc.pid})" not in line):
                raise Bad(f"exit 2, but the line names neither {inside.relative_to(folder)} nor its process: {line}")
            after = digest(root)
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            if changed:
                raise Bad(f"exit 2, but the inner {inner}'s files changed: {', '.join(changed[:4])}")
            if proc is not None and proc.poll() is not None:
                raise Bad(f"the inner {inner} died (exit {proc.returncode})")
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        return f"exit 2, the inner {inner} kept: {line}"
    return Case(name, check)


def planted_link(bench: Bench, folder: Path) -> str:
    """``R/.parnas.lock`` a link to a file of the user's: ``parnas train`` into ``R`` must not write through it."""
    victim = folder / "notes.txt"
    victim.write_text("a file of the user's\n")
    root = folder / "R"
    root.mkdir(exist_ok=True)
    lock = root / ".parnas.lock"
    if not lock.is_symlink():
        lock.symlink_to(victim)
    line = one_line(bench.cli(run_args(bench, "train", root), folder), 2)
    if victim.read_text() != "a file of the user's\n":
        raise Bad(f"exit 2, but the link's target was written: {victim.read_text()[:40]!r}")
    if "symbolic link" not in line or str(root) not in line:
        raise Bad(f"exit 2, but the line does not say the lock is a link: {line}")
    if sorted(p.name for p in root.iterdir()) != [".parnas.lock"]:
        raise Bad(f"exit 2, but it wrote into {root}")
    return f"exit 2, its target untouched: {line}"


def cases() -> list[Case]:
    out = [nested(inner, outer, "tensorboard", live) for inner, outer in (("train", "search"), ("search", "train"))
           for live in (False, True)]
    out += [nested("retrain", "study", "retrain/ADAD", live) for live in (False, True)]
    out.append(Case("lock: a planted link at .parnas.lock", planted_link, quick=True))
    return out

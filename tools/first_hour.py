"""Rerun the README's first hour as a newcomer would, time every step, and (with ``--write``) put the times in
the README.

    python tools/first_hour.py                 # run and print the table (about 10 minutes on 2 cores)
    python tools/first_hour.py --write         # the same, then rewrite the README's times from it
    python tools/first_hour.py --runs 3 --write  # three runs one after another; the README gets each median
    python tools/first_hour.py --dry-run       # the commands it would run, nothing run

It runs each timed line of the README's "First hour" block in order, in a scratch folder with a fresh ``HOME``
(so no cache of an earlier run: the tokenizer is trained and the latency table timed as a newcomer's are), with
the environment a newcomer has: no ``OMP_NUM_THREADS`` (what ``search.yaml``'s trial command sets stays), data
from ``PARNAS_DATA_DIR`` where set (as ``make`` sets it in this checkout). ``<id>`` and ``<trial>`` are taken
from what the search printed. The load average is read before and after each step: a time is only as good as
the machine was quiet. After the times it prints what the search, the export and the compare printed (the
architectures found, the trials' table, the comparison), so that what the run found can be quoted beside its
times. ``--write`` replaces the first ``N s`` / ``N min`` of each timed README line's comment and the sentence
that says at what load the times were taken; nothing else in the README changes (the date and the table it
prints go in docs/benchmarks.md by hand, and so does ``make search``'s time in the Makefile's and search.yaml's
first comments, which tests/cli/test_first_hour.py holds to the README's). On this 2-core machine
one run's times differed from the next one's by up to a third, so ``--runs N`` reruns the whole hour N times and
takes each step's median (and prints every run's times beside it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMED = ("make search", "parnas export", "parnas retrain --arch found", "parnas retrain --arch transformer-xl",
         "parnas compare", "parnas plot")  # the README lines whose comment states a time this script measures
WHEN = re.compile(r"Times: a 2-core CPU.*?\]\(docs/benchmarks\.md#the-first-hour-timed\)\)\.", re.S)


def first_hour_lines(readme: str) -> list[str]:
    """The README's first-hour commands, in order (the bash block under "## First hour")."""
    section = readme.split("## First hour", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def command_of(line: str) -> str:
    return line.split("  #", 1)[0].strip()


def timed(line: str) -> bool:
    """A line this script times: a CPU step of the README's list (the GPU retrain and the commands that serve or
    stop are not timed)."""
    command = command_of(line)
    return any(command.startswith(prefix) for prefix in TIMED) and "--accelerator gpu" not in command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def rewrite(readme: str, times: dict[str, float], load: float, runs: int = 1) -> str:
    """The README with each timed line's first time replaced by ``times[command]`` and the load
    sentence rewritten (``runs``: how many runs each time is the median of); lines not timed are left as they
    are."""
    out = []
    in_block = False
    for line in readme.splitlines(keepends=True):
        if line.startswith("```bash") and not in_block and "## First hour" in "".join(out):
            in_block = True
        elif line.startswith("```") and in_block:
            in_block = False
        command = command_of(line)
        if in_block and "#" in line and command in times:
            head, comment = line.split("  #", 1)
            comment = re.sub(r"\d+(?:\.\d+)? (?:s|min|minutes)\b", seconds_text(times[command]), comment, count=1)
            line = f"{head}  #{comment}"
        out.append(line)
    text = "".join(out)
    median = f", each the median of {runs} runs" if runs > 1 else ""
    sentence = (f"Times: a 2-core CPU at a load average\nof about {load:.1f}{median} "
                "([how](docs/benchmarks.md#the-first-hour-timed)).")
    return WHEN.sub(sentence.replace("\\", "\\\\"), text, count=1)


SHOWN = ("parnas launch", "parnas export", "parnas compare")  # what they print is what the run found: shown after it


def run(lines: list[str], dry_run: bool) -> tuple[dict[str, float], list[tuple[str, float, float, float, str]]]:
    scratch = Path(tempfile.mkdtemp(prefix="first-hour-"))
    home = scratch / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    work = scratch / "work"
    shutil.copytree(REPO, work, ignore=shutil.ignore_patterns(".git", ".venv", ".lint", "runs", "__pycache__"))
    port, found = free_port(), {}
    times, rows = {}, []
    try:
        for line in lines:
            command = command_of(line)
            if not timed(line):
                continue
            words = command.replace("<id>", found.get("id", "<id>")).replace("<trial>", found.get("trial", "<trial>"))
            if command.startswith("make search"):
                words = f"parnas launch --config search.yaml --port {port} --wait"
            if dry_run:
                print(words)
                continue
            before = os.getloadavg()[0]
            start = time.monotonic()
            done = subprocess.run(words, shell=True, cwd=work, env=env, capture_output=True, text=True)
            seconds = time.monotonic() - start
            after = os.getloadavg()[0]
            if done.returncode != 0:
                raise SystemExit(f"first_hour: `{words}` failed ({done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            if command.startswith("make search"):
                found["id"] = re.search(r"experiment (\w+): web UI", done.stdout)[1]
                found["trial"] = re.search(r"--arch found/(\w+)\.json", done.stdout)[1]
            times[command] = seconds
            rows.append((words, seconds, before, after, done.stdout))
            print(f"{seconds_text(seconds):>8}  load {before:.1f} -> {after:.1f}  {words}", flush=True)
    finally:
        if "id" in found:
            subprocess.run(["nnictl", "stop", found["id"]], env=env, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return times, rows


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each command's median time over ``runs`` (each a run's times by command)."""
    return {command: statistics.median(times[command] for times in runs) for command in runs[0]}


def report_medians(runs: list[dict[str, float]]) -> str:
    """Each command's median over the runs, its range, and every run's time, as Markdown."""
    lines = ["", f"| command | median of {len(runs)} | range | each run |", "|---|---|---|---|"]
    for command, median in medians(runs).items():
        each = [times[command] for times in runs]
        lines.append(f"| `{command}` | {seconds_text(median)} | {seconds_text(min(each))} - {seconds_text(max(each))} "
                     f"| {', '.join(seconds_text(t) for t in each)} |")
    return "\n".join(lines)


def report(rows: list[tuple[str, float, float, float, str]]) -> str:
    """The run as Markdown: each command's wall time and load, then the last 25 lines the search, the export and
    the compare printed (the architectures found, the trials' table, the comparison): what the run found."""
    lines = ["", "| command | wall time | load before -> after |", "|---|---|---|"]
    lines += [f"| `{words}` | {seconds_text(seconds)} | {before:.1f} -> {after:.1f} |"
              for words, seconds, before, after, _ in rows]
    for words, _, _, _, printed in rows:
        if words.startswith(SHOWN):
            lines += ["", f"$ {words}  (its last 25 lines)", *printed.rstrip().splitlines()[-25:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's times from this run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--runs", type=int, default=1, help="run the hour this many times; the README gets medians")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    readme = README.read_text()
    runs, load = [], 0.0
    for k in range(1 if args.dry_run else args.runs):
        if args.runs > 1:
            print(f"run {k + 1} of {args.runs}", flush=True)
        times, rows = run(first_hour_lines(readme), args.dry_run)
        if args.dry_run:
            return 0
        runs.append(times)
        load = max(load, *(max(b, a) for _, _, b, a, _ in rows))
        print(report(rows))
    if args.runs > 1:
        print(report_medians(runs))
    if args.write:
        README.write_text(rewrite(readme, medians(runs), load, args.runs))
        print(f"rewrote {README.relative_to(REPO)}'s first-hour times (load up to {load:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Follow a launched nnictl experiment from the terminal until it is done (``nnictl create`` returns as soon as the
manager is up): trial k of n, its step, its phases, the time left. :class:`Follower` reads only what the trials write
anyway (``history.jsonl``, their output, NNI's record of their statuses) and the manager's status, so following adds
nothing to the trials' work. It is done when NNI says the experiment is, or when the manager has gone. The time
left: once a trial has run from start to end while followed, the trials still to run at the mean duration of those;
before that, the steps still to run at the seconds per step seen so far, a final pick's retrain step counted as
:data:`PICK_STEP_SHARE` of a supernet step.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from parnas.report.experiments import FINISHED, STOPPED, default_root, experiment_stopped, experiment_trials

if TYPE_CHECKING:
    from parnas.pick_config import SelectConfig

ENDED = ("DONE", "STOPPED", "ERROR")  # NNI's experiment statuses after which no trial runs
PRINT_EVERY_S = 15.0  # a progress line at most this often, besides a trial's start and end
# a fixed model's step runs one kind a block where the supernet's runs every candidate: about half its time
PICK_STEP_SHARE = 0.5
# the trial's own lines passed on (its phases), after "parnas: " is taken off a stderr line
PHASES = re.compile(r"^(training a .*tokenizer|latency table|warning: |step \d+: validation|final pick|"
                    r"the shallower Transformer-XL|Transformer-XL beat|architecture \S+ \(|parnas search: error)")
# a trial's output: NNI's print hook writes stdout to trial.log ("[time] PRINT line"), the rest goes to the others
OUTPUTS = ("trial.log", "trial.stdout", "trial.stderr")
PRINTED = re.compile(r"^\[[^\]]*\] PRINT ")


def last_step(run_dir: Path) -> int | None:
    """The step of the last complete line of ``run_dir/history.jsonl`` (None before the first). Reads the file's
    tail only: a search logs thousands of lines."""
    path = run_dir / "history.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.split("\n")[:-1]):  # the part after the last newline may be half written
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


class LineReader:
    """The whole lines added to a file since the last call (a trial's output, read as it grows)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(1 << 20)
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1  # the part after the last newline may be half written
        self.offset += end
        return [part for line in chunk[:end].decode(errors="replace").split("\n")
                for part in line.split("\r") if part.strip()]


def phase_lines(lines: list[str]) -> list[str]:
    """Of a trial's output lines, those that mark a phase (:data:`PHASES`), without the ``parnas:`` prefix."""
    out = []
    for line in lines:
        text = PRINTED.sub("", line.strip()).removeprefix("parnas: ")
        if PHASES.match(text):
            out.append(text)
    return out


def manager_status(port: int) -> str | None:
    """NNI's experiment status from its REST API on 127.0.0.1 (``RUNNING``, ``DONE``, ...); None: no answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/nni/check-status", timeout=3) as answer:
            return json.loads(answer.read()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Follower:
    """The progress of one experiment of ``n_trials`` trials of ``max_steps`` steps each (None when unknown):
    :meth:`poll` returns the lines to print now, :attr:`done` says whether the experiment has ended."""

    def __init__(self, experiment_id: str, port: int, n_trials: int | None, max_steps: int | None,
                 root: str | Path | None = None, clock: Callable[[], float] = time.monotonic,
                 status: Callable[[int], str | None] = manager_status, pick_steps: int = 0) -> None:
        self.experiment_id, self.port, self.root = experiment_id, port, root
        self.n_trials, self.max_steps, self.pick_steps = n_trials, max_steps, pick_steps
        self.clock, self.status = clock, status
        self.start = clock()
        self.first_step: dict[str, int] = {}  # trial -> the first step seen: only steps run while following count
        self.progress: dict[str, int] = {}  # trial -> steps run while following
        self.announced: dict[str, str] = {}  # trial -> the status last printed
        self.readers: dict[str, list[LineReader]] = {}  # trial -> readers of its output files
        self.started: dict[str, float] = {}  # trial -> when it was first seen running
        self.durations: list[float] = []  # of the trials seen from their start to their end
        self.last_print = -PRINT_EVERY_S
        self.done = False

    def seconds_left(self, trials_running: dict[str, int], trials_ended: int) -> float | None:
        if self.n_trials is None:
            return None
        not_started = max(0, self.n_trials - trials_ended - len(trials_running))
        now = self.clock()
        if self.durations:  # a whole trial seen: its mean duration, the final pick included
            mean = sum(self.durations) / len(self.durations)
            return mean * not_started + sum(max(0.0, mean - (now - self.started.get(t, now))) for t in trials_running)
        steps_done = sum(self.progress.values())
        if self.max_steps is None or steps_done == 0:
            return None
        per_step = (now - self.start) / steps_done
        pick = PICK_STEP_SHARE * self.pick_steps  # in supernet steps
        to_run = sum(max(0, self.max_steps - s) + pick for s in trials_running.values())
        to_run += (self.max_steps + pick) * not_started
        return per_step * to_run

    def poll(self) -> list[str]:
        trials = experiment_trials(self.experiment_id, self.root) if self._has_folder() else {}
        lines, running, ended = [], {}, 0
        for number, (trial, info) in enumerate(trials.items(), start=1):
            step = last_step(info.run_dir)
            readers = self.readers.setdefault(trial, [LineReader(info.run_dir / name) for name in OUTPUTS])
            phases = [f"trial {number}: {line}" for r in readers for line in phase_lines(r.new_lines())]
            if step is not None:
                self.progress[trial] = step - self.first_step.setdefault(trial, step)
            ended_now = info.status in (FINISHED, STOPPED) or (info.nni_status or "").endswith(("FAILED", "CANCELED"))
            if ended_now:
                lines += phases
                ended += 1
                what = "finished" if info.status == FINISHED else (info.nni_status or info.status).lower()
                if self.announced.get(trial) != what:
                    if self.announced.get(trial) == "running" and trial in self.started:
                        self.durations.append(self.clock() - self.started[trial])
                    self.announced[trial] = what
                    lines.append(f"trial {number}{self._of()} ({trial}) {what}" + (f" at step {step}" if step else ""))
            else:
                running[trial] = step or 0
                if trial not in self.announced:
                    self.announced[trial] = "running"
                    self.started[trial] = self.clock()
                    lines.append(f"trial {number}{self._of()} ({trial}) started")
                lines += phases
        manager = self.status(self.port)
        self.done = manager in ENDED or (manager is None and experiment_stopped(self.experiment_id, self.root))
        now = self.clock()
        if running and (lines or now - self.last_print >= PRINT_EVERY_S):
            left = self.seconds_left(running, ended)
            numbers = {t: i for i, t in enumerate(trials, start=1)}
            steps = "; ".join(f"trial {numbers[t]}{self._of()} at step {s}"
                              + (f" of {self.max_steps}" if self.max_steps else "") for t, s in running.items())
            lines.append(f"{steps}; {ended} ended" + (f"; about {duration(left)} left" if left is not None else ""))
        if lines:
            self.last_print = now
        return lines

    def _has_folder(self) -> bool:
        folder = Path(self.root).expanduser() if self.root else default_root()
        return (folder / self.experiment_id).is_dir()

    def _of(self) -> str:
        return f" of {self.n_trials}" if self.n_trials else ""


def follow(follower: Follower, out: Callable[[str], None] = print, every_s: float = 5.0,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """Print the follower's lines until the experiment is done (KeyboardInterrupt goes to the caller)."""
    while True:
        for line in follower.poll():
            out(line)
        if follower.done:
            return
        sleep(every_s)


def pick_retrain_steps(select: SelectConfig, max_steps: int) -> int:
    """The most retrain steps a search's final pick (:mod:`parnas.strategies.final_pick`) runs, for the time left: the
    guard entering apart and reaching the last round, where a layout beats it (so the confirming seeds run)."""
    if not select.enabled:
        return 0
    rounds, alive, total, reached = select.rounds(max_steps), select.k + 1, 0, 0  # the guard always enters
    for r, target in enumerate(rounds):
        total += alive * (target - reached)
        reached = target
        alive = min(alive, select.kept(alive, r, len(rounds)) + 1)
    return total + 2 * select.confirm_seeds * rounds[-1]


def experiment_size(config: str | Path) -> tuple[int | None, int | None, str | None, str | None, int]:
    """``(trials, steps a trial, preset, experimentWorkingDirectory, pick retrain steps a trial)`` of an experiment
    config whose trials run ``parnas search --config PRESET [--set k=v ...]``; None (pick steps: 0) where not told."""
    import shlex

    from parnas import reading
    from parnas.config import load_config

    try:
        experiment = reading.parse_yaml(reading.read_text(Path(config)), str(config))
        words = shlex.split(str(experiment.get("trialCommand", "")))
    except Exception:  # noqa: BLE001 - nnictl has read it already; what it cannot tell stays unknown
        return None, None, None, None, 0
    trials = experiment.get("maxTrialNumber")
    trials = trials if isinstance(trials, int) and trials > 0 else None
    root = experiment.get("experimentWorkingDirectory")
    root = root if isinstance(root, str) else None
    if "parnas" not in words or "--config" not in words:
        return trials, None, None, root, 0
    words = words[words.index("parnas"):]
    preset = words[words.index("--config") + 1] if words.index("--config") + 1 < len(words) else None
    sets = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    space = experiment.get("searchSpace") if isinstance(experiment.get("searchSpace"), dict) else {}
    try:
        cfg = load_config(preset, sets)
    except Exception:  # noqa: BLE001 - the trials will say what is wrong with their config themselves
        return trials, None, preset, root, 0
    steps = None if "train.max_steps" in space else cfg.train.max_steps
    select = getattr(cfg.search.settings, "select", None)  # the final pick of a strategy that has one (PAR's)
    drawn = any(k.startswith(f"search.{cfg.search.strategy}.select.") for k in space)
    pick = 0 if steps is None or select is None or drawn else pick_retrain_steps(select, steps)
    return trials, steps, preset, root, pick

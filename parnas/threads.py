"""How many threads torch computes with, and how they wait: chosen once per process, before torch loads.

A small model's step is a few milliseconds of small matrix products; on a shared, busy machine torch's default
(a thread per core, OpenMP threads spinning while they wait) makes it many times slower. So every command that
computes has OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, unless the user set it) and takes
``train.threads`` when set, else ``OMP_NUM_THREADS`` when set, else the fewest of: the cores this process may use
(affinity and cgroup quota) less the machine's load, shared among the run's processes, and what a step of this
size gains from (:func:`useful_threads`). The choice travels in ``OMP_NUM_THREADS``, so DDP processes and a
study's searches use the same. Only the standard library is imported here.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from parnas.errors import ConfigError

# One thread per this much of a step's work (tokens x d_model**2): smaller matrix products do not pay for the
# threads meeting at every operation (benchmarks/threads.py; its figures: docs/benchmarks.md).
WORK_PER_THREAD = 2**23


@dataclass(frozen=True)
class Choice:
    """``threads`` for this process and the reason, for the run's first line."""

    threads: int
    reason: str

    def line(self) -> str:
        return f"threads: {self.threads} ({self.reason})"


def useful_threads(d_model: int, tokens: int) -> int:
    """The most threads a step of ``tokens`` tokens (batch x segment; 1 for a generated token) through a model
    ``d_model`` wide gains from: one per ``WORK_PER_THREAD`` of ``tokens * d_model**2``, the size of its
    matrix products."""
    return max(1, tokens * d_model**2 // WORK_PER_THREAD)


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``),
    None where there is none or it cannot be read."""
    places = [Path("")]
    try:
        for line in proc_cgroup.read_text().splitlines():  # "0::/path" (v2) or "N:cpu,cpuacct:/path" (v1)
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                places.insert(0, Path(path.lstrip("/")))
    except (OSError, ValueError):
        pass
    for place in places:
        for quota, period in ((root / place / "cpu.max", None),
                              (root / "cpu" / place / "cpu.cfs_quota_us", root / "cpu" / place / "cpu.cfs_period_us")):
            try:
                if period is None:
                    q, p = quota.read_text().split()[:2]
                else:
                    q, p = quota.read_text().strip(), period.read_text().strip()
            except (OSError, ValueError):
                continue
            if q in ("max", "-1"):
                return None
            try:
                return int(q) / int(p)
            except (ValueError, ZeroDivisionError):
                return None
    return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    quota = cgroup_cpus()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def machine_load() -> float:
    """The machine's 1-minute load average (runnable processes), the share of it on this process's cores:
    the load spreads over every core the machine has, ``usable_cores`` of which are this process's."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0.0
    return load * usable_cores() / (os.cpu_count() or 1)


def runnable_elsewhere() -> float | None:
    """Threads of other processes running or waiting for a core at this moment: the machine's runnable count
    (``/proc/loadavg``) less this process's own runnable threads. None where the system does not say (not
    Linux). Sampled while this process times something, it is the load that timing competed with."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        own = 0
        for stat in Path("/proc/self/task").glob("*/stat"):
            try:
                own += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                continue  # a thread that ended meanwhile
    except (OSError, ValueError, IndexError):
        return None
    return float(max(0, running - own))


def _environment_threads(value: str) -> int:
    """``OMP_NUM_THREADS``'s number of threads (its first level, for a nested list such as ``4,2``)."""
    try:
        threads = int(value.split(",")[0])
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(f"OMP_NUM_THREADS={value!r} is not a number of threads: set it to a positive integer, "
                          "or unset it and let parnas choose (or set train.threads)")
    return threads


def choose(d_model: int, tokens: int, setting: int = 0, processes: int = 1, *,
           environ: MutableMapping[str, str] | None = None, cores: int | None = None,
           load: float | None = None) -> Choice:
    """The threads one of ``processes`` processes on this machine computes steps of ``tokens`` tokens through a
    model of width ``d_model`` with.

    ``setting`` is ``train.threads`` (0: choose). ``cores`` and ``load`` default to this machine's
    (:func:`usable_cores`, :func:`machine_load`); tests pass their own."""
    environ = os.environ if environ is None else environ
    if setting > 0:
        return Choice(setting, f"train.threads={setting}")
    if environ.get("OMP_NUM_THREADS"):
        return Choice(_environment_threads(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS in the environment")
    cores = usable_cores() if cores is None else cores
    load = machine_load() if load is None else load
    idle = math.floor(cores - load + 0.5)  # cores nobody else is using, rounded; 0 or less: all taken
    free = max(1, min(cores, idle))
    share = max(1, free // processes)
    useful = useful_threads(d_model, tokens)
    threads = min(share, useful)
    return Choice(threads, _reason(cores, load, idle, processes, share, useful, tokens, d_model))


def _reason(cores: int, load: float, idle: int, processes: int, share: int, useful: int, tokens: int,
            d_model: int) -> str:
    """Why the threads are what they are, in the words of the limit that decided (a busy machine, the free
    cores, the run's processes or the step's size), so a user sees what would change it."""
    machine = f"{cores} core{'s' * (cores > 1)}"
    if idle < 1:  # every core is taken: more threads would only wait for them
        fights = "one thread fights least" if processes == 1 else f"one thread for each of {processes} processes"
        return f"{machine}, busy at load {load:.1f}: {fights}"
    free = min(cores, idle)
    where = f"{machine}, {'all' if free == cores else free} free at load {load:.1f}"
    if processes > 1:
        where += f", {share} for each of {processes} processes"
    step = f"{tokens:,} token{'s' * (tokens > 1)} a step at width {d_model}"
    if useful == 1:
        return f"{where}; {step} gains nothing from a second thread"
    if useful <= share:  # the step's size decided
        return f"{where}; {step} gains from up to {useful}"
    return f"{where}; {step} would use {useful}"


def prepare(choice: Choice, environ: MutableMapping[str, str] | None = None) -> None:
    """Make ``choice`` this process's and its children's: ``OMP_NUM_THREADS`` in the environment (torch reads
    it when it loads; DDP processes inherit it) and, when torch is loaded already, ``torch.set_num_threads``."""
    environ = os.environ if environ is None else environ
    environ["OMP_NUM_THREADS"] = str(choice.threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(choice.threads)


def wait_passively(environ: MutableMapping[str, str] | None = None) -> None:
    """OpenMP threads that sleep while they wait, unless the user chose otherwise (``OMP_WAIT_POLICY``).
    Takes effect only when called before torch is imported: the OpenMP runtime reads it as it loads."""
    environ = os.environ if environ is None else environ
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def use_threads(d_model: int, tokens: int, setting: int = 0, processes: int = 1,
                show: Callable[[str], None] | None = print) -> Choice:
    """The CLI's one call per command: choose, prepare, and show the choice's line (on rank 0 only: a DDP
    process Lightning or torchrun starts has ``LOCAL_RANK`` > 0 and the line from its rank 0)."""
    choice = choose(d_model, tokens, setting, processes)
    prepare(choice)
    shown = show is not None and os.environ.get("LOCAL_RANK", "0") == "0"
    if shown:
        show(choice.line())
    load_torch(show if shown else None)
    return choice


# Said when loading torch takes longer than this: on a fresh machine (a cold file cache, CUDA's libraries read
# from disk) the imports alone can take long enough that a user, seeing nothing after the threads line, waits
# without knowing why.
SLOW_LOAD_S = 3.0


def load_torch(show: Callable[[str], None] | None = print, after_s: float = SLOW_LOAD_S, module: str = "torch") -> None:
    """Import ``module`` (torch) now, once the thread settings it reads at load are in the environment, and say
    so in one line if that takes longer than ``after_s`` (nothing is printed when it is quick, or loaded)."""
    if module in sys.modules:
        return

    def say() -> None:
        if show is not None:
            show("loading PyTorch (a first run on a fresh machine reads it from disk: 10-20 s) ...")
            sys.stdout.flush()

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        importlib.import_module(module)
    finally:
        timer.cancel()

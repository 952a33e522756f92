"""A hostile user's campaign against the ``parnas`` command line, on the tiny config, as real processes.

    python tools/campaign.py                      # every case (about 20 minutes on a loaded 2-core CPU)
    python tools/campaign.py --quick              # a handful of fast bad inputs (seconds)
    python tools/campaign.py --only 'kill|lock' --seed 3 --jobs 2

Each case runs ``python -m parnas.cli ...`` (this checkout's, ``PYTHONPATH`` set to it; data from
``PARNAS_DATA_DIR``) and checks its answer mechanically: a bad input exits 2 with one line on stderr naming what is
wrong, no traceback, nothing written; a run killed (``kill -9``) or stopped (SIGINT, SIGTERM) at a random moment
and resumed as its line says ends bit-exact with the run done in one go, final metrics and weights; a second run
into a live run's folder is refused naming its process; a full disk (a small tmpfs, where it can be mounted) costs
one line and the last checkpoint survives; the web UI does not answer on the machine's other addresses unless
``--listen-all``; a run whose loss explodes (train, retrain, search, --resume, evaluate) ends with one line and
its metrics marked ``diverged``; hostile files and moments (YAML aliases without end, keys given twice, paths
that read as YAML, a poisoned latency cache, SIGHUP and bursts of signals, an unusable cache folder, a run under
``ulimit -v``, a pickle that would run code) end in one line; every documented command runs or is skipped with
its reason. One line per case (``ok``,
``BAD`` or ``skip`` and what happened), then ``N of M answered well``; the exit status is 1 if any case is BAD.
Work folders go to a temporary folder, removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.campaign_cases import divergence, faults, hostile, ownership, refusals, trust  # noqa: E402  (this checkout's, as the commands run it)
from tools.campaign_cases.bench import Bad, Bench, Case, Skip, last_words  # noqa: E402


def all_cases() -> list[Case]:
    cases = [*refusals.cases(), *faults.cases(), *divergence.cases(), *ownership.cases(), *hostile.cases(),
             *trust.cases()]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "two cases share a name"
    return cases


def slug(name: str) -> str:
    return re.sub(r"[^\w.-]+", "-", name).strip("-")[:80]


def run_case(case: Case, bench: Bench) -> tuple[str, str]:
    """``(verdict, what happened)``: ``ok``, ``BAD`` (the answer, or an error of the case itself) or ``skip``."""
    folder = bench.root / "cases" / slug(case.name)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return "ok", case.check(bench, folder)
    except Bad as e:
        return "BAD", str(e)
    except Skip as e:
        return "skip", str(e)
    except Exception as e:  # the case's own failure is a failure too, shown where it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        return "BAD", f"{type(e).__name__}: {last_words(str(e), 120)} ({Path(where.filename).name}:{where.lineno})"


def run_cases(cases: list[Case], bench: Bench, jobs: int = 1, out=sys.stdout) -> list[tuple[str, str, str]]:  # noqa: ANN001
    """Run the cases, printing one line each as it ends; returns ``(verdict, name, what)`` in the cases' order."""
    lock = threading.Lock()

    def one(case: Case) -> tuple[str, str, str]:
        start = time.monotonic()
        verdict, what = run_case(case, bench)
        with lock:
            print(f"{verdict:4} {case.name} ({time.monotonic() - start:.0f} s): {what}", file=out, flush=True)
        return verdict, case.name, what

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def summary(results: list[tuple[str, str, str]]) -> str:
    tried = [r for r in results if r[0] != "skip"]
    good = sum(r[0] == "ok" for r in tried)
    skipped = len(results) - len(tried)
    return f"{good} of {len(tried)} answered well" + (f" ({skipped} skipped, each with its reason)" if skipped else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only the fast cases (bad inputs refused before torch loads)")
    p.add_argument("--only", metavar="PATTERN", help="only the cases whose name matches this regular expression")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill and signal moments (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (printed) for a look afterwards")
    p.add_argument("--list", action="store_true", help="print the cases' names and exit")
    args = p.parse_args(argv)
    cases = [c for c in all_cases() if (c.quick or not args.quick) and re.search(args.only or "", c.name)]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    data = os.environ.get("PARNAS_DATA_DIR")
    if not cases or not data or not (Path(data) / "wikitext-2" / "train.txt").is_file():
        print("campaign: error: " + ("no case matches --only" if not cases else
                                     "set PARNAS_DATA_DIR to a folder holding wikitext-2/"), file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="parnas-campaign-"))
    bench = Bench(root, Path(data), args.seed)
    start = time.monotonic()
    try:
        results = run_cases(cases, bench, max(1, args.jobs))
    finally:
        bench.close()
        if args.keep:
            print(f"work folder: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{summary(results)} (seed {args.seed}, {time.monotonic() - start:.0f} s)")
    return 1 if any(r[0] == "BAD" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""What threads buy on a shared CPU: a second thread at each model width, and a retrain beside a busy process.

``widths``: the standard Transformer-XL of each preset takes training steps with 1, 2, ... threads (up to the
cores this process may use), in alternating rounds in one process (the same model, the thread count switched
between rounds), OpenMP waiting passively as parnas sets it. Prints each count's steps/s and the median of
the same-round speed-ups over one thread: where a second thread starts to pay is what ``parnas.threads``'s
``WORK_PER_THREAD`` encodes (a step's tokens x d_model**2).

``retrain``: ``parnas retrain --arch transformer-xl --config wt2-cpu`` for ``--steps`` steps, four ways, in
alternating rounds: torch's old defaults (a thread per core, OpenMP's default spin-then-sleep wait; the library
called without the CLI) and parnas's policy (the CLI, nothing set), each alone and beside one busy process
(``while True: pass``; ``--pin`` pins it to the first core). Speed is steps/s between the first and the last
progress line (start-up and evaluation excluded; a run still going after ``--limit`` seconds is stopped and
timed over the steps it took). Prints the ratios: busy over alone for each policy, and new over old.

    python benchmarks/threads.py widths                     # tiny, wt2-cpu, wt2-seed
    python benchmarks/threads.py widths --presets wt2-seed --set model.d_model=256 --set model.d_ff=1024
    python benchmarks/threads.py retrain --steps 300 --rounds 2

Other processes on the machine load it too: compare ratios taken in one run, and note the load it prints.
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it, before torch loads
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from parnas.config import load_config  # noqa: E402
from parnas.threads import usable_cores  # noqa: E402


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def widths(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    counts = list(range(1, min(args.max_threads, usable_cores()) + 1))
    print(f"torch {torch.__version__}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {usable_cores()} usable "
          f"cores; {args.rounds} alternating rounds of {', '.join(map(str, counts))} thread(s); {load()}")
    for preset in args.presets.split(","):
        cfg = load_config(preset, args.set)
        names = [f"{n} thread{'s' * (n > 1)}" for n in counts]
        steps_s = thread_rounds(cfg, names, args.rounds, args.steps, args.warmup)
        parts = []
        for name in names:
            gain = [x / y for x, y in zip(steps_s[name], steps_s[names[0]])]
            parts.append(f"{name} {statistics.median(steps_s[name]):.1f} steps/s"
                         + (f" ({statistics.median(gain):.2f}x, rounds {min(gain):.2f}-{max(gain):.2f})"
                            if name != names[0] else ""))
        print(f"{preset} (d_model {cfg.model.d_model}, batch {cfg.data.batch_size} x {cfg.data.seg_len}): "
              f"{'; '.join(parts)}; {load()}", flush=True)


def thread_rounds(cfg, names: list[str], rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Steps/s per round of one standard Transformer-XL at each thread count (``names``: "N thread(s)")."""
    from train_step import alternating_rounds, parnas_step, segment_runner, zipf_ids

    step = parnas_step(cfg, cfg.data.vocab_size, ["attention", "dense"] * (cfg.model.n_blocks // 2), ())
    B, L = cfg.data.batch_size, cfg.data.seg_len
    stream = zipf_ids(B * (L * (warmup + rounds * steps) + 1), cfg.data.vocab_size).view(B, -1)
    run_step = segment_runner(dict.fromkeys(names, step), stream, L)

    def run(name: str, n: int) -> float:
        torch.set_num_threads(int(name.split()[0]))
        return run_step(name, n) / (B * L)

    return alternating_rounds(run, names, rounds, steps, warmup)


PROGRESS = re.compile(r"^step ([\d,]+)/([\d,]+)")


def timed_retrain(policy: str, steps: int, limit: float, out: Path) -> tuple[float, str]:
    """Steps/s of one wt2-cpu retrain of the standard layout, and the threads line it printed (new policy)."""
    sets = [f"train.max_steps={steps}", f"train.eval_every={steps * 10}", f"train.ckpt_every={steps * 10}",
            f"train.log_every={max(1, steps // 20)}", f"train.out_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(ROOT)
    if policy == "new":
        command = [sys.executable, "-m", "parnas.cli", "retrain", "--arch", "transformer-xl", "--config", "wt2-cpu",
                   *[a for s in sets for a in ("--set", s)]]
    else:  # the library as the CLI called it before: torch's own threads and wait policy
        call = f"retrain('transformer-xl', 'wt2-cpu', {sets!r})"
        command = [sys.executable, "-c", f"from parnas.retrain.run import retrain; {call}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    marks: list[tuple[int, float]] = []
    threads_line = ""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = None
    try:
        while True:
            timeout = None if deadline is None else deadline - time.perf_counter()
            if timeout is not None and timeout <= 0 or not selector.select(timeout):
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("threads:"):
                threads_line = line.strip()
            match = PROGRESS.match(line)
            if match:
                marks.append((int(match[1].replace(",", "")), time.perf_counter()))
                deadline = deadline or marks[0][1] + limit
                if marks[-1][0] >= steps:
                    break
    finally:
        proc.send_signal(signal.SIGTERM)  # no evaluation: only the steps are timed
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if len(marks) < 2:
        raise SystemExit(f"the {policy} retrain printed {len(marks)} progress line(s): nothing to time")
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (s1 - s0) / (t1 - t0), threads_line


def busy_process(pin: bool) -> subprocess.Popen:
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " if pin else "") + \
        "\nwhile True: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def retrain_beside(args: argparse.Namespace) -> None:
    names = [(policy, beside) for policy in ("old", "new") for beside in ("alone", "busy")]
    speed: dict[tuple[str, str], list[float]] = {name: [] for name in names}
    print(f"wt2-cpu retrain of ADADAD, {args.steps} steps a run, {args.rounds} alternating round(s), "
          f"{usable_cores()} usable cores, busy process {'pinned to one core' if args.pin else 'not pinned'}; "
          f"{load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i in range(len(names)):
                policy, beside = names[(i + r) % len(names)]
                busy = busy_process(args.pin) if beside == "busy" else None
                try:
                    time.sleep(1.0 if busy else 0.0)
                    rate, line = timed_retrain(policy, args.steps, args.limit, Path(tmp) / f"{policy}-{beside}-{r}")
                finally:
                    if busy:
                        busy.kill()
                        busy.wait()
                speed[policy, beside].append(rate)
                print(f"  round {r + 1}: {policy} policy, {beside}: {rate:.1f} steps/s"
                      f"{f'  [{line}]' if line else ''}; {load()}", flush=True)

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        same = [x / y for x, y in zip(speed[a], speed[b])]
        spread = f" (rounds {min(same):.2f}-{max(same):.2f})" if len(same) > 1 else ""
        return f"{statistics.median(same):.2f}{spread}"

    for policy, label in (("old", "torch's defaults"), ("new", "parnas's policy")):
        print(f"{label:17s}: {statistics.median(speed[policy, 'alone']):6.1f} steps/s alone, "
              f"{statistics.median(speed[policy, 'busy']):6.1f} beside a busy process: busy / alone "
              f"{ratio((policy, 'busy'), (policy, 'alone'))}")
    print(f"new / old: alone {ratio(('new', 'alone'), ('old', 'alone'))}, "
          f"beside a busy process {ratio(('new', 'busy'), ('old', 'busy'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("widths", help="a second thread's gain at each preset's width")
    p.add_argument("--presets", default="tiny,wt2-cpu,wt2-seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="steps per thread count per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-threads", type=int, default=4)
    p = sub.add_parser("retrain", help="a wt2-cpu retrain alone and beside a busy process, old policy and new")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--limit", type=float, default=120.0, help="seconds of steps after which a run is cut short")
    p.add_argument("--pin", action="store_true", help="pin the busy process to one core")
    args = parser.parse_args()
    widths(args) if args.part == "widths" else retrain_beside(args)


if __name__ == "__main__":
    main()

"""Faults, as a shared machine deals them: kill -9, SIGINT and SIGTERM at random moments of train, retrain and
search, then the resume; a second run into a live run's folder; a full disk; a damaged checkpoint; the web UI seen
from the network. Nothing may be lost: every interrupted run, resumed as its one line says, ends bit-exact
(final metrics and weights) with the same run done in one go, or says in one line why it cannot.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tools.campaign_cases.bench import (
    REPO,
    Bad,
    Bench,
    Case,
    Skip,
    again_command,
    last_words,
    one_line,
    sets,
    signal_name,
    succeeded,
)

STEPS = 24
RUN = ["model.dropout=0.1", "train.warmup_steps=3", f"train.max_steps={STEPS}", "train.eval_every=8",
       "train.ckpt_every=4", "train.log_every=1", "search.log_every=2", "search.penalty_cost=flops"]
OUT_KEY = {"train": "train.out_dir", "retrain": "train.out_dir", "search": "search.out_dir"}
HEAD = {"train": ["train"], "retrain": ["retrain", "--arch", "transformer-xl"], "search": ["search"]}


def tests_module(name: str):  # noqa: ANN201 - a test module, imported for its helpers
    """A module of tests/, named by its dotted path under it (``training.test_interrupt``): helpers the tests check
    with, reused here rather than copied."""
    import importlib

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"tests.{name}")


def run_args(bench: Bench, command: str, out: Path, *extra: str) -> list[str]:
    return [*HEAD[command], "--config", "tiny", *bench.micro_sets(), *sets(*RUN, *extra, f"{OUT_KEY[command]}={out}")]


def reference(bench: Bench, command: str, *extra: str) -> tuple[Path, float]:
    """The run done in one go (made once), and its wall time."""
    def make() -> tuple[Path, float]:
        out = bench.root / "reference" / "-".join([command, *extra]).replace("/", "_")
        start = time.monotonic()
        succeeded(bench.cli(run_args(bench, command, out, *extra), bench.root), f"the uninterrupted {command}")
        return out, time.monotonic() - start
    return bench.once(f"reference:{command}:{extra}", make)


def same_run(straight: Path, run: Path, command: str) -> None:
    """Bit-exact: the weights and step of last.ckpt, and the final metrics and history."""
    try:
        tests_module("training.test_interrupt").same_weights(straight / "checkpoints" / "last.ckpt",
                                                    run / "checkpoints" / "last.ckpt")
    except AssertionError as e:
        raise Bad(f"the resumed run's weights differ from the uninterrupted one's ({last_words(str(e), 80)})") from None
    if command == "search":
        a, b = (json.loads((d / "architecture.json").read_text()) for d in (straight, run))
        pick = lambda r: (r["architecture"], r["probabilities"], r["search"]["val_ppl"])  # noqa: E731
        same = pick(a) == pick(b) and (straight / "history.jsonl").read_bytes() == (run / "history.jsonl").read_bytes()
    else:
        a, b = (json.loads((d / "metrics.json").read_text()) for d in (straight, run))
        same = all(a[k] == b[k] for k in ("val_ppl", "test_ppl", "history"))
    if not same:
        raise Bad("the resumed run's final metrics differ from the uninterrupted one's")


def interrupted(command: str, signum: int, moment: str) -> Case:
    """``moment``: ``step`` (a random step's line, then up to 50 ms), ``time`` (a random time within the
    uninterrupted run's wall time: imports, data, validation, evaluation alike) or ``end`` (the last step's line:
    the last validation or the final evaluation)."""
    name = f"{signal_name(signum)} at a random {moment} of a {command}, resumed" if moment != "end" else \
        f"{signal_name(signum)} after the last step of a {command}, resumed"

    def check(bench: Bench, folder: Path) -> str:
        straight, seconds = reference(bench, command)
        rng, out = bench.rng(name), folder / "run"
        args = run_args(bench, command, out)
        proc = bench.start(args, folder, folder / "stderr.txt")
        try:
            when = send_at(proc, signum, moment, rng, seconds)
            proc.communicate(timeout=900)
        finally:
            proc.kill()
            proc.wait()
        err = (folder / "stderr.txt").read_text()
        said = ""
        if proc.returncode == 0 and moment != "step":
            said = "it had finished"
        elif signum == signal.SIGKILL:
            if proc.returncode != -signal.SIGKILL:
                raise Bad(f"{when}: exit {proc.returncode}: {last_words(err)}")
            again = bench.cli([*args, "--resume"], folder)
            if again.returncode == 2 and "nothing to resume" in one_line(again, 2):  # killed before a checkpoint
                said, again = "--resume: nothing to resume; run again", bench.cli(args, folder)
            succeeded(again, "the resume")
        else:
            line = one_line(subprocess.CompletedProcess(args, proc.returncode, "", err), 128 + signum)
            if f"stopped by {signal_name(signum)}" not in line:
                raise Bad(f"{when}: the line does not say what stopped it: {line}")
            succeeded(bench.cli(again_command(line), folder), "the command its line gives")
            said = f"exit {128 + signum}, '{re.split(r', saved| [(]saved|;', line)[0]}'"
        same_run(straight, out, command)
        return f"{when}: {said or 'resumed'}; metrics and weights bit-exact"
    return Case(name, check)


def send_at(proc: subprocess.Popen, signum: int, moment: str, rng, seconds: float) -> str:  # noqa: ANN001
    """Send ``signum`` at the moment; returns when it was sent, in words."""
    if moment == "time":
        delay = rng.uniform(0.3, seconds)
        try:
            proc.wait(timeout=delay)  # stdout: a few kB, far below a pipe's buffer
        except subprocess.TimeoutExpired:
            proc.send_signal(signum)
        return f"{signal_name(signum)} {delay:.1f} s after the start"
    step = rng.randint(1, STEPS - 1) if moment == "step" else STEPS
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            time.sleep(rng.uniform(0, 0.05))
            proc.send_signal(signum)
            return f"{signal_name(signum)} at step {step}"
    raise Bad(f"the run ended (exit {proc.wait()}) before step {step}")


def interruption_cases() -> list[Case]:
    kill, sigint, sigterm = signal.SIGKILL, signal.SIGINT, signal.SIGTERM
    cases = [interrupted(c, s, "step") for c in HEAD for s in (kill, sigint, sigterm)]
    cases += [interrupted(c, s, "time") for c in HEAD for s in (kill, sigterm)]
    cases += [interrupted(c, sigterm, "end") for c in HEAD] + [interrupted("retrain", sigint, "end")]
    return cases


# --- one run per folder ------------------------------------------------------------------------------------------

def live_run(bench: Bench) -> tuple[subprocess.Popen, Path]:
    """A train that holds its folder until the campaign ends: paused (SIGSTOP) once it has begun to train, so it
    costs no CPU meanwhile; a paused process holds its lock as a running one does."""
    def make() -> tuple[subprocess.Popen, Path]:
        folder = bench.root / "live"
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / "run"
        proc = bench.start(run_args(bench, "train", out, "train.max_steps=1000000", "train.log_every=100000"), folder,
                           folder / "stderr.txt")
        bench.cleanups.append(lambda: (proc.kill(), proc.wait()))
        for line in proc.stdout:
            if line.startswith("step "):
                proc.send_signal(signal.SIGSTOP)
                return proc, out
        raise Bad(f"the live run ended: {last_words((folder / 'stderr.txt').read_text())}")
    return bench.once("live", make)


def into_live(what: str, command: str, *extra: str) -> Case:
    def check(bench: Bench, folder: Path) -> str:
        proc, out = live_run(bench)
        line = one_line(bench.cli([*run_args(bench, command, out), *extra], folder), 2)
        if f"(process {proc.pid})" not in line or str(out) not in line:
            raise Bad(f"exit 2, but the line names neither the folder nor process {proc.pid}: {line}")
        if proc.poll() is not None:
            raise Bad(f"the live run died (exit {proc.returncode})")
        return f"exit 2, the live run goes on: {line}"
    return Case(f"lock: {what} into a live run's folder", check)


def listens_nowhere(bench: Bench, folder: Path) -> str:
    import psutil

    proc, _ = live_run(bench)
    listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    if listening:
        raise Bad(f"the training process listens on {listening}")
    return "no listening socket"


# --- a full disk -----------------------------------------------------------------------------------------------

def tmpfs(bench: Bench, folder: Path, size: str) -> Path:
    """A small tmpfs at ``folder / 'disk'``, unmounted when the campaign ends; Skip where it cannot be mounted."""
    disk = folder / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        raise Skip("no mount(8) to make a small disk")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if done.returncode:
        raise Skip(f"cannot mount a tmpfs here ({last_words(done.stderr, 80)}); "
                   "tests/training/test_disk_full.py mocks it")
    bench.cleanups.append(lambda: subprocess.run(["umount", "-l", str(disk)], check=False))
    return disk


DISK_RUN = ["model.d_model=64", "model.d_ff=256", "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=100"]


def full_disk(bench: Bench, folder: Path) -> str:
    """A 1.5 MB checkpoint fits a 2 MB disk once; its successor's temp file beside it does not."""
    from parnas.training import checkpoint as ckpt

    disk = tmpfs(bench, folder, "2m")
    run, last = disk / "run", disk / "run" / "checkpoints" / "last.ckpt"
    args = run_args(bench, "retrain", run, *DISK_RUN)
    line = one_line(bench.cli(args, folder), 2)
    if f"cannot write {last}: No space left on device" not in line or "is unchanged" not in line:
        raise Bad(f"exit 2, but the line does not say which file the full disk cost: {line}")
    if ckpt.load(last)["global_step"] != 2 or sorted(p.name for p in last.parent.iterdir()) != ["last.ckpt"]:
        raise Bad("the previous checkpoint was not kept whole, alone")
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # the user makes room
    succeeded(bench.cli([*args, "--resume"], folder), "the resume once there is room")
    same_run(reference(bench, "retrain", *DISK_RUN)[0], run, "retrain")
    return f"2 MB tmpfs: exit 2, '{last_words(line, 90)}'; grown to 64 MB, --resume: bit-exact"


def no_room(bench: Bench, folder: Path) -> str:
    """A disk full before the run starts."""
    disk = tmpfs(bench, folder, "64k")
    try:
        (disk / "filler").write_bytes(b"\0" * 2**20)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    line = one_line(bench.cli(run_args(bench, "retrain", disk / "run"), folder), 2)
    if "No space left on device" not in line or str(disk) not in line:
        raise Bad(f"exit 2, but the line does not say which disk is full: {line}")
    if sorted(p.name for p in disk.iterdir()) != ["filler"]:
        raise Bad(f"exit 2, but it left {sorted(p.name for p in disk.iterdir())} on the disk: {line}")
    return f"64 kB tmpfs, full: exit 2: {line}"


# --- a damaged checkpoint --------------------------------------------------------------------------------------

def damaged(bench: Bench, folder: Path) -> str:
    """A damaged last.ckpt beside an older copy: --resume names the copy, --resume=PATH goes on from it, bit-exact."""
    out = folder / "run"
    args = run_args(bench, "train", out)
    succeeded(bench.cli([*args, *sets("train.stop_at=8")], folder), "the first 8 steps")
    last = out / "checkpoints" / "last.ckpt"
    older = shutil.copy(last, out / "checkpoints" / "older.ckpt")
    succeeded(bench.cli([*args, "--resume", *sets("train.stop_at=16")], folder), "steps 9 to 16")
    last.write_bytes(last.read_bytes()[:len(last.read_bytes()) // 2])
    line = one_line(bench.cli([*args, "--resume"], folder), 2)
    if f"--resume={older}" not in line:
        raise Bad(f"exit 2, but the line does not name the intact {older}: {line}")
    succeeded(bench.cli([*args, f"--resume={older}"], folder), "--resume=PATH")
    same_run(reference(bench, "train")[0], out, "train")
    return f"--resume: exit 2, '{last_words(line, 90)}'; --resume=PATH: bit-exact"


def damaged_alone(bench: Bench, folder: Path) -> str:
    out = folder / "run"
    args = run_args(bench, "train", out)
    succeeded(bench.cli([*args, *sets("train.stop_at=4")], folder), "the first 4 steps")
    (out / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    return "exit 2: " + one_line(bench.cli([*args, "--resume"], folder), 2)


# --- the web UI from the network -------------------------------------------------------------------------------

def web_ui(listen_all: bool) -> Case:
    def check(bench: Bench, folder: Path) -> str:
        import yaml

        nnictl = tests_module("cli.test_nnictl")
        if not (Path(sys.executable).parent / "nnictl").exists():
            raise Skip("nnictl is not installed beside this Python")
        address = nnictl.non_loopback_address()
        if address is None:
            raise Skip("this machine has no non-loopback IPv4 address to connect from")
        port = own_port()
        config = folder / "probe.yaml"
        config.write_text(yaml.safe_dump({**nnictl.PROBE, "trialCodeDirectory": str(folder),
                                          "experimentWorkingDirectory": str(folder / "experiments")}))
        done = bench.cli(["launch", "--config", str(config), "--port", str(port), *["--listen-all"] * listen_all],
                         folder, {"PATH": f"{Path(sys.executable).parent}:{bench.env['PATH']}"}, timeout=300)
        experiment = done.stdout.split("experiment ")[1].split(":")[0] if "experiment " in done.stdout else None
        try:
            succeeded(done, "parnas launch")
            for _ in range(60):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).close()
                    break
                except OSError:
                    time.sleep(1)
            else:
                raise Bad(f"the web UI never answered on 127.0.0.1:{port}")
            with socket.socket() as s:
                s.settimeout(10)
                outside = s.connect_ex((address, port))
        finally:
            if experiment:
                subprocess.run([str(Path(sys.executable).parent / "nnictl"), "stop", experiment],
                               capture_output=True, timeout=120)
        err = done.stderr.strip()
        if listen_all:
            if outside != 0 or len(err.splitlines()) != 1 or f"anyone who reaches port {port}" not in err:
                raise Bad(f"--listen-all: {address}:{port} gave {errno.errorcode.get(outside, outside)}; stderr: {err}")
            return f"--listen-all: {address}:{port} answers, after one line saying so; stopped"
        if outside != errno.ECONNREFUSED or err:
            raise Bad(f"{address}:{port} gave {errno.errorcode.get(outside, 'a connection')}; stderr: {err}")
        return f"127.0.0.1:{port} answers, {address}:{port} refused; stopped"
    return Case(f"web UI: launch {'--listen-all ' if listen_all else ''}seen from {'' if listen_all else 'the '}"
                "non-loopback address", check)


def own_port() -> int:
    """A free port in 18000-18999 (never NNI's 8080)."""
    for port in range(18100, 18999):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise Skip("no free port in 18100-18999")


def documented(bench: Bench, folder: Path) -> str:
    """Every command the README and docs show runs at tiny scale, or is skipped with its reason (the test that
    collects them, run here as it is)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/cli/test_first_hour.py", "-k", "documented"], cwd=REPO, env=bench.env,
                          capture_output=True, text=True, timeout=3600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0:
        raise Bad(f"pytest exit {done.returncode}: {last_words(done.stdout, 200)}")
    return f"tests/cli/test_first_hour.py -k documented: {summary}"


def cases() -> list[Case]:
    return [
        *interruption_cases(),
        into_live("a second train", "train"), into_live("a --resume", "train", "--resume"),
        into_live("a retrain", "retrain"), into_live("a search", "search"),
        Case("port: a training run listens on no port", listens_nowhere),
        Case("disk: a checkpoint that fills the disk, resumed once there is room", full_disk),
        Case("disk: no room at all", no_room),
        Case("checkpoint: a damaged last.ckpt beside an older one", damaged),
        Case("checkpoint: a damaged last.ckpt alone", damaged_alone),
        web_ui(False), web_ui(True),
        Case("docs: every documented command runs or is skipped with its reason", documented),
    ]

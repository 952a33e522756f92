"""One run writes a folder at a time: a second run into it, or a --resume of a live one, exits 2 with one line naming
the process that holds it; the lock dies with its process, kill -9 included; nested runs and DDP ranks pass."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parnas.errors import ParnasError
from parnas.owned_folders import LOCK_FILE, check_not_held, hold_run_dir

ROOT = Path(__file__).parents[2]
HOLD = ("import sys, time\n"
        "from parnas.owned_folders import hold_run_dir\n"
        "with hold_run_dir(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n")


def holder(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder`` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_folder_is_refused_naming_the_holder_and_freed_when_it_is_killed(tmp_path):
    folder = tmp_path / "run"
    proc = holder(folder)
    try:
        for attempt in (lambda: hold_run_dir(folder).__enter__(), lambda: check_not_held(folder)):
            with pytest.raises(ParnasError, match=rf"in use by another parnas run \(process {proc.pid}\)"):
                attempt()
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        proc.wait()
    assert (folder / LOCK_FILE).exists()  # left by the killed process, but nobody holds it
    check_not_held(folder)
    with hold_run_dir(folder):
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
    assert not (folder / LOCK_FILE).exists()


def test_this_process_may_hold_a_folder_again_and_its_sub_folders(tmp_path):
    """A command holds its folder around the library call that holds it too; a study holds its folder while its
    searches and retrains hold their sub-folders. Folders the lock made are removed when nothing else was written."""
    study = tmp_path / "a" / "study"
    with hold_run_dir(study):
        with hold_run_dir(study):
            check_not_held(study)
        assert (study / LOCK_FILE).exists()  # the inner block did not release the outer one's lock
        with hold_run_dir(study / "retrain" / "AD"):
            (study / "retrain" / "AD" / "metrics.json").write_text("{}")
        with hold_run_dir(study / "search" / "s0"):
            pass
        assert not (study / "search").exists() and (study / "retrain" / "AD" / "metrics.json").exists()
    assert not (study / LOCK_FILE).exists() and (study / "retrain").is_dir()
    with hold_run_dir(tmp_path / "b" / "c"):
        pass
    assert not (tmp_path / "b").exists()  # refused or empty: nothing left behind


def test_ranks_a_launcher_started_neither_lock_nor_refuse(tmp_path, monkeypatch):
    """Lightning's DDP re-runs the command for rank 1 (``LOCAL_RANK=1``) while rank 0 holds the folder."""
    folder = tmp_path / "run"
    proc = holder(folder)
    try:
        for variable in ("LOCAL_RANK", "NODE_RANK", "RANK"):
            with monkeypatch.context() as m:
                m.setenv(variable, "1")
                check_not_held(folder)
                with hold_run_dir(folder):
                    pass
        assert (folder / LOCK_FILE).read_text().strip() == str(proc.pid)
        monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 itself, once Lightning has set it
        with pytest.raises(ParnasError, match=str(proc.pid)):
            check_not_held(folder)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_second_run_or_a_resume_into_a_live_runs_folder_exits_2_naming_its_process(micro, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--config", "tiny", "--set", f"data.path={micro}", "--set", "data.tokenizer=char",
              "--set", "model.cutoffs=[20, 40]", "--set", f"train.out_dir={run}"]
    first = subprocess.Popen([sys.executable, "-m", "parnas.cli", "train", *common, "--set", "train.max_steps=100000"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / LOCK_FILE).is_file() or not (run / LOCK_FILE).read_text().strip():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not take its folder"
            time.sleep(0.2)
        for command in (["train", *common], ["train", *common, "--resume"],
                        ["retrain", "--arch", "transformer-xl", *common]):
            second = subprocess.run([sys.executable, "-m", "parnas.cli", *command], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=120)
            (line,) = second.stderr.strip().splitlines()
            assert second.returncode == 2 and f"(process {first.pid})" in line and str(run) in line, second.stderr
    finally:
        first.kill()  # SIGKILL: nothing of the first run's own runs
        first.wait()
    done = subprocess.run([sys.executable, "-m", "parnas.cli", "train", *common, "--set", "train.max_steps=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "metrics.json").is_file() and not (run / LOCK_FILE).exists()


# --- the lock file cannot be pointed at another file ---------------------------------------------------------------

def plant(folder: Path, how: str, victim: Path) -> None:
    """Put something other than parnas's own lock at ``folder/.parnas.lock``; ``victim`` is a user's file."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    if how == "link":
        lock.symlink_to(victim)
    elif how == "dangling link":
        lock.symlink_to(victim.parent / "absent")
    elif how == "hard link":
        os.link(victim, lock)
    elif how == "folder":
        lock.mkdir()
    elif how == "pipe":
        os.mkfifo(lock)
    else:  # a file of the user's own, not a process id
        lock.write_text("my notes\n")


@pytest.mark.parametrize("how, why", [("link", "symbolic link"), ("dangling link", "symbolic link"),
                                      ("hard link", "hard link"), ("folder", "not a regular file"),
                                      ("pipe", "not a regular file"), ("file", "other than a process id")])
def test_a_lock_path_that_is_not_parnas_own_lock_is_refused_and_nothing_is_written_through_it(tmp_path, how, why):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's data\n")
    folder = tmp_path / "run"
    plant(folder, how, victim)
    for attempt in (lambda: hold_run_dir(folder).__enter__(), lambda: check_not_held(folder)):
        with pytest.raises(ParnasError, match=why) as refused:
            attempt()
        assert str(folder) in str(refused.value) and "\n" not in str(refused.value)
    assert victim.read_text() == "the user's data\n"
    assert os.path.lexists(folder / LOCK_FILE) and not (tmp_path / "absent").exists()  # left as it was


def test_a_lock_left_by_a_killed_run_is_replaced_never_truncated(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_FILE).write_text("4194999\n")  # no such process holds it: its run was killed
    stale = os.open(folder / LOCK_FILE, os.O_RDONLY)
    try:
        with hold_run_dir(folder):
            assert (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"
            assert not os.path.samestat(os.fstat(stale), os.stat(folder / LOCK_FILE))  # a new file
            assert os.pread(stale, 64, 0) == b"4194999\n"  # the old one was removed, not rewritten
    finally:
        os.close(stale)
    assert not (folder / LOCK_FILE).exists()


@pytest.mark.parametrize("command", ["train", "retrain", "search"])
def test_a_command_refuses_a_planted_lock_link_in_one_line_and_leaves_its_target(tmp_path, capsys, command):
    from test_bad_input import assert_refused, cli

    victim = tmp_path / "victim.txt"
    victim.write_text("the user's data\n")
    run = tmp_path / "R"
    plant(run, "link", victim)
    head = {"train": ["train"], "retrain": ["retrain", "--arch", "transformer-xl"], "search": ["search"]}[command]
    code, _, err = cli(capsys, *head, "--config", "tiny", "--set", f"train.out_dir={run}",
                       "--set", f"search.out_dir={run}")
    assert_refused(code, err, str(run), "symbolic link")
    assert victim.read_text() == "the user's data\n" and os.listdir(run) == [LOCK_FILE]

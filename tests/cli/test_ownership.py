"""A command writes, clears and removes only what it made, in its own folder: another run nested in the folders it
writes in (a train's in a search's ``tensorboard/``, a search's in a train's, a user's retrain in a study's
``retrain/``) is refused in one line naming it (its process while it is live) and kept, byte for byte; a study uses
only the sub-folders it made; a command checks and holds its folder once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import assert_refused, cli, micro_settings
from test_run_lock import holder

from parnas.errors import ParnasError
from parnas.owned_folders import LOCK_FILE
from parnas.study.sub_folders import OWNER_FILE, clear_own_dir, own_sub_dir

HEAD = {"train": ["train"], "retrain": ["retrain", "--arch", "transformer-xl"], "search": ["search"]}


def command(name: str, out: Path, *extra: str) -> list[str]:
    return [*HEAD[name], "--config", "tiny", "--set", f"train.out_dir={out}", "--set", f"search.out_dir={out}", *extra]


def finished_run(folder: Path, kind: str) -> None:
    """The files a finished train (or retrain) or search leaves."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"the weights")
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out.tfevents.1").write_bytes(b"logs")
    if kind == "search":
        (folder / "architecture.json").write_text('{"architecture": {}}\n')
        (folder / "history.jsonl").write_text('{"step": 4}\n')
    else:
        (folder / "metrics.json").write_text('{"val_ppl": 3.0}\n')


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


# (outer command, inner run, the sub-folder of the outer's folder that holds it)
NESTED = [("search", "train", "tensorboard"), ("train", "search", "tensorboard"), ("train", "train", "checkpoints"),
          ("retrain", "search", "tensorboard"), ("search", "retrain", "checkpoints")]


@pytest.mark.parametrize("outer, inner, sub", NESTED)
def test_a_finished_run_nested_where_a_command_writes_is_kept_and_the_command_refused(tmp_path, capsys, outer, inner,
                                                                                      sub):
    """The search of the report removed ``R/tensorboard`` holding a finished train, and exited 0."""
    root = tmp_path / "R"
    finished_run(root / sub, inner)
    before = snapshot(root)
    code, _, err = cli(capsys, *command(outer, root))
    assert_refused(code, err, str(root / sub), "another run", "kept")
    assert snapshot(root) == before  # nothing removed, nothing written (not even the outer's lock)


@pytest.mark.parametrize("outer, inner, sub", NESTED[:3])
def test_a_live_run_nested_where_a_command_writes_is_refused_naming_its_process(tmp_path, capsys, outer, inner, sub):
    root = tmp_path / "R"
    (root / sub / "tensorboard").mkdir(parents=True)
    proc = holder(root / sub)
    try:
        before = snapshot(root)
        code, _, err = cli(capsys, *command(outer, root))
        assert_refused(code, err, str(root / sub), f"(process {proc.pid})")
        assert snapshot(root) == before and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_fresh_search_clears_its_own_stale_logs_but_not_a_run_that_arrived_there(tmp_path):
    from parnas.strategies.search_folder import prepare_run_dir

    run = tmp_path / "search"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"stale")
    prepare_run_dir(run, None)
    assert not (run / "tensorboard").exists()
    finished_run(run / "tensorboard", "train")  # started there after the search's checks
    before = snapshot(run)
    with pytest.raises(ParnasError, match="another run"):
        prepare_run_dir(run, None)
    assert snapshot(run) == before


# --- a study and the sub-folders it made ------------------------------------------------------------------------

def study(out: Path, strategies: bool = False) -> list[str]:
    command = (["strategies", "par-gumbel-darts,random"] if strategies else
               ["study", "--budgets", "none"])
    return [*command, "--config", "tiny", "--seeds", "1", "--out", str(out), "--steps", "2"]


@pytest.mark.parametrize("group", ["retrain", "search"])
@pytest.mark.parametrize("strategies", [False, True])
def test_a_study_refuses_a_finished_run_it_did_not_start_in_its_sub_folders_before_any_work(tmp_path, capsys, group,
                                                                                          strategies):
    """A user's ``parnas retrain --out S/retrain/ADAD``: the study would have read its metrics as its own."""
    out = tmp_path / "S"
    finished_run(out / group / "ADAD", "search" if group == "search" else "retrain")
    before = snapshot(out)
    code, _, err = cli(capsys, *study(out, strategies))
    assert_refused(code, err, str(out / group / "ADAD"), "not made by this study", "kept")
    assert snapshot(out) == before  # no settings.json, no search started


@pytest.mark.parametrize("marked", [False, True])
def test_a_study_refuses_a_live_run_in_its_sub_folders_naming_its_process(tmp_path, capsys, marked):
    """Started by hand into a folder the study did not make, or into one it made: either is refused, kept."""
    out = tmp_path / "S"
    run = out / "retrain" / "ADAD"
    run.mkdir(parents=True)
    if marked:
        own_sub_dir(run, "study")
    proc = holder(run)
    try:
        before = snapshot(out)
        code, _, err = cli(capsys, *study(out))
        assert_refused(code, err, str(run), f"(process {proc.pid})")
        assert snapshot(out) == before and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_sub_folder_is_the_parents_only_if_it_made_it(tmp_path):
    absent, empty, foreign = tmp_path / "a", tmp_path / "e", tmp_path / "f"
    assert own_sub_dir(absent, "study", make=False) == absent and not absent.exists()  # a check writes nothing
    own_sub_dir(absent, "study")
    empty.mkdir()
    own_sub_dir(empty, "study")
    assert (absent / OWNER_FILE).is_file() and (empty / OWNER_FILE).is_file()
    finished_run(absent, "retrain")
    assert own_sub_dir(absent, "study", make=False) == absent  # its own finished run: read, resumed or cleared
    (foreign / "notes").mkdir(parents=True)
    with pytest.raises(ParnasError, match=r"not made by this study \(it holds files: notes\)"):
        own_sub_dir(foreign, "study")
    assert not (foreign / OWNER_FILE).exists()


def test_clearing_a_studys_interrupted_sub_run_keeps_its_mark_and_any_run_that_arrived_in_it(tmp_path):
    run = tmp_path / "retrain" / "ADAD"
    own_sub_dir(run, "study")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"stale")
    (run / LOCK_FILE).write_text("4194999\n")  # its run was killed before its first checkpoint
    (run / "architecture.json").write_text("{}")
    (run / "checkpoints" / "nested").mkdir(parents=True)
    (run / "checkpoints" / "nested" / "metrics.json").write_text("{}")  # another's, started inside it
    with pytest.raises(ParnasError, match="another run"):
        clear_own_dir(run)
    assert (run / "tensorboard").is_dir() and (run / "checkpoints" / "nested" / "metrics.json").is_file()
    (run / "checkpoints" / "nested" / "metrics.json").unlink()
    clear_own_dir(run)
    assert sorted(p.name for p in run.iterdir()) == sorted([OWNER_FILE, LOCK_FILE])


# --- each check once ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["train", "retrain", "search"])
def test_a_command_checks_and_locks_its_folder_once(micro, tmp_path, name):
    """One check with one set of messages, one lock file opened: the library calls inside the command find the
    folder taken (counted in a child process, whose imports are its own)."""
    out = tmp_path / "run"
    args = [*HEAD[name], *micro_settings(micro, out, f"search.out_dir={out}", "search.log_every=1")]
    code = ("import sys, parnas.owned_folders as r\n"
            "calls = {'check': 0, 'lock': 0}\n"
            "def count(name, real):\n"
            "    def f(*a, **k):\n"
            "        calls[name] += 1\n"
            "        return real(*a, **k)\n"
            "    return f\n"
            "r.check_run_dir, r._open_lock = count('check', r.check_run_dir), count('lock', r._open_lock)\n"
            "from parnas.cli import main\n"
            f"status = main({[str(a) for a in args]!r})\n"
            "print(status, calls['check'], calls['lock'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.stdout.strip().splitlines()[-1] == "0 1 1", done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / ("architecture.json" if name == "search" else "metrics.json")).is_file()
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("name, sub", [("train", "checkpoints"), ("train", "tensorboard"), ("retrain", "checkpoints"),
                                       ("search", "tensorboard"), ("search", "select")])
@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_link_or_a_file_at_a_sub_folder_a_run_writes_is_refused_before_any_work(tmp_path, capsys, name, sub,
                                                                                  planted):
    """``out/checkpoints`` a link to a folder elsewhere would take the run's checkpoints there; a file there would
    fail only once the run had trained. Either is one line, at the start, and nothing is written anywhere."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    if planted == "link":
        (out / sub).symlink_to(elsewhere, target_is_directory=True)
    else:
        (out / sub).write_text("a file of the user's\n")
    code, _, err = cli(capsys, *command(name, out))
    assert_refused(code, err, str(out / sub), "symbolic link" if planted == "link" else "a file, not a folder")
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == [sub]


def test_a_file_may_be_written_into_a_linked_folder_the_user_named_but_never_through_a_link_at_its_name(tmp_path):
    """The folder a file goes into is the user's to name, link or not (macOS's /tmp is one); a link at the file's
    own name is replaced by the atomic write, never written through."""
    from parnas.files import check_file_folder, write_json_atomic

    real, linked = tmp_path / "real", tmp_path / "linked"
    real.mkdir()
    linked.symlink_to(real)
    assert check_file_folder(linked / "eval.json") == real
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    (real / "eval.json").symlink_to(victim)
    write_json_atomic(linked / "eval.json", {"ok": 1})
    assert victim.read_text() == "keep" and not (real / "eval.json").is_symlink()
    with pytest.raises(ParnasError, match="not a folder"):
        check_file_folder(tmp_path / "victim.json" / "x.json")

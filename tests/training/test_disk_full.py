"""A full disk or quota: one line naming the file, the bytes it needs and those free, exit 2, and the previous file
(a run's last.ckpt, metrics) whole; never a traceback or a hang."""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parnas.cli import main
from parnas.errors import ParnasError
from parnas.files import out_of_space, write_atomic, write_text_atomic
from parnas.owned_folders import LOCK_FILE, hold_run_dir
from parnas.training import checkpoint as ckpt

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_that_fills_the_disk_says_so_and_keeps_the_previous_file(tmp_path, code):
    path = tmp_path / "metrics.json"
    write_text_atomic(path, "old\n")

    def fill(f):
        f.write("half of it")
        raise OSError(code, os.strerror(code))

    with pytest.raises(ParnasError) as refused:
        write_atomic(path, fill, size=123_456)
    line = str(refused.value)
    assert str(path) in line and os.strerror(code) in line and "needs about 123 kB" in line, line
    assert " free there" in line and "the previous metrics.json is unchanged" in line and "\n" not in line
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_run_folder_on_a_disk_with_no_room_names_its_lock_file_and_leaves_nothing(tmp_path, monkeypatch):
    """The first write of a run is its lock file's process id: a disk full from the start fails there."""
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    folder = tmp_path / "disk" / "run"
    with pytest.raises(ParnasError) as refused:
        with hold_run_dir(folder):
            pass
    line = str(refused.value)
    assert line.startswith(f"cannot write {folder / LOCK_FILE}: No space left on device (") and " free there" in line
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_behind_a_write_to_a_descriptor_claims_no_free_space():
    """Without a path the disk is unknown: the free space of the working folder's disk would mislead."""
    line = str(out_of_space(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert line == "cannot write a file: No space left on device; free some space or choose another output folder"


def micro_args(corpus: Path, run: Path, *extra: str) -> list[str]:
    pairs = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=4",
             "train.ckpt_every=2", "train.eval_every=100", *extra]
    return ["retrain", "--arch", "transformer-xl", "--config", "tiny", "--out", str(run),
            *[a for p in pairs for a in ("--set", p)]]


def test_a_checkpoint_that_fills_the_disk_stops_the_run_in_one_line_keeping_the_last_one(micro, tmp_path,
                                                                                         monkeypatch, capsys):
    """torch.save turns the failed write into a RuntimeError about its zip file; the line still says what happened."""
    real, saves = torch.save, []

    class Full:
        """A file whose disk fills after ``room`` bytes."""

        def __init__(self, f, room):
            self.f, self.room = f, room

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= len(data)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def save(obj, f, *args, **kwargs):
        saves.append(obj["global_step"])
        return real(obj, f if len(saves) == 1 else Full(f, 1000), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    assert main(micro_args(micro, run)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    last = run / "checkpoints" / "last.ckpt"
    assert saves == [2, 4] and line.startswith(f"parnas retrain: error: cannot write {last}: "), line
    assert "No space left on device" in line and "needs about" in line and "is unchanged" in line, line
    assert ckpt.load(last)["global_step"] == 2  # the previous checkpoint, whole
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no temp file left
    assert not (run / "metrics.json").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only; skipped where mounting is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_retrain_on_a_real_full_disk_exits_2_in_one_line_and_keeps_its_last_checkpoint(micro, small_disk):
    """A 1.5 MB checkpoint fits the 2 MB disk once; its successor's temp file beside it does not."""
    run = small_disk / "run"
    args = micro_args(micro, run, "model.d_model=64", "model.d_ff=256")
    done = subprocess.run([sys.executable, "-m", "parnas.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    last = run / "checkpoints" / "last.ckpt"
    assert line.startswith(f"parnas retrain: error: cannot write {last}: No space left on device"), line
    assert ckpt.load(last)["global_step"] == 2 and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]

"""The thread policy (parnas.threads): what a run computes with on a shared machine, and that it says why.

The machine's cores and load are passed in, so nothing here depends on how busy the test machine is."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parnas import threads
from parnas.errors import ConfigError

ROOT = Path(__file__).parents[2]
TOKENS = 1024
WIDE = 256  # 1,024 tokens a step at this width gain from 8 threads


def test_an_explicit_setting_wins_then_the_users_environment():
    assert threads.choose(64, TOKENS, 3, environ={"OMP_NUM_THREADS": "2"}, cores=2, load=0).threads == 3
    choice = threads.choose(WIDE, TOKENS, 0, environ={"OMP_NUM_THREADS": "5"}, cores=2, load=0)
    assert choice.threads == 5 and "OMP_NUM_THREADS" in choice.line()
    assert threads.choose(WIDE, TOKENS, 0, environ={"OMP_NUM_THREADS": "4,2"}, cores=8, load=0).threads == 4  # nested


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_wrong_omp_num_threads_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        threads.choose(64, TOKENS, environ={"OMP_NUM_THREADS": value}, cores=2, load=0)


def test_a_busy_machine_leaves_fewer_threads_and_never_none():
    free = threads.choose(WIDE, TOKENS, environ={}, cores=8, load=0.2)
    busy = threads.choose(WIDE, TOKENS, environ={}, cores=8, load=5.0)
    swamped = threads.choose(WIDE, TOKENS, environ={}, cores=2, load=9.0)
    assert free.threads == 8 and busy.threads == 3 and swamped.threads == 1
    assert "load 5.0" in busy.line() and busy.line().startswith("threads: 3 (")


def test_a_small_step_takes_one_thread_however_many_cores_are_free():
    choice = threads.choose(64, TOKENS, environ={}, cores=16, load=0)  # wt2-cpu's width at batch 32 x 32
    assert choice.threads == 1 and "1,024 tokens a step at width 64 gains nothing from a second thread" in choice.line()
    assert threads.choose(128, TOKENS, environ={}, cores=16, load=0).threads == 2  # wt2-seed's step
    assert threads.choose(WIDE, 1, environ={}, cores=16, load=0).threads == 1  # a generated token


def test_the_threads_a_step_gains_from_grow_with_its_matrix_products():
    work = [threads.useful_threads(d, tokens) for d, tokens in ((64, 256), (128, 256), (128, 1024), (256, 1024),
                                                                  (512, 1024), (1024, 8192))]
    assert work == sorted(work) and work[0] == 1 and work[-1] > 16


def test_the_processes_of_a_run_share_the_free_cores():
    assert threads.choose(WIDE, TOKENS, processes=4, environ={}, cores=8, load=0).threads == 2
    assert threads.choose(WIDE, TOKENS, processes=16, environ={}, cores=8, load=0).threads == 1


def test_the_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    assert threads.cgroup_cpus(tmp_path, tmp_path / "cgroup") == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpus(tmp_path, tmp_path / "cgroup") is None
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "job" / "cpu.max").unlink()
    (tmp_path / "cgroup").write_text("4:cpu,cpuacct:/\n")
    assert threads.cgroup_cpus(tmp_path, tmp_path / "cgroup") == 2.0
    assert threads.cgroup_cpus(tmp_path / "absent", tmp_path / "absent") is None

    monkeypatch.setattr(threads, "cgroup_cpus", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert threads.usable_cores() == 2


def test_prepare_passes_the_choice_to_torch_and_to_child_processes():
    import torch

    environ: dict[str, str] = {}
    threads.prepare(threads.Choice(2, "test"), environ)
    assert environ["OMP_NUM_THREADS"] == "2" and torch.get_num_threads() == 2


def test_a_users_wait_policy_is_kept():
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    threads.wait_passively(environ)
    assert environ["OMP_WAIT_POLICY"] == "ACTIVE"
    environ = {}
    threads.wait_passively(environ)
    assert environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_cli_sets_the_wait_policy_before_torch_loads():
    """OpenMP reads its wait policy once, when torch loads it: the CLI must have set it by then."""
    code = ("import os, sys; from parnas.cli import main; code = main(['train', '--config', 'tiny', '--set', "
            "'train.threads=-1']); print(code, os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.stdout.split() == ["2", "PASSIVE", "False"], done.stderr
    assert "train.threads must be >= 0" in done.stderr


@pytest.mark.slow  # a run with two threads: seconds of waiting for a core on a busy machine
def test_a_run_says_first_how_many_threads_it_uses_and_uses_them(micro, tmp_path, capsys, monkeypatch):
    import torch

    from parnas.cli import main

    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=1",
            "train.eval_every=1", f"train.out_dir={tmp_path / 'run'}", "train.threads=2"]
    assert main(["train", "--config", "tiny", *[a for s in sets for a in ("--set", s)]]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "threads: 2 (train.threads=2)" and torch.get_num_threads() == 2
    assert os.environ["OMP_NUM_THREADS"] == "2"  # what a DDP process Lightning starts reads


def test_the_threads_line_names_the_limit_that_decided_and_never_counts_a_busy_core_free():
    busy = threads.choose(64, TOKENS, environ={}, cores=2, load=3.5).line()
    assert busy == "threads: 1 (2 cores, busy at load 3.5: one thread fights least)"
    assert "free" not in threads.choose(WIDE, TOKENS, processes=4, environ={}, cores=2, load=2.0).line()
    some = threads.choose(WIDE, TOKENS, environ={}, cores=8, load=5.0).line()  # the free cores decide
    assert some == "threads: 3 (8 cores, 3 free at load 5.0; 1,024 tokens a step at width 256 would use 8)"
    small = threads.choose(64, TOKENS, environ={}, cores=8, load=0.0).line()  # the step's size decides
    assert small.startswith("threads: 1 (8 cores, all free at load 0.0; ") and small.endswith("second thread)")


def test_a_slow_load_of_torch_is_said_in_one_line_and_a_quick_one_not_at_all(tmp_path, monkeypatch):
    """A fresh machine reads torch from a cold disk for many seconds: after the threads line, the run says why
    it is quiet instead of printing nothing."""
    (tmp_path / "slow_to_load.py").write_text("import time\ntime.sleep(0.5)\n")
    (tmp_path / "quick_to_load.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    said: list[str] = []
    threads.load_torch(said.append, after_s=0.05, module="slow_to_load")
    assert len(said) == 1 and said[0].startswith("loading PyTorch")
    threads.load_torch(said.append, after_s=0.05, module="quick_to_load")
    threads.load_torch(said.append, after_s=0.05, module="slow_to_load")  # loaded already: nothing to wait for
    assert len(said) == 1

"""Input as a hostile or careless user gives it: YAML aliases that expand without end, keys given twice, paths
that look like YAML, a cached latency table with impossible costs, a closed terminal, a burst of Ctrl-C, an
unusable cache folder or output path, a process that cannot allocate, a pickle that would run code. Each ends
in one line (a refusal: exit 2, nothing written) or does what was asked."""

import json
import math
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_bad_input import assert_refused, cli

from parnas import reading
from parnas.config import load_config
from parnas.errors import ParnasError
from parnas.overrides import as_given, parse_overrides
from parnas.training import latency, latency_cache, latency_table, memory

ROOT = Path(__file__).parents[2]


def laughs(levels: int) -> str:
    """A flow list of anchors, each nine aliases of the one before: ``9**levels`` strings in a few hundred bytes."""
    rows = [f"&a0 [{', '.join(['lol'] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


# --- bounded YAML and JSON -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    (f"data:\n  path: {laughs(9)}\n", "repeat more than 100,000 values"),  # 387 million strings: never built
    ("data:\n  path: &x [*x]\n", "once its aliases (*name) are expanded"),  # an alias inside its own anchor
    ("data:\n  path: &x {a: [*x]}\n", "once its aliases (*name) are expanded"),
    ("a: &d " + "[" * 40 + "1" + "]" * 40 + "\ndata:\n  path: " + "[" * 30 + "*d" + "]" * 30 + "\n",
     "once its aliases (*name) are expanded"),  # 70 deep only once expanded
])
def test_yaml_aliases_are_counted_before_anything_is_built(capsys, tmp_path, text, needle):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    started = time.monotonic()
    code, _, err = cli(capsys, "train", "--config", config, "--dry-run")
    assert time.monotonic() - started < 5, "the aliases were expanded"
    assert_refused(code, err, str(config), needle)
    assert len(err) < 400


def test_a_billion_laughs_in_a_set_value_is_refused_too(capsys):
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"data.path={laughs(8)}", "--dry-run")
    assert_refused(code, err, "--set data.path", "repeat more than 100,000 values")


def test_aliases_within_the_limit_and_merge_keys_read_as_yaml_reads_them():
    text = ("base: &b {d_model: 64, n_heads: 2}\nmodel: {<<: *b, d_model: 128}\nlist: &l [1, 2, 3]\n"
            f"again: [*l, *l]\nwide: {laughs(5)}\n")  # 9**5 = 59,049 strings: allowed
    assert reading.parse_yaml(text, "x") == yaml.safe_load(text)


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  max_steps: 3\nmodel:\n  d_model: 64\ntrain:\n  max_steps: 5\n", "'train'", "lines 1 and 5"),
    ("train:\n  max_steps: 3\n  lr: 0.1\n  max_steps: 5\n", "'max_steps'", "lines 2 and 4"),
    ("model: {d_model: 64, d_model: 128}\n", "'d_model'", "lines 1 and 1"),
    ('train:\n  max_steps: 3\n  "max_steps": 5\n', "'max_steps'", "lines 2 and 3"),
])
def test_a_key_given_twice_in_a_config_is_refused_with_both_lines(capsys, tmp_path, text, key, lines):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    code, _, err = cli(capsys, "train", "--config", config, "--dry-run")
    assert_refused(code, err, str(config), f"key {key} is given twice", lines)


def test_a_key_given_twice_in_a_set_value_or_a_json_file_is_refused(capsys, tmp_path):
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", "model={d_model: 64, d_model: 128}", "--dry-run")
    assert_refused(code, err, "--set model", "key 'd_model' is given twice")
    arch = tmp_path / "arch.json"
    arch.write_text('{"format": "parnas.architecture",\n "model": {"d_model": 64,\n  "d_model": 128}}')
    code, _, err = cli(capsys, "retrain", "--arch", arch, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/r")
    assert_refused(code, err, str(arch), "key 'd_model' is given twice in one object (lines 2 and 3)")
    assert not (tmp_path / "r").exists()
    # the same key in two objects, or inside a string, is no repeat
    assert reading.parse_json('[{"a": 1}, {"a": 2, "b": "{\\"a\\": 1, \\"a\\": 2}"}]', "x")[1]["a"] == 2


@pytest.mark.parametrize("value", ["[" + "1, " * 2_000 + "1]", "x" * 100_000,
                                   "{" + ", ".join(f"k{i}: v" for i in range(1000)) + "}"])
def test_a_message_quotes_a_bounded_prefix_of_a_bad_value(capsys, value):
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"train.max_steps={value}", "--dry-run")
    assert_refused(code, err, "train.max_steps must be int, got ")
    assert len(err) < 250 and value[:12] in err.replace("'", "")


def test_a_huge_integer_is_one_line():
    with pytest.raises(ParnasError, match="a number of more than"):
        reading.parse_yaml("9" * 5000, "--set train.max_steps")


# --- paths are paths -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["runs/exp #2", "yes", "null", "on", "~", "1e3", "[a]", "a: b", "&x", "*x", "!!str",
                                  'q"uote\\d', "tab\there", "new\nline", "é😀", "bad\udcffbyte", " lead", "trail "])
def test_a_path_option_passes_the_string_as_given(text):
    assert parse_overrides([as_given("train.out_dir", text)]) == {"train": {"out_dir": text}}


@pytest.mark.parametrize("out", ["exp #2", "yes", "null", "off"])
def test_retrain_out_is_taken_as_given(capsys, tmp_path, monkeypatch, out):
    import parnas.config

    seen = []

    def spy(source, overrides=(), extra=None):  # the config retrain would run with, then stop
        seen.append(load_config(source, overrides, extra).train.out_dir)
        raise ParnasError("stop here")

    monkeypatch.setattr(parnas.config, "load_config", spy)
    code, _, err = cli(capsys, "retrain", "--arch", "transformer-xl", "--config", "tiny", "--out", str(tmp_path / out))
    assert_refused(code, err, "stop here")
    assert seen == [str(tmp_path / out)]


# --- a cached latency table passes a given table's checks ------------------------------------------------------

def steady_table(cost: float = 1.0) -> latency_table.LatencyTable:
    import torch

    cfg = load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]"])
    key = latency_table.table_key(cfg, 64, ["attention", "dense", "identity"], torch.device("cpu"))
    modes = latency_table.MODES
    timing = {"timed_at": "2026-01-01T00:00:00+00:00", "host": "here", "device": key["device"], "threads": 1,
              "cores": 2, "load": 0.0, "rounds": 7, "spread": {m: {"constant": 0.01, "dense": 0.01} for m in modes}}
    kinds = {"attention": dict.fromkeys(modes, 2.0 * cost), "dense": dict.fromkeys(modes, cost),
             "identity": dict.fromkeys(modes, 0.0)}
    return latency_table.LatencyTable(key, dict.fromkeys(modes, 5.0), kinds, 2, timing)


@pytest.mark.parametrize("where, cost, said", [
    (("kinds_ms", "dense", "train"), math.nan, "a train cost of nan ms"),
    (("kinds_ms", "attention", "inference"), -1.0, "an inference cost of -1.0 ms"),
    (("kinds_ms", "attention", "train"), 0.0, "a train cost of 0.0 ms"),
    (("constant_ms", "train"), math.inf, "a train constant of inf ms"),
    (("kinds_ms", "identity", "train"), -0.5, "a train cost of -0.5 ms"),
    (("kinds_ms", "dense", "train"), "fast", "costs that are not numbers"),
])
def test_a_cached_table_with_impossible_costs_is_timed_again_with_one_line(tmp_path, monkeypatch, where, cost, said):
    good = steady_table()
    bad = good.to_dict()
    node = bad
    for step in where[:-1]:
        node = node[step]
    node[where[-1]] = cost
    cached = latency_cache.cache_path(good.key, tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps(bad))
    assert latency_cache.newest_covering(good.key, cached.parent, warn=lambda line: None) is None  # never used
    cached.write_text(json.dumps(bad))
    lines = []
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: good)
    cfg = load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]"])
    table, was_cached = latency_cache.latency_table(cfg, 64, ["attention", "dense"], cache_dir=tmp_path,
                                                    warn=lines.append)
    assert (table, was_cached) == (good, False)
    (line,) = lines
    assert str(cached) in line and said in line and "not used" in line
    assert latency_table.cost_problem(latency_table.LatencyTable.from_dict(json.loads(cached.read_text()))) is None


# --- SIGHUP, and a burst of signals ----------------------------------------------------------------------------

def start_train(micro: Path, run: Path) -> subprocess.Popen:
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=400",
            "train.log_every=1", f"train.out_dir={run}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "parnas.cli", "train", "--config", "tiny",
                             *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def signal_at_step(proc: subprocess.Popen, signums: list[int], step: int = 5) -> str:
    try:
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                for signum in signums:
                    proc.send_signal(signum)
                break
        return proc.communicate(timeout=300)[1]
    finally:
        proc.kill()


@pytest.mark.slow
def test_sighup_saves_says_so_in_one_line_and_the_run_resumes(micro, tmp_path):
    run = tmp_path / "run"
    err = signal_at_step(start_train(micro, run), [signal.SIGHUP])
    (line,) = err.strip().splitlines()
    assert line.startswith("parnas train: stopped by SIGHUP after step "), line
    assert (run / "checkpoints" / "last.ckpt").is_file()
    again = shlex.split(line.split("resume with: ")[1]) + ["--set", "train.stop_at=12"]
    done = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_burst_of_three_ctrl_c_ends_with_a_line(micro, tmp_path):
    proc = start_train(micro, tmp_path / "run")
    err = signal_at_step(proc, [signal.SIGINT] * 3)
    assert proc.returncode in (-signal.SIGINT, 130), err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("parnas"), err[-2000:]


# --- an unusable cache folder or output path, a failed allocation ----------------------------------------------

@pytest.mark.parametrize("where, said", [("file", "is not a folder"), ("/dev/null", "is not a folder"),
                                         ("file/sub", "is under"), ("y" * 300, "too long")])
def test_an_unusable_cache_folder_is_one_line(capsys, tmp_path, monkeypatch, micro, where, said):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("PARNAS_CACHE_DIR", where if where.startswith("/") else str(tmp_path / where))
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"data.path={micro}",
                       "--set", "data.tokenizer=char", "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, "PARNAS_CACHE_DIR=", said)
    assert not (tmp_path / "run").exists()


def test_a_cache_folder_this_user_may_not_write_is_one_line(capsys, tmp_path, monkeypatch, micro):
    """As root every folder is writable: the permission is what ``os.access`` answers."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(cache))
    monkeypatch.setattr(os, "access", lambda path, mode, **k: Path(path) != cache)
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"data.path={micro}",
                       "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, f"PARNAS_CACHE_DIR={cache} is a folder this user may not write")


@pytest.mark.parametrize("out, said", [("file/x", "a file"), ("y" * 300, "too long")])
def test_an_output_path_under_a_file_or_too_long_is_one_line(capsys, tmp_path, out, said):
    (tmp_path / "file").write_text("x")
    code, _, err = cli(capsys, "study", "--config", "tiny", "--out", tmp_path / out, "--seeds", "1",
                       "--steps", "2")
    assert_refused(code, err, said, str(tmp_path / out)[:100])
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"train.out_dir={tmp_path / out}")
    assert_refused(code, err, said, str(tmp_path / out)[:100])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("setting, said", [
    ("model.reversible=true", "a search's supernet runs each block alone"),
    ("train.accumulate=2", "train.accumulate was removed"),
])
def test_a_study_whose_searches_would_be_refused_is_refused_before_it_writes(capsys, tmp_path, setting, said):
    """What its first search would refuse, a study refuses at the top: not after its folder and settings exist."""
    code, out, err = cli(capsys, "study", "--config", "tiny", "--set", setting, "--out", tmp_path / "study",
                         "--seeds", "1", "--steps", "2")
    assert_refused(code, err, said)
    assert "threads:" not in out and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_process_limit_below_the_estimate_is_refused_before_training():
    """``ulimit -v`` 50 MB above what the process maps: RAM would hold the run, the process may not."""
    code = ("import resource\n"
            "from parnas.config import load_config\n"
            "from parnas.training import memory\n"
            "cfg = load_config('tiny', ['model.d_model=512', 'model.d_ff=4096'])\n"
            "memory.estimate_memory(cfg, 1000, [['dense']])  # torch loaded, before the limit\n"
            "limit = int(memory._status_bytes('VmSize')) + 50 * 2**20\n"
            "resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            "print(memory.process_limit()[1])\n"
            "memory.check_memory(cfg, 1000, [['attention'], ['dense']] * 2)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "left under this process's ulimit -v", done.stderr[-2000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("parnas.errors.ConfigError: training needs at least") and "ulimit -v" in last, last


def test_an_allocation_that_fails_after_the_check_is_one_line(capsys, tmp_path, monkeypatch, micro):
    from parnas.training import fit

    def train(cfg, resume=False):  # the check passes, then the allocator fails, as under ulimit -v
        memory.check_memory(cfg, 1000, [[k] for k in cfg.model.layout])
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 16777216 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(fit, "train", train)
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"data.path={micro}",
                       "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, "could not allocate memory while training (an allocation of 16.0 MiB failed)",
                   "parnas estimated it needs at least", "make them smaller")


def test_a_library_the_loader_cannot_map_under_a_memory_limit_is_one_line(capsys, tmp_path, monkeypatch, micro):
    """Under ``ulimit -v`` a command may fail to load a library it imports only when it needs it (NNI's sqlite3,
    say): one line naming memory and the loader's words, not a traceback. Any other ImportError stays a bug's
    traceback."""
    from parnas.training import fit

    def unmapped(cfg, resume=False):
        raise ImportError("libsqlite3.so.0: failed to map segment from shared object")

    monkeypatch.setattr(fit, "train", unmapped)
    args = ("train", "--config", "tiny", "--set", f"data.path={micro}", "--set", f"train.out_dir={tmp_path}/run")
    code, _, err = cli(capsys, *args)
    assert_refused(code, err, "could not allocate memory", "(libsqlite3.so.0: failed to map segment from shared "
                   "object)")

    def missing(cfg, resume=False):
        raise ImportError("No module named 'sentencepiece'")

    monkeypatch.setattr(fit, "train", missing)
    with pytest.raises(ImportError, match="sentencepiece"):
        cli(capsys, *args)


@pytest.mark.slow
def test_a_pickle_of_another_protocol_is_refused_in_parnas_line_alone(tmp_path):
    """torch's weights-only loader warns about the protocol before refusing: that warning is not the user's."""
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"state_dict": Evil()}, protocol=4))
    done = subprocess.run([sys.executable, "-m", "parnas.cli", "evaluate", str(evil)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("parnas evaluate: error:") and "refused unread" in line
    assert not (tmp_path / "ran").exists()

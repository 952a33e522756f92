"""What a busy machine does to latency tables: a table timed unsteadily or under load is never cached silently.

The machine's load and the timings are injected, so these tests mean the same on a quiet and a loaded machine."""

import json
import os
from pathlib import Path

import pytest

from parnas.cli import main
from parnas.config import load_config
from parnas.training import latency, latency_cache, latency_table

VOCAB = 64
MODES = latency_table.MODES
H100 = Path(os.environ.get("PARNAS_DATA_DIR") or "/nonexistent").parent / "latency" / "h100-wt2-par-gpu.json"


def tiny_config(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8",
                                "model.mem_len=8", *overrides])


@pytest.fixture
def rules(monkeypatch):
    """The cache's own limit (conftest lifts it for the tests that merely time a table)."""
    monkeypatch.setattr(latency_cache, "SPREAD_LIMIT", 0.10)


def table(spread: float = 0.02, load: float = 0.0, threads: int = 1, cores: int = 2, cost: float = 1.0,
          key=None) -> latency_table.LatencyTable:
    """A table as measure_table makes one, with the spread, load and cores given."""
    key = key or latency_table.table_key(tiny_config(), VOCAB, ["attention", "dense", "identity"],
                                   __import__("torch").device("cpu"))
    kinds = {"attention": dict.fromkeys(MODES, 2.0 * cost), "dense": dict.fromkeys(MODES, cost),
             "identity": dict.fromkeys(MODES, 0.0)}
    timing = {"timed_at": "2026-01-01T00:00:00+00:00", "host": "here", "device": key["device"], "threads": threads,
              "cores": cores, "load": load, "rounds": 7,
              "spread": {m: {"constant": spread / 2, "attention": spread, "dense": spread / 3} for m in MODES}}
    return latency_table.LatencyTable(key, dict.fromkeys(MODES, 5.0 * cost), kinds, 2, timing)


def test_a_table_records_each_costs_spread_the_load_beside_it_and_when_and_where(monkeypatch):
    rounds = {"identity": [10.0, 10.0, 11.0, 10.0, 12.0], "dense": [14.0, 14.0, 15.0, 14.0, 20.0]}
    samples = iter([1.0, 3.0, 2.0] * 100)  # 15 samples: 5 rounds, 3 targets
    monkeypatch.setattr(latency, "runnable_elsewhere", lambda: next(samples))

    def fake_rounds(layouts, cfg, vocab_size, mode, n_rounds, steps, warmup, device, models=None, after_round=None,
                    **_):
        for _ in range(n_rounds):
            after_round()
        return [rounds[layout[0]] for layout in layouts]

    monkeypatch.setattr(latency, "_round_times", fake_rounds)
    timed = latency.measure_table(tiny_config(), VOCAB, ["dense", "identity"], rounds=5)
    assert timed.constant_ms["train"] == 10.0 and timed.kinds_ms["dense"]["train"] == 4.0 / 2  # per block
    record = timed.timing
    assert record["load"] == 2.0 and record["rounds"] == 5 and record["host"] and record["timed_at"].startswith("20")
    assert record["threads"] >= 1 and record["cores"] >= 1 and record["device"] == timed.key["device"]
    # the constant's rounds: quartiles 10 and 11 of a median 10; dense's differences 4, 4, 4, 4, 8 of a median 14
    assert record["spread"]["train"] == {"constant": 0.1, "dense": 0.0}
    rounds["dense"] = [14.0, 15.0, 15.0, 16.0, 20.0]  # differences 4, 5, 4, 6, 8: quartiles 4 and 6
    assert latency.measure_table(tiny_config(), VOCAB, ["dense"], rounds=5).timing["spread"]["inference"]["dense"] \
        == round(2 / 15, 4)
    again = latency_table.LatencyTable.from_dict(json.loads(json.dumps(timed.to_dict())))
    assert again == timed and again.to_dict()["version"] == latency_table.WHOLE_VERSION


def test_a_steady_table_timed_on_a_quiet_machine_is_cached(tmp_path, monkeypatch, rules):
    steady = table(spread=0.05, load=0.6)
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: steady)
    got, cached = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path)
    assert got == steady and not cached and len(list((tmp_path / "latency").glob("*.json"))) == 1
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: pytest.fail("a cached table was timed again"))
    assert latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path) == (steady,
                                                                                                            True)


@pytest.mark.parametrize("wobbly, steadiest, named", [
    ({"load": 1.5}, {"load": 1.5, "spread": 0.01}, "other processes kept 1.5 threads runnable beside its 1 on 2 cores"),
    ({"load": 3.0, "threads": 2, "cores": 4}, {"load": 3.0, "threads": 2, "cores": 4, "spread": 0.01},
     "kept 3.0 threads runnable beside its 2 on 4 cores"),
    ({"load": 1.5, "spread": 0.3}, {"load": 1.5, "spread": 0.2}, "spread 20% (attention, "),
])
def test_a_table_timed_under_load_is_timed_again_saying_so_then_the_steadiest_used_uncached_with_one_warning(
        tmp_path, monkeypatch, rules, wobbly, steadiest, named):
    tries = [table(**wobbly, cost=1.0 + i / 10) for i in range(latency_cache.TRIES)]
    tries[1] = table(**steadiest, cost=9.0)
    timings = iter(tries)
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: next(timings))
    warnings, said = [], []
    got, cached = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path,
                                              warn=warnings.append, progress=said.append)
    assert not cached and got is tries[1] and next(timings, None) is None  # every try taken, the steadiest used
    assert not (tmp_path / "latency").exists() or not list((tmp_path / "latency").glob("*.json"))
    (line,) = warnings
    assert f"timed {latency_cache.TRIES} times" in line and "not cached" in line and named in line, line
    assert [f"({k} of at most {latency_cache.TRIES})" in s for k, s in enumerate(said, 2)] == [True] * (
        latency_cache.TRIES - 1), said  # no try in silence


def test_a_table_unsteady_on_a_machine_left_to_it_is_timed_once_cached_and_said_once(tmp_path, monkeypatch, rules):
    """Another try repeats the device's own jitter (an H100 at load 0: 29%, 17%, 29% in three tries, 35 s before
    a search's first step), and timing it again for every search prices each run differently: a table timed
    uncrowded is cached whatever its spread, said in one line, and the next search takes it from the cache."""
    wobbly = table(spread=0.3, load=1.0)  # one runnable thread beside one on two cores: the timing had its core
    timings = iter([wobbly])
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: next(timings))
    warnings, said = [], []
    got, cached = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path,
                                              warn=warnings.append, progress=said.append)
    assert got is wobbly and not cached and said == [] and len(list(tmp_path.glob("latency/*.json"))) == 1
    (line,) = warnings
    assert "spread widely (spread 30% (attention, " in line and "cached and used" in line and "--refresh" in line
    again = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path,
                                        warn=warnings.append)
    assert again == (wobbly, True) and len(warnings) == 1  # from the cache, silently


def test_a_table_steady_at_the_second_try_is_cached(tmp_path, monkeypatch, rules):
    timings = iter([table(spread=0.4, load=1.5), table(spread=0.03)])
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: next(timings))
    got, _ = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path,
                                         warn=lambda line: pytest.fail(line), progress=None)
    assert latency_cache.unsteady(got) is None and len(list((tmp_path / "latency").glob("*.json"))) == 1


def test_a_table_cached_before_tables_recorded_their_spread_is_timed_again_and_replaced(tmp_path, monkeypatch,
                                                                                       rules):
    old = table()
    old = latency_table.LatencyTable(old.key, old.constant_ms, old.kinds_ms, old.n_reference)  # no timing record
    path = latency_cache.cache_path(old.key, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old.to_dict()))
    fresh = table(cost=3.0)
    monkeypatch.setattr(latency, "measure_table", lambda *a, **k: fresh)
    got, cached = latency_cache.latency_table(tiny_config(), VOCAB, ["attention", "dense"], cache_dir=tmp_path)
    assert (got, cached) == (fresh, False) and json.loads(path.read_text())["timing"] == fresh.timing


def test_tables_without_a_timing_record_still_load_and_say_so(tmp_path):
    old = table().to_dict()
    old.pop("timing")
    for version in (1, 2):
        data = {**old, "version": version}
        if version == 1:
            data["constant_ms"] = {m: 5.0 for m in ("train", "inference")}
            data["kinds_ms"] = {k: {m: v["train"] for m in ("train", "inference")} for k, v in old["kinds_ms"].items()}
        (tmp_path / "t.json").write_text(json.dumps(data))
        loaded = latency_table.load_table_for(tmp_path / "t.json", old["key"])
        assert loaded.timing is None and "no record of when, its spread or load" in latency_cache.describe(loaded)


@pytest.mark.skipif(not H100.is_file(), reason=f"{H100} not found (the shared tables beside PARNAS_DATA_DIR)")
def test_the_shared_h100_table_still_loads():
    par = load_config("wt2-par", ["data.batch_size=32", "data.seg_len=128", "model.mem_len=128"])
    key = latency_table.table_key(par, 12000, ["attention", "dense", "identity"], __import__("torch").device("cpu"))
    assert "NVIDIA H100" in latency_cache.describe(latency_table.load_table_for(H100, key))


def test_check_says_how_far_the_cache_is_off():
    lines = latency_cache.drift(table(cost=1.2), table(cost=1.0), n_blocks=2)
    assert "constant 6.000 ms cached, 5.000 now (+20%)" in lines[0] and "attention 2.400 ms cached, 2.000 now (+20%)" \
        in lines[0]
    assert lines[-1].startswith("the cached table is off by at most +20% on a ")


def micro_sets(corpus, *extra):
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "model.n_blocks=2", *extra]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def test_parnas_latency_check_compares_the_cache_with_a_timing_now_and_writes_nothing(micro, tmp_path, capsys,
                                                                                       monkeypatch, rules):
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["latency", *micro_sets(micro), "--check"]) == 0
    assert "no steady table for these shapes in this machine's cache" in capsys.readouterr().out
    cached, now = table(), table(cost=1.1)
    timings = iter([cached, now])

    def measure(cfg, vocab_size, kinds, device="cpu", **kw):
        t = next(timings)
        return latency_table.LatencyTable(latency_table.table_key(cfg, vocab_size, kinds, device), t.constant_ms,
                                          t.kinds_ms, t.n_reference, t.timing)

    monkeypatch.setattr(latency, "measure_table", measure)
    assert main(["latency", *micro_sets(micro), "--out", str(tmp_path / "t.json")]) == 0
    files = sorted((tmp_path / "cache" / "latency").glob("*.json"))
    assert len(files) == 1
    before = files[0].read_text()
    capsys.readouterr()
    assert main(["latency", *micro_sets(micro), "--check"]) == 0
    out = capsys.readouterr().out
    assert "cached: timed 2026-01-01" in out and "the cached table is off by at most -9% on a " in out, out
    assert sorted((tmp_path / "cache" / "latency").glob("*.json")) == files and files[0].read_text() == before


@pytest.mark.parametrize("args, needle", [(["--check", "--out", "x.json"], "writes nothing"),
                                          ([], "give --out FILE")])
def test_parnas_latency_refuses_check_with_out_and_neither_in_one_line(args, needle, capsys):
    assert main(["latency", "--config", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_the_trials_of_one_experiment_price_with_the_table_the_first_one_made(tmp_path):
    """The first trial obtains the table (here an unsteady one, which the machine's cache refuses) and the others
    reuse it from the experiment's folder, never timing their own."""
    first, later = table(spread=0.4, load=3.0), table(cost=9.0)
    made, path, reused = latency_cache.experiment_table(tmp_path / "latency", first.key, lambda: first)
    assert (made, reused) == (first, False) and path.is_file()
    again, same_path, reused = latency_cache.experiment_table(tmp_path / "latency", first.key, lambda: later)
    assert reused and same_path == path and again.kinds_ms == first.kinds_ms and again.timing == first.timing
    assert not list((tmp_path / "latency").glob(".parnas.lock"))  # the lock goes with its holder


def test_a_held_experiment_table_is_waited_for(tmp_path, monkeypatch):
    from parnas.errors import ParnasError

    tries, said = [], []
    real = latency_cache.hold_run_dir

    def busy_twice(folder):  # another trial holds the folder for two looks
        tries.append(folder)
        if len(tries) <= 2:
            raise ParnasError(f"{folder} is in use by another parnas run (process 1): wait for it")
        return real(folder)

    monkeypatch.setattr(latency_cache, "hold_run_dir", busy_twice)
    monkeypatch.setattr(latency_cache.time, "sleep", lambda s: None)
    one = table()
    latency_cache.experiment_table(tmp_path / "latency", one.key, lambda: one, progress=said.append)
    assert len(tries) == 3 and said == ["latency table: waiting for the trial that is timing the experiment's table"]


def test_a_trial_finds_its_experiments_folder(tmp_path, monkeypatch):
    from parnas.strategies.nni_trial import experiment_folder

    run = tmp_path / "exp1" / "environments" / "local" / "trials" / "T"
    run.mkdir(parents=True)
    monkeypatch.setenv("NNI_PLATFORM", "local")
    monkeypatch.setenv("NNI_OUTPUT_DIR", str(run))
    monkeypatch.setenv("NNI_EXP_ID", "exp1")
    assert experiment_folder() == (tmp_path / "exp1").resolve()
    monkeypatch.delenv("NNI_PLATFORM")
    assert experiment_folder() is None

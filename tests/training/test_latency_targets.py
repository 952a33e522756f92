"""Latency tables time only the targets asked for, say how far along a long phase is, refuse an unknown target
before building anything, and write nothing when the device fails mid-table."""

import json
import re

import pytest
import torch

from parnas.cli import main
from parnas.config import load_config
from parnas.errors import ConfigError, ParnasError
from parnas.training import latency, latency_cache, latency_table, timing

VOCAB = 64


def tiny_config(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8",
                                "model.mem_len=8", *overrides])


@pytest.fixture
def modes_timed(monkeypatch):
    """The targets measure_table times, in order (the timing itself is real)."""
    timed = []
    real = latency._round_times

    def record(layouts, cfg, vocab_size, mode, *args, **kwargs):
        timed.append(mode)
        return real(layouts, cfg, vocab_size, mode, *args, **kwargs)

    monkeypatch.setattr(latency, "_round_times", record)
    return timed


def test_a_table_of_one_target_times_that_target_alone_and_reads_back(modes_timed):
    table = latency.measure_table(tiny_config(), VOCAB, ["attention", "dense"], rounds=2, steps=1,
                                  targets=["train"])
    assert modes_timed == ["train"] and table.modes == ("train",)
    assert set(table.kinds_ms["attention"]) == {"train"} and table.kinds_ms["identity"] == {"train": 0.0}
    data = json.loads(json.dumps(table.to_dict()))
    assert data["version"] == latency_table.PARTIAL_VERSION  # parnas versions that read only whole tables refuse it
    assert latency_table._valid_table(data) == table and latency_table.cost_problem(table) is None
    with pytest.raises(ConfigError, match="unknown latency target 'decode'"):
        latency.measure_table(tiny_config(), VOCAB, ["dense"], targets=["train", "decode"])


def test_a_search_times_its_own_target_and_a_cached_table_serves_the_targets_it_prices(tmp_path, modes_timed,
                                                                                        monkeypatch):
    from parnas.strategies.pricing import cost_model

    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path))  # an empty cache: nothing timed before

    cfg = tiny_config("search.penalty_cost=latency", "search.latency_target=inference")
    costs, record = cost_model(cfg, VOCAB, torch.device("cpu"))
    assert modes_timed == ["inference"] and record["table"].modes == ("inference",)
    assert costs.target == "inference"
    # the partial table it cached serves its own target, not another
    key = latency_table.table_key(cfg, VOCAB, ["attention", "dense", "identity"], torch.device("cpu"))
    folder = latency_cache.cache_path(key).parent
    assert latency_cache.newest_covering(key, folder, ["inference"]) is not None
    assert latency_cache.newest_covering(key, folder, ["generate"]) is None


def test_parnas_latency_refuses_an_unknown_target_in_one_line_before_building_a_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(latency._Stepper, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    out = tmp_path / "t.json"
    assert main(["latency", "--config", "tiny", "--target", "train,decode", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown latency target 'decode'" in err and "generate" in err, err
    assert not out.exists()


def test_a_phase_that_runs_over_five_seconds_says_once_what_it_does_and_how_far_along(monkeypatch):
    now = iter(range(0, 10**6, 3))  # every read of the clock 3 s after the last
    monkeypatch.setattr(timing, "clock", lambda: float(next(now)))
    lines = []
    latency.measure_table(tiny_config(), VOCAB, ["dense"], rounds=5, steps=1, targets=["train", "inference"],
                          progress=lines.append)
    # per target a warm-up and its rounds, then the table: each one line, no more
    warm = [line for line in lines if "warm-up" in line]
    rounds = [line for line in lines if "rounds done" in line]
    assert len(warm) == 2 and len(rounds) == 2 and len(lines) == 5, lines
    assert rounds[0].startswith("latency table (train, inference): train steps of 2 models: ") and " of 5 rounds" in \
        rounds[0]
    table = [line for line in lines if "targets done" in line]
    assert len(table) == 1 and re.fullmatch(r"latency table: 1 of 2 targets done \(\d+ s so far\)", table[0]), lines
    quiet = []  # a phase under five seconds says nothing
    monkeypatch.setattr(timing, "clock", lambda: 0.0)
    latency.measure_table(tiny_config(), VOCAB, ["dense"], rounds=2, steps=1, targets=["train"], progress=quiet.append)
    assert quiet == []


def test_a_device_that_fails_mid_table_gives_one_line_and_writes_no_table(monkeypatch, capsys, micro, tmp_path):
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = latency._Stepper.steps

    def failing(self, n):
        calls.append(n)
        if len(calls) > 6:  # after the warm-ups, within the rounds
            raise torch.AcceleratorError("CUDA error: unspecified launch failure\nCUDA kernel errors might be ...")
        return real(self, n)

    monkeypatch.setattr(latency._Stepper, "steps", failing)
    out = tmp_path / "t.json"
    sets = [f"data.path={micro}", "data.tokenizer=char", "model.n_blocks=2", "model.cutoffs=[20, 40]"]
    code = main(["latency", "--config", "tiny", *[a for s in sets for a in ("--set", s)], "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "timing the latency table" in err and "unspecified launch failure" in err and "nothing was written" in err
    assert not out.exists() and not list(tmp_path.glob("cache/latency/*.json"))
    with pytest.raises(RuntimeError, match="shape"):  # an error of the work itself keeps its traceback
        with timing.device_failures_said("x", "cuda"):
            raise RuntimeError("shape mismatch")
    with pytest.raises(ParnasError, match="ran out of memory"):
        with timing.device_failures_said("x", "cuda"):
            raise torch.OutOfMemoryError("CUDA out of memory")


def test_rounds_stop_early_once_steady(monkeypatch):
    """On CUDA the rounds end once every timing spreads by at most STEADY_SPREAD; never before MIN_ROUNDS."""
    monkeypatch.setattr(latency, "time_ms", lambda work, device: (work(), 5.0)[1])
    times = latency._round_times([["dense"]], tiny_config(), VOCAB, "train", 20, 1, 1, torch.device("cpu"),
                                 steady=latency._each_steady)
    assert len(times[0]) == latency.MIN_ROUNDS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_table_is_timed_by_events_and_stops_once_steady():
    table = latency.measure_table(tiny_config(), VOCAB, ["attention", "dense"], device="cuda", rounds=15,
                                  targets=["train", "generate"])
    assert table.modes == ("train", "generate") and latency_table.cost_problem(table) is None
    assert latency.MIN_ROUNDS <= table.timing["rounds"] <= 15
    assert table.key["device_type"] == "cuda"


def test_a_side_by_side_timing_says_how_far_along_each_long_phase_is(monkeypatch):
    """``parnas compare`` and ``parnas study`` time every target side by side: each target says it starts, and
    a warm-up or rounds that run over five seconds say how far along they are, once."""
    from parnas.training.side_by_side import time_side_by_side

    now = iter(range(0, 10**6, 3))
    monkeypatch.setattr(timing, "clock", lambda: float(next(now)))
    heard = []
    timed = time_side_by_side(tiny_config(), 5, {"a": (["attention", "dense"], None), "b": (["dense"] * 2, None)},
                              VOCAB, torch.device("cpu"), lambda stage, i, n, line: heard.append((i, n, line)))
    assert [(i, n) for i, n, _ in heard] == [(i, 3) for i in (1, 2, 3) for _ in range(3)]
    lines = [line for _, _, line in heard]
    assert lines[6].startswith("generated tokens of 2 layouts, 5 alternating rounds")
    assert lines[7].startswith("generated tokens of 2 models, warm-up: 2 of 2 models done (")
    assert lines[8].startswith("generated tokens of 2 models: 2 of 5 rounds done (")
    assert set(timed["generate_step_ms"]) == {"a", "b"}

"""The latency table: measured once per device and shape set, reused, and additive by construction."""

import json

import pytest

from parnas.config import load_config
from parnas.nn.model import full_memory_steps
from parnas.training import latency, latency_cache, latency_table, timing

VOCAB = 64


def tiny_config(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8",
                                "model.mem_len=8", *overrides])


def test_table_round_trips_through_its_cache_and_is_not_timed_again(tmp_path, monkeypatch):
    cfg = tiny_config()
    table, cached = latency_cache.latency_table(cfg, VOCAB, ["attention", "dense", "identity"], cache_dir=tmp_path)
    assert not cached
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["format"] == "parnas.latency"

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached table must not be timed again")

    monkeypatch.setattr(latency, "measure_table", no_timing)
    again, cached = latency_cache.latency_table(cfg, VOCAB, ["dense", "attention"], cache_dir=tmp_path)
    assert cached and again == table
    with pytest.raises(AssertionError):  # other shapes are another key: timed, not reused
        latency_cache.latency_table(tiny_config("data.seg_len=16"), VOCAB, ["attention", "dense"],
                                    cache_dir=tmp_path)


def test_prediction_is_the_constant_plus_each_blocks_cost():
    table = latency_table.LatencyTable({}, {"train": 10.0, "inference": 4.0},
                                 {"attention": {"train": 3.0, "inference": 1.0}, "dense": {"train": 1.0,
                                  "inference": 0.5}, "identity": {"train": 0.0, "inference": 0.0}}, 4)
    assert table.predict(["attention", "dense", "identity"]) == 14.0
    assert table.predict(["attention", "attention"], "inference") == 6.0
    assert table.transformer_xl_ms(4) == table.predict(["attention", "dense", "attention", "dense"]) == 18.0
    assert latency_table.LatencyTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    with pytest.raises(KeyError, match="no latency for block kind 'conv'"):
        table.predict(["conv"])


def test_measured_table_has_every_kind_and_mode_and_identity_is_free():
    table = latency.measure_table(tiny_config(), VOCAB, ["attention", "dense", "identity"], rounds=3, steps=1)
    assert set(table.kinds_ms) == {"attention", "dense", "identity"}
    for modes in table.kinds_ms.values():
        assert set(modes) == {"train", "inference", "generate"} and all(v >= 0 for v in modes.values())
    assert table.kinds_ms["identity"] == {"train": 0.0, "inference": 0.0, "generate": 0.0}
    assert table.constant_ms["train"] > 0 and table.constant_ms["inference"] > 0 and table.constant_ms["generate"] > 0


def test_time_layouts_returns_one_positive_median_per_layout():
    ms = latency.time_layouts([["attention", "dense"], ["identity", "identity"]], tiny_config(), VOCAB,
                              mode="inference", rounds=2, steps=1)
    assert len(ms) == 2 and all(m > 0 for m in ms)


def test_a_generation_round_decodes_a_short_run_of_tokens_and_reports_ms_per_token(monkeypatch):
    """A segment's worth of tokens per step made a GPU table decode thousands of tokens one by one (over 90 s):
    a round decodes ``DECODE_TOKENS`` (fewer only where the steps' segments hold fewer), the time divided per
    token."""
    cfg = tiny_config("data.seg_len=64")
    decoded = []
    monkeypatch.setattr(latency._Stepper, "_generate", lambda self, n: decoded.append(n))
    clock = iter(range(0, 10**6, 3))  # every read of the clock 3 s after the last: each round takes 3 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    ms = latency.time_layouts([["attention", "dense"]], cfg, VOCAB, mode="generate", rounds=2, steps=2)
    timed = decoded[-2:]  # after the warm-up
    assert timed == [latency.DECODE_TOKENS] * 2 == [latency.tokens_per_round(cfg, 2)] * 2
    assert latency.DECODE_TOKENS < 2 * 64  # not a segment per step
    assert ms == [pytest.approx(3000 / latency.DECODE_TOKENS)]
    assert latency.tokens_per_round(tiny_config("data.seg_len=4"), 2) == 8  # two segments of 4 hold fewer


def test_timing_starts_with_every_memory_full_compressed_memory_included(monkeypatch):
    """Steps are timed at steady state: a compressive block's compressed memory is full before the first round."""
    cfg = tiny_config("data.seg_len=4", "model.mem_len=16", "model.compressive.rate=2", "model.compressive.length=8")
    warm = full_memory_steps(cfg.model, cfg.data.seg_len)
    assert warm == (16 + 2 * 8) // 4 + 1
    stepped = []
    real = latency._Stepper.steps

    def record(self, n):
        real(self, n)
        stepped.append(self)

    monkeypatch.setattr(latency._Stepper, "steps", record)
    latency.time_layouts([["compressive", "dense"]], cfg, VOCAB, rounds=1, steps=1, warmup=1)
    after_warmup = stepped[0]
    assert after_warmup.t == warm + 1  # warm-up, then one timed step
    compressed = after_warmup.mems[2]  # mems: one per block, then the compressive block's [compressed, pending]
    assert compressed.size(1) == 8


def test_a_table_timed_for_more_kinds_serves_fewer_and_the_newest_covering_table_wins(tmp_path, monkeypatch):
    """Searches of different candidate sets started after one timing price their shared kinds alike."""
    import os

    cfg = tiny_config()
    wide, cached = latency_cache.latency_table(cfg, VOCAB, ["attention", "conv", "dense"], cache_dir=tmp_path)
    assert not cached

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(latency, "measure_table", no_timing)
    narrow, cached = latency_cache.latency_table(cfg, VOCAB, ["dense", "attention"], cache_dir=tmp_path)
    assert cached and narrow.key["kinds"] == ["attention", "dense", "identity"]
    assert narrow.kinds_ms == {k: wide.kinds_ms[k] for k in ("attention", "dense", "identity")}
    assert narrow.constant_ms == wide.constant_ms

    # an older table for exactly these kinds loses to the newer wide one; once newer, it wins
    modes = latency_table.MODES
    older = latency_table.LatencyTable(narrow.key, dict.fromkeys(modes, 1.0),
                                 {k: dict.fromkeys(modes, 2.0) for k in narrow.kinds_ms}, narrow.n_reference,
                                 narrow.timing)
    exact = latency_cache.cache_path(narrow.key, tmp_path)
    exact.write_text(json.dumps(older.to_dict()))
    wide_file = latency_cache.cache_path(wide.key, tmp_path)
    os.utime(exact, ns=(wide_file.stat().st_mtime_ns - 10**9,) * 2)
    assert latency_cache.latency_table(cfg, VOCAB, ["attention", "dense"],
                                       cache_dir=tmp_path)[0].kinds_ms == narrow.kinds_ms
    os.utime(exact, ns=(wide_file.stat().st_mtime_ns + 10**9,) * 2)
    assert latency_cache.latency_table(cfg, VOCAB, ["attention", "dense"], cache_dir=tmp_path)[0] == older

    # a version-1 table (no generation costs), however new, is not used: the cache times it afresh
    v1 = {**older.to_dict(), "version": 1, "constant_ms": {"train": 1.0, "inference": 1.0},
          "kinds_ms": {k: {"train": 2.0, "inference": 2.0} for k in narrow.kinds_ms}}
    exact.write_text(json.dumps(v1))
    os.utime(exact, ns=(wide_file.stat().st_mtime_ns + 10**9,) * 2)
    assert latency_cache.latency_table(cfg, VOCAB, ["attention", "dense"],
                                       cache_dir=tmp_path)[0].kinds_ms == narrow.kinds_ms

    # other shapes, or a kind the tables lack, are timed afresh
    for args in ((tiny_config("data.seg_len=4"), ["attention", "dense"]), (cfg, ["attention", "glu"])):
        with pytest.raises(AssertionError, match="timed again"):
            latency_cache.latency_table(args[0], VOCAB, args[1], cache_dir=tmp_path)


def test_a_resumed_search_keeps_the_table_it_started_with(tmp_path, monkeypatch):
    import torch

    from parnas.strategies.pricing import cost_model

    cfg = tiny_config()
    table, _ = latency_cache.latency_table(cfg, VOCAB, ["attention", "dense"])  # the session's private cache
    pinned = latency_table.LatencyTable(table.key, {"train": 5.0, "inference": 1.0},
                                  {"attention": {"train": 3.0, "inference": 1.0},
                                   "dense": {"train": 1.0, "inference": 0.5},
                                   "identity": {"train": 0.0, "inference": 0.0}}, table.n_reference)
    path = tmp_path / "latency_table.json"
    path.write_text(json.dumps(pinned.to_dict()))
    costs, record = cost_model(cfg, VOCAB, torch.device("cpu"), pinned=path)
    assert record["table"] == pinned and costs.per_kind["attention"] == 3.0 and costs.per_kind["dense"] == 1.0
    costs, record = cost_model(cfg, VOCAB, torch.device("cpu"), pinned=tmp_path / "absent.json")
    assert record["table"].kinds_ms == table.kinds_ms


@pytest.mark.parametrize("precision, fused", [("32-true", True), ("bf16-mixed", True), ("16-mixed", None)])
def test_a_timed_step_uses_the_optimiser_training_uses(precision, fused):
    """Fused Adam where training takes it (not under fp16's gradient scaler): the constant part is what a step
    pays."""
    cfg = tiny_config(f"train.precision={precision}")
    stepper = latency._Stepper(["attention", "dense"], cfg, VOCAB, "train", __import__("torch").device("cpu"))
    assert stepper.optimizer.defaults["fused"] is fused

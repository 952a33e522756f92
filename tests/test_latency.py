"""The latency table: measured once per device and shape set, reused, and additive by construction."""

import json

import pytest

from parnas import latency
from parnas.config import load_config

VOCAB = 64


def tiny_config(*overrides: str):
    return load_config("tiny", ["model.n_blocks=2", "model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8",
                                "model.mem_len=8", *overrides])


def test_table_round_trips_through_its_cache_and_is_not_timed_again(tmp_path, monkeypatch):
    cfg = tiny_config()
    table, cached = latency.latency_table(cfg, VOCAB, ["attention", "dense", "identity"], cache_dir=tmp_path)
    assert not cached
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["format"] == "parnas.latency"

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached table must not be timed again")

    monkeypatch.setattr(latency, "measure_table", no_timing)
    again, cached = latency.latency_table(cfg, VOCAB, ["dense", "attention"], cache_dir=tmp_path)
    assert cached and again == table
    with pytest.raises(AssertionError):  # other shapes are another key: timed, not reused
        latency.latency_table(tiny_config("data.seg_len=16"), VOCAB, ["attention", "dense"], cache_dir=tmp_path)


def test_prediction_is_the_constant_plus_each_blocks_cost():
    table = latency.LatencyTable({}, {"train": 10.0, "inference": 4.0},
                                 {"attention": {"train": 3.0, "inference": 1.0}, "dense": {"train": 1.0,
                                  "inference": 0.5}, "identity": {"train": 0.0, "inference": 0.0}}, 4)
    assert table.predict(["attention", "dense", "identity"]) == 14.0
    assert table.predict(["attention", "attention"], "inference") == 6.0
    assert table.transformer_xl_ms(4) == table.predict(["attention", "dense", "attention", "dense"]) == 18.0
    assert latency.LatencyTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    with pytest.raises(KeyError, match="no latency for block kind 'conv'"):
        table.predict(["conv"])


def test_measured_table_has_every_kind_and_mode_and_identity_is_free():
    table = latency.measure_table(tiny_config(), VOCAB, ["attention", "dense", "identity"], rounds=3, steps=1)
    assert set(table.kinds_ms) == {"attention", "dense", "identity"}
    for modes in table.kinds_ms.values():
        assert set(modes) == {"train", "inference"} and all(v >= 0 for v in modes.values())
    assert table.kinds_ms["identity"] == {"train": 0.0, "inference": 0.0}
    assert table.constant_ms["train"] > 0 and table.constant_ms["inference"] > 0


def test_time_layouts_returns_one_positive_median_per_layout():
    ms = latency.time_layouts([["attention", "dense"], ["identity", "identity"]], tiny_config(), VOCAB,
                              mode="inference", rounds=2, steps=1)
    assert len(ms) == 2 and all(m > 0 for m in ms)


def test_timing_starts_with_every_memory_full_compressed_memory_included(monkeypatch):
    """Steps are timed at steady state: a compressive block's compressed memory is full before the first round."""
    cfg = tiny_config("data.seg_len=4", "model.mem_len=16", "model.compress_rate=2", "model.compress_len=8")
    warm = latency.full_memory_steps(cfg)
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

"""parnas compare: speed from a side-by-side timing of the runs' models, the runs' own figures apart and labelled.

The timings are injected, so what is asserted does not depend on how busy the machine is."""

import json

import pytest

from parnas.cli import main
from parnas.config import load_config
from parnas.training import side_by_side


def finished_run(folder, blocks, own_tokens_per_s, parameters=10_000, *sets):
    """A finished run's metrics.json as fit writes it, its own throughput as given."""
    cfg = load_config("tiny", ["model.cutoffs=[]", "data.batch_size=2", "data.seg_len=8", *sets])
    folder.mkdir()
    metrics = {"architecture": "".join(k[0].upper() for k in blocks), "blocks": blocks, "steps": 10,
               "parameters": parameters, "attention_blocks": blocks.count("attention"), "vocab_size": 64,
               "train_tokens_per_s": own_tokens_per_s, "eval_tokens_per_s": 1000.0, "device": "cpu",
               "val_ppl": 50.0, "test_ppl": 51.0, "config": cfg.to_dict()}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return str(folder)


@pytest.fixture
def timed_here(monkeypatch):
    """Side-by-side timings: the Transformer-XL's steps twice as long as the found model's, whatever the machine."""
    def time_layouts(layouts, cfg, vocab_size, mode, rounds, device, models, progress=None):
        return [2.0 if layout.count("attention") > 1 else 1.0 for layout in layouts]

    monkeypatch.setattr(side_by_side, "time_layouts", time_layouts)


def speed_column(text, header="train tokens/s"):
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    return [line.strip("|").split("|")[head.index(header)].strip() for line in lines[2:4]]


def test_the_speed_columns_come_from_the_side_by_side_timing_and_the_runs_own_are_apart(tmp_path, capsys, timed_here):
    found = finished_run(tmp_path / "found", ["attention", "dense", "dense", "dense"], 1_000.0)  # own: looks slow
    txl = finished_run(tmp_path / "txl", ["attention", "dense", "attention", "dense"], 2_500.0)
    assert main(["compare", found, txl, "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    main_table, separately = out.split("Timed separately")
    assert speed_column(main_table) == ["16,000", "8,000"]  # 2 x 8 tokens in 1 ms and in 2 ms: found ranks first
    assert speed_column(main_table, "generated tokens/s") == ["1,000", "500"]
    assert "Speed timed side by side in this process: 5 alternating rounds" in main_table
    assert speed_column(separately) == ["1,000", "2,500"]  # each run's own record, kept under its own heading
    csv = (tmp_path / "cmp.csv").read_text().splitlines()
    assert "side_train_tokens_per_s" in csv[0] and "train_tokens_per_s" in csv[0]


def test_no_time_leaves_the_speed_to_the_runs_own_records_under_their_heading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(side_by_side, "time_layouts", lambda *a, **k: pytest.fail("timed with --no-time"))
    runs = [finished_run(tmp_path / n, ["attention", "dense"], 1_000.0) for n in ("a", "b")]
    assert main(["compare", *runs, "--no-time", "--out", ""]) == 0
    main_table, separately = capsys.readouterr().out.split("Timed separately")
    assert "tokens/s" not in main_table and "train tokens/s" in separately


def test_models_too_large_to_time_by_default_are_named_and_time_times_them(tmp_path, capsys, timed_here):
    big = [finished_run(tmp_path / n, ["attention", "dense"], 1_000.0, 50_000_000) for n in ("a", "b")]
    assert main(["compare", *big, "--out", ""]) == 0
    assert "Not timed side by side: a run is over 20,000,000 parameters" in capsys.readouterr().out
    assert main(["compare", *big, "--time", "--out", ""]) == 0
    assert "Speed timed side by side" in capsys.readouterr().out


def test_runs_at_other_shapes_are_not_timed_side_by_side(tmp_path, capsys, timed_here):
    a = finished_run(tmp_path / "a", ["attention", "dense"], 1_000.0)
    b = finished_run(tmp_path / "b", ["attention", "dense"], 1_000.0, 10_000, "data.seg_len=16")
    assert main(["compare", a, b, "--out", ""]) == 0
    assert "Not timed side by side: the runs differ in data.seg_len (8, 16)" in capsys.readouterr().out
    assert main(["compare", a, b, "--time", "--out", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "differ in data.seg_len" in err

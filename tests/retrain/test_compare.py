"""parnas compare: speed from a side-by-side timing of the runs' models, the runs' own figures apart and labelled.

The timings are injected, so what is asserted does not depend on how busy the machine is."""

import json
import re

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


ROUNDS = (0.9, 1.0, 1.1, 0.9, 1.0)  # one model's rounds, relative to its median: an interquartile range of 10%


@pytest.fixture
def timed_here(monkeypatch):
    """Side-by-side timings: the Transformer-XL's steps twice as long as the found model's, whatever the machine,
    its rounds spread by 10%; a quiet machine (load average 0)."""
    def time_layout_rounds(layouts, cfg, vocab_size, mode, rounds, device, models, progress=None):
        return [[(2.0 if layout.count("attention") > 1 else 1.0) * r for r in ROUNDS[:rounds]] for layout in layouts]

    monkeypatch.setattr(side_by_side, "time_layout_rounds", time_layout_rounds)
    monkeypatch.setattr(side_by_side.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


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
    # 2 x 8 tokens in 1 ms and in 2 ms (the rounds' median): found ranks first; each with its rounds' spread
    assert speed_column(main_table) == ["16,000 ±10%", "8,000 ±10%"]
    assert speed_column(main_table, "generated tokens/s") == ["1,000 ±10%", "500 ±10%"]
    assert "the median of 5 alternating rounds of every model (± their interquartile range)" in main_table
    assert "One network" not in out and "load average" not in out  # two networks, a quiet machine
    assert speed_column(separately) == ["1,000", "2,500"]  # each run's own record, kept under its own heading
    csv = (tmp_path / "cmp.csv").read_text().splitlines()
    assert "side_train_tokens_per_s" in csv[0] and "train_tokens_per_s" in csv[0]


def test_no_time_leaves_the_speed_to_the_runs_own_records_under_their_heading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(side_by_side, "time_layout_rounds", lambda *a, **k: pytest.fail("timed with --no-time"))
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


def test_two_runs_of_one_network_are_said_to_be_one_with_their_gaps_as_the_noise_floor(tmp_path, capsys, timed_here,
                                                                                         monkeypatch):
    """Runs of one layout, model, data and training length are one network, whatever their seed: the table says
    so, with the gaps between them (timed side by side, and their perplexities) as its noise floor; a load
    average above the cores the timing used is named; the perplexities say what they are per."""
    a = finished_run(tmp_path / "a", ["attention", "dense"], 1_000.0)
    b = finished_run(tmp_path / "b", ["attention", "dense"], 1_300.0, 10_000, "train.seed=7")
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    (tmp_path / "b" / "metrics.json").write_text(json.dumps({**metrics, "val_ppl": 50.5}))
    other = finished_run(tmp_path / "c", ["attention", "attention"], 1_000.0)
    monkeypatch.setattr(side_by_side.os, "getloadavg", lambda: (99.5, 99.0, 99.0))
    assert main(["compare", a, b, other, "--out", ""]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("One network"))
    assert f"{a}, {b} (layout AD," in line and str(other) not in line
    assert "train tokens/s 0%" in line and "val ppl 0.50" in line and "test ppl 0.00" in line
    assert re.search(r"The machine's load average was 99.50 over the \d+ cores? this timing used: other work", out)
    assert "Perplexities per SentencePiece piece, vocabulary 64: not per word" in out

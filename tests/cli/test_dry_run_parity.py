"""``--dry-run`` refuses what the real run refuses: a plan it prints is one the run gets past. Each case runs
the command twice, once with ``--dry-run`` and once without, and both must end in the same one line, exit 2,
nothing written. The real runs read a few kB of WikiText-2 (a SentencePiece vocabulary of 150, so the
vocabulary the dry run plans is the one the run builds); every case is refused before a model is built."""

import dataclasses

import pytest
import torch

from parnas import architecture
from parnas.cli import main
from parnas.config import load_config

VOCAB = 150


def record(tmp_path, vocab: int, tokenizer: str = "sentencepiece") -> str:
    """An architecture JSON as a search writes it: the tiny preset's Transformer-XL, searched at ``vocab``."""
    model = dataclasses.replace(load_config("tiny").model, cutoffs=())
    found = architecture.named_layout("transformer-xl", model, vocab)
    found["tokenizer"] = {"kind": tokenizer, "vocab_size": vocab, "sha256": "0" * 64}
    return str(architecture.write(tmp_path / "found" / "architecture.json", found))


def refusals(capsys, tmp_path, micro, command, *args):
    """The two refusals of ``parnas COMMAND`` on a few kB of text with ``ARGS`` last: with ``--dry-run`` and
    without; each exit 2 and one line."""
    data = ["--config", "tiny", "--set", f"data.path={micro}", "--set", f"data.vocab_size={VOCAB}",
            "--set", "model.cutoffs=[]", "--set", f"train.out_dir={tmp_path}/run",
            "--set", f"search.out_dir={tmp_path}/run"]
    lines = []
    for dry in (["--dry-run"], []):
        code = main([*command, *data, *args, *dry])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (dry, code, err)
        assert not (tmp_path / "run").exists(), "a refused run wrote its folder"
        lines.append(err)
    return lines


def test_an_architecture_searched_with_another_vocabulary_is_refused_by_both(capsys, tmp_path, micro):
    dry, real = refusals(capsys, tmp_path, micro, ["retrain", "--arch", record(tmp_path, 1000)])
    assert dry == real and "searched with a vocabulary of 1000" in real and f"tokenizer of {VOCAB}" in real


def test_an_architecture_searched_with_another_tokenizer_is_refused_by_both(capsys, tmp_path, micro):
    dry, real = refusals(capsys, tmp_path, micro, ["retrain", "--arch", record(tmp_path, VOCAB, "word")])
    assert dry == real and "searched with a word tokenizer, not sentencepiece" in real


@pytest.mark.parametrize("command", [["train"], ["search"], ["retrain", "--arch", "transformer-xl"]])
def test_training_that_does_not_fit_this_machines_memory_is_refused_by_both(capsys, tmp_path, micro, command):
    dry, real = refusals(capsys, tmp_path, micro, command, "--set", "model.d_model=32768", "--set",
                         "model.d_ff=65536")
    assert dry == real and "training needs at least" in real and "model.d_model=32768" in real


@pytest.mark.parametrize("command", [["train"], ["search"], ["retrain", "--arch", "transformer-xl"]])
def test_cutoffs_not_below_the_vocabulary_are_refused_by_both(capsys, tmp_path, micro, command):
    dry, real = refusals(capsys, tmp_path, micro, command, "--set", f"model.cutoffs=[50,{VOCAB}]")
    assert dry == real and "cutoffs" in real


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to ask for")
@pytest.mark.parametrize("command", [["train"], ["search"], ["retrain", "--arch", "transformer-xl"]])
def test_a_gpu_this_machine_lacks_is_refused_by_both(capsys, tmp_path, micro, command):
    dry, real = refusals(capsys, tmp_path, micro, command, "--set", "train.accelerator=gpu")
    assert dry == real and "sees no CUDA device" in real


@pytest.mark.parametrize("settings, needle", [
    (["model.reversible=true"], "model.reversible"),
    (["train.compile=default", "search.par-gumbel-darts.forward=sampled"], "train.compile=default")])
def test_what_a_searchs_supernet_cannot_run_is_refused_by_both(capsys, tmp_path, micro, settings, needle):
    dry, real = refusals(capsys, tmp_path, micro, ["search"], *[arg for s in settings for arg in ("--set", s)])
    assert dry == real and needle in real


def test_a_plan_the_run_gets_past_is_printed(capsys, tmp_path, micro):
    """The refusals above are the run's, not a dry run grown strict: the same settings, fitting, dry-run."""
    code = main(["retrain", "--arch", record(tmp_path, VOCAB), "--config", "tiny", "--set", f"data.path={micro}",
                 "--set", f"data.vocab_size={VOCAB}", "--set", "model.cutoffs=[]", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and f"vocabulary {VOCAB}" in out and "nothing read" in out


def test_a_latency_budget_below_the_given_tables_cheapest_layout_is_refused_by_both(capsys, tmp_path, micro):
    """The dry run prices the budget with the table the search would use (given here: nothing is timed)."""
    from parnas.files import write_json_atomic
    from parnas.training.latency_table import MODES, LatencyTable, table_key

    cfg = load_config("tiny", [f"data.vocab_size={VOCAB}", "model.cutoffs=[]"])
    key = table_key(cfg, VOCAB, ["attention", "dense", "identity"], torch.device("cpu"))
    timing = {"timed_at": "2026-01-01T00:00:00+00:00", "host": "here", "device": key["device"], "threads": 1,
              "cores": 2, "load": 0.0, "rounds": 7,
              "spread": {m: {"constant": 0.01, "attention": 0.01, "dense": 0.01} for m in MODES}}
    kinds = {"attention": dict.fromkeys(MODES, 2.0), "dense": dict.fromkeys(MODES, 1.0),
             "identity": dict.fromkeys(MODES, 0.0)}
    table = tmp_path / "table.json"
    write_json_atomic(table, LatencyTable(key, dict.fromkeys(MODES, 4.0), kinds, 2, timing).to_dict())
    # Transformer-XL (4 blocks, ADAD): 4 + 2 x 3 = 10 ms; all dense: 4 + 4 = 8 ms, a floor of 0.8
    dry, real = refusals(capsys, tmp_path, micro, ["search"], "--set", "search.candidates=[attention, dense]",
                         "--set", f"search.latency_table={table}",
                         "--set", "search.par-gumbel-darts.latency_budget=0.5")
    assert dry == real and "latency_budget 0.5 is out of reach" in real and "0.800" in real, real
    assert main(["search", "--config", "tiny", "--set", f"data.vocab_size={VOCAB}", "--set", "model.cutoffs=[]",
                 "--set", "search.candidates=[attention, dense]", "--set", f"search.latency_table={table}",
                 "--set", "search.par-gumbel-darts.latency_budget=0.9", "--set", f"search.out_dir={tmp_path}/run",
                 "--dry-run"]) == 0
    assert "latency budget 0.9: within reach by the given table" in capsys.readouterr().out


def test_a_search_folder_that_holds_a_run_is_refused_by_both(capsys, tmp_path, micro):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"a run's checkpoint")
    data = ["--config", "tiny", "--set", f"data.path={micro}", "--set", f"data.vocab_size={VOCAB}",
            "--set", "model.cutoffs=[]", "--set", f"search.out_dir={tmp_path}/run"]
    lines = []
    for dry in (["--dry-run"], []):
        code = main(["search", *data, *dry])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (dry, err)
        lines.append(err)
    assert lines[0] == lines[1] and "already holds a run" in lines[1] and "--resume" in lines[1]
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == ["checkpoints", "last.ckpt"]

"""Retrain: the fixed model from an architecture JSON, exact resume, safe checkpoints, bad input, evaluate, compare."""

import io
import json
import os
import pathlib
import pickle
import re
import zipfile

import pytest
import torch

from parnas import architecture
from parnas.cli import main
from parnas.config import DataConfig, ModelConfig
from parnas.data.corpora import ContextBatches, load_splits
from parnas.retrain.run import retrain
from parnas.search_spaces import fixed_model
from parnas.training import checkpoint as ckpt

SMALL = ["data.vocab_size=300", "model.cutoffs=[100, 200]"]
TINY_MODEL = ModelConfig(n_blocks=4, d_model=32, n_heads=2, d_ff=64, mem_len=16, dropout=0.0, cutoffs=(100, 200))
KINDS = {"A": "attention", "D": "dense", "I": "identity"}


def record_for(layout: str, model: ModelConfig = TINY_MODEL, vocab_size: int = 300,
               kind: str = "sentencepiece") -> dict:
    kinds = [KINDS[c] for c in layout]
    model = ModelConfig(**{**model.__dict__, "n_blocks": len(kinds)})
    return architecture.make_record({architecture.label(i): k for i, k in enumerate(kinds)}, model, vocab_size,
                                    tokenizer={"kind": kind, "vocab_size": vocab_size})


def write_arch(path: pathlib.Path, record: dict) -> str:
    path.write_text(json.dumps(record))
    return str(path)


def settings(corpus, out, *extra):
    return ["--config", "tiny", "--set", f"data.path={corpus}", *[a for s in SMALL for a in ("--set", s)],
            "--set", f"train.out_dir={out}", *[a for s in extra for a in ("--set", s)]]


@pytest.fixture(scope="module")
def trained(wt2_short_eval, tmp_path_factory):
    """One short retrain of AADI (shared by the evaluate/compare tests) and of the transformer-xl baseline."""
    root = tmp_path_factory.mktemp("retrained")
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        arch = write_arch(root / "aadi.json", record_for("AADI"))
        overrides = [f"data.path={wt2_short_eval}", *SMALL, "train.max_steps=8", "train.eval_every=4",
                     "train.ckpt_every=5"]
        found = retrain(arch, "tiny", [*overrides, f"train.out_dir={root / 'aadi'}"])
        baseline = retrain("transformer-xl", "tiny", [*overrides, f"train.out_dir={root / 'txl'}"])
        yield {"root": root, "found": found, "baseline": baseline, "corpus": wt2_short_eval}


# --- the model is what the JSON lists ---------------------------------------------------------------

def test_model_from_json_has_exactly_the_listed_blocks_and_memory_only_for_attention():
    record = record_for("ADIAD")
    model = fixed_model(architecture.model_config(record), 300, record["architecture"])
    assert model.block_kinds == ["attention", "dense", "identity", "attention", "dense"]
    assert [type(b).__name__ for b in model.blocks] == ["AttentionBlock", "DenseBlock", "IdentityBlock",
                                                        "AttentionBlock", "DenseBlock"]
    assert not any("LayerChoice" in type(m).__name__ for m in model.modules())
    x = torch.randint(0, 300, (2, 8))
    _, mems = model(x)
    _, mems = model(x, mems)
    assert [m is not None for m in mems] == [True, False, False, True, False]
    assert all(m.shape == (2, 16, 32) for m in mems if m is not None)


@pytest.mark.slow
def test_retrained_runs_record_their_layout(trained):
    found, baseline = trained["found"], trained["baseline"]
    assert found["blocks"] == ["attention", "attention", "dense", "identity"] and found["architecture"] == "AADI"
    assert found["attention_blocks"] == 2 and baseline["architecture"] == "ADAD"
    for m in (found, baseline):
        assert m["steps"] == 8 and m["val_ppl"] > 1 and m["train_tokens_per_s"] > 0
        assert m["eval_tokens_per_s"] is None or m["eval_tokens_per_s"] > 0  # None: too quick to time
        assert m["peak_memory_mb"] > 0 and m["parameters"] > 0 and [h["step"] for h in m["history"]] == [4, 8]
    run = trained["root"] / "aadi"
    assert architecture.read(run / "architecture.json")["architecture"] == record_for("AADI")["architecture"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_all_attention_layout():
    """The named layout is attention at every depth (retrain takes a named layout as it takes transformer-xl)."""
    record = architecture.named_layout("all-attention", TINY_MODEL, 300)
    assert fixed_model(architecture.model_config(record), 300, record["architecture"]).block_kinds == ["attention"] * 4


# --- bad architecture files: exit 2, one line, nothing written --------------------------------------

def _edit(**changes):
    def make(path):
        record = record_for("AADI")
        for key, value in changes.items():
            section, _, leaf = key.partition("__")
            if leaf:
                record[section][leaf] = value
            else:
                record[section] = value
        return write_arch(path, record)
    return make


def _not_json(path):
    path.write_text("{'format': oops")
    return str(path)


def _fifo(path):
    os.mkfifo(path)  # opened, it would block until a writer came: refused by stat, never opened
    return str(path)


BAD = {
    "not json": (_not_json, "not JSON"),
    "wrong format": (_edit(format="nni.sample"), "format"),
    "wrong version": (_edit(version=2), "version 2"),
    "unknown kind": (_edit(architecture__block_1="convolution"), "convolution"),
    "labels": (_edit(architecture={"block_0": "attention", "block_1": "dense", "layer_2": "dense",
                                   "block_3": "identity"}), "labels"),
    "block count": (_edit(model__n_blocks=6), "n_blocks"),
    "vocabulary": (_edit(model__vocab_size=500), "vocabulary of 500"),
    "missing file": (lambda p: str(p.with_name("absent.json")), "no architecture file"),
    "version true": (_edit(version=True), "version True"),  # true == 1 in Python
    "n_blocks a float": (_edit(model__n_blocks=4.0), "model.n_blocks must be int, got 4.0"),
    "n_blocks true": (_edit(model__n_blocks=True), "model.n_blocks must be int, got True"),
    "vocab_size a float": (_edit(model__vocab_size=500.0), "an integer vocab_size"),
    "a FIFO": (_fifo, "is a FIFO"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_architecture_json_is_refused_with_one_line(case, wt2_slice, tmp_path, capsys):
    make, needle = BAD[case]
    arch = make(tmp_path / "arch.json")
    out = tmp_path / "run"
    code = main(["retrain", "--arch", arch, *settings(wt2_slice, out)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and needle in err, err
    assert not out.exists()


def test_overrides_cannot_contradict_the_architecture(wt2_slice, tmp_path, capsys):
    arch = write_arch(tmp_path / "arch.json", record_for("AADI"))
    for extra, needle in (("model.n_blocks=6", "n_blocks"), ("model.blocks=[dense,dense,dense,dense]", "blocks")):
        code = main(["retrain", "--arch", arch, *settings(wt2_slice, tmp_path / "run", extra)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


# --- kill and resume ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_and_resumed_run_is_identical_to_an_uninterrupted_one(micro_corpus, kill_at, tmp_path):
    tokenizer, splits = load_splits(DataConfig(path=str(micro_corpus), tokenizer="char"))
    # a pass is n segments = n steps; n even, so that one checkpoint falls in the middle of a pass and one
    # exactly on its end
    seg_len = next(L for L in range(40, 80) if len(ContextBatches(splits["train"], 8, L)) % 2 == 0)
    n = len(ContextBatches(splits["train"], 8, seg_len))  # steps per pass
    half, total = n // 2, n + n // 2 + 3
    common = [f"data.path={micro_corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "data.batch_size=8",
              f"data.seg_len={seg_len}", "model.dropout=0.2", "model.dropatt=0.1", f"train.max_steps={total}",
              f"train.eval_every={half}", f"train.ckpt_every={half}", "train.warmup_steps=5"]
    model = ModelConfig(**{**TINY_MODEL.__dict__, "cutoffs": (20, 40)})
    arch = write_arch(tmp_path / "arch.json", record_for("ADAI", model, tokenizer.vocab_size, "char"))
    whole = retrain(arch, "tiny", [*common, f"train.out_dir={tmp_path / 'whole'}"])
    split = [*common, f"train.out_dir={tmp_path / 'split'}"]
    for kill in (half, n):  # the middle of a pass, then exactly its end
        with pytest.raises(RuntimeError, match="killed"):
            retrain(arch, "tiny", split, resume=kill != half, callbacks=[kill_at(kill + 1)])
        assert torch.load(tmp_path / "split/checkpoints/last.ckpt", weights_only=True)["global_step"] == kill
    resumed = retrain(arch, "tiny", split, resume=True)
    a = ckpt.load(tmp_path / "whole/checkpoints/last.ckpt")
    b = ckpt.load(tmp_path / "split/checkpoints/last.ckpt")
    assert a["global_step"] == b["global_step"] == total  # a pass and a half: it crossed the end of one
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for mine, theirs in zip(a["parnas"]["train_memory"], b["parnas"]["train_memory"]):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    assert resumed["val_ppl"] == whole["val_ppl"] and resumed["test_ppl"] == whole["test_ppl"]
    assert [h["step"] for h in whole["history"]] == [half, 2 * half, 3 * half]
    assert resumed["history"] == whole["history"]


def test_resume_refuses_a_different_run(trained, tmp_path, capsys):
    run = trained["root"] / "aadi"
    arch = write_arch(tmp_path / "arch.json", record_for("AADI"))
    code = main(["retrain", "--arch", arch, "--resume", *settings(trained["corpus"], run, "train.lr=0.5")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "train.lr" in err and len(err.splitlines()) == 1, err
    code = main(["retrain", "--arch", arch, "--resume", *settings(trained["corpus"], tmp_path / "none")])
    assert code == 2 and "nothing to resume" in capsys.readouterr().err


@pytest.mark.slow
def test_a_damaged_last_checkpoint_names_the_intact_one_beside_it_and_resume_from_it_continues_exactly(
        micro, tmp_path, capsys):
    """``--resume`` refuses a damaged last.ckpt in one line naming the latest intact checkpoint beside it and the
    ``--resume=PATH`` that takes it; that run continues exactly (the same weights as the undamaged run's)."""
    run = tmp_path / "run"
    args = ["retrain", "--arch", "transformer-xl", "--config", "tiny", "--out", str(run),
            *[a for p in (f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=6",
                          "train.eval_every=100", "train.stop_at=3") for a in ("--set", p)]]
    assert main(args) == 0
    last = run / "checkpoints" / "last.ckpt"
    kept = last.with_name("step-3.ckpt")
    kept.write_bytes(last.read_bytes())  # e.g. a copy the user kept
    assert main([*args, "--resume", "--set", "train.stop_at=6"]) == 0
    good = ckpt.load(last)
    last.write_bytes(last.read_bytes()[:1000])  # damaged
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "truncated" in line and f"{kept} (step 3) is intact: resume from it with --resume={kept}" in line, line
    assert main([*args, f"--resume={kept}", "--set", "train.stop_at=6"]) == 0
    again = ckpt.load(last)  # written over the damaged file
    assert again["global_step"] == 6 and again["state_dict"].keys() == good["state_dict"].keys()
    assert all(torch.equal(v, good["state_dict"][k]) for k, v in again["state_dict"].items())
    assert ckpt.load(kept)["global_step"] == 3  # the kept checkpoint is left as it was


# --- checkpoints: plain data only, damage refused ----------------------------------------------------

def test_checkpoint_loads_with_weights_only(trained):
    checkpoint = torch.load(trained["root"] / "aadi/checkpoints/last.ckpt", weights_only=True)
    meta = checkpoint["parnas"]
    assert meta["format"] == "parnas.checkpoint" and checkpoint["global_step"] == 8
    assert architecture.layout(meta["architecture"]) == ["attention", "attention", "dense", "identity"]
    assert meta["config"]["model"]["blocks"] == ("attention", "attention", "dense", "identity")
    assert meta["data_position"]["batches_seen"] == 8 and checkpoint["optimizer_states"]
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 8


def test_checkpoints_name_no_class_of_this_project_so_moving_modules_never_breaks_them(trained):
    """A pickle names the module of every class it holds; a checkpoint that named one of parnas's would stop
    loading when that module moved. Record every class the checkpoint's pickle asks for, build none."""
    class Anything(dict):
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __setstate__(self, state) -> None:
            pass

        def append(self, item) -> None:
            pass

    modules = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return Anything

        def persistent_load(self, pid):  # tensor storages: not needed to see the classes
            return None

    with zipfile.ZipFile(trained["root"] / "aadi/checkpoints/last.ckpt") as archive:
        data = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
        Recorder(io.BytesIO(archive.read(data))).load()
    assert modules and "torch._utils" in modules  # the recorder saw the tensors' rebuild functions
    ours = {m for m in modules if m.split(".")[0] in ("parnas", "strategies", "retrain", "study", "search_spaces")}
    assert not ours, ours


class Payload:
    """Unpickling this (unsafely) would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _evaluate_err(capsys, path):
    code = main(["evaluate", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_damaged_or_edited_checkpoints_are_refused_never_executed(trained, tmp_path, capsys):
    good = (trained["root"] / "aadi/checkpoints/last.ckpt").read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good[:len(good) // 2])
    assert "truncated" in _evaluate_err(capsys, truncated)

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"parnas": Payload(marker), "state_dict": {}}, evil)
    err = _evaluate_err(capsys, evil)
    assert "refused" in err and "weights_only" not in err  # never advise loading it unsafely
    assert not marker.exists()

    checkpoint = torch.load(trained["root"] / "aadi/checkpoints/last.ckpt", weights_only=True)
    name = next(iter(checkpoint["state_dict"]))
    original = checkpoint["state_dict"][name].clone()
    checkpoint["state_dict"][name] += 1.0
    torch.save(checkpoint, tmp_path / "weights.ckpt")
    assert "sha256" in _evaluate_err(capsys, tmp_path / "weights.ckpt")

    checkpoint["state_dict"][name] = original
    checkpoint["parnas"]["architecture"]["architecture"]["block_3"] = "attention"  # identity weights absent
    torch.save(checkpoint, tmp_path / "layout.ckpt")
    assert "edited" in _evaluate_err(capsys, tmp_path / "layout.ckpt")
    ckpt.save(checkpoint, tmp_path / "layout.ckpt")  # digests made to match: the weights still do not fit
    assert "do not fit" in _evaluate_err(capsys, tmp_path / "layout.ckpt")
    assert "does not exist" in _evaluate_err(capsys, tmp_path / "absent.ckpt")


# --- evaluate and compare ----------------------------------------------------------------------------

def test_evaluate_equals_the_perplexity_recorded_at_the_end_of_training(trained, tmp_path, capsys):
    last = trained["root"] / "aadi/checkpoints/last.ckpt"
    for split, key in (("valid", "val_ppl"), ("test", "test_ppl")):
        out = tmp_path / f"{split}.json"
        run = last.parent.parent if split == "valid" else last  # a run folder or its checkpoint
        assert main(["evaluate", str(run), "--split", split, "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["ppl"] == trained["found"][key] and result["tokens"] > 0
        assert result["eval_tokens_per_s"] is None or result["eval_seconds"] >= 1.0  # quoted only when timed long
        printed = capsys.readouterr().out
        assert f"{split} perplexity" in printed and re.search(r"perplexity [\d.]+ \(per [\w ]+, vocabulary [\d,]+\)",
                                                               printed), printed
    assert main(["evaluate", str(last), "--mem-len", "48"]) == 0
    longer = json.loads((last.parent / "last.ckpt.valid-mem48.json").read_text())
    assert longer["mem_len"] == 48 and longer["ppl"] != trained["found"]["val_ppl"] and longer["ppl"] < 1e4


def test_compare_prints_and_writes_one_table(trained, tmp_path, capsys):
    runs = [str(trained["root"] / "aadi"), str(trained["root"] / "txl")]
    prefix = tmp_path / "table"
    assert main(["compare", *runs, "--out", str(prefix)]) == 0
    printed = capsys.readouterr().out
    assert "| AADI |" in printed and "| ADAD |" in printed and "val ppl" in printed
    assert "Speed timed side by side in this process" in printed and "Timed separately" in printed  # small models
    assert (prefix.with_suffix(".md")).read_text() in printed
    rows = (prefix.with_suffix(".csv")).read_text().splitlines()
    assert rows[0].startswith("run,architecture,steps,parameters,attention_blocks") and len(rows) == 3
    assert float(rows[1].split(",")[-2]) == trained["found"]["val_ppl"]
    assert main(["compare", str(tmp_path / "nothing")]) == 2


"""User mistakes: exit status 2 and one line on stderr, no traceback, nothing written."""

import dataclasses

import pytest

import parnas.data.corpora
from parnas.cli import main
from parnas.data.corpora import DATASETS


def run(capsys, *args):
    code = main(["train", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line(code, err, *needles):
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("setting, needle", [
    ("model.cutoffs=[400, 100]", "increasing"),
    ("model.n_heads=3", "divisible"),
    ("data.seg_len=0", "data.seg_len"),
    ("model.nonsense=1", "unknown config key model.nonsense"),
    ("train.lr=fast", "train.lr"),
])
def test_bad_settings(capsys, tmp_path, setting, needle):
    code, err = run(capsys, "--config", "tiny", "--set", setting, "--set", f"train.out_dir={tmp_path}/run")
    assert_one_line(code, err, needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cutoffs_not_below_the_vocabulary(capsys, tmp_path, wt2_slice):
    code, err = run(capsys, "--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=300",
                    "--set", "model.cutoffs=[100, 300]", "--set", f"train.out_dir={tmp_path}/run")
    assert_one_line(code, err, "cutoffs", "300")


def test_vocabulary_larger_than_the_corpus_allows(capsys, tmp_path, micro):
    code, err = run(capsys, "--config", "tiny", "--set", f"data.path={micro}", "--set", "data.vocab_size=90000",
                    "--set", "model.cutoffs=[]", "--set", f"train.out_dir={tmp_path}/run")
    assert_one_line(code, err, "vocab")


def test_empty_corpus(capsys, tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("")
    code, err = run(capsys, "--config", "tiny", "--set", f"data.path={tmp_path}")
    assert_one_line(code, err, "empty")


def test_corpus_missing_and_offline(capsys, tmp_path, monkeypatch):
    spec = dataclasses.replace(DATASETS["wikitext-2"], url=(tmp_path / "nowhere.zip").as_uri(), mirrors=())
    monkeypatch.setattr(parnas.data.corpora, "DATASETS", {"wikitext-2": spec})
    monkeypatch.delenv("PARNAS_DATA_DIR", raising=False)
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))  # nothing remembered from other tests
    code, err = run(capsys, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/run")
    assert_one_line(code, err, "train.txt", "PARNAS_DATA_DIR")


def test_checksum_mismatch(capsys, tmp_path, monkeypatch):
    archive = tmp_path / "wikitext-2-v1.zip"
    archive.write_bytes(b"not the real archive")
    spec = dataclasses.replace(DATASETS["wikitext-2"], url=archive.as_uri(), mirrors=(), size=archive.stat().st_size)
    monkeypatch.setattr(parnas.data.corpora, "DATASETS", {"wikitext-2": spec})
    monkeypatch.delenv("PARNAS_DATA_DIR", raising=False)
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))  # nothing remembered from other tests
    code, err = run(capsys, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/run")
    assert_one_line(code, err, "checksum")

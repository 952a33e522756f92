"""Corpus resolution and download, token-id caching, context batching."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WT2, needs_wt2

import parnas.data.tokenizer
from parnas.config import DataConfig
from parnas.data.corpora import DATASETS, ContextBatches, DatasetSpec, load_splits, resolve_corpus
from parnas.data.tokenizer import file_digest
from parnas.errors import DataError, ParnasError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test reads the user's cache or the shared data unless it asks for it."""
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PARNAS_DATA_DIR", raising=False)


def write_corpus(folder: Path, train: str, valid: str, test: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    return folder


def wikitext_zip(path: Path, texts: dict[str, str], top: str = "wikitext-2") -> tuple[str, int]:
    with zipfile.ZipFile(path, "w") as zf:
        for split, text in texts.items():
            zf.writestr(f"{top}/wiki.{split}.tokens", text)
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size


def first_lines(path: Path, n: int) -> str:
    with open(path, encoding="utf-8", newline="\n") as f:
        return "".join(line for _, line in zip(range(n), f, strict=False))


def local(name: str, archive: Path, **changes) -> DatasetSpec:
    """A registry entry that downloads ``archive`` instead (and never tries a mirror on the network)."""
    return dataclasses.replace(DATASETS[name], url=archive.as_uri(), **{"mirrors": (), **changes})


TEXTS = {"train": " a b c \n \n b c \n", "valid": " a d \n", "test": " c \n"}


# --- context batching -----------------------------------------------------------------------------

def segments(ds: ContextBatches) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*ds, strict=True)
    return torch.cat(xs, dim=1).numpy(), torch.cat(ys, dim=1).numpy()


@pytest.mark.parametrize("drop_last", [True, False])
def test_segments_walk_contiguous_streams(drop_last):
    ids = np.random.default_rng(0).integers(0, 1000, size=103).astype(np.int32)
    ds = ContextBatches(ids, batch_size=4, seg_len=5, drop_last=drop_last)
    streams = ids[:100].reshape(4, 25)
    assert ds.n_streams == 4 and ds.stream_len == 25
    assert len(ds) == (4 if drop_last else 5)  # 24 targets per stream: 4 full segments (+ one of 4)
    x, y = ds[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 5)
    xs, ys = segments(ds)
    n = 20 if drop_last else 24
    np.testing.assert_array_equal(xs, streams[:, :n])  # concatenated segments reproduce each stream
    np.testing.assert_array_equal(ys, streams[:, 1:n + 1])  # y is x shifted by one
    assert ds.n_predicted == ys.size == 4 * n
    assert ds.tail_tokens == 103 - 4 * n  # 3 left over + 4 stream heads (+ the dropped 4 per stream)
    if not drop_last:
        assert ds[len(ds) - 1][0].shape == (4, 4)
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_own_disjoint_streams_that_cover_the_batch(world_size):
    ids = np.arange(8 * 30, dtype=np.int32)  # token value = its position, so rows identify streams
    full = ContextBatches(ids, batch_size=8, seg_len=7)
    parts = [ContextBatches(ids, batch_size=8, seg_len=7, rank=r, world_size=world_size) for r in range(world_size)]
    rows = [segments(p)[0] for p in parts]
    assert all(r.shape[0] == 8 // world_size for r in rows)
    np.testing.assert_array_equal(np.concatenate(rows), segments(full)[0])  # complete and in order
    starts = [set(r[:, 0].tolist()) for r in rows]
    assert sum(len(s) for s in starts) == len(set().union(*starts)) == 8  # disjoint
    assert all(len(p) == len(full) for p in parts) and parts[0].n_predicted == full.n_predicted


def test_batches_slice_a_memory_map_without_copying_it(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.int32))
    ids = np.load(tmp_path / "ids.npy", mmap_mode="r")
    ds = ContextBatches(ids, batch_size=4, seg_len=10, rank=1, world_size=2)
    assert np.shares_memory(ds.streams, ids)
    x, y = ds[3]
    np.testing.assert_array_equal(x[0].numpy(), np.arange(500 + 30, 500 + 40))
    np.testing.assert_array_equal(y[0].numpy(), np.arange(500 + 31, 500 + 41))


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=6, seg_len=4, world_size=4), "does not split evenly"),
    (dict(batch_size=4, seg_len=0), "must be > 0"),
    (dict(batch_size=4, seg_len=30), "too short"),
    (dict(batch_size=4, seg_len=4, rank=2, world_size=2), "rank"),
])
def test_batching_rejects_impossible_settings(kwargs, match):
    with pytest.raises(DataError, match=match) as e:
        ContextBatches(np.arange(100, dtype=np.int32), **kwargs)
    assert "\n" not in str(e.value)


def test_evaluation_accepts_a_split_shorter_than_one_segment():
    ds = ContextBatches(np.arange(100, dtype=np.int32), batch_size=4, seg_len=30, drop_last=False)
    assert len(ds) == 1 and ds[0][0].shape == (4, 24) and ds.tail_tokens == 4


# --- corpus resolution ----------------------------------------------------------------------------

def test_explicit_path_wins_and_must_be_complete(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "mine", **TEXTS)
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path))  # ignored when a path is given
    assert resolve_corpus("anything", corpus) == corpus
    (corpus / "test.txt").unlink()
    with pytest.raises(DataError, match="lacks test.txt"):
        resolve_corpus("anything", corpus)
    with pytest.raises(DataError, match="not a directory"):
        resolve_corpus("anything", tmp_path / "missing")


def test_data_dir_then_cache(tmp_path, monkeypatch):
    offline = {"tiny": local("wikitext-2", tmp_path / "none.zip")}
    cached = write_corpus(tmp_path / "cache" / "tiny", **TEXTS)
    assert resolve_corpus("tiny", registry=offline) == cached  # found in the cache: no download tried
    shared = write_corpus(tmp_path / "shared" / "tiny", **TEXTS)
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "shared"))
    assert resolve_corpus("tiny", registry=offline) == shared


@pytest.mark.parametrize("special", ["fifo", "socket"])
def test_a_special_file_at_a_split_is_named_as_such_never_opened(tmp_path, special):
    import socket

    corpus = write_corpus(tmp_path / "c", **TEXTS)
    (corpus / "train.txt").unlink()
    if special == "fifo":
        os.mkfifo(corpus / "train.txt")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(corpus / "train.txt"))
    with pytest.raises(ParnasError, match=r"train.txt is a (FIFO|socket).*not a file"):
        resolve_corpus("c", corpus)


def test_empty_split_is_an_error(tmp_path):
    corpus = write_corpus(tmp_path / "c", TEXTS["train"], "", TEXTS["test"])
    with pytest.raises(DataError, match="valid.txt is empty"):
        resolve_corpus("c", corpus)


def test_train_split_without_tokens_is_an_error(tmp_path):
    corpus = write_corpus(tmp_path / "c", " \n \n", TEXTS["valid"], TEXTS["test"])
    with pytest.raises(DataError, match="no tokens"):
        load_splits(DataConfig(dataset="c", path=str(corpus), tokenizer="word"))


def test_download_unpacks_a_wikitext_zip(tmp_path):
    checksum, size = wikitext_zip(tmp_path / "wt.zip", TEXTS)
    registry = {"wikitext-2": local("wikitext-2", tmp_path / "wt.zip", checksum=checksum, size=size, files_sha256=())}
    cache = tmp_path / "cache"
    corpus = resolve_corpus("wikitext-2", registry=registry)
    assert corpus == cache / "wikitext-2"
    for split, text in TEXTS.items():
        assert (corpus / f"{split}.txt").read_text() == text
    assert sorted(p.name for p in cache.iterdir()) == ["wikitext-2"]  # no temporary files left
    (tmp_path / "wt.zip").unlink()
    assert resolve_corpus("wikitext-2", registry=registry) == corpus  # the second call reads the cache


def test_download_cuts_a_byte_level_archive(tmp_path):
    data = bytes(range(256)) * 4
    with zipfile.ZipFile(tmp_path / "b.zip", "w") as zf:
        zf.writestr("bytes8", data)
    archive = (tmp_path / "b.zip").read_bytes()
    spec = local("text8", tmp_path / "b.zip", size=len(archive), checksum="sha1:" + hashlib.sha1(archive).hexdigest(),
                 split_bytes=(1000, 14))
    corpus = resolve_corpus("bytes8", registry={"bytes8": spec})
    parts = [(corpus / f"{s}.txt").read_bytes() for s in ("train", "valid", "test")]
    assert parts == [data[:1000], data[1000:1014], data[1014:]]


def test_mirrors_are_tried_when_the_url_fails(tmp_path):
    checksum, size = wikitext_zip(tmp_path / "wt.zip", TEXTS)
    spec = local("wikitext-2", tmp_path / "gone.zip", checksum=checksum, size=size, files_sha256=(),
                 mirrors=((tmp_path / "wt.zip").as_uri(),))
    corpus = resolve_corpus("wikitext-2", registry={"wikitext-2": spec})
    assert (corpus / "valid.txt").read_text() == TEXTS["valid"]


def test_offline_download_names_where_to_put_the_files(tmp_path):
    registry = {"wikitext-2": local("wikitext-2", tmp_path / "gone.zip")}
    with pytest.raises(DataError) as e:
        resolve_corpus("wikitext-2", registry=registry)
    message = str(e.value)
    assert "\n" not in message and "not found" in message and "train.txt" in message
    assert str(tmp_path / "cache" / "wikitext-2") in message and "PARNAS_DATA_DIR" in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_unknown_corpus_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError, match="parnas can only download") as e:
        resolve_corpus("my-corpus")
    assert "\n" not in str(e.value) and str(tmp_path / "cache" / "my-corpus") in str(e.value)


def test_checksum_mismatch_removes_the_download(tmp_path):
    _, size = wikitext_zip(tmp_path / "wt.zip", TEXTS)
    registry = {"wikitext-2": local("wikitext-2", tmp_path / "wt.zip", size=size)}  # keeps the real sha256
    with pytest.raises(DataError, match="sha256 .* expected 92675f1d") as e:
        resolve_corpus("wikitext-2", registry=registry)
    assert "\n" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []
    with pytest.raises(DataError, match="expected 4,475,746"):  # a wrong size is caught before hashing
        resolve_corpus("wikitext-2", registry={"wikitext-2": dataclasses.replace(registry["wikitext-2"],
                                                                                 size=4_475_746)})
    assert list((tmp_path / "cache").iterdir()) == []


def test_extracted_files_are_checked_where_their_sha256_is_known(tmp_path):
    checksum, size = wikitext_zip(tmp_path / "wt.zip", TEXTS)
    registry = {"wikitext-2": local("wikitext-2", tmp_path / "wt.zip", checksum=checksum, size=size)}
    with pytest.raises(DataError, match="train.txt .* does not match"):  # the real per-file sha256 are kept
        resolve_corpus("wikitext-2", registry=registry)
    assert list((tmp_path / "cache").iterdir()) == []


@needs_wt2
def test_registry_pins_the_real_wikitext2_files():
    pinned = dict(DATASETS["wikitext-2"].files_sha256)
    assert {split: file_digest(WT2 / f"{split}.txt") for split in pinned} == pinned


# --- token ids ------------------------------------------------------------------------------------

def test_token_ids_are_cached_as_npy_and_reused(tmp_path, monkeypatch):
    """On the first 2,000 lines of each WikiText-2 split where available, else on a made-up corpus."""
    wt2 = (WT2 / "train.txt").is_file()
    texts = [first_lines(WT2 / f"{s}.txt", 2000) if wt2 else TEXTS[s] * 500 for s in ("train", "valid", "test")]
    corpus = write_corpus(tmp_path / "slice", *texts)
    cfg = DataConfig(dataset="wikitext-2", path=str(corpus), tokenizer="word")
    tok, splits = load_splits(cfg)
    assert not tok.from_cache
    assert all(isinstance(a, np.memmap) and a.dtype == np.int32 for a in splits.values())
    assert int((splits["train"] == tok.eos_id).sum()) == texts[0].count("\n")  # one eos per line, empty ones too
    npys = sorted(p.name for p in tok.path.parent.glob("*.npy"))
    assert npys == sorted(f"{s}-{file_digest(corpus / f'{s}.txt')[:16]}.npy" for s in ("train", "valid", "test"))

    def no_encoding(*args, **kwargs):
        raise AssertionError("encoded again instead of reading the .npy cache")

    monkeypatch.setattr(parnas.data.tokenizer.Tokenizer, "encode_file", no_encoding)
    monkeypatch.setattr(parnas.data.tokenizer, "word_vocab", no_encoding)
    tok2, again = load_splits(cfg)
    assert tok2.from_cache and tok2.sha256 == tok.sha256
    for split in splits:
        np.testing.assert_array_equal(again[split], splits[split])


def _valid_ids(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", *(TEXTS[s] * 50 for s in ("train", "valid", "test")))
    cfg = DataConfig(path=str(corpus), tokenizer="word")
    tok, splits = load_splits(cfg)
    npy = next(tok.path.parent.glob("valid-*.npy"))
    return cfg, tok, np.array(splits["valid"]), npy


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "outside the vocabulary", "wrong dtype",
                                    "zeroed at the same size", "no checksum"])
def test_damaged_token_id_caches_are_reported_and_encoded_again(tmp_path, capsys, damage):
    cfg, tok, ids, npy = _valid_ids(tmp_path)
    if damage == "empty":
        npy.write_bytes(b"")
    elif damage == "garbage":
        npy.write_bytes(b"\x93NUMPY but not really" * 10)
    elif damage == "truncated":
        npy.write_bytes(npy.read_bytes()[:-40])
    elif damage == "outside the vocabulary":
        np.save(npy, np.full_like(ids, tok.vocab_size + 5))
    elif damage == "zeroed at the same size":  # the header kept: only the checksum tells
        size = npy.stat().st_size
        np.save(npy, np.zeros_like(ids))
        assert npy.stat().st_size == size
    elif damage == "no checksum":
        npy.with_name(npy.name + ".blake2b").unlink()
    else:
        np.save(npy, ids.astype(np.int64))
    capsys.readouterr()
    _, splits = load_splits(cfg)
    note = capsys.readouterr().err.strip()
    assert len(note.splitlines()) == 1 and "damaged" in note and str(npy) in note, note
    np.testing.assert_array_equal(splits["valid"], ids)
    _, again = load_splits(cfg)  # repaired: read quietly from now on
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("failure", [MemoryError(), OSError(errno.ENOMEM, "Cannot allocate memory")])
def test_cached_token_ids_that_memory_cannot_hold_are_not_called_damaged(tmp_path, capsys, monkeypatch, failure):
    """Under ``ulimit -v`` the map of an intact cache fails: the failure goes to the memory refusal as it is, the
    file is neither reported damaged nor encoded again (which would need more memory still)."""
    cfg, _, _, npy = _valid_ids(tmp_path)
    before = npy.stat().st_mtime_ns

    def no_memory(*args, **kwargs):
        raise failure

    monkeypatch.setattr(np, "load", no_memory)
    capsys.readouterr()
    with pytest.raises(type(failure)):
        load_splits(cfg)
    assert capsys.readouterr().err == "" and npy.stat().st_mtime_ns == before


def test_a_corpus_found_through_the_data_dir_is_found_again_without_it(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    write_corpus(data_dir / "wikitext-2", *(TEXTS[s] for s in ("train", "valid", "test")))
    monkeypatch.setenv("PARNAS_DATA_DIR", str(data_dir))
    assert resolve_corpus("wikitext-2") == data_dir / "wikitext-2"
    monkeypatch.delenv("PARNAS_DATA_DIR")  # the next command, in a shell without the variable
    assert resolve_corpus("wikitext-2", registry={}) == data_dir / "wikitext-2"
    shutil.rmtree(data_dir)
    with pytest.raises(DataError, match="remembered"):
        resolve_corpus("wikitext-2", registry={})


def test_a_data_dir_that_is_not_a_folder_is_refused_not_replaced_by_the_remembered_corpus(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    write_corpus(data_dir / "wikitext-2", *(TEXTS[s] for s in ("train", "valid", "test")))
    monkeypatch.setenv("PARNAS_DATA_DIR", str(data_dir))
    assert resolve_corpus("wikitext-2") == data_dir / "wikitext-2"  # remembered from now on
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "dta"))  # a typo
    with pytest.raises(DataError, match=r"PARNAS_DATA_DIR=.*dta is not a folder"):
        resolve_corpus("wikitext-2", registry={})

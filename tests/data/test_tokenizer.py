"""Tokenizers: conventions (eos per line, frequency order, unk), caching, bad settings."""

from __future__ import annotations

import errno
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import WT2, needs_wt2

import parnas.data.tokenizer
from parnas.config import DataConfig
from parnas.data.tokenizer import CharTokenizer, SentencePieceTokenizer, WordTokenizer, build_tokenizer, read_lines
from parnas.errors import TokenizerError


def write_corpus(folder: Path, train: str, valid: str = " x \n", test: str = " x \n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    return folder


def text_slice(n_lines: int = 2000) -> str:
    """The first lines of WikiText-2 train, or Zipf-distributed made-up words without it."""
    if (WT2 / "train.txt").is_file():
        with open(WT2 / "train.txt", encoding="utf-8", newline="\n") as f:
            return "".join(line for _, line in zip(range(n_lines), f, strict=False))
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    return "".join(" " + " ".join(rng.choices(words, weights, k=rng.randint(0, 40))) + " \n" for _ in range(n_lines))


def fail(*args, **kwargs):
    raise AssertionError("trained again instead of loading the cache")


# --- word level -----------------------------------------------------------------------------------

def test_word_level_order_eos_and_unk(tmp_path):
    corpus = write_corpus(tmp_path / "c", " c c c \n b a b a \n \n", valid=" a zebra \n")
    tok = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    assert isinstance(tok, WordTokenizer) and tok.kind == "word" and not tok.from_cache
    # counts: c 3, <eos> 3, b 2, a 2, <unk> 0 (absent: added); ties keep the order of first appearance
    assert tok.itos == ["c", "<eos>", "b", "a", "<unk>"] and tok.vocab_size == 5
    ids = tok.encode_file(corpus / "train.txt")
    assert ids.dtype == np.int32 and ids.tolist() == [0, 0, 0, 1, 2, 3, 2, 3, 1, 1]
    assert tok.encode_file(corpus / "valid.txt").tolist() == [3, tok.unk_id, tok.eos_id]
    assert tok.decode(ids.tolist()) == "c c c\nb a b a\n\n"
    assert tok.encode("a c") == [3, 0]


@needs_wt2
@pytest.mark.slow
def test_word_level_wikitext2_counts(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer="word"), WT2, tmp_path / "cache")
    ids = tok.encode_file(WT2 / "train.txt")
    assert tok.vocab_size == 33_278 and len(ids) == 2_088_628
    assert int((ids == tok.eos_id).sum()) == 36_718  # one per line, empty lines included
    counts = np.bincount(ids, minlength=tok.vocab_size)
    assert np.all(np.diff(counts) <= 0)  # ids in descending frequency: adaptive softmax heads are frequent
    assert tok.itos[:3] == ["the", ",", "."]


@needs_wt2
def test_word_level_slice_maps_unseen_words_to_unk(tmp_path):
    corpus = write_corpus(tmp_path / "c", text_slice(2000), valid=text_slice(2500)[-20000:])
    tok = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    valid = tok.encode_file(corpus / "valid.txt")
    lines = list(read_lines(corpus / "valid.txt"))
    assert int((valid == tok.eos_id).sum()) == len(lines)
    unseen = sum(word not in tok.stoi for line in lines for word in line.split())
    assert unseen > 0 and int((valid == tok.unk_id).sum()) >= unseen


def test_word_vocabulary_is_cached(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c", " a b \n")
    first = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    monkeypatch.setattr(parnas.data.tokenizer, "word_vocab", fail)
    second = build_tokenizer(DataConfig(tokenizer="word", vocab_size=7), corpus, tmp_path / "cache")
    assert second.from_cache and second.path == first.path and second.sha256 == first.sha256
    assert first.path.parent.name.endswith("-word") and first.path.name == "vocab.txt"


# --- char level -----------------------------------------------------------------------------------

def test_char_level_is_byte_level_with_newline_as_eos(tmp_path):
    corpus = write_corpus(tmp_path / "c", "aab é\nba", valid="ab!\n")
    tok = build_tokenizer(DataConfig(tokenizer="char"), corpus, tmp_path / "cache")
    assert isinstance(tok, CharTokenizer)
    ids = tok.encode_file(corpus / "train.txt")
    assert len(ids) == len("aab é\nba".encode()) + 1  # a final eos for the unterminated last line
    assert int((ids == tok.eos_id).sum()) == 2
    assert tok.decode(ids.tolist()) == "aab é\nba\n"
    counts = np.bincount(ids, minlength=tok.vocab_size)
    assert np.all(np.diff(counts) <= 0)
    assert tok.encode_file(corpus / "valid.txt")[2] == tok.unk_id  # "!" never seen in train
    assert tok.encode_lines(["ab", ""]).tolist() == tok.encode("ab\n\n")
    second = build_tokenizer(DataConfig(tokenizer="char"), corpus, tmp_path / "cache")
    assert second.from_cache


# --- SentencePiece --------------------------------------------------------------------------------

@pytest.mark.slow
def test_sentencepiece_trains_once_and_is_reused(tmp_path, monkeypatch):
    model_type = "unigram"
    corpus = write_corpus(tmp_path / "c", text_slice(2000))
    cfg = DataConfig(tokenizer="sentencepiece", vocab_size=200)
    calls = []
    train = parnas.data.tokenizer.train_sentencepiece
    monkeypatch.setattr(parnas.data.tokenizer, "train_sentencepiece", lambda *a: calls.append(a) or train(*a))
    tok = build_tokenizer(cfg, corpus, tmp_path / "cache")
    assert len(calls) == 1 and not tok.from_cache and isinstance(tok, SentencePieceTokenizer)
    assert tok.path.parent.name.endswith(f"-sentencepiece-{model_type}-200") and tok.path.name == "spm.model"
    assert (tok.vocab_size, tok.unk_id, tok.eos_id) == (200, 0, 1)
    lines = list(read_lines(corpus / "train.txt"))[:50]
    ids = tok.encode_lines(lines)
    assert ids.dtype == np.int32 and int((ids == tok.eos_id).sum()) == 50
    assert len(tok.decode(ids.tolist()).split("\n")) == 51
    common = " ".join([w for w, _ in Counter(" ".join(lines).split()).most_common(30) if w.isalpha()][:6])
    assert tok.decode(tok.encode(common)) == common

    monkeypatch.setattr(parnas.data.tokenizer, "train_sentencepiece", fail)
    again = build_tokenizer(cfg, corpus, tmp_path / "cache")
    assert again.from_cache and again.sha256 == tok.sha256
    np.testing.assert_array_equal(again.encode_lines(lines), ids)


def test_sentencepiece_vocab_too_small_is_one_clear_line(tmp_path):
    corpus = write_corpus(tmp_path / "c", "".join(f" {chr(945 + i % 25)} line {i} \n" for i in range(60)))
    with pytest.raises(TokenizerError, match=r"data.vocab_size=10 is too small .*at least \d+") as e:
        build_tokenizer(DataConfig(tokenizer="sentencepiece", vocab_size=10), corpus, tmp_path / "cache")
    assert "\n" not in str(e.value)


def test_sentencepiece_vocab_too_large_is_one_clear_line(tmp_path):
    corpus = write_corpus(tmp_path / "c", "".join(f" line {i} of a tiny corpus \n" for i in range(30)))
    with pytest.raises(TokenizerError, match=r"data.vocab_size=50000 is too large .*at most \d+") as e:
        build_tokenizer(DataConfig(tokenizer="sentencepiece", vocab_size=50_000), corpus, tmp_path / "cache")
    assert "\n" not in str(e.value) and "smaller data.vocab_size" in str(e.value)
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == []  # nothing half-built left behind


@pytest.mark.slow
def test_identity_survives_a_rebuild_of_the_cache(tmp_path):
    """spm.model embeds the temporary path it was built in; the identity is what the tokenizer does."""
    corpus = write_corpus(tmp_path / "c", text_slice(1000))
    cfg = DataConfig(tokenizer="sentencepiece", vocab_size=200)
    first = build_tokenizer(cfg, corpus, tmp_path / "cache")
    lines = list(read_lines(corpus / "train.txt"))[:20]
    shutil.rmtree(tmp_path / "cache")
    rebuilt = build_tokenizer(cfg, corpus, tmp_path / "cache")
    elsewhere = build_tokenizer(cfg, corpus, tmp_path / "other-cache")
    assert not rebuilt.from_cache and rebuilt.identity() == first.identity() == elsewhere.identity()
    np.testing.assert_array_equal(rebuilt.encode_lines(lines), first.encode_lines(lines))
    other = build_tokenizer(DataConfig(tokenizer="sentencepiece", vocab_size=220), corpus, tmp_path / "cache")
    assert other.sha256 != first.sha256  # another tokenizer, another identity


@pytest.mark.parametrize("damage", [b"", b"garbage, not a protobuf \xff\xfe"])
@pytest.mark.slow
def test_a_damaged_cached_model_is_reported_and_built_again(tmp_path, capsys, damage):
    corpus = write_corpus(tmp_path / "c", text_slice(1000))
    cfg = DataConfig(tokenizer="sentencepiece", vocab_size=200)
    good = build_tokenizer(cfg, corpus, tmp_path / "cache")
    good.path.write_bytes(damage)
    capsys.readouterr()
    again = build_tokenizer(cfg, corpus, tmp_path / "cache")
    note = capsys.readouterr().err.strip()
    assert len(note.splitlines()) == 1 and "damaged" in note and "building it again" in note, note
    assert not again.from_cache and again.sha256 == good.sha256 and again.vocab_size == 200
    assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir()] == [good.path.parent.name]


def test_a_cached_tokenizer_that_memory_cannot_load_is_not_called_damaged(tmp_path, capsys, monkeypatch):
    """A load that fails for want of memory is not damage: it reaches the memory refusal, nothing is rebuilt."""
    corpus = write_corpus(tmp_path / "c", " a b c \n b c \n")
    cfg = DataConfig(tokenizer="word")
    good = build_tokenizer(cfg, corpus, tmp_path / "cache")

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(parnas.data.tokenizer, "checksum_mismatch", no_memory)
    capsys.readouterr()
    with pytest.raises(OSError, match="Cannot allocate memory"):
        build_tokenizer(cfg, corpus, tmp_path / "cache")
    assert capsys.readouterr().err == "" and good.path.is_file()


def test_a_damaged_word_vocabulary_is_built_again(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c", " a b c \n b c \n")
    good = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    good.path.write_text("no eos or unk in here\n")
    again = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    assert "damaged" in capsys.readouterr().err and again.sha256 == good.sha256


def test_a_cached_vocabulary_changed_in_place_is_caught_by_its_checksum(tmp_path, capsys):
    """A vocabulary that still reads as one (one word swapped for another, same size) is not used: the checksum
    recorded when it was built no longer matches."""
    corpus = write_corpus(tmp_path / "c", " a b c \n b c \n")
    good = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    text = good.path.read_text()
    good.path.write_text(text.replace("b\n", "x\n"))
    capsys.readouterr()
    again = build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache")
    note = capsys.readouterr().err.strip()
    assert len(note.splitlines()) == 1 and "checksum" in note and "building it again" in note, note
    assert not again.from_cache and again.path.read_text() == text
    assert build_tokenizer(DataConfig(tokenizer="word"), corpus, tmp_path / "cache").from_cache


@pytest.mark.slow
def test_sentencepiece_writes_the_unknown_piece_as_unk(tmp_path):
    corpus = write_corpus(tmp_path / "c", text_slice(1000))
    tok = build_tokenizer(DataConfig(tokenizer="sentencepiece", vocab_size=200), corpus, tmp_path / "cache")
    ids = tok.encode("the \u6f22 cat")  # a character the corpus never had
    assert tok.unk_id in ids
    text = tok.decode(ids)
    assert text == "the <unk> cat" and "\u2047" not in text


@pytest.mark.slow
def test_word_starts_and_the_unknown_marker_for_every_kind(tmp_path):
    """A token may follow a whole word when its text does not begin with a letter or digit; an unknown
    token decodes as "<unk>" whatever the kind."""
    corpus = write_corpus(tmp_path / "c", text_slice(1000))
    sp = build_tokenizer(DataConfig(tokenizer="sentencepiece", vocab_size=200), corpus, tmp_path / "cache")
    starts = sp.word_starts()
    pieces = [sp.sp.id_to_piece(i) for i in range(sp.vocab_size)]
    assert starts.shape == (200,) and starts[sp.eos_id] and not starts[sp.unk_id]
    assert all(starts[i] == p.startswith("\u2581") for i, p in enumerate(pieces) if p[:1].isalpha() or
               p.startswith("\u2581"))
    assert any(starts) and not all(starts)

    char = build_tokenizer(DataConfig(tokenizer="char"), write_corpus(tmp_path / "h", "ab c,\n"), tmp_path / "cache")
    text = {char.decode([i]): bool(s) for i, s in enumerate(char.word_starts())}
    assert text == {"a": False, "b": False, "c": False, " ": True, ",": True, "\n": True, "<unk>": False}

    word = build_tokenizer(DataConfig(tokenizer="word"), write_corpus(tmp_path / "w", " a b \n"), tmp_path / "cache")
    assert word.word_starts().all() and word.decode([word.unk_id]) == "<unk>"


def test_training_a_tokenizer_on_a_large_corpus_says_so_first_and_a_cached_one_says_nothing(tmp_path, capsys,
                                                                                             monkeypatch):
    """Seconds to tens of seconds of SentencePiece on a fresh machine are announced, not sat through."""
    import parnas.data.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "SAY_TRAINING_OVER", 0)  # the test's corpus stands in for a large one
    corpus = write_corpus(tmp_path / "c", text_slice(300))
    cfg = DataConfig(tokenizer="sentencepiece", vocab_size=200)
    build_tokenizer(cfg, corpus, tmp_path / "cache")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("parnas: training a 200-piece SentencePiece tokenizer on ") and "cached under" in line
    assert build_tokenizer(cfg, corpus, tmp_path / "cache").from_cache and capsys.readouterr().err == ""

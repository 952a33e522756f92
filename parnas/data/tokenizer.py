"""Tokenizers: SentencePiece, word level and character (byte) level.

Each is trained once on a corpus's train split and cached under ``<cache_dir>/tokenizers/``, built in a temporary
directory and renamed into place, so a crash or a racing DDP rank never sees half of one; a damaged cached one is
said in one line and built again. A tokenizer's identity (``sha256``, recorded in architecture JSONs and
checkpoints) is a digest of what it does, not of incidental bytes (the paths and thread count ``spm.model``
embeds), so a rebuilt cache keeps it and ``--resume`` works.

Shared conventions: lines end only at ``\\n`` and every line, empty ones too, ends with one eos (WikiText's
convention); ids run roughly by descending frequency, which adaptive softmax relies on (word and char
vocabularies by train counts, SentencePiece by piece score); an unknown token decodes as ``<unk>``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from parnas.config import DataConfig
from parnas.errors import DataError, TokenizerError
from parnas.files import checksum_mismatch, file_digest, lacks_memory, write_checksum

EOS, UNK = "<eos>", "<unk>"
_BATCH_LINES = 8192  # lines encoded per call: bounds the Python lists alive at once


def read_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file without their ``\\n``; no other character ends a line."""
    with open(path, encoding="utf-8", newline="\n") as f:
        try:
            for line in f:
                yield line[:-1] if line.endswith("\n") else line
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 text; use data.tokenizer=char for byte-level corpora") from None


class Tokenizer(ABC):
    """Text <-> int ids. ``path`` is the model/vocabulary file; ``sha256`` identifies what the
    tokenizer does in architecture JSONs and checkpoints; ``from_cache`` says it was loaded, not trained."""

    kind: str
    vocab_size: int
    eos_id: int
    unk_id: int

    def __init__(self, path: Path, *, from_cache: bool = True) -> None:
        self.path = Path(path)
        self.sha256 = file_digest(self.path)  # word and char vocabularies are plain lists: their bytes are it
        self.from_cache = from_cache
        self.corpus_sha256: str | None = None  # sha256 of the train split it was built from, where known

    @abstractmethod
    def _encode_batch(self, lines: list[str]) -> list[list[int]]:
        """Ids of each line, no eos."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; eos becomes a newline, an unknown token ``<unk>``."""

    @abstractmethod
    def word_starts(self) -> np.ndarray:
        """Bool per id: whether the token can follow a whole word without joining it (its text does not begin with
        a letter or digit), so sampling after a prompt that ends a word keeps that word whole."""

    def identity(self) -> dict[str, Any]:
        """What architecture JSONs and checkpoints record of the tokenizer."""
        return {"kind": self.kind, "vocab_size": self.vocab_size, "sha256": self.sha256}

    def encode(self, text: str) -> list[int]:
        """Ids of a text fragment; no eos is added."""
        return self._encode_batch([text])[0]

    def encode_lines(self, lines: Iterable[str]) -> np.ndarray:
        """int32 ids of all lines, one eos after each line."""
        chunks, it = [], iter(lines)
        while batch := list(islice(it, _BATCH_LINES)):
            flat: list[int] = []
            for ids in self._encode_batch(batch):
                flat.extend(ids)
                flat.append(self.eos_id)
            chunks.append(np.asarray(flat, dtype=np.int32))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)

    def encode_file(self, path: Path) -> np.ndarray:
        return self.encode_lines(read_lines(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, path={str(self.path)!r})"


def sentencepiece_identity(proto: Any) -> str:
    """sha256 of a SentencePiece model without its incidental trainer fields: pieces, scores,
    types, normalisation and the settings that shape encoding, as serialised by protobuf."""
    proto = type(proto).FromString(proto.SerializeToString())  # a copy
    for name in _INCIDENTAL_TRAINER_FIELDS:
        proto.trainer_spec.ClearField(name)
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def _split_at_eos(ids: Sequence[int], eos: int) -> list[list[int]]:
    parts: list[list[int]] = [[]]
    for i in ids:
        if i == eos:
            parts.append([])
        else:
            parts[-1].append(int(i))
    return parts


def _replace_run(ids: list[int], run: tuple[int, ...], by: int) -> list[int]:
    """``ids`` with every occurrence of the id sequence ``run`` replaced by the one id ``by``."""
    if not run:
        return ids
    out, i, n = [], 0, len(run)
    while i < len(ids):
        if tuple(ids[i:i + n]) == run:
            out.append(by)
            i += n
        else:
            out.append(ids[i])
            i += 1
    return out


# Trainer settings that say where and how fast a model was trained, not what it does.
_INCIDENTAL_TRAINER_FIELDS = ("input", "model_prefix", "num_threads")


class SentencePieceTokenizer(Tokenizer):
    """A trained ``spm.model``: unk=0, eos=1, no bos or pad. The unknown piece decodes as ``<unk>``
    (the WikiText spelling), not SentencePiece's "⁇"."""

    kind = "sentencepiece"

    def __init__(self, path: Path, *, from_cache: bool = True) -> None:
        super().__init__(path, from_cache=from_cache)
        proto = sentencepiece_model_pb2.ModelProto()
        try:
            proto.ParseFromString(self.path.read_bytes())
        except DecodeError:
            raise TokenizerError(f"{self.path} is not a SentencePiece model") from None
        if not proto.pieces:
            raise TokenizerError(f"{self.path} is not a SentencePiece model (it holds no pieces)")
        self.sha256 = sentencepiece_identity(proto)
        proto.trainer_spec.unk_surface = UNK
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id, self.unk_id = self.sp.eos_id(), self.sp.unk_id()
        # A vocabulary without "<" and ">" spells WikiText's "<unk>" as unknown, "un", "k", unknown, which
        # would decode as "<unk>unk<unk>": decoding shows that spelling as the one marker it stands for.
        spelled = self.sp.encode(UNK)
        spelled = spelled[1:] if spelled and self.sp.id_to_piece(spelled[0]) == "\u2581" else spelled
        self._unk_spelling = tuple(spelled) if self.unk_id in spelled and len(spelled) > 1 else ()

    def _encode_batch(self, lines: list[str]) -> list[list[int]]:
        return self.sp.encode(lines, out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return "\n".join(self.sp.decode(_replace_run(part, self._unk_spelling, self.unk_id))
                         for part in _split_at_eos(ids, self.eos_id))

    def word_starts(self) -> np.ndarray:
        starts = np.array([not self.sp.id_to_piece(i)[:1].isalnum() for i in range(self.vocab_size)])
        starts[self.unk_id] = False  # its surface would stick to the word: "was<unk>"
        return starts


class WordTokenizer(Tokenizer):
    """Whitespace tokens; ``vocab.txt`` holds one token per line, line number = id."""

    kind = "word"

    def __init__(self, path: Path, *, from_cache: bool = True) -> None:
        super().__init__(path, from_cache=from_cache)
        with open(self.path, encoding="utf-8", newline="\n") as f:
            self.itos = f.read().split("\n")[:-1]
        self.stoi = {tok: i for i, tok in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.eos_id, self.unk_id = self.stoi[EOS], self.stoi[UNK]

    def _encode_batch(self, lines: list[str]) -> list[list[int]]:
        get, unk = self.stoi.get, self.unk_id
        return [[get(tok, unk) for tok in line.split()] for line in lines]

    def decode(self, ids: Sequence[int]) -> str:
        return "\n".join(" ".join(self.itos[i] for i in part) for part in _split_at_eos(ids, self.eos_id))

    def word_starts(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=bool)  # tokens are whole words, joined by spaces


class CharTokenizer(Tokenizer):
    """One token per byte (text8 is ASCII; enwik8 is byte level by convention); the newline
    byte is eos. ``vocab.txt`` holds ``<eos>``, ``<unk>`` or a byte value (0-255) per line."""

    kind = "char"

    def __init__(self, path: Path, *, from_cache: bool = True) -> None:
        super().__init__(path, from_cache=from_cache)
        entries = self.path.read_text(encoding="ascii").split()
        self.vocab_size = len(entries)
        self.eos_id, self.unk_id = entries.index(EOS), entries.index(UNK)
        self.table = np.full(256, self.unk_id, dtype=np.int32)  # byte -> id
        self.bytes_of: list[bytes] = []  # id -> bytes
        for i, entry in enumerate(entries):
            if entry in (EOS, UNK):
                self.bytes_of.append(b"\n" if entry == EOS else UNK.encode())
            else:
                self.table[int(entry)] = i
                self.bytes_of.append(bytes([int(entry)]))
        self.table[ord("\n")] = self.eos_id

    def _encode_bytes(self, data: bytes) -> np.ndarray:
        return self.table[np.frombuffer(data, dtype=np.uint8)]

    def _encode_batch(self, lines: list[str]) -> list[list[int]]:
        return [self._encode_bytes(line.encode("utf-8")).tolist() for line in lines]

    def encode_lines(self, lines: Iterable[str]) -> np.ndarray:
        return self._encode_bytes("".join(line + "\n" for line in lines).encode("utf-8"))

    def encode_file(self, path: Path) -> np.ndarray:
        data = Path(path).read_bytes()
        ids = self._encode_bytes(data)
        return ids if data.endswith(b"\n") or not data else np.append(ids, np.int32(self.eos_id))

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.bytes_of[i] for i in ids).decode("utf-8", errors="replace")

    def word_starts(self) -> np.ndarray:
        # bytes >= 128 are parts of non-ASCII characters, letters mostly: they may continue a word
        starts = np.array([len(b) == 1 and b[0] < 128 and not chr(b[0]).isalnum() for b in self.bytes_of])
        starts[self.eos_id], starts[self.unk_id] = True, False
        return starts


SAY_TRAINING_OVER = 1 << 20  # corpus bytes over which training takes long enough to say so first


def train_sentencepiece(train_file: Path, model_prefix: Path, vocab_size: int, model_type: str) -> None:
    """Train ``<model_prefix>.model``. Module-level so tests can check it is not called twice."""
    try:
        spm.SentencePieceTrainer.train(
            input=str(train_file), model_prefix=str(model_prefix), vocab_size=vocab_size, model_type=model_type,
            unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
            num_threads=os.cpu_count() or 1,
            input_sentence_size=5_000_000, shuffle_input_sentence=True,  # all of WikiText-103's 1.8M lines
            max_sentence_length=1 << 16,  # WikiText paragraphs can exceed the 4,192-byte default
            minloglevel=1,
        )
    except RuntimeError as e:
        message = str(e)
        if "Vocabulary size too high" in message:
            most = re.search(r"<=\s*(\d+)", message)
            limit = f" (at most {most.group(1)} for this corpus)" if most else ""
            raise TokenizerError(f"data.vocab_size={vocab_size} is too large for {train_file}{limit}; "
                                 "set a smaller data.vocab_size") from None
        least = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
        if least:
            raise TokenizerError(f"data.vocab_size={vocab_size} is too small for {train_file}: its characters need "
                                 f"at least {least.group(1)}; set a larger data.vocab_size") from None
        first = message.strip().splitlines()[0] if message.strip() else type(e).__name__
        raise TokenizerError(f"SentencePiece could not train on {train_file}: {first}") from None


def word_vocab(train_file: Path) -> list[str]:
    """Tokens of ``train_file`` plus eos (and unk), by descending count; ties keep first appearance."""
    counts: Counter[str] = Counter()
    for line in read_lines(train_file):
        counts.update(line.split())
        counts[EOS] += 1
    if len(counts) <= 1:
        raise DataError(f"{train_file} has no tokens: the train split needs text")
    counts.setdefault(UNK, 0)
    return [tok for tok, _ in sorted(counts.items(), key=lambda kv: -kv[1])]


def char_vocab(train_file: Path) -> list[str]:
    """Bytes of ``train_file`` plus eos and unk, by descending count; ties by byte value."""
    data = np.fromfile(train_file, dtype=np.uint8)
    counts = np.bincount(data, minlength=256)
    n_eos = int(counts[ord("\n")]) + int(len(data) > 0 and data[-1] != ord("\n"))
    counts[ord("\n")] = 0
    if not counts.any():
        raise DataError(f"{train_file} has no tokens: the train split needs text")
    entries = [(EOS, n_eos), (UNK, 0)] + [(str(b), int(counts[b])) for b in range(256) if counts[b]]
    return [tok for tok, _ in sorted(entries, key=lambda kv: -kv[1])]


def _write_vocab(path: Path, tokens: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(tok + "\n" for tok in tokens)


def _build_once(target: Path, filename: str, build: Callable[[Path], None]) -> None:
    """Run ``build`` in a temporary directory beside ``target``, then rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")  # mkdir, unlike mkdtemp, keeps umask modes
    tmp.mkdir()
    try:
        build(tmp)
        write_checksum(tmp / filename)
        if target.exists() and not (target / filename).is_file():
            shutil.rmtree(target)  # left incomplete by hand: rebuild it
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / filename).is_file():  # otherwise another process finished first: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tokenizer(cfg: DataConfig, corpus_dir: Path, cache_dir: Path) -> Tokenizer:
    """Load the tokenizer for ``corpus_dir/train.txt`` and ``cfg`` from the cache, training it first
    if absent. Word and char vocabularies are decided by the corpus (``cfg.vocab_size`` is ignored)."""
    train_file = Path(corpus_dir) / "train.txt"
    root = Path(cache_dir) / "tokenizers"
    corpus_sha256 = file_digest(train_file)
    key = corpus_sha256[:16]
    cls: type[Tokenizer]
    build: Callable[[Path], None]
    if cfg.tokenizer == "sentencepiece":
        cls, filename = SentencePieceTokenizer, "spm.model"
        target = root / f"{key}-sentencepiece-unigram-{cfg.vocab_size}"

        def build(tmp: Path) -> None:
            train_sentencepiece(train_file, tmp / "spm", cfg.vocab_size, "unigram")
            (tmp / "spm.vocab").unlink(missing_ok=True)
    elif cfg.tokenizer in ("word", "char"):
        target, filename = root / f"{key}-{cfg.tokenizer}", "vocab.txt"
        cls, make_vocab = (WordTokenizer, word_vocab) if cfg.tokenizer == "word" else (CharTokenizer, char_vocab)

        def build(tmp: Path) -> None:
            _write_vocab(tmp / "vocab.txt", make_vocab(train_file))
    else:
        raise TokenizerError(f"unknown data.tokenizer {cfg.tokenizer!r}; choose sentencepiece, word or char")
    if (target / filename).is_file():
        try:
            damaged = checksum_mismatch(target / filename)
            if damaged is not None:
                raise TokenizerError(damaged)
            tokenizer = cls(target / filename, from_cache=True)
            if cls is SentencePieceTokenizer and tokenizer.vocab_size != cfg.vocab_size:
                raise TokenizerError(f"it has {tokenizer.vocab_size} pieces, not {cfg.vocab_size}")
            tokenizer.corpus_sha256 = corpus_sha256
            return tokenizer
        except Exception as e:  # whatever a damaged file raises, the remedy is a rebuild
            if lacks_memory(e):
                raise
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            print(f"parnas: note: the cached tokenizer {target} is damaged ({reason}); building it again",
                  file=sys.stderr)
            discard(target)
    elif cls is SentencePieceTokenizer and train_file.stat().st_size > SAY_TRAINING_OVER:  # said, not sat through
        print(f"parnas: training a {cfg.vocab_size:,}-piece SentencePiece tokenizer on {train_file} (once: cached "
              f"under {root})", file=sys.stderr, flush=True)
    _build_once(target, filename, build)
    tokenizer = cls(target / filename, from_cache=False)
    tokenizer.corpus_sha256 = corpus_sha256
    return tokenizer


def discard(target: Path) -> None:
    """Remove a damaged cache entry: renamed aside first (atomic), so no reader sees it half-deleted."""
    aside = target.with_name(f".{target.name}.damaged-{uuid.uuid4().hex[:12]}.tmp")
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(aside, ignore_errors=True)

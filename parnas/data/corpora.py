"""Corpora, token ids and context batching.

A corpus is a directory holding ``train.txt``, ``valid.txt`` and ``test.txt``, found by :func:`resolve_corpus`
(the known public ones downloaded into the cache and checked against a published checksum). Token ids are
encoded once per split and tokenizer and cached as checked int32 ``.npy`` (:func:`load_splits`).
:class:`ContextBatches` walks a split as B contiguous streams, which lets Transformer-XL carry its memory.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from urllib.error import HTTPError

import numpy as np
import torch
from tqdm import tqdm

from parnas import reading
from parnas.config import DataConfig
from parnas.data.tokenizer import Tokenizer, build_tokenizer, file_digest
from parnas.errors import DataError, ParnasError
from parnas.files import checksum_mismatch, lacks_memory, write_atomic, write_checksum, write_json_atomic

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class DatasetSpec:
    """A public corpus parnas can download: ``checksum`` (``"<hashlib algorithm>:<hex digest>"``) and ``size`` of
    the archive; ``layout`` ``"wikitext"`` (members ``wiki.{split}.tokens``) or ``"bytes"`` (one file cut at
    ``split_bytes``, the rest test); ``files_sha256`` optionally pins the splits. A checksum mismatch is final:
    mirrors are only tried when a download fails."""

    url: str
    checksum: str
    size: int
    layout: str
    split_bytes: tuple[int, int] = (90_000_000, 5_000_000)
    files_sha256: tuple[tuple[str, str], ...] = ()
    mirrors: tuple[str, ...] = ()  # tried in order when ``url`` cannot be downloaded


# Checksums are published ones, never computed here from an unverified download:
# - wikitext-2/-103 zips: sha256 and size from huggingface/datasets datasets/wikitext/dataset_infos.json,
#   recorded for the original s3 research.metamind.io URLs; dellison/WikiText.jl src/WikiText.jl pins the
#   same sha256. wikitext.smerity.com (the author's current host) is assumed to serve the same bytes: this
#   could not be checked offline, and a different file fails verification rather than being used.
# - WikiText-2's extracted files: sha256 of the files in the published zip above; those files also match
#   the sha1 that dmlc/gluon-nlp (gluonnlp/data/language_model.py) pins for wiki.{train,valid,test}.tokens.
# - enwik8.zip: sha256 and size from huggingface/datasets datasets/enwik8/dataset_infos.json.
# - text8.zip: no published sha256 found; sha1 from dmlc/gluon-nlp scripts/word_embeddings/data.py
#   (downloaded from mattmahoney.net/dc/text8.zip), size 31,344,016 from TensorFlow's word2vec tutorial.
DATASETS: Mapping[str, DatasetSpec] = MappingProxyType({
    "wikitext-2": DatasetSpec(
        "https://wikitext.smerity.com/wikitext-2-v1.zip",
        "sha256:92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c", 4_475_746, "wikitext",
        files_sha256=(("train", "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f"),
                      ("valid", "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
                      ("test", "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0")),
        mirrors=("https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",)),
    "wikitext-103": DatasetSpec(
        "https://wikitext.smerity.com/wikitext-103-v1.zip",
        "sha256:242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590", 190_229_076, "wikitext",
        mirrors=("https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",)),
    "enwik8": DatasetSpec(
        "http://mattmahoney.net/dc/enwik8.zip",
        "sha256:547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc", 36_445_475, "bytes"),
    "text8": DatasetSpec(
        "http://mattmahoney.net/dc/text8.zip",
        "sha1:6c70299b93b7e1f927b42cd8f6ac1a31547c7a2e", 31_344_016, "bytes"),
})


def default_cache_dir() -> Path:
    """``$PARNAS_CACHE_DIR``, else ``~/.cache/parnas``; refused in one line (DataError) when it cannot be a folder
    this user writes: a file (``/dev/null``), a path under a file, a folder it may not write, a name too long.
    Nothing is created here: the first write makes the folder."""
    cache = Path(os.environ.get("PARNAS_CACHE_DIR") or "~/.cache/parnas").expanduser()
    named = f"PARNAS_CACHE_DIR={cache}" if os.environ.get("PARNAS_CACHE_DIR") else f"the cache folder {cache}"
    fix = "set PARNAS_CACHE_DIR to a folder this user may write"
    if any(len(os.fsencode(part)) > 255 for part in cache.parts) or len(os.fsencode(str(cache))) > 3900:
        raise DataError(f"{named}: the name is too long for a folder; {fix}")
    existing = next(p for p in (cache, *cache.parents) if os.path.lexists(p))
    if not existing.is_dir():
        where = "is not a folder" if existing == cache else f"is under {existing}, which is not a folder"
        raise DataError(f"{named} {where}; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is a folder" if existing == cache else f"would be made in {existing}, a folder"
        raise DataError(f"{named} {where} this user may not write; {fix}")
    return cache


def _is_corpus(folder: Path, *, required: bool = False) -> bool:
    """Whether ``folder`` holds all three splits; a partial or empty corpus is an error, not a miss."""
    files = [reading.check_regular(folder / f"{split}.txt", f"corpus file {folder / f'{split}.txt'}")
             for split in SPLITS]  # a FIFO or a device there is named as such, never opened
    present = [f for f in files if f.is_file()]
    if not present and not required:
        return False
    missing = [f.name for f in files if f not in present]
    if missing:
        raise DataError(f"corpus {folder} lacks {', '.join(missing)}: a corpus directory holds train.txt, "
                        "valid.txt and test.txt")
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"corpus file {f} is empty: every split needs text")
    return True


def resolve_corpus(dataset: str, path: str | Path | None = None, *, cache_dir: Path | None = None,
                   registry: Mapping[str, DatasetSpec] | None = None) -> Path:
    """The directory holding ``dataset``'s train.txt, valid.txt and test.txt: an explicit ``path`` (any text
    corpus), else ``$PARNAS_DATA_DIR/<dataset>/`` (remembered in the cache; a ``$PARNAS_DATA_DIR`` that is not a
    folder is an error, not a reason to look elsewhere), ``<cache_dir>/<dataset>/``, the folder remembered from an
    earlier ``$PARNAS_DATA_DIR``, and last a download into ``<cache_dir>/<dataset>/`` from ``registry``."""
    if path is not None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise DataError(f"data.path {folder} is not a directory; it must hold train.txt, valid.txt and test.txt")
        _is_corpus(folder, required=True)
        return folder
    looked = []
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if os.environ.get("PARNAS_DATA_DIR"):
        data_dir = Path(os.environ["PARNAS_DATA_DIR"]).expanduser().absolute()
        if not data_dir.is_dir():  # a typo: never replaced by another corpus found elsewhere
            raise DataError(f"PARNAS_DATA_DIR={os.environ['PARNAS_DATA_DIR']} is not a folder: point it at the folder "
                            f"that holds {dataset}/, or unset it")
        folder = data_dir / dataset
        if _is_corpus(folder):
            _remember(cache, dataset, folder)
            return folder
        looked.append(str(folder))
    dest = cache / dataset
    if _is_corpus(dest):
        return dest
    looked.append(str(dest))
    remembered = _remembered(cache).get(dataset)
    if remembered:
        if _is_corpus(Path(remembered)):
            return Path(remembered)
        looked.append(f"{remembered} (remembered in {cache / LOCATIONS})")
    registry = DATASETS if registry is None else registry
    failed = f"corpus {dataset!r} not found (looked in {', '.join(looked)})"
    where = (f"put train.txt, valid.txt and test.txt in {dest} (or in $PARNAS_DATA_DIR/{dataset}, "
             "or point data.path at a directory holding them)")
    if dataset not in registry:
        raise DataError(f"{failed} and parnas can only download {', '.join(sorted(registry))}; {where}")
    _download(dataset, registry[dataset], dest, failed=failed, where=where)
    return dest


LOCATIONS = "corpora.json"  # in the cache: dataset -> the folder $PARNAS_DATA_DIR pointed to


def _remembered(cache: Path) -> dict[str, str]:
    try:
        found = json.loads((cache / LOCATIONS).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: the next find writes it again
    return {k: v for k, v in found.items() if isinstance(v, str)} if isinstance(found, dict) else {}


def _remember(cache: Path, dataset: str, folder: Path) -> None:
    """Note where ``dataset`` was found; a cache that cannot be written only loses the convenience."""
    known = _remembered(cache)
    if known.get(dataset) != str(folder):
        try:
            write_json_atomic(cache / LOCATIONS, {**known, dataset: str(folder)})
        except ParnasError:
            pass


def _download(name: str, spec: DatasetSpec, dest: Path, *, failed: str, where: str) -> None:
    """Fetch, verify and unpack ``spec`` into ``dest``; all work happens in a temporary directory
    beside ``dest`` that is renamed into place at the end, or removed on any failure."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.download-", dir=dest.parent))
    except OSError as e:
        raise DataError(f"{failed} and the cache {dest.parent} is not writable ({e.strerror}); set PARNAS_CACHE_DIR "
                        f"to a writable directory, or {where}") from None
    try:
        archive = tmp / "archive"
        url = _fetch_any((spec.url, *spec.mirrors), archive, name, failed=failed, where=where)
        size = archive.stat().st_size
        if size != spec.size:
            raise DataError(f"{url} gave {size:,} bytes, expected {spec.size:,}: the download is incomplete "
                            f"or the file changed, so it was removed; retry, or {where}")
        algorithm, expected = spec.checksum.split(":", 1)
        got = file_digest(archive, algorithm)
        if got != expected:
            raise DataError(f"{url} has {algorithm} {got}, expected {expected}: the download is corrupt "
                            f"or the file changed, so it was removed; retry, or {where}")
        out = tmp / name
        out.mkdir()
        try:
            with zipfile.ZipFile(archive) as zf:
                _unpack(zf, spec, out)
        except zipfile.BadZipFile:
            raise DataError(f"{url} is not a valid zip archive; {where}") from None
        for split, digest in spec.files_sha256:
            if file_digest(out / f"{split}.txt") != digest:
                raise DataError(f"{split}.txt unpacked from {url} does not match its published sha256; {where}")
        _is_corpus(out, required=True)
        try:
            os.rename(out, dest)
        except OSError as e:
            if not _is_corpus(dest):  # otherwise another process finished the same download first
                raise DataError(f"cannot move the unpacked corpus into {dest} ({e.strerror}); {where}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch_any(urls: tuple[str, ...], target: Path, name: str, *, failed: str, where: str) -> str:
    """Download the first of ``urls`` that answers into ``target``; returns that url."""
    errors = []
    for url in urls:
        # Some mirrors (wikitext.smerity.com) refuse urllib's default User-Agent with a 403.
        request = urllib.request.Request(url, headers={"User-Agent": "Mozilla/5.0 (compatible; parnas)"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response, open(target, "wb") as f:
                total = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {name}", disable=None,
                          leave=False) as bar:
                    while block := response.read(1 << 20):
                        bar.update(f.write(block))
            return url
        except (OSError, ValueError) as e:
            reason = " ".join(str(e if isinstance(e, HTTPError) else getattr(e, "reason", None) or e).split())
            errors.append(f"{url}: {reason}")
    raise DataError(f"{failed} and downloading it failed ({'; '.join(errors)}); {where}")


def _unpack(zf: zipfile.ZipFile, spec: DatasetSpec, out: Path) -> None:
    members = [m for m in zf.infolist() if not m.is_dir()]
    if spec.layout == "wikitext":
        by_name = {Path(m.filename).name: m for m in members}
        for split in SPLITS:
            member = by_name.get(f"wiki.{split}.tokens")
            if member is None:
                raise DataError(f"{spec.url} lacks wiki.{split}.tokens")
            with zf.open(member) as src, open(out / f"{split}.txt", "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    elif spec.layout == "bytes":
        if len(members) != 1:
            raise DataError(f"{spec.url} should hold one file, not {len(members)}")
        with zf.open(members[0]) as src:
            for split, n in zip(SPLITS, (*spec.split_bytes, -1), strict=True):
                (out / f"{split}.txt").write_bytes(src.read(n))  # -1: the rest
    else:
        raise DataError(f"unknown corpus layout {spec.layout!r}")


# --- token ids ------------------------------------------------------------------------------------

def load_splits(cfg: DataConfig, *, cache_dir: Path | None = None) -> tuple[Tokenizer, dict[str, np.ndarray]]:
    """The tokenizer and the int32 token ids of each split (read-only memory maps), cached by the split file's
    sha256 in the tokenizer's directory, so editing a split file re-encodes it and nothing else."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = resolve_corpus(cfg.dataset, cfg.path, cache_dir=cache)
    tokenizer = build_tokenizer(cfg, corpus, cache)
    splits = {split: _token_ids(tokenizer, corpus / f"{split}.txt") for split in SPLITS}
    if not np.any(splits["train"] != tokenizer.eos_id):
        raise DataError(f"the train split of {corpus} has no tokens, only empty lines")
    return tokenizer, splits


def _cached_ids(cached: Path, vocab_size: int) -> np.ndarray:
    """The ids in ``cached``, checked: the bytes recorded when it was made (:func:`parnas.files.checksum_mismatch`),
    a 1-D int32 array with every id inside the vocabulary."""
    damaged = checksum_mismatch(cached)
    if damaged is not None:
        raise ValueError(damaged)
    ids = np.load(cached, mmap_mode="r")
    if ids.ndim != 1 or ids.dtype != np.int32:
        raise ValueError(f"it holds a {ids.dtype} array of shape {ids.shape}, not 1-D int32 ids")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"it holds ids outside the vocabulary of {vocab_size} "
                         f"(from {int(ids.min())} to {int(ids.max())})")
    return ids


def _token_ids(tokenizer: Tokenizer, text_file: Path) -> np.ndarray:
    cached = tokenizer.path.parent / f"{text_file.stem}-{file_digest(text_file)[:16]}.npy"
    if cached.is_file():
        try:
            return _cached_ids(cached, tokenizer.vocab_size)
        except (ValueError, OSError, EOFError, pickle.UnpicklingError) as e:
            if lacks_memory(e):
                raise
            reason = " ".join(str(e).split())[:160] or type(e).__name__
            print(f"parnas: note: the cached token ids {cached} are damaged ({reason}); encoding them again",
                  file=sys.stderr)
    ids = tokenizer.encode_file(text_file).astype(np.int32, copy=False)
    write_atomic(cached, lambda f: np.save(f, ids), "wb")
    write_checksum(cached)
    return np.load(cached, mmap_mode="r")


# --- context batching -----------------------------------------------------------------------------

class ContextBatches(torch.utils.data.Dataset):
    """Segment ``t`` of a split cut into ``batch_size`` contiguous streams: ``(x, y)``, ``x = streams[:, t*L:(t+1)*L]``
    and ``y`` shifted by one, int64 (B/world_size, L). Row i of segment t+1 continues row i of segment t, so memory
    carries over: never shuffle. With ``drop_last`` (training) only full segments; without it a last, shorter one
    makes every token but a stream's first a target. ``n_predicted`` counts targets over all ranks, ``tail_tokens``
    the split's other tokens. Rank r of W owns streams [r*B/W, (r+1)*B/W); each item reads only its own slice."""

    def __init__(self, ids: np.ndarray, batch_size: int, seg_len: int, *, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True) -> None:
        if seg_len <= 0 or batch_size <= 0:
            raise DataError(f"batch size and segment length must be > 0, got {batch_size} and {seg_len}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not one of {world_size} processes")
        if batch_size % world_size:
            raise DataError(f"batch size {batch_size} does not split evenly over {world_size} processes; "
                            f"use a multiple of {world_size}")
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise DataError(f"token ids must be one-dimensional, got shape {ids.shape}")
        self.n_streams, self.seg_len, self.drop_last = batch_size, seg_len, drop_last
        self.stream_len = len(ids) // batch_size
        targets = max(self.stream_len - 1, 0)  # per stream: every token but the first
        self.n_segments = targets // seg_len if drop_last else math.ceil(targets / seg_len)
        if self.n_segments == 0:
            need = batch_size * (seg_len + 1 if drop_last else 2)
            raise DataError(f"a split of {len(ids):,} tokens is too short for one segment of {batch_size} streams "
                            f"x {seg_len} tokens (needs {need:,}); use a smaller batch size or segment length")
        self.n_predicted = batch_size * (self.n_segments * seg_len if drop_last else targets)
        self.tail_tokens = len(ids) - self.n_predicted
        local = batch_size // world_size
        self.n_local_streams = local
        self.streams = ids[:batch_size * self.stream_len].reshape(batch_size, self.stream_len)[
            rank * local:(rank + 1) * local]

    def __len__(self) -> int:
        return self.n_segments

    def __getitem__(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= t < self.n_segments:
            raise IndexError(f"segment {t} of {self.n_segments}")
        start = t * self.seg_len
        end = min(start + self.seg_len, self.stream_len - 1)
        x = self.streams[:, start:end].astype(np.int64)
        y = self.streams[:, start + 1:end + 1].astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[t] for t in range(self.n_segments))

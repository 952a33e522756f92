"""Checkpoints parnas writes, and the only way it reads them back.

A checkpoint is Lightning's dict plus a ``parnas`` section (config, architecture record, the tokenizer's file,
data position and training memory, a sha256 of the weights and, written last, of everything else), so an edit
anywhere is caught. Every value is a tensor or plain data: it loads with ``weights_only=True`` and can never run
code. :func:`load` is the single reader; anything wrong with the file is one :class:`CheckpointError` line.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from parnas import architecture, kinds
from parnas.config import Config
from parnas.errors import ParnasError
from parnas.files import write_atomic
from parnas.overrides import from_dict

FORMAT, VERSION = "parnas.checkpoint", 2


class CheckpointError(ParnasError):
    """A checkpoint that is missing, damaged, edited or not parnas'."""


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of every tensor, in key order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def content_digest(checkpoint: Mapping[str, Any]) -> str:
    """sha256 over the whole checkpoint but ``parnas.content_sha256`` itself: every key, tensor
    (name, dtype, shape, bytes) and plain value, mappings in sorted key order."""
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            digest.update(f"T|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            digest.update(f"M{len(value)}|".encode())
            for key in sorted(value, key=lambda k: (type(k).__name__, str(k))):
                digest.update(f"{type(key).__name__}:{key!s}=".encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            digest.update(f"{type(value).__name__}{len(value)}|".encode())
            for item in value:
                feed(item)
        else:  # None, bool, int, float, str, torch.Size, ...: their repr is exact
            digest.update(f"{type(value).__name__}:{value!r}|".encode())

    if isinstance(checkpoint.get("parnas"), Mapping):
        meta = {k: v for k, v in checkpoint["parnas"].items() if k != "content_sha256"}
        checkpoint = {**checkpoint, "parnas": meta}
    feed(checkpoint)
    return digest.hexdigest()


def save(checkpoint: Mapping[str, Any], path: str | Path) -> Path:
    """``torch.save`` to a temp file beside ``path``, then rename: readers see the old or the new file.
    A parnas checkpoint gets its ``content_sha256`` here, after every hook has added its part."""
    checkpoint = dict(checkpoint)
    if isinstance(checkpoint.get("parnas"), Mapping):
        checkpoint["parnas"] = meta = dict(checkpoint["parnas"])
        meta.pop("content_sha256", None)
        meta["content_sha256"] = content_digest(checkpoint)
    # one writer per run (the run holds its folder), so any temp file beside it is stale
    return write_atomic(path, lambda f: torch.save(checkpoint, f), "wb", stale_after=0, size=tensor_bytes(checkpoint))


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (mappings and sequences walked): about a checkpoint's size on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def load(path: str | Path) -> dict[str, Any]:
    """Read and check a parnas checkpoint (on the CPU); raises CheckpointError with one line."""
    path = Path(path)
    fix = "use a checkpoint written by parnas (e.g. <run>/checkpoints/last.ckpt)"
    try:
        with warnings.catch_warnings(record=True) as said:  # a refusal below explains the file in its own line
            warnings.simplefilter("always")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory; {fix}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} holds objects other than tensors and plain data ({_unsafe_what(e)}), "
                              f"so it was refused unread; {fix}") from None
    except (RuntimeError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is truncated or not a torch checkpoint ({_first_line(e)}); {fix}") from None
    for w in said:  # read: torch's warnings stand, but its advice about pickle protocols is not the user's to act on
        if "pickle protocol" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return check_contents(checkpoint, str(path))


def check_contents(checkpoint: Any, source: str = "checkpoint") -> dict[str, Any]:
    """The structure parnas relies on, the weights and then everything else against their digests."""
    def fail(message: str) -> None:
        raise CheckpointError(f"{source}: {message}")

    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("parnas"), dict):
        fail("not a parnas checkpoint (no 'parnas' section)")
    meta = checkpoint["parnas"]
    if meta.get("format") != FORMAT:
        fail(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        fail(f"version {meta.get('version')!r} is not supported (this parnas reads version {VERSION})")
    for key, kind in (("config", dict), ("architecture", dict), ("tokenizer", dict), ("weights_sha256", str),
                      ("content_sha256", str)):
        if not isinstance(meta.get(key), kind):
            fail(f"'parnas.{key}' is missing or not a {kind.__name__}")
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail("'state_dict' is missing or holds something other than tensors")
    if weights_digest(state) != meta["weights_sha256"]:
        fail("the weights do not match their recorded sha256: the file was edited or damaged")
    if content_digest(checkpoint) != meta["content_sha256"]:
        fail("its optimiser or training state does not match its recorded sha256: the file was edited or damaged")
    return checkpoint


def fixed_model_record(checkpoint: Mapping[str, Any], source: str) -> tuple[Config, dict[str, Any]]:
    """The config and architecture record of a fixed model's checkpoint (a checked one, :func:`check`);
    CheckpointError for any other, e.g. a search's, whose record names a space, not an architecture."""
    meta = checkpoint["parnas"]
    lacking = _lacking_kinds(meta)
    if lacking:
        raise CheckpointError(f"{source} was trained with block kind(s) {', '.join(lacking)}, which this parnas lacks "
                              f"(a plugin not installed here, or a newer parnas): {kinds.HOW_TO_REGISTER}")
    try:
        return from_dict(Config, meta["config"]), architecture.validate(meta["architecture"], "architecture")
    except ParnasError as e:
        raise CheckpointError(f"{source} is not a fixed model's checkpoint, or its record was edited ({e})") from None


def _lacking_kinds(meta: Mapping[str, Any]) -> list[str]:
    """The kinds a checkpoint's architecture names that no kind here (registered or installed) is."""
    record = meta.get("architecture")
    blocks = record.get("architecture") if isinstance(record, dict) else None
    if not isinstance(blocks, dict):
        return []  # not a fixed model's record: the caller says so
    return sorted({k for k in blocks.values() if isinstance(k, str) and not kinds.is_known(k)})


def _unsafe_what(e: BaseException) -> str:
    """What torch's weights-only unpickler refused, without its advice to load the file unsafely."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    return f"it refers to {found.group(1)}" if found else "something the safe loader does not accept"


def _first_line(e: BaseException) -> str:
    if "weights_only" in str(e):  # torch's advice to load unsafely is never passed on
        return _unsafe_what(e)
    text = " ".join(str(e).strip().splitlines()[:1]) or type(e).__name__
    return text if len(text) < 200 else text[:197] + "..."


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with an atomic writer and :func:`load` as the only reader."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return load(path)

"""Checkpoints parnas writes, and the only way it reads them back.

A checkpoint is Lightning's checkpoint dict (weights, optimiser, scheduler,
loop counters) plus a ``parnas`` section: format and version, the config, the
architecture record, the tokenizer (its file's bytes, so sampling needs no
corpus), the data position and training memory, and a sha256 of the weights.
Every value is a tensor or plain Python data, so it loads with
``torch.load(..., weights_only=True)``: a checkpoint can never run code.

:func:`load` is the single reader (resume, evaluate, generate): a file that is
missing, truncated, holds anything but plain data, or whose weights no longer
match their digest raises :class:`CheckpointError` with one line.
:class:`SafeCheckpointIO` plugs the same reader and an atomic writer into
Lightning.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from parnas.errors import ParnasError

FORMAT, VERSION = "parnas.checkpoint", 1


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


def save(checkpoint: Mapping[str, Any], path: str | Path) -> Path:
    """``torch.save`` to a temp file beside ``path``, then rename: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(checkpoint), f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide checkpoints from the user's group
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read and check a parnas checkpoint (on the CPU); raises CheckpointError with one line."""
    path = Path(path)
    fix = "use a checkpoint written by parnas (e.g. <run>/checkpoints/last.ckpt)"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory; {fix}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except pickle.UnpicklingError as e:
        what = _first_line(e)
        raise CheckpointError(f"{path} holds objects other than tensors and plain data, refused unread "
                              f"({what}); {fix}") from None
    except (RuntimeError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is truncated or not a torch checkpoint ({_first_line(e)}); {fix}") from None
    return check(checkpoint, str(path))


def check(checkpoint: Any, source: str = "checkpoint") -> dict[str, Any]:
    """The structure parnas relies on, and the weights against their digest."""
    def fail(message: str) -> None:
        raise CheckpointError(f"{source}: {message}")

    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("parnas"), dict):
        fail("not a parnas checkpoint (no 'parnas' section)")
    meta = checkpoint["parnas"]
    if meta.get("format") != FORMAT:
        fail(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        fail(f"version {meta.get('version')!r} is not supported (this parnas reads version {VERSION})")
    for key, kind in (("config", dict), ("architecture", dict), ("tokenizer", dict), ("weights_sha256", str)):
        if not isinstance(meta.get(key), kind):
            fail(f"'parnas.{key}' is missing or not a {kind.__name__}")
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail("'state_dict' is missing or holds something other than tensors")
    if weights_digest(state) != meta["weights_sha256"]:
        fail("the weights do not match their recorded sha256: the file was edited or damaged")
    return checkpoint


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).strip().splitlines()[:1]) or type(e).__name__
    return text if len(text) < 200 else text[:197] + "..."


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with an atomic writer and :func:`load` as the only reader."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return load(path)

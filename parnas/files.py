"""Files a user keeps, and the folders they go into.

Files are written atomically (a temp file in the same folder, then rename) with the
permissions any new file of the user's gets (``0o666`` less the umask, not ``mkstemp``'s
0600). Output folders are checked before the work that fills them
(:func:`check_writable_dir`), so a folder that cannot be created fails in one line at the
start, not with a traceback at the end.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from parnas.errors import ParnasError

STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a process that died while writing


def current_umask() -> int:
    """The process umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _folder_error(folder: Path, e: OSError) -> ParnasError:
    reason = e.strerror or type(e).__name__
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        reason = "a file is in the way" if folder.exists() and not folder.is_dir() else "a parent is a file"
    return ParnasError(f"cannot write to {folder}: {reason}; choose another output folder")


def check_writable_dir(folder: str | Path) -> Path:
    """Raise ParnasError (one line) unless ``folder`` is, or can be made, a folder this process can write.

    Leaves the file system as it found it: folders created to find out are removed again,
    so a run that fails a later check leaves no empty output folder behind."""
    folder = Path(folder)
    missing = []  # folders this check creates, deepest last
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        for made in reversed(missing):
            made.mkdir()
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".parnas-write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise _folder_error(folder, e) from None
    finally:
        for made in missing:  # deepest first
            try:
                made.rmdir()
            except OSError:
                pass
    return folder


def ensure_writable_dir(folder: str | Path) -> Path:
    """``folder``, created if absent; ParnasError (one line) if it cannot be created or written."""
    folder = check_writable_dir(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _folder_error(folder, e) from None
    return folder


def remove_stale_temps(folder: Path, name: str, older_than: float = STALE_TEMP_SECONDS) -> None:
    """Delete ``.<name>.*.tmp`` files in ``folder`` that no writer has touched for ``older_than``
    seconds: what a process killed in the middle of an atomic write leaves behind."""
    cutoff = time.time() - older_than
    for tmp in Path(folder).glob(f".{name}.*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except OSError:
            pass  # another process removed or renamed it


def write_atomic(path: str | Path, write: Callable[[IO[Any]], None], mode: str = "w", *,
                 stale_after: float = STALE_TEMP_SECONDS) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, then rename it to ``path``: readers see the
    old file or the new one, never half of it. A failure to write raises ParnasError (one line).
    Temp files of ``path`` older than ``stale_after`` seconds (left by a killed writer) are removed;
    0 suits a file only one process writes, such as a run's checkpoint."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, path.name, stale_after)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise ParnasError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would hide the file from the user's group
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ParnasError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_atomic`)."""
    return write_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_run_dir(out_dir: str | Path, resume: bool) -> Path:
    """Before a training run touches ``out_dir``: it can be written, and it holds no earlier run's
    checkpoint or metrics unless the run resumes (which needs the checkpoint)."""
    out = check_writable_dir(out_dir)
    last = out / "checkpoints" / "last.ckpt"
    if resume:
        if not last.is_file():
            raise ParnasError(f"nothing to resume: no checkpoint at {last}; run without --resume to start")
    elif last.exists() or (out / "metrics.json").exists():
        raise ParnasError(f"{out} already holds a run: pass --resume to continue it, "
                          "or choose a new output folder (train.out_dir, --out)")
    return out

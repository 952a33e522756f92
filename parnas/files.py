"""Files a user keeps, and the folders they go into.

Files are written atomically (temp file, fsync, rename) with a new file's usual permissions (``0o666`` less the
umask); a full disk fails in one line and leaves the previous file whole. Output folders are checked before the
work that fills them (:func:`check_writable_dir`). A run's own folder is :mod:`parnas.owned_folders`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from parnas import reading
from parnas.errors import ParnasError

STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a process that died while writing


def current_umask() -> int:
    """The process umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def folder_error(folder: Path, e: OSError) -> ParnasError:
    """One line for a folder that cannot be made or written: why, and to choose another."""
    reason = e.strerror or type(e).__name__
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        reason = "a file is in the way" if folder.exists() and not folder.is_dir() else "a parent is a file"
    return ParnasError(f"cannot write to {folder}: {reason}; choose another output folder")


def check_not_link(folder: str | Path) -> Path:
    """Raise ParnasError (one line) if ``folder`` is a symbolic link or exists and is not a folder: parnas writes
    through no link (what it points to is not the run's), and a file where a folder goes would fail only once the
    run had done its work. Creates nothing."""
    folder = Path(folder)
    if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
        raise ParnasError(f"cannot write to {folder}: it is {reading.kind_of(folder)}, not a folder parnas writes "
                          "into; remove it, or choose another output folder")
    return folder


def check_file_folder(file: str | Path) -> Path:
    """:func:`check_writable_dir` for the folder a file is written into. That folder is the user's to name, link or
    not (``/tmp`` is one on macOS); the file itself is written atomically, so a link at its own name is replaced,
    never written through."""
    return check_writable_dir(Path(file).parent.resolve())


def check_writable_dir(folder: str | Path) -> Path:
    """Raise ParnasError (one line) unless ``folder`` is, or can be made, a folder this process can write: not a
    symbolic link nor a file (:func:`check_not_link`), the one check every folder a command writes gets.

    Leaves the file system as it found it: folders created to find out are removed again,
    so a run that fails a later check leaves no empty output folder behind."""
    folder = check_not_link(folder)
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
        raise folder_error(folder, e) from None
    finally:
        for made in missing:  # deepest first
            try:
                made.rmdir()
            except OSError:
                pass
    return folder


def ensure_writable_dir(folder: str | Path) -> Path:
    """``folder``, created if absent; ParnasError (one line) if it cannot be created or written, or is a link or a
    file (:func:`check_writable_dir`)."""
    folder = check_writable_dir(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise folder_error(folder, e) from None
    return check_not_link(folder)  # made by another meanwhile: still no link


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


def os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e``: ``e`` itself or one it was raised from or while handling (``torch.save``
    turns a failed write into a RuntimeError about the zip file's position)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def lacks_memory(e: BaseException) -> bool:
    """Whether reading a cached file failed for want of memory (``MemoryError``, or a map refused with ``ENOMEM``):
    not damage, so a cache reader lets it go to the memory refusal instead of building the file again."""
    return isinstance(e, MemoryError) or isinstance(e, OSError) and e.errno == errno.ENOMEM


def out_of_space(e: BaseException, path: str | Path | None = None, size: int | None = None) -> ParnasError | None:
    """One line for a write that failed because the disk or the user's quota is full, else None: the file, the
    bytes it needs (``size``, where known) and those free beside it."""
    error = os_error(e)
    if error is None or error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    named = path or error.filename
    need = f"it needs about {_size(size)}, " if size else ""
    free, kept = need.removesuffix(", "), ""
    if named:  # else a write to a descriptor: the disk is unknown, so no free space is claimed for it
        path = Path(named)
        try:
            stat = os.statvfs(next(p for p in (path.parent, *path.parents) if p.exists()))
            free = f"{need}{_size(stat.f_bavail * stat.f_frsize)} free there"
        except (OSError, StopIteration):
            pass
        kept = f"; the previous {path.name} is unchanged" if path.is_file() else ""
    return ParnasError(f"cannot write {named or 'a file'}: {error.strerror or 'no space left on device'}"
                       f"{f' ({free})' if free else ''}{kept}; free some space or choose another output folder")


def _size(n: int) -> str:
    if n < 10_000:
        return f"{n:,} bytes"
    return f"{n / 1e3:,.0f} kB" if n < 10**7 else f"{n / 1e6:,.1f} MB" if n < 10**10 else f"{n / 1e9:,.1f} GB"


def write_atomic(path: str | Path, write: Callable[[IO[Any]], None], mode: str = "w", *,
                 stale_after: float = STALE_TEMP_SECONDS, size: int | None = None) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, flush it to the disk, then rename it to ``path``:
    readers see the old file or the new one, never half of it, even after a power cut. A failure to write
    raises ParnasError (one line; for a full disk with ``size``, the bytes needed, and the bytes free).
    Temp files of ``path`` older than ``stale_after`` seconds (left by a killed writer) are removed;
    0 suits a file only one process writes, such as a run's checkpoint."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, path.name, stale_after)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise out_of_space(e, path, size) or ParnasError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on the disk before the name points to it
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would hide the file from the user's group
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        full = out_of_space(e, path, size)
        if full is not None:
            raise full from None
        if isinstance(e, OSError):
            raise ParnasError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to the disk; best effort: not every file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_atomic`)."""
    return write_atomic(path, lambda f: f.write(text))


def copy_atomic(source: str | Path, path: str | Path) -> Path:
    """Copy ``source`` to ``path`` atomically (see :func:`write_atomic`): a link already at ``path`` is replaced,
    never written through."""
    with open(source, "rb") as src:
        return write_atomic(path, lambda f: shutil.copyfileobj(src, f), "wb")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


CHECKSUM_SUFFIX = ".blake2b"  # beside a cached file: the hash of its bytes, written when the file was made


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """The hex digest of the file's bytes, read in blocks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksum(path: str | Path) -> Path:
    """Record the hash of ``path``'s bytes beside it (``<name>.blake2b``), for :func:`checksum_mismatch` to verify
    when the file is read again: a cache entry damaged at the same size (its bytes zeroed) is found so."""
    path = Path(path)
    return write_text_atomic(path.with_name(path.name + CHECKSUM_SUFFIX), file_digest(path, "blake2b") + "\n")


def checksum_mismatch(path: str | Path) -> str | None:
    """Why ``path``'s bytes are not those :func:`write_checksum` recorded (no record, or another hash), else None."""
    path = Path(path)
    try:
        recorded = path.with_name(path.name + CHECKSUM_SUFFIX).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return "no checksum was recorded with it"
    if file_digest(path, "blake2b") != recorded:
        return "its bytes do not match the checksum recorded when it was made"
    return None


def resume_source(out_dir: str | Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint a run continues from: None without ``--resume``, ``<out_dir>/checkpoints/last.ckpt``
    with a plain ``--resume``, the path given with ``--resume=PATH``."""
    if not resume:
        return None
    return Path(out_dir) / "checkpoints" / "last.ckpt" if resume is True else Path(resume)

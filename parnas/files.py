"""Files a user keeps, and the folders they go into.

Files are written atomically (a temp file in the same folder, flushed to the disk, then renamed)
with the permissions any new file of the user's gets (``0o666`` less the umask, not ``mkstemp``'s
0600); a disk that fills up fails in one line and leaves the previous file whole. Output folders
are checked before the work that fills them (:func:`check_writable_dir`), so a folder that cannot
be created fails in one line at the start, not with a traceback at the end.

One run writes a folder at a time: :func:`hold_run_dir` takes an exclusive OS lock (``flock``) on
``<folder>/.parnas.lock`` for as long as a run writes there. The kernel drops it when the process
ends, however it ends, so a killed run never leaves the folder locked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def resume_source(out_dir: str | Path, resume: bool | str | Path) -> Path | None:
    """The checkpoint a run continues from: None without ``--resume``, ``<out_dir>/checkpoints/last.ckpt``
    with a plain ``--resume``, the path given with ``--resume=PATH``."""
    if not resume:
        return None
    return Path(out_dir) / "checkpoints" / "last.ckpt" if resume is True else Path(resume)


def check_run_dir(out_dir: str | Path, resume: bool | str | Path) -> Path:
    """Before a training run touches ``out_dir``: no other run writes it (:func:`check_not_held`), it can be
    written, and it holds no earlier run's checkpoint or metrics unless the run resumes (which needs the
    checkpoint: ``last.ckpt``, or the one ``--resume=PATH`` names)."""
    out = check_writable_dir(out_dir)
    check_not_held(out)
    last = out / "checkpoints" / "last.ckpt"
    source = resume_source(out, resume)
    if source is not None:
        if not source.is_file():
            others = sorted(str(p) for p in last.parent.glob("*.ckpt")) if source == last else []
            hint = (f"; other checkpoints are there: resume from one with --resume=PATH ({', '.join(others)})"
                    if others else "; run without --resume to start")
            raise ParnasError(f"nothing to resume: no checkpoint at {source}{hint}")
    elif last.exists() or (out / "metrics.json").exists():
        raise ParnasError(f"{out} already holds a run: pass --resume to continue it, "
                          "or choose a new output folder (train.out_dir, --out)")
    return out


# --- one run per folder ---------------------------------------------------------------------------------

LOCK_FILE = ".parnas.lock"
# Set by launchers in the processes they start for ranks other than 0 (Lightning's DDP, torchrun, SLURM, the
# other nodes): the run's rank 0 holds its folder, so these neither take the lock nor refuse the folder.
RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "SLURM_PROCID")


def launched_as_other_rank() -> bool:
    """Whether this process is a rank other than 0 of a distributed run (see ``RANK_VARIABLES``)."""
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in RANK_VARIABLES)


def _in_use(folder: Path, pid: int | None) -> ParnasError:
    who = f"process {pid}" if pid else "another process"
    stop = f"stop it (kill {pid})" if pid else "stop it"
    return ParnasError(f"{folder} is in use by another parnas run ({who}): wait for it to end or {stop}, "
                       "or choose another output folder")


def _holder(fd: int) -> int | None:
    """The process id a lock file holds (written by its holder once it has the lock), if any."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def check_not_held(folder: str | Path) -> None:
    """Raise ParnasError (one line, naming the process) if another process holds ``folder`` (:func:`hold_run_dir`).
    Creates nothing; a folder this process holds passes."""
    path = Path(folder) / LOCK_FILE
    if launched_as_other_rank():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file: nobody holds the folder (or it cannot be read: the lock will say)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        if pid != os.getpid():
            raise _in_use(Path(folder), pid) from None
    except OSError:
        pass  # a file system without locks: hold_run_dir says so
    finally:
        os.close(fd)


@contextmanager
def hold_run_dir(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder`` (created if absent) for the block: an exclusive ``flock`` on ``<folder>/.parnas.lock``,
    which holds this process's id for the message another run gets. Another process's run into the same folder
    raises ParnasError (one line naming the holder); a block of this process inside another that holds the
    folder passes (a ``parnas search`` command around its search). Folders are locked exactly, not their parents:
    a study holds its folder while its searches and retrains hold their own sub-folders. Ranks other than 0
    (:func:`launched_as_other_rank`) take no lock. On leaving, the lock file goes, and so do the folders this
    made if nothing else was written in them."""
    folder = Path(folder)
    if launched_as_other_rank():
        yield folder
        return
    made = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        made.append(probe)
        probe = probe.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _lock(folder)
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield folder
    finally:
        if fd is not None:
            try:
                os.unlink(folder / LOCK_FILE)  # while still held; a waiting locker sees the file is gone
            except OSError:
                pass
            os.close(fd)
            _remove_empty(made)


def _lock(folder: Path) -> int | None:
    """A descriptor holding ``folder``'s lock; None when this process holds it already, or when the file
    system has no locks (then a warning says the folder is not protected)."""
    path = folder / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise _folder_error(folder, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            if pid == os.getpid():
                return None
            raise _in_use(folder, pid) from None
        except OSError as e:  # e.g. a network file system without flock
            os.close(fd)
            print(f"parnas: warning: cannot lock {folder} ({e.strerror or e}); another run into it would not be "
                  "stopped", file=sys.stderr)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a file its last holder removed meanwhile
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        except FileNotFoundError:
            pass
        except OSError as e:  # a full disk: no room for the process id
            path.unlink(missing_ok=True)
            os.close(fd)
            raise out_of_space(e, path) or _folder_error(folder, e) from None
        os.close(fd)  # locked a removed file: take the new one


def _remove_empty(folders: list[Path]) -> None:
    for made in folders:  # deepest first
        try:
            made.rmdir()
        except OSError:
            return

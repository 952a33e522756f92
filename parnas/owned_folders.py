"""A run's folder: one run writes it at a time, and a run writes and removes only its own files.

:func:`hold_run_dir` takes an exclusive ``flock`` on ``<folder>/.parnas.lock``, which the kernel drops however
the process ends; a lock file parnas did not make (a link, a hard link, another file) is refused, never written
through. :func:`take_run_dir` holds and checks a run's folder once per command. A folder holding another run's
files is that run's: never written into nor removed (:func:`check_no_other_run`, :func:`remove_own_tree`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from parnas.errors import ParnasError
from parnas.files import check_not_link, check_writable_dir, folder_error, out_of_space, resume_source


def check_run_dir(out_dir: str | Path, resume: bool | str | Path, *, results: tuple[str, ...] = ("metrics.json",),
                  setting: str = "train.out_dir, --out", folders: tuple[str, ...] = ()) -> Path:
    """The one run-folder check, before a run touches ``out_dir``: no other run writes it, it can be written, it
    holds no earlier run (``last.ckpt`` or one of ``results``) unless the run resumes (which needs the checkpoint),
    and the sub-folders the run writes in (``RUN_SUBFOLDERS`` and ``folders``) are neither links nor files nor hold
    another run. ``setting`` names where the user chooses another folder. Prefer :func:`take_run_dir`."""
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
    else:
        done = next((name for name in ("checkpoints/last.ckpt", *results) if (out / name).exists()), None)
        if done is not None:
            raise ParnasError(f"{out} already holds a run ({done}): pass --resume to continue it, "
                              f"or choose a new output folder ({setting})")
    for sub in (*RUN_SUBFOLDERS, *folders):
        check_not_link(out / sub)  # a link or a file there: refused now, not once the run has trained
    for sub, what in RUN_SUBFOLDERS.items():
        check_no_other_run(out / sub, what)
    return out


# --- one run per folder ---------------------------------------------------------------------------------

LOCK_FILE = ".parnas.lock"
# Set by launchers in the processes they start for ranks other than 0 (Lightning's DDP, torchrun, SLURM, the
# other nodes): the run's rank 0 holds its folder, so these neither take the lock nor refuse the folder.
RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "SLURM_PROCID")
# The folders this process holds (their real paths, with how deep the holds nest) and those it has also checked
# (take_run_dir): a command holds and checks its folder once, and the library calls inside it do neither again.
_HELD: dict[str, int] = {}
_TAKEN: set[str] = set()


def launched_as_other_rank() -> bool:
    """Whether this process is a rank other than 0 of a distributed run (see ``RANK_VARIABLES``)."""
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in RANK_VARIABLES)


def _key(folder: str | Path) -> str:
    return os.path.realpath(folder)


def _in_use(folder: Path, pid: int | None) -> ParnasError:
    who = f"process {pid}" if pid else "another process"
    stop = f"stop it (kill {pid})" if pid else "stop it"
    return ParnasError(f"{folder} is in use by another parnas run ({who}): wait for it to end or {stop}, "
                       "or choose another output folder")


def _holder(fd: int) -> int | None:
    """The process id a lock file holds (written by its holder once it has the lock), if any."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _not_a_lock(folder: Path, why: str) -> ParnasError:
    return ParnasError(f"cannot hold {folder}: its {LOCK_FILE} {why}, not a lock parnas made; remove it, or choose "
                       "another output folder")


def _open_lock(folder: Path, create: bool) -> tuple[int, bool] | None:
    """A descriptor of ``folder``'s lock file and whether this call created it (then it may be written; one it did not
    create is opened to read only); None if there is none and ``create`` is false. Never follows a symbolic link nor
    keeps anything open but a regular file with one name and at most a process id in it (a link, a hard link, a folder,
    a pipe or another file there is refused in one line), so the lock cannot be pointed at another file."""
    path = folder / LOCK_FILE
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(100):
        if create:
            try:
                return _lock_file(folder, os.open(path, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)), True
            except FileExistsError:
                pass
            except OSError as e:
                raise out_of_space(e, path) or folder_error(folder, e) from None
        try:
            return _lock_file(folder, os.open(path, flags | os.O_RDONLY)), False
        except FileNotFoundError:
            if not create:
                return None
            continue  # removed between the two opens: create it
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _not_a_lock(folder, "is a symbolic link") from None
            if not create and e.errno in (errno.EACCES, errno.EPERM):
                return None  # cannot be read: the lock will say
            raise folder_error(folder, e) from None
    raise ParnasError(f"cannot hold {folder}: its {LOCK_FILE} keeps being replaced; try again")


def _lock_file(folder: Path, fd: int) -> int:
    """``fd`` if it is a lock parnas made (a regular file, one name, empty or a process id), else closed and
    refused."""
    info = os.fstat(fd)
    why = ("is not a regular file" if not stat.S_ISREG(info.st_mode) else
           "has other names (a hard link)" if info.st_nlink > 1 else
           "holds something other than a process id" if info.st_size > 32 or (info.st_size and _holder(fd) is None)
           else None)
    if why is not None:
        os.close(fd)
        raise _not_a_lock(folder, why)
    return fd


def check_not_held(folder: str | Path) -> None:
    """Raise ParnasError (one line, naming the process) if another process holds ``folder`` (:func:`hold_run_dir`),
    or if its lock file is not one parnas made (a link, say). Creates nothing; a folder this process holds passes."""
    if launched_as_other_rank() or _key(folder) in _HELD:
        return
    opened = _open_lock(Path(folder), create=False)
    if opened is None:
        return  # no lock file: nobody holds the folder
    fd, _ = opened
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
    """Hold ``folder`` (created if absent) for the block: an exclusive ``flock`` on its lock file, which holds this
    process's id for the message another process's run gets (ParnasError, one line). A hold inside one of this
    process passes (a ``parnas search`` command around its search); folders are locked exactly, not their
    parents; ranks other than 0 take none. A lock left by a killed run is removed and made afresh, never
    truncated. On leaving, the lock file goes, and so do the folders this made if nothing else was written there."""
    folder, key = Path(folder), _key(folder)
    if launched_as_other_rank() or key in _HELD:
        _HELD[key] = _HELD.get(key, 0) + 1
        try:
            yield folder
        finally:
            _HELD[key] -= 1
            if not _HELD[key]:
                del _HELD[key]
        return
    made = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        made.append(probe)
        probe = probe.parent
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise folder_error(folder, e) from None
        fd = _lock(folder)
    except BaseException:
        _remove_empty(made)
        raise
    _HELD[key] = 1
    try:
        yield folder
    finally:
        del _HELD[key]
        if fd is not None:
            _unlink_if(folder / LOCK_FILE, fd)  # while still held; a waiting locker sees the file is gone
            os.close(fd)
        _remove_empty(made)


@contextmanager
def take_run_dir(out_dir: str | Path, resume: bool | str | Path, *, results: tuple[str, ...] = ("metrics.json",),
                 setting: str = "train.out_dir, --out", folders: tuple[str, ...] = ()) -> Iterator[Path]:
    """A run's folder, held (:func:`hold_run_dir`) and then checked (:func:`check_run_dir`) once for the whole
    command: the command takes it at the top, before torch loads, and the library calls inside it (``train``,
    ``retrain``, a search) find it taken and neither check nor lock again. Holding first means no other run can
    slip in between the check and the work; a refusal leaves nothing (the lock and the folders it made go)."""
    key = _key(out_dir)
    if key in _TAKEN:
        yield Path(out_dir)
        return
    with hold_run_dir(out_dir) as folder:
        check_run_dir(folder, resume, results=results, setting=setting, folders=folders)
        _TAKEN.add(key)
        try:
            yield folder
        finally:
            _TAKEN.discard(key)


def is_taken(out_dir: str | Path) -> bool:
    """Whether this process has taken ``out_dir`` (:func:`take_run_dir`) and is inside that block."""
    return _key(out_dir) in _TAKEN


def _unlink_if(path: Path, fd: int) -> None:
    """Remove ``path`` if it is still the file ``fd`` has open (not a file another put there since)."""
    if _same_file(fd, path):
        with suppress(OSError):
            os.unlink(path)


def _lock(folder: Path) -> int | None:
    """A descriptor holding ``folder``'s lock; None when this process holds it already, or when the file
    system has no locks (then a warning says the folder is not protected)."""
    path = folder / LOCK_FILE
    while True:
        fd, made = _open_lock(folder, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            replaced = not _same_file(fd, path)
            os.close(fd)
            if replaced:
                continue  # its holder replaced or removed it meanwhile: look again
            if pid == os.getpid():
                return None
            raise _in_use(folder, pid) from None
        except OSError as e:  # e.g. a network file system without flock
            if made:
                _unlink_if(path, fd)
            os.close(fd)
            print(f"parnas: warning: cannot lock {folder} ({e.strerror or e}); another run into it would not be "
                  "stopped", file=sys.stderr)
            return None
        if not _same_file(fd, path):  # locked a file its last holder removed meanwhile: take the new one
            os.close(fd)
            continue
        if not made:  # left by a run that ended without removing it (killed): remove it, never truncate it
            _unlink_if(path, fd)
            os.close(fd)
            continue
        try:
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        except OSError as e:  # a full disk: no room for the process id
            _unlink_if(path, fd)
            os.close(fd)
            raise out_of_space(e, path) or folder_error(folder, e) from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except OSError:
        return False


def _remove_empty(folders: list[Path]) -> None:
    for made in folders:  # deepest first
        try:
            made.rmdir()
        except OSError:
            return


# --- another run's files ----------------------------------------------------------------------------------------

# The sub-folders a run writes in, and what it writes there: a folder there that holds another run's files is
# that run's, never this one's to write into or clear.
RUN_SUBFOLDERS = {"tensorboard": "TensorBoard logs", "checkpoints": "checkpoints"}
# What marks a folder as a run's: its lock (live or left by a killed run), its results, its checkpoints.
RUN_MARKS = (LOCK_FILE, "metrics.json", "architecture.json", "history.jsonl", "checkpoints")


def runs_within(folder: str | Path) -> list[tuple[Path, str]]:
    """Every folder at or below ``folder`` that holds a run's files (:data:`RUN_MARKS`), with the first it holds;
    symbolic links are not followed. A run's own ``checkpoints/`` holds checkpoint files, not these."""
    found = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        names = set(files) | set(dirs)
        mark = next((m for m in RUN_MARKS if m in names), None)
        if mark is not None:
            found.append((Path(top), mark))
    return found


def check_no_other_run(folder: str | Path, what: str) -> None:
    """Raise ParnasError (one line) if ``folder``, where this run writes its ``what`` (or which it is about to
    clear), holds another run: a live one is named with its process (:func:`check_not_held`); a finished one, or
    one a kill left behind, is kept, and the line says which folder holds it."""
    found = runs_within(folder)
    for run, _ in found:
        check_not_held(run)
    if found:
        run, mark = found[0]
        raise ParnasError(f"{run} holds another run ({mark}) where this one writes its {what}: it is kept; "
                          "move it elsewhere, or choose another output folder")


def remove_own_tree(folder: str | Path, what: str) -> None:
    """Remove ``folder``, this run's own ``what`` (e.g. stale logs), unless another run is found in it
    (:func:`check_no_other_run`: one line, nothing removed). A symbolic link is removed, not what it points to."""
    if not Path(folder).is_symlink():
        check_no_other_run(folder, what)
    remove_own_runs(folder)


def remove_own_runs(folder: str | Path) -> None:
    """Remove ``folder`` and the runs in it, all made by the command that calls this (a search's final-pick
    retrains, replanned or restarted): a symbolic link is removed, not what it points to; a live run in it (one
    started there by hand, or the same pick in another process) is refused in one line, nothing removed."""
    folder = Path(folder)
    if folder.is_symlink():
        folder.unlink()
        return
    for run, _ in runs_within(folder):
        check_not_held(run)
    shutil.rmtree(folder, ignore_errors=True)

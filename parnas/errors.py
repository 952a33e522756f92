"""Typed errors for user mistakes.

The library raises these; the CLI turns any of them into one line on stderr and exit status 2. Anything else is a bug
and keeps its traceback.
"""

import errno
import os
import signal
from pathlib import Path
from types import FrameType

# What stops a run, saving what it can (Interrupted): Ctrl-C, a scheduler's SIGTERM, and the SIGHUP a closed
# terminal or ssh session sends, which would otherwise end the process silently, losing the steps since the
# last periodic checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ParnasError(Exception):
    """A problem with what the user asked for, explained in one line."""


class ConfigError(ParnasError):
    """A configuration key, type or value that cannot be honoured."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``: the one shape of every setting's check."""
    if not ok:
        raise ConfigError(message)


class DataError(ParnasError):
    """A corpus that is missing, corrupt, empty or too small."""


class TokenizerError(ParnasError):
    """A tokenizer that cannot be trained or loaded with the given settings."""


class Interrupted(BaseException):
    """A run stopped by one of :data:`STOP_SIGNALS`: the CLI exits with 128 + its number and, on rank 0, says what
    was saved (``checkpoint``, at ``step``; None: nothing) and the command that goes on. ``during``: the work after
    the last step the signal cut, which ``--resume`` finishes. A ``BaseException``, so no ``except Exception``
    on the way swallows it."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: str | None = None, rank: int = 0,
                 during: str | None = None) -> None:
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint {checkpoint}")
        self.signum, self.step, self.checkpoint, self.rank, self.during = signum, step, checkpoint, rank, during


def stop_at_once(signum: int, frame: FrameType | None) -> None:
    """The handler once a stop is under way: a second signal (a burst of Ctrl-C) ends the process at once, dying
    by that signal as with no handler, but first says so in one line, so a burst never ends in silence."""
    name = signal.Signals(signum).name
    try:
        os.write(2, f"parnas: {name} again: stopped at once, saving nothing more; --resume goes on from the run's "
                    "last checkpoint, if it wrote one\n".encode())
    except OSError:  # the terminal is gone (SIGHUP)
        pass
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def stop_at_once_from_now() -> None:
    """After the first stop signal: every further one is :func:`stop_at_once`'s."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_at_once)


def path_error(e: BaseException) -> ParnasError | None:
    """One line for a path no file can have, else None: a name too long for the file system, or a path under a
    file (``--out /etc/passwd/x``), wherever a command first meets it (an output folder, a lock, a log). What
    any parnas command writes lies under a path the user gave, so the line names that path."""
    if not isinstance(e, OSError) or e.errno not in (errno.ENAMETOOLONG, errno.ENOTDIR) or not e.filename:
        return None
    path = Path(os.fsdecode(e.filename))
    if e.errno == errno.ENAMETOOLONG:
        shown = str(path) if len(str(path)) <= 120 else str(path)[:120] + "..."
        return ParnasError(f"cannot write {shown}: the name is too long (the file system takes at most 255 bytes "
                           "per name); choose a shorter path")
    blocker = next((p for p in path.parents if os.path.isfile(p)), None)
    why = f"{blocker} is a file, not a folder" if blocker else "a parent is not a folder"
    return ParnasError(f"cannot write {path}: {why}; choose another path")

"""A study's sub-folders (``search/``, ``retrain/``): the study runs, resumes, clears or reads one only if it made
it, and a folder there that it did not make, or that holds another run, is refused in one line and kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from parnas.errors import ParnasError
from parnas.files import check_not_link, check_writable_dir
from parnas.owned_folders import LOCK_FILE, check_no_other_run, check_not_held, runs_within

OWNER_FILE = ".parnas-owner"  # written by a parent command (a study) into each sub-folder it makes


def own_sub_dir(folder: str | Path, owner: str, *, make: bool = True) -> Path:
    """Make sure ``folder`` is a sub-folder the parent command ``owner`` (e.g. ``study``) made, and may run, resume,
    clear or read as its own; returns it. It is the parent's if it holds :data:`OWNER_FILE`, written when the parent
    made it (an absent or empty folder is made or taken over; with ``make`` false, left as it is). Any other folder,
    and a live run in the parent's own, is refused in one line naming what it holds, and kept."""
    folder = Path(folder)
    check_not_held(folder)
    marker = folder / OWNER_FILE
    if marker.is_file() and not marker.is_symlink():
        return folder
    inside = folder.is_dir() and not folder.is_symlink()
    held = sorted(p.name for p in folder.iterdir()) if inside else [folder.name] if os.path.lexists(folder) else []
    if held:
        marks = runs_within(folder) if inside else []
        what = f"another run's {marks[0][1]}" if marks else f"files: {', '.join(held[:3])}"
        raise ParnasError(f"{folder} was not made by this {owner} (it holds {what}): it is kept; move it out of "
                          f"the way, or choose another --out")
    if make:
        check_writable_dir(folder).mkdir(parents=True, exist_ok=True)
        marker.write_text(f"made by parnas {owner}, which may resume, replace or remove what this folder holds\n")
    return folder


def check_sub_dirs(parent: str | Path, groups: tuple[str, ...], owner: str) -> None:
    """Every sub-folder already in ``parent``'s ``groups`` (e.g. ``search/``, ``retrain/``) is one ``owner`` made
    and no other run holds (:func:`own_sub_dir`, writing nothing): checked before the parent's work begins."""
    for group in groups:
        folder = check_not_link(Path(parent) / group)  # a link there would take the study's runs elsewhere
        for sub in sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else ():
            own_sub_dir(sub, owner, make=False)


def clear_own_dir(folder: str | Path) -> None:
    """Empty ``folder``, a parent command's own sub-folder (:func:`own_sub_dir`) whose run stopped before it saved
    anything worth resuming, keeping the owner's mark; refused in one line, nothing removed, if another run is in
    it (:func:`check_no_other_run`)."""
    folder = Path(folder)
    check_not_held(folder)
    entries = [p for p in folder.iterdir() if p.name not in (OWNER_FILE, LOCK_FILE)]
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            check_no_other_run(entry, "files")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

"""A claim's folder in the state dir's `claimed/`, on disk: the inbox entry is renamed
into it (`MOVED`), then copied to the daemon's own file, which only the daemon can write
(`privatize`), so that what is hashed is what runs. Worker-thread code: every function
here blocks."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from aoe.errors import ModelError, PermissionDeniedError
from aoed import safefs
from aoed.watch.discover import entry_kind

__all__ = [
    "MOVED",
    "check_claimed",
    "claimed_entry",
    "move_in",
    "privatize",
    "remove",
    "same_file_data",
]

#: in a claim's folder, the entry renamed out of the inbox until the daemon's own copy of
#: it is made (`privatize`); inbox names starting with `.` are never taken, so no model
#: has this name
MOVED = ".moved"


def move_in(src: Path, dst: Path) -> None:
    """Take the inbox entry `src` into the claim folder of `dst`: renamed to `MOVED` (the
    entry itself, whatever it is, at once: a file dropped under its name after this is
    another file), or, from another file system, copied straight to `dst` (a regular file
    with one link, else LinkRefusedError or LinkedError: safefs.move) and unlinked."""
    with safefs.opened_dir(src.parent) as s, safefs.opened_dir(dst.parent) as d:
        try:
            os.rename(src.name, MOVED, src_dir_fd=s, dst_dir_fd=d)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            safefs.move(src.name, dst.name, src_dir_fd=s, dst_dir_fd=d)


def privatize(folder: Path, name: str) -> None:
    """Make `name` in the claim folder `folder` the daemon's own copy of the entry moved
    there (`MOVED`), then remove that entry. Whoever dropped the file may still hold it
    open for writing, and writes through that descriptor reach it wherever it is
    renamed; nobody but the daemon can write the copy, so what is hashed is what runs.
    Done already (a crash after the copy, or a claim from another file system): only the
    moved entry, if any, goes. ModelError when the moved entry is not a regular file,
    PermissionDeniedError when it has several hard links: either way nothing behind it
    is opened. OSError (ENOSPC...) when the copy cannot be made: nothing changed then."""
    with safefs.opened_dir(folder) as d:
        if not safefs.taken(name, dir_fd=d):
            try:
                st = os.stat(MOVED, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, "gone from the claims folder before it was copied", str(folder)
                ) from None
            # Looked at before it is opened: opening a hard link reads, for whoever made
            # it, a file from elsewhere (its atime, a FIFO's writer...).
            if not stat.S_ISREG(st.st_mode):
                raise ModelError(
                    f"{name}: {entry_kind(st.st_mode)} by the time it was claimed (it was replaced after "
                    "it was found); only regular files are taken, and nothing behind it was read"
                )
            if st.st_nlink > 1:
                raise PermissionDeniedError(
                    f"{name}: the file has {st.st_nlink} hard links, and a hard link can make the "
                    "daemon read a file its submitter could not; copy the file (cp, not ln) or upload it"
                )
            try:
                fd = safefs.open_file(MOVED, dir_fd=d, single_link=True)
            except (safefs.LinkRefusedError, safefs.LinkedError) as exc:  # swapped since
                raise ModelError(f"{name}: {exc.strerror}; nothing behind it was read") from None
            with os.fdopen(fd, "rb") as moved:
                safefs.write_file(
                    name, lambda f: safefs.copy_fd(moved.fileno(), f.fileno()), dir_fd=d
                )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(MOVED, dir_fd=d)


def claimed_entry(dst: Path) -> Path:
    """What a claim of `dst` holds: the daemon's copy, else the entry moved out of the
    inbox (a claim refused before its copy was made)."""
    moved = dst.parent / MOVED
    return moved if not os.path.lexists(dst) and os.path.lexists(moved) else dst


def check_claimed(model: Path) -> None:
    """ModelError unless the claimed entry `model` is a regular file: a writer of the
    inbox may swap a link in between the look and the claim's rename, which moves the
    entry itself; nothing reads through such a link."""
    st = os.lstat(model)
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(
            f"{model.name}: {entry_kind(st.st_mode)} by the time it was claimed (it was replaced "
            "after it was found); only regular files are taken, and nothing behind it was read"
        )


def same_file_data(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_size, sa.st_mtime_ns) == (sb.st_size, sb.st_mtime_ns)


def remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)

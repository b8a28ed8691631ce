"""What in an inbox folder is a model to take, as the watcher sees it: the names it
ignores (a writer's temporary names, hidden files), the entries it takes (regular
`*.onnx`, `*.pt2` and `*.tar` files: a `.tar` is a TensorFlow SavedModel packed in one
file, aoe.savedmodel), what it says of the others, and the signs by which it tells
that a file is complete (its signature; whether Linux can say who writes it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from aoe.savedmodel import ARCHIVE_SUFFIX
from aoed.watch.options import OPTIONS_FILE

__all__ = [
    "candidate",
    "entry_kind",
    "entry_signature",
    "ignored",
    "listing",
    "no_lease_reason",
    "polling_forced",
]


def ignored(name: str) -> bool:
    """Temporary names of writers that copy and rename (and hidden files)."""
    return name.startswith(".") or name.endswith((".part", "~"))


def candidate(name: str) -> bool:
    # A SavedModel is dropped as a .tar of its directory, never as the directory: a file
    # is complete once renamed into place and claimed by one rename, and the archive is
    # checked member by member in the confined process that unpacks it.
    return not ignored(name) and name.lower().endswith((".onnx", ".pt2", ARCHIVE_SUFFIX))


def polling_forced() -> bool:
    """Whether watchfiles polls without being asked to (its environment variable)."""
    return os.environ.get("WATCHFILES_FORCE_POLLING", "").lower() not in (
        "",
        "false",
        "disable",
        "disabled",
    )


def listing(folder: Path) -> tuple[list[str], dict[str, tuple[int, str]]]:
    """The folder's candidate models, and the entries that are left alone, as name:
    (inode, what it is). Hidden and temporary names and the options file are neither."""
    models: list[str] = []
    left: dict[str, tuple[int, str]] = {}
    with os.scandir(folder) as it:
        for e in it:
            if ignored(e.name) or e.name == OPTIONS_FILE:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and candidate(e.name):
                models.append(e.name)
            else:
                left[e.name] = (st.st_ino, entry_kind(st.st_mode))
    return models, left


def entry_kind(mode: int) -> str:
    """What an entry that is not taken is, in words."""
    for test, words in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return words
    return (
        "not a regular file"
        if not stat.S_ISREG(mode)
        else "not an .onnx model (nor a .pt2 or a .tar)"
    )


def entry_signature(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of the entry `path`, not following a link; None when gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def no_lease_reason() -> str:
    """Why a read lease cannot be taken, as far as can be told."""
    try:
        with open("/proc/sys/fs/leases-enable", encoding="ascii") as f:
            if f.read().strip() == "0":
                return "leases are off: /proc/sys/fs/leases-enable is 0"
    except OSError:
        pass
    return (
        "no read lease: the daemon neither owns the files dropped here nor has CAP_LEASE, or the file system "
        "has no leases"
    )

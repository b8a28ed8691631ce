"""Free space where the daemon writes, and the floor below which it takes no new work.

A full disk fails the call or the job in hand, never the daemon. Writes that find the
disk full are translated where they happen (the job store, uploads) into a
DiskFullError that names the folder and its free space (`disk_full`). `[limits]
min_free_mb` keeps room for what already runs: below it, new jobs and uploads are
refused with the same error before they write anything (`check_floor`), and queued
jobs wait for space instead of starting.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from aoe.errors import DiskFullError

__all__ = ["FULL_ERRNOS", "check_floor", "disk_full", "free_bytes", "size_text"]

#: errno values that mean "no room": the filesystem is full, or the user's quota is.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `folder`
    (or its nearest existing parent); -1 when none can be asked."""
    for p in (folder, *folder.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return -1


def size_text(n: int) -> str:
    """`n` bytes for a person: "0 bytes", "812 KiB", "3.2 MiB", "41 GiB"."""
    if n < 0:
        return "an unknown amount"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def disk_full(folder: Path, what: str, floor: int = 0) -> DiskFullError:
    """The error for `what` (e.g. "SubmitJob") finding `folder` full, or below `floor`
    bytes free when `floor` is given."""
    free = free_bytes(folder)
    if floor:
        why = f"{folder} has {size_text(free)} free, below the floor of {size_text(floor)} ([limits] min_free_mb)"
    else:
        why = f"the disk is full ({folder} has {size_text(free)} free)"
    return DiskFullError(f"{what}: {why}; free space there, then try again", str(folder), free)


def check_floor(folder: Path, floor: int, what: str, need: int = 0) -> None:
    """Raise DiskFullError for `what` when writing `need` more bytes into `folder` would
    leave less than `floor` bytes free there."""
    if floor <= 0 and need <= 0:
        return
    free = free_bytes(folder)
    if 0 <= free and free - need < floor:
        raise disk_full(folder, what, floor) if floor else disk_full(folder, what)

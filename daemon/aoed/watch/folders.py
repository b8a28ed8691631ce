"""The drop folders themselves: an inbox, outbox or failed folder that is missing (at
start, or removed while the daemon runs) is made again with the inbox's `mode` and
`group` (deploy/'s 2770: group-writable and setgid), and that it was made is logged.
Worker-thread code: every function here blocks."""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import stat
from pathlib import Path

from aoed import safefs
from aoed.config import Inbox

__all__ = ["ensure_folder", "prepare_dirs"]

# one logger for all of the watcher's parts: its lines name the watcher, not the part
log = logging.getLogger("aoed.watch")


def prepare_dirs(inbox: Inbox) -> int:
    """Make the inbox and its outbox and failed folders where missing (`ensure_folder`);
    returns the inbox's inode. LinkRefusedError when one is a link (they are opened
    without following one when used), OSError naming the folder when one cannot be made."""
    for d in (inbox.path, inbox.outbox, inbox.failed):
        ensure_folder(d, inbox)
    return os.stat(inbox.path).st_ino


def ensure_folder(folder: Path, inbox: Inbox) -> None:
    """Make the drop folder `folder` (`inbox`'s inbox, outbox or failed folder) when it is
    missing, with the inbox's mode and group, and log that it was made: writers of a
    folder made with the daemon's umask alone (0750) would meet "Permission denied",
    and nothing would say why. A folder that is there is left as it is. LinkRefusedError
    when `folder` is a link or a file; OSError naming `folder` when it cannot be made
    (a folder made but not given its mode and group is removed again)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with safefs.opened_dir(folder.parent) as parent:
        try:
            # 0700 until its group and mode are set: never open to more than they say
            os.mkdir(folder.name, 0o700, dir_fd=parent)
        except FileExistsError:
            os.close(safefs.open_dir(folder.name, dir_fd=parent))
            return
        except OSError as exc:
            raise OSError(exc.errno, f"cannot make it: {exc.strerror}", str(folder)) from None
        try:
            group = _give_mode(folder, parent, inbox)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(folder.name, dir_fd=parent)
            raise
    log.warning(
        "inbox %s: %s was missing; made it with mode %04o, group %s ([[inbox]] mode and group)",
        inbox.path,
        folder,
        inbox.mode,
        group,
    )


def _give_mode(folder: Path, parent: int, inbox: Inbox) -> str:
    """Give the folder `folder` just made in `parent` the inbox's group and mode; returns
    the group's name. OSError naming the folder and the setting when the daemon may not."""
    fd = safefs.open_dir(folder.name, dir_fd=parent)
    try:
        if inbox.group:
            try:
                gid = grp.getgrnam(inbox.group).gr_gid
            except KeyError:
                raise OSError(
                    errno.EINVAL, f"[[inbox]] group {inbox.group!r}: no such group", str(folder)
                ) from None
            try:
                os.fchown(fd, -1, gid)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot give it the group {inbox.group!r} of [[inbox]] group ({exc.strerror}): "
                    "the daemon's user must be a member of it",
                    str(folder),
                ) from None
        # (after the chown, which may clear a setgid bit)
        os.fchmod(fd, inbox.mode)
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != inbox.mode:  # the kernel drops setgid for a non-member
            raise OSError(
                errno.EPERM,
                f"it has mode {stat.S_IMODE(st.st_mode):04o}, not {inbox.mode:04o} as [[inbox]] mode "
                "says: the daemon's user must be a member of its group",
                str(folder),
            )
        try:
            return grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            return str(st.st_gid)
    finally:
        os.close(fd)

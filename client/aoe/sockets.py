"""Which unix socket a client may talk to: one that only root or the daemon's own user
could have put where it is, and that this user may reach.

A client sends the daemon its models and takes back tuned ones, so a socket another user
planted (say `/tmp/aoed-<uid>/aoed.sock`, made in the shared temp folder before the
user's own daemon ever ran) would receive the models and could answer with anything.
Before every call, and before `aoe tune` picks a daemon, the path is checked
(`check_socket`), symbolic links followed by hand:

- Every folder on the way belongs to root, to this user or to the daemon's user (the
  owner of the socket's folder), and nobody else may write in it, except a sticky
  folder such as /tmp, where anyone may make entries but only their owner remove them:
  there the entry on the way must belong to root or to this user.
- The socket belongs to root, to this user or to the daemon's user.

So the system service's /run/aoed/ (made by root for the aoed user), the user's own
$XDG_RUNTIME_DIR/aoed/ and a /tmp/aoed-<uid>/ this user made are trusted, and a
/tmp/aoed-<uid>/ that someone else made is not. A path that fails is one clear
PermissionDeniedError that names it and says why, and nothing is sent.

A socket this user may not reach (a folder of the service's group that the user is not
in) is a PermissionDeniedError too, naming the group to ask for, never a traceback.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from pathlib import Path

from aoe.errors import DaemonUnavailableError, PermissionDeniedError

__all__ = ["check_socket"]

#: Symbolic links followed on one path before it is called a loop (the kernel's own limit).
_MAX_LINKS = 40


def check_socket(path: Path, *, alternative: str = "") -> bool:
    """True when a socket to trust is at `path`; False when nothing is there (no daemon
    runs). Raises PermissionDeniedError when this user may not reach the socket (naming
    the group to ask for, then `alternative`, e.g. "use --local") or when it is not one
    to trust (saying why); DaemonUnavailableError when `path` is something else than a
    socket."""
    path = Path(os.path.abspath(path))
    try:
        steps = _walk(path)
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise DaemonUnavailableError(
            f"no daemon at {path}: a part of the path is not a folder"
        ) from None
    except PermissionError as exc:
        raise _denied(path, Path(exc.filename or path).parent, alternative) from None
    except OSError as exc:
        raise DaemonUnavailableError(f"no daemon at {path}: {exc.strerror or exc}") from None
    folder, entry, st = steps[-1]
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailableError(f"no daemon at {path}: {entry} is not a socket")
    why = _distrust(steps)
    if why is not None:
        raise PermissionDeniedError(
            f"refusing the daemon socket {path}: {why}. A client uses a socket only where "
            "nobody but root and the daemon's user could have put it; if that folder is "
            "yours, remove it and restart aoed, else set AOED_SOCKET or --socket to your daemon"
        )
    if not os.access(entry, os.W_OK):  # connect() needs write permission on the socket
        raise _denied(path, entry, alternative)
    return True


def _walk(path: Path) -> list[tuple[Path, Path, os.stat_result]]:
    """Each (folder, entry, the entry's lstat) met resolving the absolute `path`, with
    symbolic links followed by hand; the folders are real paths. Raises OSError (a
    missing part, a folder this user may not search, a loop)."""
    steps: list[tuple[Path, Path, os.stat_result]] = []
    todo = list(reversed(path.parts[1:]))  # a stack: the next name is last
    folder, links = Path("/"), 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            folder = folder.parent
            continue
        entry = folder / name
        st = os.lstat(entry)
        steps.append((folder, entry, st))
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            target = Path(os.readlink(entry))
            if target.is_absolute():
                folder = Path("/")
            todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
            continue
        folder = entry
    if not steps:
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    return steps


def _distrust(steps: list[tuple[Path, Path, os.stat_result]]) -> str | None:
    """Why the walk `steps` ends at a socket not to trust (see the module doc), or None."""
    me = os.geteuid()
    folder_of_socket, _, socket_st = steps[-1]
    daemon_user = os.lstat(folder_of_socket).st_uid
    mine = {0, me}
    trusted = mine | {daemon_user}
    for folder, entry, st in steps:
        fst = os.lstat(folder)
        mode = stat.S_IMODE(fst.st_mode)
        if fst.st_uid not in trusted:
            return f"{folder} belongs to {_user(fst.st_uid)}, who could replace what is in it"
        if mode & 0o022:
            if not mode & stat.S_ISVTX:
                return f"{folder} may be written by others (mode {mode:04o})"
            if st.st_uid not in mine:
                return (
                    f"{entry} belongs to {_user(st.st_uid)} and is in {folder}, where anyone "
                    "may make it"
                )
    if socket_st.st_uid not in trusted:
        return (
            f"it belongs to {_user(socket_st.st_uid)}, neither root, you nor the owner of "
            f"{folder_of_socket}"
        )
    return None


def _denied(path: Path, where: Path, alternative: str) -> PermissionDeniedError:
    """The error for a socket behind `where` (a folder this user may not search, or the
    socket itself) that this user may not reach: names the group that may."""
    ask = f"ask for access to {where}"
    try:
        st = os.stat(where)
        member = st.st_gid == os.getegid() or st.st_gid in os.getgroups()
        if not member and st.st_mode & (0o020 if stat.S_ISSOCK(st.st_mode) else 0o010):
            ask = f"ask to be added to group {_group(st.st_gid)}"
    except OSError:
        pass
    if alternative:
        ask += f", or {alternative}"
    return PermissionDeniedError(f"cannot reach the daemon at {path}: permission denied ({ask})")


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)

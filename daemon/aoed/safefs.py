"""Creating files in folders other users can write, without ever following their links.

Someone who can write a folder can plant a symbolic link at any name the daemon may use
there, or swap an entry between the daemon's look and its use. The folders where that
matters: each inbox and its outbox and failed folders, a job's output folder (a client
may name one in a shared place), and, as a second line, the state dir's claims and
uploads. In all of them:

- A folder is opened once, `O_DIRECTORY | O_NOFOLLOW`, and every name in it is used
  relative to that descriptor, so a folder swapped for a link later changes nothing.
  A folder made here (`make_dir`) is opened the same way: a link at its name is refused.
- A file is written under a fresh random name created `O_CREAT | O_EXCL | O_NOFOLLOW`
  (anything already at that name, a link included, fails the create and is never
  opened), fsynced, then renamed to its final name in the same folder. The rename
  replaces the entry at the final name, a link included; it never writes through it.
- A file is read (`open_file`) with `O_NOFOLLOW`, checked on its descriptor.
- A move between folders (`move`) is a rename between two folder descriptors; across
  file systems it is a copy made as above from a descriptor that must be a regular file
  with a single link, then an unlink.

Temporary names are short and fixed in length, so a final name of up to NAME_MAX bytes
always has a temporary that fits; `fit()` shortens final names to fit (with a hash).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "NAME_MAX",
    "LinkedError",
    "LinkRefusedError",
    "copy_fd",
    "fit",
    "has_writers",
    "make_dir",
    "move",
    "move_path",
    "open_dir",
    "open_file",
    "opened_dir",
    "read_lease",
    "reserve",
    "taken",
    "write_file",
]

#: Bytes in one file name on Linux file systems (ext4, xfs, btrfs, tmpfs).
NAME_MAX = 255

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO swapped in for the file must not block the open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LinkRefusedError(OSError):
    """A symbolic link (or another kind of file) where the daemon wants a folder or a
    regular file of its own; it is left as it is and never followed."""


class LinkedError(OSError):
    """A file with several hard links that a move would have to copy: a hard link may be
    a file from elsewhere, which the copy would read for whoever made the link."""


def _refused(exc: OSError, what: str, where: str) -> OSError:
    """`exc` from an O_NOFOLLOW open, as LinkRefusedError when a link caused it."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        return LinkRefusedError(
            exc.errno, f"is a symbolic link or not {what}; links are never followed here", where
        )
    return exc


def open_dir(path: Path | str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the folder `path` (relative to `dir_fd` when given). Raises
    LinkRefusedError when its last component is a link or not a folder, else OSError."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(exc, "a folder", str(path)) from None


@contextlib.contextmanager
def opened_dir(path: Path | str) -> Iterator[int]:
    """`open_dir(path)`, closed on exit."""
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def make_dir(name: str, *, dir_fd: int, mode: int = 0o777) -> int:
    """The folder `name` in `dir_fd`, made when missing; returns a descriptor of it.
    LinkRefusedError when `name` is a link or a file."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=dir_fd)
    return open_dir(name, dir_fd=dir_fd)


def taken(name: str, *, dir_fd: int) -> bool:
    """Whether anything, a dangling link included, has the name `name` in `dir_fd`."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _temp_name() -> str:
    return f".aoed-{secrets.token_hex(8)}.tmp"


def write_file(
    name: str, fill: Callable[[BinaryIO], object], *, dir_fd: int, sync: bool = True
) -> None:
    """Write `name` in `dir_fd`: `fill(f)` writes a fresh file of a random name, which is
    fsynced (unless not `sync`: scratch that a crash may lose) and renamed to `name`
    (replacing what was there, a link included, never writing through it). The mode is
    what a plain open gives (0666 less the umask). On any error, or cancellation inside
    `fill`, the temporary is removed and `name` is as it was."""
    tmp = _temp_name()
    fd = os.open(tmp, _NEW_FLAGS, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if sync:
        os.fsync(dir_fd)


def reserve(name: str, *, dir_fd: int) -> bool:
    """Create `name` in `dir_fd` as an empty file of ours, exclusively; False when the
    name is taken (by anything: a link at it is neither opened nor replaced)."""
    try:
        os.close(os.open(name, _NEW_FLAGS, 0o666, dir_fd=dir_fd))
    except FileExistsError:
        return False
    return True


def open_file(name: str | Path, *, dir_fd: int | None = None, single_link: bool = False) -> int:
    """A read-only descriptor of the regular file `name`. LinkRefusedError when it is a
    link or not a regular file; LinkedError, with `single_link`, when it has several hard
    links (checked on the descriptor, so on the very file that will be read)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(exc, "a regular file", str(name)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LinkRefusedError(errno.EINVAL, "is not a regular file", str(name))
        if single_link and st.st_nlink > 1:
            raise LinkedError(
                errno.EPERM,
                f"the file has {st.st_nlink} hard links, so it may be a file from "
                "elsewhere, and is not copied; copy it into the folder (cp, not ln)",
                str(name),
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def move(src: str, dst: str, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """Rename `src` in `src_dir_fd` to `dst` in `dst_dir_fd` (the entry itself moves,
    whatever it is; what was at `dst` is replaced, never written through). Across file
    systems, copy a regular file with a single link (else LinkRefusedError or
    LinkedError, and nothing moves) with `write_file`, then unlink `src`, so `dst` exists
    only complete."""
    try:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    fd = open_file(src, dir_fd=src_dir_fd, single_link=True)
    with os.fdopen(fd, "rb") as s:
        write_file(dst, lambda f: _copy(s, f), dir_fd=dst_dir_fd)
    os.unlink(src, dir_fd=src_dir_fd)


def move_path(src: Path, dst: Path) -> None:
    """`move` from the path `src` to the path `dst`, each folder opened as `open_dir`
    opens it (LinkRefusedError when either is a link)."""
    with opened_dir(src.parent) as s, opened_dir(dst.parent) as d:
        move(src.name, dst.name, src_dir_fd=s, dst_dir_fd=d)


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    dst.flush()
    copy_fd(src.fileno(), dst.fileno())


#: errno values of a kernel copy that cannot be done between two given files (another
#: file system, a kernel or file system without it): the next way is tried
_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})
#: bytes one kernel copy call is asked for (sendfile takes at most 2 GiB less a page)
_KERNEL_CHUNK = 1 << 30


def copy_fd(src: int, dst: int) -> int:
    """Copy the file `src` from its offset to its end onto `dst` at its offset; returns
    the bytes copied. In the kernel where it can (copy_file_range, which shares extents
    where the file system can; else sendfile), so a model of many GiB never passes
    through the daemon's memory; by read and write where neither works between these
    two files. Each way advances both offsets, so the next goes on where one stopped."""
    done = 0
    ways: tuple[Callable[[], int], ...] = (
        lambda: os.copy_file_range(src, dst, _KERNEL_CHUNK),
        lambda: os.sendfile(dst, src, None, _KERNEL_CHUNK),
    )
    for way in ways:
        try:
            while n := way():
                done += n
            return done
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
    while chunk := os.read(src, 1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]
        done += len(chunk)
    return done


def fit(stem: str, room: int) -> str:
    """`stem`, or when `stem` and `room` more bytes (the longest suffix to come) exceed
    NAME_MAX, a readable prefix of it plus `~` and 10 hex digits of its sha256 (so
    different long names stay different), within NAME_MAX - `room` bytes."""
    raw = stem.encode("utf-8", "surrogateescape")
    if len(raw) + room <= NAME_MAX:
        return stem
    tag = "~" + hashlib.sha256(raw).hexdigest()[:10]
    keep = max(0, NAME_MAX - room - len(tag))
    # Cut at a character boundary: a name stays valid UTF-8 when it was.
    prefix = raw[:keep].decode("utf-8", "ignore").encode("utf-8", "surrogateescape")
    return prefix.decode("utf-8", "surrogateescape") + tag


def has_writers(fd: int) -> bool | None:
    """Whether any process has the file of `fd` (opened read-only) open for writing, as
    Linux says through a read lease taken and released at once (`read_lease`); None
    when no lease can be taken here."""
    with read_lease(fd) as held:
        return None if held is None else not held


@contextlib.contextmanager
def read_lease(fd: int) -> Iterator[bool | None]:
    """Hold a read lease on the file of `fd` (opened read-only) for the block; yields
    True while held, False when a process has the file open for writing (a read lease
    cannot be taken then), None when no lease can be taken here: the caller neither owns
    the file nor has CAP_LEASE, leases are off (/proc/sys/fs/leases-enable), or the file
    system has none.

    A process that opens the file for writing while the lease is held waits until the
    lease is released (at most /proc/sys/fs/lease-break-time), and the kernel signals
    the holder, by default with SIGIO, whose default action ends the process. The
    signal is set to SIGURG instead, whose default action is to ignore it."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        yield False if exc.errno in (errno.EAGAIN, errno.EBUSY) else None
        return
    try:
        yield True
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

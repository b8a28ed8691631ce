"""One measurer per device, machine-wide: a lock file per device in the runtime dir.

A daemon, an embedded `aoe tune` and `aoe bank verify` each run their own device agent;
inside one process the agent serializes measurements by construction, and across
processes this lock does: the agent holds it (`flock`) for every request it serves and
lets go in between, so several processes take turns request by request and never
measure at once. The kernel drops a flock when its holder dies, so a lock is never
stale. The holder writes who it is into the file, and a process that has to wait says
so, naming the holder.

Waiting is aoed.flock's: cancellable at any moment, with nothing polling and no thread
left blocked in the kernel.

`flock` needs only a descriptor, and a read-only one will do: whoever can open the file
can hold the device and stop every measurement. So the file is 0600 (0660 with the
service's group, whose members may measure too), in a directory no one else can write
(made 0750, owned by this user or root), opened without following a link; an existing
file that is open to other users is narrowed when it is ours and refused when it is not.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from aoe.errors import DeviceError
from aoed import flock

__all__ = ["DeviceLock"]


class DeviceLock:
    def __init__(self, runtime_dir: Path, device: str, group: int | None = None):
        self.path = Path(runtime_dir) / f"device-{device.replace(':', '-')}.lock"
        #: the service's group: its members may hold the lock too (mode 0660)
        self.group = group
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = _open_lock(self.path, self.group)
            except OSError as exc:
                raise DeviceError(
                    f"device lock {self.path}: {exc.strerror or exc}; set [engine] runtime_dir "
                    "(or AOED_RUNTIME_DIR) to a directory every measuring process can write"
                ) from None
        return self._fd

    def holder(self) -> str:
        """Who the file says holds the lock (best effort)."""
        try:
            text = os.pread(self._open(), 512, 0).decode("utf-8", "replace").strip()
        except (OSError, DeviceError):
            text = ""
        return text or "another process"

    def _try(self, fd: int) -> bool:
        if not flock.try_lock(fd):
            return False
        self._claim(fd)
        return True

    @staticmethod
    def _claim(fd: int) -> None:
        """Write who holds the lock now held on `fd` into its file."""
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pid {os.getpid()} ({' '.join(sys.argv)[:200]}) since {time.strftime('%H:%M:%S')}\n".encode(),
            0,
        )

    @contextlib.asynccontextmanager
    async def hold(self, on_wait: Callable[[str], None] | None = None) -> AsyncIterator[None]:
        """Hold the device for the block; waits (saying so once through `on_wait`) while
        another process measures on it. Cancellable while waiting."""
        fd = self._open()
        if not self._try(fd):
            if on_wait is not None:
                on_wait(
                    f"waiting for {self.path.stem.removeprefix('device-')}: measuring for {self.holder()}"
                )
            try:
                await flock.wait_lock(fd)
            except OSError as exc:
                raise DeviceError(f"device lock {self.path}: cannot wait for it: {exc}") from None
            self._claim(fd)
        try:
            yield
        finally:
            flock.unlock(fd)

    @contextlib.contextmanager
    def hold_sync(self) -> Iterator[None]:
        """`hold()` for a thread that has no trio loop (a Ray actor measuring on its
        node: aoed.engine.rayexec): blocks while another process measures."""
        fd = self._open()
        flock.lock(fd)
        self._claim(fd)
        try:
            yield
        finally:
            flock.unlock(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _private_dir(path: Path) -> int:
    """A descriptor of the directory `path` (made 0750 when missing): it must not be a
    link, must belong to this user or root, and nobody else may write in it (a
    group- or world-writable one of ours loses those bits). DeviceError otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o750)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if not path.is_symlink():
            raise
        raise DeviceError(
            f"device lock directory {path}: is a symbolic link ({exc.strerror}); "
            "point [engine] runtime_dir (or AOED_RUNTIME_DIR) at the real directory"
        ) from None
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (me, 0):
            raise DeviceError(
                f"device lock directory {path}: belongs to uid {st.st_uid}, who could replace the "
                "locks in it; remove it or set [engine] runtime_dir (or AOED_RUNTIME_DIR) to a "
                "directory of your own"
            )
        if st.st_mode & 0o022:
            if st.st_uid != me:
                raise DeviceError(
                    f"device lock directory {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
                    "replace the locks in it; make it writable by its owner only"
                )
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(path: Path, group: int | None) -> int:
    """The lock file at `path`, opened read-write (created 0600, or 0660 for `group`).
    DeviceError when it is not a regular file, or other users could open it and it is
    not ours to narrow."""
    want = 0o600 if group is None else 0o660
    dfd = _private_dir(path.parent)
    try:
        try:
            fd = os.open(
                path.name,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                want,
                dir_fd=dfd,
            )
        except OSError as exc:
            if os.path.islink(path):
                raise DeviceError(
                    f"device lock {path}: is a symbolic link; remove it (the lock is a plain file "
                    "this process creates)"
                ) from None
            raise exc from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            raise DeviceError(f"device lock {path}: not a regular file; remove it")
        if st.st_uid == os.geteuid():
            if group is not None and st.st_gid != group:
                os.fchown(fd, -1, group)
            if mode != want:
                os.fchmod(fd, want)
        elif mode & 0o007:
            raise DeviceError(
                f"device lock {path}: belongs to uid {st.st_uid} and any user may open it (mode "
                f"{mode:04o}), so anyone could hold the device; have its owner remove it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd

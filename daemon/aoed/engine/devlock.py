"""One measurer per device, machine-wide: a lock file per device in the runtime dir.

A daemon, an embedded `aoe tune` and `aoe bank verify` each run their own device agent;
inside one process the agent serializes measurements by construction, and across
processes this lock does: the agent holds it (`flock`) for every request it serves and
lets go in between, so several processes take turns request by request and never
measure at once. The kernel drops a flock when its holder dies, so a lock is never
stale. The holder writes who it is into the file, and a process that has to wait says
so, naming the holder.

Waiting polls (non-blocking flock, then a short sleep): cancellable at any moment,
with no thread left blocked in the kernel.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import trio

from aoe.errors import DeviceError

__all__ = ["DeviceLock"]

_POLL_S = 0.02


class DeviceLock:
    def __init__(self, runtime_dir: Path, device: str):
        self.path = Path(runtime_dir) / f"device-{device.replace(':', '-')}.lock"
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise DeviceError(
                    f"device lock {self.path}: {exc.strerror or exc}; set [engine] runtime_dir "
                    "(or AOED_RUNTIME_DIR) to a directory every measuring process can write"
                ) from None
        return self._fd

    def holder(self) -> str:
        """Who the file says holds the lock (best effort)."""
        try:
            return self.path.read_text(encoding="utf-8", errors="replace").strip() or "another process"
        except OSError:
            return "another process"

    def _try(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({' '.join(sys.argv)[:200]}) since {time.strftime('%H:%M:%S')}\n".encode(), 0)
        return True

    @contextlib.asynccontextmanager
    async def hold(self, on_wait: Callable[[str], None] | None = None) -> AsyncIterator[None]:
        """Hold the device for the block; waits (saying so once through `on_wait`) while
        another process measures on it. Cancellable while waiting."""
        fd = self._open()
        if not self._try(fd):
            if on_wait is not None:
                on_wait(f"waiting for {self.path.stem.removeprefix('device-')}: measuring for {self.holder()}")
            while not self._try(fd):
                await trio.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

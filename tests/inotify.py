"""Whether a file is opened or read, seen by the kernel (inotify), not assumed: the tests
that promise the daemon never opens a file outside what it may read watch it with this."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

__all__ = ["Inotify"]


class Inotify:
    """Just enough inotify (ctypes, no dependency) to see whether a file is opened or read.

    A watch is on the inode, so an open through any name (a hard link included) shows.
    """

    IN_ACCESS, IN_OPEN = 0x00000001, 0x00000020
    _IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(self._IN_NONBLOCK | self._IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.paths: dict[int, Path] = {}

    def watch(self, path: Path) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_OPEN | self.IN_ACCESS)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        self.paths[wd] = path

    def events(self) -> list[tuple[Path, int]]:
        """(watched path, event mask) of every event so far; never blocks."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            i = 0
            while i < len(data):  # struct inotify_event: wd, mask, cookie, len, name[len]
                wd, mask, _, size = struct.unpack_from("iIII", data, i)
                out.append((self.paths.get(wd, Path("?")), mask))
                i += 16 + size

    def close(self) -> None:
        os.close(self.fd)

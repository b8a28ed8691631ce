"""One writer per bank, across processes: an exclusive flock on `{bank}/writer.lock`.

A `BankStore` takes the lock when it opens and lets go when it closes. The holder then
writes who it is into the file (pid, host, when, command line), so that a process that
finds the bank busy can name it. The kernel drops a flock when its holder's last file
descriptor closes, which includes the process dying, so a lock is never stale: a
holder killed with SIGKILL frees the bank at once. The descriptor is close-on-exec, so
child processes (compile workers, runners) never hold it on.

Readers never take this lock; LMDB already lets any number of them read while one
process writes. A would-be writer that may wait blocks in flock (`acquire(wait=True)`,
where ^C ends the wait) or, in trio code (`aoed.bank.writer`), awaits `wait()`, which
whatever cancels the caller cancels, holding nothing (aoed.flock).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aoe.errors import BankBusyError, BankError
from aoed import flock

__all__ = ["LOCK_NAME", "WriterLock", "busy_holder"]

LOCK_NAME = "writer.lock"


def _command_line() -> str:
    """This process's command as a user would recognize it, e.g. `aoe tune m.onnx`."""
    argv = list(sys.argv) or ["python"]
    if argv[0] in ("-c", ""):  # python -c CODE ARGS / an interactive interpreter
        name = "python -c ..." if argv[0] == "-c" else "python"
    else:
        head = Path(argv[0])
        if head.name in ("cli.py", "__main__.py"):  # python -m aoe.cli / python -m aoed
            head = head.parent
        name = head.name
    text = " ".join([name, *argv[1:]])
    return text if len(text) <= 160 else text[:157] + "..."


def _describe(info: dict[str, Any]) -> str:
    """`pid 123 (aoe tune m.onnx, since 12:01:02)` from what a holder wrote."""
    since = info.get("since", 0.0)
    stamp = time.localtime(since)
    fmt = (
        "%H:%M:%S"
        if time.strftime("%Y%m%d", stamp) == time.strftime("%Y%m%d")
        else "%Y-%m-%d %H:%M:%S"
    )
    host = info.get("host", "")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    return f"pid {info.get('pid', '?')}{where} ({info.get('command', '?')}, since {time.strftime(fmt, stamp)})"


class WriterLock:
    """The writer lock of the bank at `bank` (a directory, created when missing).

    Not held after construction: `try_acquire()` or `acquire()` takes it, `release()`
    lets go (and is safe to repeat). Raises BankError when the directory cannot be
    made or the lock file cannot be opened for writing.
    """

    def __init__(self, bank: str | os.PathLike[str]):
        self.bank = Path(bank)
        self.path = self.bank / LOCK_NAME
        self.held = False
        try:
            # What a bank holds is what was learned from its writers' models: theirs and
            # their group's to read, not everyone's (an embedded run keeps the user's umask).
            self.bank.mkdir(mode=0o750, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file where the bank or a parent should be
            raise BankError(
                f"bank {self.bank}: not a directory (a file is in the way); pass a directory "
                "for the bank"
            ) from None
        except OSError as exc:
            raise BankError(
                f"bank {self.bank}: cannot create it ({exc.strerror or exc}); pass a directory you may write"
            ) from None
        if not os.access(self.bank, os.W_OK):
            raise BankError(
                f"bank {self.bank}: directory is not writable; fix its permissions or use another --bank"
            )
        try:
            # Close-on-exec: a child process must never keep the lock alive. flock works on
            # a read-only descriptor, so whoever may open the file may hold it: the
            # writers and their group, never other users (0640; a link is not followed).
            self._fd: int | None = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BankError(
                    f"bank {self.bank}: {self.path} is a symbolic link; remove it"
                ) from None
            raise BankError(
                f"bank {self.bank}: cannot open {self.path} ({exc.strerror or exc}); check its permissions"
            ) from None
        st = os.fstat(self._fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o007:
            # as earlier versions left it (0644)
            os.fchmod(self._fd, stat.S_IMODE(st.st_mode) & ~0o007)

    def try_acquire(self, record: bool = True) -> bool:
        """Take the lock if no other process (or other WriterLock) holds it; on success
        record this process as the holder (unless not `record`). Never blocks."""
        if self.held:
            return True
        try:
            if not flock.try_lock(self._descriptor()):
                return False
        except OSError as exc:
            raise self._lock_error(exc) from None
        self._taken(record)
        return True

    def _descriptor(self) -> int:
        if self._fd is None:
            raise BankError(f"bank {self.bank}: writer lock used after release")
        return self._fd

    def _lock_error(self, exc: OSError) -> BankError:
        return BankError(f"bank {self.bank}: cannot lock {self.path} ({exc.strerror or exc})")

    def _taken(self, record: bool = True) -> None:
        """The lock is held now: record this process as the holder (unless not `record`)."""
        self.held = True
        if not record or self._fd is None:
            return
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "command": _command_line(),
        }
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(info, sort_keys=True) + "\n").encode(), 0)
        except OSError:
            pass  # naming the holder is a courtesy; the lock itself is held

    def holder(self) -> str:
        """Who holds the lock, as the holder recorded it; says so when unknown."""
        if self._fd is None:
            return "an unknown process"
        try:
            raw = os.pread(self._fd, 4096, 0)
            info = json.loads(raw) if raw.strip() else None
        except (OSError, ValueError):
            info = None
        if not isinstance(info, dict):
            return "another process (it has not said which yet)"
        return _describe(info)

    def busy_error(self) -> BankBusyError:
        holder = self.holder()
        return BankBusyError(
            f"bank {self.bank}: being written by {holder}; wait for it to finish or pass --wait",
            holder,
        )

    def waiting_message(self) -> str:
        return f"bank {self.bank}: being written by {self.holder()}; waiting for it to finish"

    def acquire(self, wait: bool = False, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock. Without `wait` a busy bank raises BankBusyError naming the
        holder; with it, block until the holder lets go, reporting once through
        `on_wait` whom it waits for. A signal (KeyboardInterrupt) ends the wait; nothing
        is then held."""
        if self.try_acquire():
            return
        if not wait:
            raise self.busy_error()
        if on_wait is not None:
            on_wait(self.waiting_message())
        try:
            flock.lock(self._descriptor())
        except OSError as exc:
            raise self._lock_error(exc) from None
        self._taken()

    async def wait(self) -> None:
        """Take the lock, waiting (in trio) while another holds it, and record this
        process as the holder. Cancellable; cancelled, it holds nothing."""
        if self.held:
            return
        try:
            await flock.wait_lock(self._descriptor())
        except OSError as exc:
            raise self._lock_error(exc) from None
        self._taken()

    def release(self) -> None:
        """Let go of the lock (closing the descriptor releases it)."""
        fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"WriterLock({str(self.bank)!r}, held={self.held})"


def busy_holder(bank: str | os.PathLike[str]) -> str | None:
    """Who writes the bank at `bank` now, or None when nobody does (or there is no bank
    yet). A probe: the lock is taken and let go at once, so another would-be writer
    that asks in that instant without waiting may see the bank busy."""
    if not (Path(bank) / LOCK_NAME).exists():
        return None
    lock = WriterLock(bank)
    try:
        return None if lock.try_acquire(record=False) else lock.holder()
    finally:
        lock.release()

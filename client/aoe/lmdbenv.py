"""How one process uses one LMDB environment of a bank: map sizes, transactions that
survive another process remapping the bank, and lmdb errors translated into BankError.

A bank is mapped once, as large as its address space allows (`MAP_SIZES`): the map is
address space only, the file grows as pages are used, so a fixed large map never needs
a resize under live transactions, which LMDB forbids.

Another process may still grow a bank past this process's map (a writer that mapped
more, or an older aoed that grew its map). LMDB then refuses this process's next
transaction with MapResizedError, and the remedy, `set_mapsize(0)` (adopt the size the
bank now records), is only allowed while no transaction of this process is live on
that environment. `TxnGate` makes that so: every transaction runs under a shared hold,
the remap under an exclusive one.

No process may touch a page of a bank file through a writable map before the filesystem
has allocated it: on a full disk the kernel answers such a write with SIGBUS, which ends
the process without a word. The data file is never mapped writable (writers open it
without `writemap`, so pages reach it by `pwrite`, whose ENOSPC is an error LMDB
reports); the lock file, whose reader table LMDB writes through a shared map, has its
blocks allocated before LMDB opens it (`reserve_lock_file`).

Nor may LMDB be handed a data file that lacks pages its meta page counts (a truncated
bank is SIGBUS at the first read): every opener checks the file first
(`aoe.lmdbcheck.find_damage`), and a damaged page LMDB reports later is a
BankDamagedError naming the file and what to do, never the advice for a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb

from aoe.errors import BankDamagedError, BankError, BankWriteError
from aoe.lmdbcheck import damaged

__all__ = [
    "FULL_MAP",
    "LOCK_BYTES",
    "MAP_SIZES",
    "TxnGate",
    "bank_error",
    "free_bytes",
    "lmdb_errors",
    "read_every_record",
    "reserve_lock_file",
]

#: The map a bank is opened with where the address space allows it (1 TiB).
FULL_MAP = 1 << 40
#: Map sizes to try in order: smaller ones only where the address space is limited
#: (ulimit -v). The last is one page: LMDB raises it to what the file holds.
MAP_SIZES = (FULL_MAP, 1 << 36, 1 << 32, 1 << 30, mmap.PAGESIZE)

#: Size of LMDB's lock file for its default 126 reader slots (LMDB 0.9 on 64-bit: a
#: 192-byte header holding the first slot, then 64 bytes per slot), which is what every
#: bank is opened with; `reserve_lock_file` gives a new lock file exactly this size, so
#: LMDB finds it as large as it would have made it.
LOCK_BYTES = 192 + 125 * 64

#: errno values of a write the disk did not take (full, over quota, file too large, I/O).
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})

#: lmdb errors that mean the data file holds what LMDB did not write there: a page that
#: is not what the tree says, or not in the file. A failed transaction (MDB_BAD_TXN) is
#: one too: no transaction here goes on after an lmdb error, so LMDB marked it failed
#: inside one of its own calls, which is where it meets a damaged page.
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.BadChecksumError,
    lmdb.BadTxnError,
    lmdb.PageFullError,
    lmdb.CursorFullError,
)

#: Named databases `read_every_record` can open (a bank has 8).
_MAX_DBS = 64

#: Remaps tried for one transaction before giving up: each adopts the size the bank
#: records at that moment, so only a bank growing again meanwhile needs another.
_REMAPS = 5


class TxnGate:
    """A readers-writer gate for the transactions of one LMDB environment in a process.

    Invariant: every transaction of the environment is begun and ended under a shared
    hold (`transaction()` does both), and `env.set_mapsize()` runs only under the
    exclusive hold (`remap()`), which is granted when no shared hold is live. So no
    transaction is live while the map changes.

    Shared holds are reentrant per thread (a thread iterating one snapshot may look up
    in another), and never wait for a pending remap when the thread already holds one,
    since the remap cannot proceed before that thread lets go anyway. Remaps are rare
    (another process grew the bank past our map), and while one is due every new
    transaction fails at its start and lets go, so the holds drain quickly.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holds: Counter[int] = Counter()  # thread id -> live shared holds
        self._remapping = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            while self._remapping and not self._holds[me]:
                self._cond.wait()
            self._holds[me] += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds[me] -= 1
                if not self._holds[me]:
                    del self._holds[me]
                    self._cond.notify_all()

    def remap(self, env: lmdb.Environment) -> bool:
        """Adopt the map size the bank records (`set_mapsize(0)`) once no transaction of
        this process is live. False, changing nothing, when the calling thread itself
        holds a transaction (it would wait for itself)."""
        me = threading.get_ident()
        with self._cond:
            if self._holds[me]:  # (a Counter lookup inserts nothing)
                return False
            while self._remapping:
                self._cond.wait()
            self._remapping = True
            while self._holds:
                self._cond.wait()
        try:
            env.set_mapsize(0)
        finally:
            with self._cond:
                self._remapping = False
                self._cond.notify_all()
        return True

    @contextlib.contextmanager
    def transaction(
        self, env: lmdb.Environment, path: Path, *, write: bool = False, db: Any = None
    ) -> Iterator[lmdb.Transaction[bytes]]:
        """A transaction under a shared hold: committed when the block ends normally
        (a read transaction just ends), aborted when it raises. A transaction refused
        because another process grew the bank past our map is retried after a remap.
        Raises lmdb errors as they come (callers translate them with `lmdb_errors`),
        and BankError when the bank keeps growing or this thread holds another
        transaction of the same environment while a remap is due."""
        for _ in range(_REMAPS):
            with self.shared():
                try:
                    txn = env.begin(write=write, db=db)
                except lmdb.MapResizedError:
                    pass
                else:
                    with txn:
                        yield txn
                    return
            if not self.remap(env):
                raise BankError(
                    f"bank {path}: grew in another process while this thread held a read "
                    "snapshot of it; finish or close that read (e.g. an unfinished iteration) and retry"
                )
        raise BankError(
            f"bank {path}: kept growing in another process faster than this one could map it; retry"
        )


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def free_bytes(path: Path) -> int | None:
    """Free bytes of the filesystem holding `path` (or its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def _free(path: Path) -> str:
    free = free_bytes(path)
    return "unknown" if free is None else _size(free)


#: Below this much free space an I/O error from a commit is read as a full disk: LMDB
#: reports a write that found no room as EIO when it fails while flushing pages.
_FULL_BELOW = 1 << 20


def _disk_full(path: Path, doing: str) -> str:
    return (
        f"bank {path}: {doing} failed, the disk holding it is full ({_free(path)} free there); nothing was "
        "written, and what the bank held is intact; free space there (or move the bank) and retry"
    )


def _write_failure(exc: lmdb.Error) -> bool:
    """True for an error that means a write did not fit or did not reach the disk."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.TxnFullError, lmdb.DiskError)):
        return True
    return getattr(exc, "code", 0) in _WRITE_ERRNOS


def _advice(exc: lmdb.Error, path: Path, doing: str, map_size: int) -> str:
    code = getattr(exc, "code", 0)
    if isinstance(exc, lmdb.DiskError) or code in (errno.ENOSPC, errno.EDQUOT):
        return _disk_full(path, doing)
    if code == errno.EIO and (free_bytes(path) or 0) < _FULL_BELOW:
        return _disk_full(path, doing)
    if isinstance(exc, (lmdb.MapFullError, lmdb.TxnFullError)):
        return (
            f"bank {path}: full, the {doing} does not fit in its {_size(map_size)} map; drop its "
            f"history with `aoe bank prune --bank {path}`, or export what matters into a new bank"
        )
    if isinstance(exc, lmdb.ReadersFullError):
        return (
            f"bank {path}: too many processes read it at once ({exc}); close readers that are "
            "done with it (each process opening it holds a slot) and retry"
        )
    if isinstance(exc, lmdb.MapResizedError):
        return f"bank {path}: grown by another process during {doing}; retry"
    if isinstance(exc, (lmdb.VersionMismatchError, lmdb.IncompatibleError)):
        return (
            f"bank {path}: {doing} failed, the bank was written by another version of LMDB or "
            f"opened with other settings ({exc}); open it with the aoe that wrote it and "
            "export it (aoe bank export), then import that into a new bank"
        )
    if isinstance(exc, lmdb.ReadonlyError):
        return f"bank {path}: {doing} failed, the bank is read-only here ({exc}); check its permissions"
    return (
        f"bank {path}: {doing} failed ({exc}); check free disk space and the permissions "
        "of the bank directory, then retry"
    )


def bank_error(
    exc: lmdb.Error, path: Path, doing: str, env: lmdb.Environment | None = None
) -> BankError:
    """The BankError for `exc`: one line naming the bank, what failed and what to do;
    a BankWriteError when a write did not fit (disk or map full) or the disk failed it;
    a BankDamagedError when LMDB met a damaged page, or gave up on the bank (MDB_PANIC)."""
    if isinstance(exc, lmdb.PanicError):
        return BankDamagedError(
            f"bank {path}: {doing} failed: LMDB gave up on the bank in this process ({exc}), "
            "after a write of its meta page failed; what was committed before that is in the "
            "file. Run the command again (aoed uses the bank again once restarted); if this "
            f"comes back, check the disk and run `aoe bank check --bank {path}`"
        )
    if isinstance(exc, _DAMAGE):
        return damaged(path, [f"{doing} failed, LMDB found {exc}"])
    map_size = 0
    if env is not None:
        with contextlib.suppress(lmdb.Error):
            map_size = env.info()["map_size"]
    cls = BankWriteError if _write_failure(exc) else BankError
    return cls(_advice(exc, path, doing, map_size))


def reserve_lock_file(path: Path, create: bool = True) -> None:
    """Have the filesystem allocate every block of the lock file of the bank at `path`
    (`lock.mdb`) before LMDB maps it (see the module's doc: a write through a map into
    an unallocated page on a full disk is SIGBUS). A lock file that does not exist is
    created at LOCK_BYTES when `create`; one that exists keeps its size, because every
    process that has it open mapped that much, and only has its holes filled.

    Raises BankWriteError naming the bank and its free space when the disk has no room
    for it. Does nothing where the file cannot be opened for writing (a reader without
    write access, which opens the bank without LMDB's lock) or is absent and not to be
    created."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path / "lock.mdb", flags, 0o644)  # LMDB's own mode for its files
    except OSError:
        return  # LMDB's open will report what is wrong, or a reader goes without the lock
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size or LOCK_BYTES)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BankWriteError(_disk_full(path, "open")) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (glibc emulates where unsupported)
            raise BankError(
                f"bank {path}: cannot allocate its lock file ({exc.strerror or exc})"
            ) from None
    finally:
        os.close(fd)


def read_every_record(path: Path) -> dict[str, int]:
    """Read every record of every named database of the bank at `path` through LMDB,
    from one snapshot; returns how many each holds. Only for a bank whose data file
    `aoe.lmdbcheck.find_damage(path, walk=True)` passed: LMDB then reads no page the
    walk did not check. Takes a reader slot where lock.mdb is writable (a writer then
    leaves the snapshot alone); without one, read only while nothing writes the bank.
    Raises BankError (BankDamagedError for a page LMDB finds damaged)."""
    reserve_lock_file(path)
    counts: dict[str, int] = {}
    with lmdb_errors(path, "check"):
        env = lmdb.open(
            str(path),
            readonly=True,
            lock=os.access(path / "lock.mdb", os.W_OK),
            create=False,
            subdir=True,
            max_dbs=_MAX_DBS,
        )
        try:
            with env.begin() as txn:
                names = [name for name, _ in txn.cursor()]  # the main db: one per database
                for name in names:
                    db = env.open_db(name, txn=txn, create=False)
                    counts[name.decode(errors="replace")] = sum(1 for _ in txn.cursor(db=db))
        finally:
            env.close()
    return counts


@contextlib.contextmanager
def lmdb_errors(path: Path, doing: str, env: lmdb.Environment | None = None) -> Iterator[None]:
    """Translate any lmdb.Error raised in the block into a BankError (`bank_error`);
    `doing` names the operation ("lookup")."""
    try:
        yield
    except lmdb.Error as exc:
        raise bank_error(exc, path, doing, env) from None

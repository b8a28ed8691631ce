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
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb

from aoe.errors import BankError

__all__ = ["FULL_MAP", "MAP_SIZES", "TxnGate", "bank_error", "lmdb_errors"]

#: The map a bank is opened with where the address space allows it (1 TiB).
FULL_MAP = 1 << 40
#: Map sizes to try in order: smaller ones only where the address space is limited
#: (ulimit -v). The last is one page: LMDB raises it to what the file holds.
MAP_SIZES = (FULL_MAP, 1 << 36, 1 << 32, 1 << 30, mmap.PAGESIZE)

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
    ) -> Iterator[lmdb.Transaction]:
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
        raise BankError(f"bank {path}: kept growing in another process faster than this one could map it; retry")


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _advice(exc: lmdb.Error, path: Path, doing: str, map_size: int) -> str:
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
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PanicError, lmdb.InvalidError, lmdb.PageNotFoundError,
                        lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadChecksumError)):  # fmt: skip
        return (
            f"bank {path}: {doing} failed, the bank's files are damaged or not LMDB's ({exc}); "
            "move the directory aside and restore the bank from an export (aoe bank import)"
        )
    if isinstance(exc, lmdb.ReadonlyError):
        return f"bank {path}: {doing} failed, the bank is read-only here ({exc}); check its permissions"
    return (
        f"bank {path}: {doing} failed ({exc}); check free disk space and the permissions "
        "of the bank directory, then retry"
    )


def bank_error(exc: lmdb.Error, path: Path, doing: str, env: lmdb.Environment | None = None) -> BankError:
    """The BankError for `exc`: one line naming the bank, what failed and what to do."""
    map_size = 0
    if env is not None:
        with contextlib.suppress(lmdb.Error):
            map_size = env.info()["map_size"]
    return BankError(_advice(exc, path, doing, map_size))


@contextlib.contextmanager
def lmdb_errors(path: Path, doing: str, env: lmdb.Environment | None = None) -> Iterator[None]:
    """Translate any lmdb.Error raised in the block into a BankError (`bank_error`);
    `doing` names the operation ("lookup")."""
    try:
        yield
    except lmdb.Error as exc:
        raise bank_error(exc, path, doing, env) from None

"""The writable LMDB bank: the only place that opens LMDB for writing.

One environment holds named databases:
  meta      schema version of the layout
  entries   bank key -> aoe.v1.BankEntry (the best known strategy per key: what serves)
  defaults  bank key -> JSON: tuned, and the default stayed best (not an entry, but no
            reason to measure again unless REPEAT_TUNE)
  history   bank key + "/" + 16 hex digits of ns time -> JSON of one measured trial
  decisions run key + "/" + bank key -> JSON: what one run of a job decided for a task,
            kept until that run ends, so an interrupted job run again measures nothing
            twice (engine/resume.py); private to the writer, never exported

A key holds an entry or a default record, not both: putting one deletes the other.
Keys sort by signature digest first (see `aoe.signature.bank_key`), so every device and
precision known for a task is one range scan away; no secondary index is needed.

One writer per bank, across processes: a store holds the bank's writer lock
(`aoed.bank.lock`) from open to close, and a second store on the same bank, in this
process or another, is refused with BankBusyError (or waits for it, if asked to).

The map is fixed when the store opens (`aoe._lmdb.MAP_SIZES`: as much address space as
the process may map, which costs no disk), so it is never resized under a live
transaction; a bank that fills it is a BankError saying so. Another process that grew
the bank past this map (an older writer) is followed with a remap between transactions
(`aoe._lmdb.TxnGate`).

A bank whose data file is removed or replaced while a store has it open (a folder
deleted, a backup restored over it) would go on taking writes into the unlinked file, and
lose every one of them at close. So each write first checks that path/data.mdb is still
the file opened, and refuses with a BankError naming the bank when it is not.

Every method runs whole transactions and returns; callers on trio run them in a worker
thread. Every lmdb error leaves as a BankError naming the bank and what to do; a write
the disk or the map had no room for (or the disk failed) as a BankWriteError, after
which the store goes on: nothing of that write is in the bank, everything before is. A
full disk never takes the process down (see `aoe._lmdb` on SIGBUS). A crash mid-write
loses at most the transaction in flight: LMDB commits are atomic.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from aoe._lmdb import MAP_SIZES, TxnGate, bank_error, lmdb_errors, reserve_lock_file
from aoe.bank import CUSTOM, MAX_DBS, LayerStats, default_bank_path, parse_schema, used_bytes
from aoe.errors import BankError
from aoe.signature import SCHEMA_VERSION
from aoed.bank._codec import encode_doc
from aoed.bank.lock import WriterLock

__all__ = [
    "DEFAULT", "ENTRY", "KINDS", "TRIAL", "BankStore", "MergeCounts", "PruneCounts", "Record",
    "default_bank_path", "encode_doc", "history_key",
]  # fmt: skip

#: Kinds of record a bank keeps (and an exchange carries).
ENTRY, DEFAULT, TRIAL = "entry", "default", "trial"
KINDS = (ENTRY, DEFAULT, TRIAL)
#: Writes per transaction for bulk operations (merge): a crash loses at most one batch.
_BATCH = 2000

#: Schema migrations: version -> function upgrading a write transaction's bank from that
#: version to the next. Versions absent here are refused with a message.
_MIGRATIONS: dict[int, Callable[[lmdb.Transaction, dict[str, Any]], None]] = {}


def history_key(key: bytes, time_ns: int) -> bytes:
    """The history key of a trial of `key` recorded at `time_ns`."""
    return key + b"/" + f"{time_ns:016x}".encode()


@dataclass(frozen=True)
class Record:
    """One stored record of some kind: an entry (a serialized aoe.v1.BankEntry) or a
    default record (JSON) under its bank key, or a trial (JSON) under its history key."""

    kind: str
    key: bytes
    value: bytes


@dataclass(frozen=True)
class MergeCounts:
    added: int = 0
    updated: int = 0
    kept: int = 0


@dataclass(frozen=True)
class PruneCounts:
    trials_removed: int
    entries_kept: int
    used_bytes_before: int
    used_bytes_after: int


class BankStore:
    """The writable bank at `path`, holding its writer lock until `close()`.

    `map_size`: bytes of address space to map (default: the largest the process may,
    see `aoe._lmdb.MAP_SIZES`); tests pass a small one. Without `wait` a bank another
    process writes raises BankBusyError naming it; with `wait` the constructor polls
    until the bank is free, reporting once through `on_wait` whom it waits for. `lock`:
    a WriterLock the caller took already (the store owns it from then on). Raises
    BankError when the bank cannot be opened or has another schema.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        map_size: int | None = None,
        *,
        wait: bool = False,
        on_wait: Callable[[str], None] | None = None,
        lock: WriterLock | None = None,
    ):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise BankError(f"bank {self.path}: not a directory; pass a directory for the bank")
        self._lock = lock if lock is not None else WriterLock(self.path)
        self._gate = TxnGate()
        self.env: lmdb.Environment | None = None
        try:
            self._lock.acquire(wait, on_wait)
            self.env = self._open(map_size)
            self._data_id = self._data_file()
            with lmdb_errors(self.path, "open", self.env):
                self._meta = self.env.open_db(b"meta")
                self._entries = self.env.open_db(b"entries")
                self._defaults = self.env.open_db(b"defaults")
                self._history = self.env.open_db(b"history")
                self._decisions = self.env.open_db(b"decisions")
            self._check_schema()
        except BaseException:
            # A refused bank must not stay open, nor locked, in this process.
            if self.env is not None:
                self.env.close()
            self._lock.release()
            raise

    def _open(self, map_size: int | None) -> lmdb.Environment:
        reserve_lock_file(self.path)
        # The smallest of MAP_SIZES (one page: what the file holds) is for readers only.
        for size in (map_size,) if map_size else MAP_SIZES[:-1]:
            try:
                # Never writemap: pages written through a map onto a full disk are SIGBUS
                # (see aoe._lmdb); written with pwrite, they are an ENOSPC LMDB reports.
                return lmdb.open(str(self.path), map_size=size, max_dbs=MAX_DBS, subdir=True, writemap=False)
            except lmdb.MemoryError:
                continue  # address space limited (ulimit -v): try a smaller map
            except lmdb.Error as exc:
                raise bank_error(exc, self.path, "open") from None
        raise BankError(f"bank {self.path}: cannot map the bank into memory; raise the address space limit (ulimit -v)")

    def _data_file(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the bank's data file; None when it is gone."""
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BankError(f"bank {self.path}: cannot check its data file ({exc.strerror or exc})") from None
        return st.st_dev, st.st_ino

    @contextlib.contextmanager
    def _txn(self, doing: str, write: bool = False, db: Any = None) -> Iterator[lmdb.Transaction]:
        """A transaction under the gate, with lmdb errors translated (see module doc); a
        write one only while the data file is the one opened."""
        assert self.env is not None, "bank store used after close()"
        if write and self._data_file() != self._data_id:
            raise BankError(f"bank {self.path}: its data file was removed or replaced while open, so this write "
                            "would be lost; restart aoed (or rerun the command) to open the bank at that path again")  # fmt: skip
        with lmdb_errors(self.path, doing, self.env), self._gate.transaction(
            self.env, self.path, write=write, db=db
        ) as txn:
            yield txn

    def _check_schema(self) -> None:
        """Record the schema in a new bank; migrate an older one in one transaction, or
        refuse it (and any newer one) with a BankError that says what to do."""
        with self._txn("schema check", write=True, db=self._meta) as txn:
            raw = txn.get(b"schema_version")
            if raw is None:
                if txn.stat(self._entries)["entries"] or txn.stat(self._history)["entries"]:
                    raise BankError(f"bank {self.path}: holds data but no schema version; not a bank aoed wrote")
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode())
                return
            version = parse_schema(self.path, raw)
            dbs = {"meta": self._meta, "entries": self._entries, "defaults": self._defaults, "history": self._history}
            while version < SCHEMA_VERSION:
                step = _MIGRATIONS.get(version)
                if step is None:
                    raise BankError(
                        f"bank {self.path}: schema version {version} is older than this aoed's "
                        f"({SCHEMA_VERSION}) and cannot be migrated (its task signatures are "
                        "computed differently); move it aside and tune into a new bank"
                    )
                step(txn, dbs)
                version += 1
                txn.put(b"schema_version", str(version).encode())

    def get(self, key: bytes) -> bytes | None:
        with self._txn("lookup", db=self._entries) as txn:
            return txn.get(key)

    def get_default(self, key: bytes) -> dict[str, Any] | None:
        with self._txn("lookup", db=self._defaults) as txn:
            raw = txn.get(key)
        return json.loads(raw) if raw is not None else None

    def commit(
        self,
        entries: Iterable[tuple[bytes, bytes]] = (),
        defaults: Iterable[tuple[bytes, dict[str, Any]]] = (),
        trials: Iterable[tuple[bytes, dict[str, Any]]] = (),
        decisions: Iterable[tuple[bytes, dict[str, Any]]] = (),
        forget: Iterable[bytes] = (),
    ) -> None:
        """Write everything given in one transaction (all or nothing): `decisions` put
        under their keys, and every decision whose key starts with one of the `forget`
        prefixes deleted. A bank too full for it is a BankError, and nothing of it is
        written."""
        entries, defaults, trials, decisions = list(entries), list(defaults), list(trials), list(decisions)
        forget = list(forget)
        with self._txn("write", write=True) as txn:
            for prefix in forget:
                cur = txn.cursor(db=self._decisions)
                found = cur.set_range(prefix)
                while found and cur.key().startswith(prefix):
                    found = cur.delete()
            for key, doc in decisions:
                txn.put(key, encode_doc(doc), db=self._decisions)
            for key, value in entries:
                txn.put(key, value, db=self._entries)
                txn.delete(key, db=self._defaults)
            for key, doc in defaults:
                txn.put(key, encode_doc(doc), db=self._defaults)
            now = time.time_ns()
            for i, (key, doc) in enumerate(trials):
                txn.put(history_key(key, now + i), encode_doc(doc), db=self._history)

    def decisions(self, prefix: bytes) -> list[tuple[bytes, dict[str, Any]]]:
        """(key, document) of every decision whose key starts with `prefix`, in key order."""
        out = []
        with self._txn("lookup", db=self._decisions) as txn:
            cur = txn.cursor()
            found = cur.set_range(prefix)
            while found and cur.key().startswith(prefix):
                out.append((cur.key(), json.loads(cur.value())))
                found = cur.next()
        return out

    def items(self, db: str = "entries") -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of one named db in key order, from one read snapshot."""
        handle = {"entries": self._entries, "defaults": self._defaults, "history": self._history}[db]
        with self._txn("read", db=handle) as txn:
            yield from txn.cursor()

    def merge(self, records: Iterable[Record], replace: Callable[[Record, Record], bool]) -> dict[str, MergeCounts]:
        """Merge `records` of every kind; returns the counts per kind (`KINDS`).

        An entry or default record whose key holds nothing is added. Where the key holds
        a record (of either kind) that differs, `replace(existing, incoming)` decides;
        a replacement deletes the record of the other kind under that key. A trial is
        added when its history key is absent, else kept. Batched transactions: an
        interrupted merge keeps whole batches, and running it again finishes it."""
        counts = {kind: [0, 0, 0] for kind in KINDS}  # added, updated, kept
        batch: list[Record] = []

        def flush() -> None:
            got = {kind: [0, 0, 0] for kind in KINDS}
            with self._txn("import", write=True) as txn:
                for rec in batch:
                    n = got[rec.kind]
                    if rec.kind == TRIAL:
                        n[0 if txn.put(rec.key, rec.value, db=self._history, overwrite=False) else 2] += 1
                        continue
                    old = self._existing(txn, rec.key)
                    if old is None:
                        n[0] += 1
                    elif old == rec or not replace(old, rec):
                        n[2] += 1
                        continue
                    else:
                        n[1] += 1
                    mine, other = (self._entries, self._defaults) if rec.kind == ENTRY else (self._defaults, self._entries)
                    txn.put(rec.key, rec.value, db=mine)
                    txn.delete(rec.key, db=other)
            for kind in KINDS:  # counted only once the batch is committed
                counts[kind] = [a + b for a, b in zip(counts[kind], got[kind])]
            batch.clear()

        for rec in records:
            if rec.kind not in KINDS:
                raise ValueError(f"unknown record kind {rec.kind!r}")
            batch.append(rec)
            if len(batch) >= _BATCH:
                flush()
        if batch:
            flush()
        return {kind: MergeCounts(*n) for kind, n in counts.items()}

    def _existing(self, txn: lmdb.Transaction, key: bytes) -> Record | None:
        raw = txn.get(key, db=self._entries)
        if raw is not None:
            return Record(ENTRY, key, raw)
        raw = txn.get(key, db=self._defaults)
        return Record(DEFAULT, key, raw) if raw is not None else None

    def prune(self, dry_run: bool = False) -> PruneCounts:
        """Drop the measurement history, keep winners and defaults (one transaction).
        What interrupted jobs had decided goes too: run again, they measure it again."""
        before = self.stats()
        if not dry_run:
            with self._txn("prune", write=True) as txn:
                txn.drop(self._history, delete=False)
                txn.drop(self._decisions, delete=False)
        after = self.stats() if not dry_run else before
        return PruneCounts(before.history, before.entries, before.used_bytes, after.used_bytes)

    def stats(self) -> LayerStats:
        """Counts and sizes of this bank, as the reader reports a layer's."""
        assert self.env is not None, "bank store used after close()"
        with self._txn("stats") as txn:
            dbs = (self._meta, self._entries, self._defaults, self._history)
            counts = [txn.stat(db)["entries"] for db in dbs[1:]]
            used = used_bytes(self.env, txn, dbs)
            raw = txn.get(b"schema_version", db=self._meta)
            map_size = self.env.info()["map_size"]
        return LayerStats(CUSTOM, str(self.path), *counts, map_size, used, int(raw or SCHEMA_VERSION))

    def counts(self) -> dict[str, int]:
        st = self.stats()
        return {"entries": st.entries, "defaults": st.defaults, "history": st.history}

    def close(self) -> None:
        """Close the environment and let go of the writer lock (safe to repeat)."""
        env, self.env = self.env, None
        if env is not None:
            env.close()
        self._lock.release()

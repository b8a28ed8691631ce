"""The writable LMDB bank: the only place that opens LMDB for writing.

One environment holds named databases:
  meta      schema version of the layout
  entries   bank key -> aoe.v1.BankEntry (the best known strategy per key: what serves)
  defaults  bank key -> JSON: tuned, and the default stayed best (not an entry, but no
            reason to measure again unless REPEAT_TUNE)
  history   bank key + "/" + 16 hex digits of ns time -> JSON of one measured trial

Keys sort by signature digest first (see `aoe.signature.bank_key`), so every device and
precision known for a task is one range scan away; no secondary index is needed.

Every method runs one whole transaction and returns; callers on trio run them in a
worker thread. A full map grows (doubles) and the write is retried, so a growing bank
never fails a job. A crash mid-write loses at most the transaction in flight: LMDB
commits are atomic.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from aoe.bank import CUSTOM, MAX_DBS, READER_MAP, LayerStats, default_bank_path, parse_schema, used_bytes
from aoe.errors import BankError
from aoe.signature import SCHEMA_VERSION

__all__ = ["BankStore", "MergeCounts", "PruneCounts", "default_bank_path"]

_INITIAL_MAP = 64 << 20
_MAX_MAP = READER_MAP
#: Writes per transaction for bulk operations (merge): a crash loses at most one batch.
_BATCH = 2000

#: Schema migrations: version -> function upgrading a write transaction's bank from that
#: version to the next. Versions absent here are refused with a message.
_MIGRATIONS: dict[int, Callable[[lmdb.Transaction, dict[str, Any]], None]] = {}


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
    def __init__(self, path: str | os.PathLike[str], map_size: int = _INITIAL_MAP):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path, os.W_OK):
                raise BankError(f"bank {self.path}: directory is not writable")
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=MAX_DBS, subdir=True)
            self._meta = self.env.open_db(b"meta")
            self._entries = self.env.open_db(b"entries")
            self._defaults = self.env.open_db(b"defaults")
            self._history = self.env.open_db(b"history")
        except lmdb.Error as exc:
            raise BankError(f"bank {self.path}: cannot open ({exc})") from None
        except OSError as exc:
            raise BankError(f"bank {self.path}: {exc.strerror or exc}") from None
        try:
            self._check_schema()
        except BaseException:
            self.env.close()  # a refused bank must not stay open in this process
            raise

    def _check_schema(self) -> None:
        """Record the schema in a new bank; migrate an older one in one transaction, or
        refuse it (and any newer one) with a BankError that says what to do."""
        with self.env.begin(write=True, db=self._meta) as txn:
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
        with self.env.begin(db=self._entries) as txn:
            return txn.get(key)

    def get_default(self, key: bytes) -> dict[str, Any] | None:
        with self.env.begin(db=self._defaults) as txn:
            raw = txn.get(key)
        return json.loads(raw) if raw is not None else None

    def commit(
        self,
        entries: Iterable[tuple[bytes, bytes]] = (),
        defaults: Iterable[tuple[bytes, dict[str, Any]]] = (),
        trials: Iterable[tuple[bytes, dict[str, Any]]] = (),
    ) -> None:
        """Write everything given in one transaction (all or nothing)."""
        entries, defaults, trials = list(entries), list(defaults), list(trials)
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in entries:
                        txn.put(key, value, db=self._entries)
                        txn.delete(key, db=self._defaults)
                    for key, doc in defaults:
                        txn.put(key, json.dumps(doc, sort_keys=True).encode(), db=self._defaults)
                    for i, (key, doc) in enumerate(trials):
                        hkey = key + b"/" + f"{time.time_ns() + i:016x}".encode()
                        txn.put(hkey, json.dumps(doc, sort_keys=True).encode(), db=self._history)
                return
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as exc:
                raise BankError(f"bank {self.path}: write failed ({exc})") from None

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        if size > _MAX_MAP:
            raise BankError(f"bank {self.path}: map would exceed {_MAX_MAP >> 30} GiB")
        self.env.set_mapsize(size)

    def items(self, db: str = "entries") -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of one named db in key order, from one read snapshot."""
        handle = {"entries": self._entries, "defaults": self._defaults, "history": self._history}[db]
        with self.env.begin(db=handle) as txn:
            yield from txn.cursor()

    def merge(
        self,
        items: Iterable[tuple[bytes, bytes]],
        replace: Callable[[bytes, bytes], bool],
    ) -> MergeCounts:
        """Put each (key, entry) whose key is new; where the key exists, replace the entry
        when `replace(existing, incoming)` says so. Batched transactions: an interrupted
        merge keeps whole batches, and running it again finishes it."""
        added = updated = kept = 0
        batch: list[tuple[bytes, bytes]] = []

        def flush() -> None:
            nonlocal added, updated, kept
            while True:
                a = u = k = 0
                try:
                    with self.env.begin(write=True) as txn:
                        for key, value in batch:
                            old = txn.get(key, db=self._entries)
                            if old is None:
                                a += 1
                            elif old == value or not replace(old, value):
                                k += 1
                                continue
                            else:
                                u += 1
                            txn.put(key, value, db=self._entries)
                            txn.delete(key, db=self._defaults)
                    break
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.Error as exc:
                    raise BankError(f"bank {self.path}: write failed ({exc})") from None
            added, updated, kept = added + a, updated + u, kept + k
            batch.clear()

        for item in items:
            batch.append(item)
            if len(batch) >= _BATCH:
                flush()
        if batch:
            flush()
        return MergeCounts(added, updated, kept)

    def prune(self, dry_run: bool = False) -> PruneCounts:
        """Drop the measurement history, keep winners and defaults (one transaction)."""
        before = self.stats()
        if not dry_run:
            try:
                with self.env.begin(write=True) as txn:
                    txn.drop(self._history, delete=False)
            except lmdb.Error as exc:
                raise BankError(f"bank {self.path}: prune failed ({exc})") from None
        after = self.stats() if not dry_run else before
        return PruneCounts(before.history, before.entries, before.used_bytes, after.used_bytes)

    def stats(self) -> LayerStats:
        """Counts and sizes of this bank, as the reader reports a layer's."""
        with self.env.begin() as txn:
            dbs = (self._meta, self._entries, self._defaults, self._history)
            counts = [txn.stat(db)["entries"] for db in dbs[1:]]
            used = used_bytes(self.env, txn, dbs)
            raw = txn.get(b"schema_version", db=self._meta)
        return LayerStats(
            CUSTOM, str(self.path), *counts, self.env.info()["map_size"], used, int(raw or SCHEMA_VERSION)
        )

    def counts(self) -> dict[str, int]:
        st = self.stats()
        return {"entries": st.entries, "defaults": st.defaults, "history": st.history}

    def close(self) -> None:
        self.env.close()

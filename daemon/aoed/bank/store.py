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
  log       sequence number (8 bytes, big-endian) -> which record that write put there:
            commit time (8 bytes, ns) + kind + NUL + key
  logidx    kind + NUL + key -> the sequence number of the record's latest write
  peers     a followed peer's target -> JSON {"bank_id", "seq"}: the last of its writes
            this bank applied

A key holds an entry or a default record, not both: putting one deletes the other.

Every write of a record takes the next sequence number, in the transaction that writes
it; the counter lives in meta (`seq`) and never goes back, so a number is never given
twice, even after the history is pruned. The log keeps one line per live record (a record
written again moves to its new number; a deleted one leaves the log), so `changes(after)`
is every record whose latest write came after `after`, in the order of those writes: what
a follower of this bank (`aoed.bank.follow`) has not seen. A put that would store the
bytes already there writes nothing and takes no number, so merging what a peer sent back
ends the echo. A bank from before the log gets its numbers on first open, in key order.
`bank_id` (meta) names this bank to its followers: another bank at the same address
(a new one) is followed from its start again.

A new kind of record needs its named database in `self._dbs`, its merge rule here
(`_EXCLUSIVE` with its pair, else added when absent), and its check in
`_codec.check_stored`; the log, FollowBank and the followers carry it as they are.
Keys sort by signature digest first (see `aoe.keys.bank_key`), so every device and
precision known for a task is one range scan away; no secondary index is needed.

One writer per bank, across processes: a store holds the bank's writer lock
(`aoed.bank.lock`) from open to close, and a second store on the same bank, in this
process or another, is refused with BankBusyError (or waits for it, if asked to).

The map is fixed when the store opens (`aoe.lmdbenv.MAP_SIZES`: as much address space as
the process may map, which costs no disk), so it is never resized under a live
transaction; a bank that fills it is a BankError saying so. Another process that grew
the bank past this map (an older writer) is followed with a remap between transactions
(`aoe.lmdbenv.TxnGate`).

A bank whose data file is removed or replaced while a store has it open (a folder
deleted, a backup restored over it) would go on taking writes into the unlinked file, and
lose every one of them at close. So each write first checks that path/data.mdb is still
the file opened, and refuses with a BankError naming the bank when it is not.

Every method runs whole transactions and returns; callers on trio run them in a worker
thread. Every lmdb error leaves as a BankError naming the bank and what to do; a write
the disk or the map had no room for (or the disk failed) as a BankWriteError, after
which the store goes on: nothing of that write is in the bank, everything before is. A
full disk never takes the process down (see `aoe.lmdbenv` on SIGBUS). A crash mid-write
loses at most the transaction in flight: LMDB commits are atomic.

Nor does a damaged bank: every page of the data file is walked before LMDB maps it, and
a damaged one is refused with a BankDamagedError naming the file (`aoe.lmdbcheck`).
After each commit the file is lengthened to the pages the commit counts, so that
readers, which check only its size, find it whole without a walk.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from aoe.bank import CUSTOM, MAX_DBS, LayerStats, default_bank_path, parse_schema, used_bytes
from aoe.errors import BankError
from aoe.keys import SCHEMA_VERSION, history_key
from aoe.lmdbcheck import cover_last_page, damaged, find_damage
from aoe.lmdbenv import MAP_SIZES, TxnGate, bank_error, lmdb_errors, reserve_lock_file
from aoed.bank.lock import WriterLock

__all__ = [
    "DEFAULT",
    "ENTRY",
    "KINDS",
    "TRIAL",
    "BankStore",
    "Change",
    "MergeCounts",
    "Position",
    "PruneCounts",
    "Record",
    "default_bank_path",
    "encode_doc",
    "history_key",
]

#: Kinds of record a bank keeps (and an exchange carries).
ENTRY, DEFAULT, TRIAL = "entry", "default", "trial"
KINDS = (ENTRY, DEFAULT, TRIAL)
#: Kinds that share one key space: a key holds a record of one of them, never both.
_EXCLUSIVE = {ENTRY: DEFAULT, DEFAULT: ENTRY}
#: Writes per transaction for bulk operations (merge): a crash loses at most one batch.
_BATCH = 2000
#: meta keys: the last sequence number given out, and this bank's id.
_SEQ, _BANK_ID = b"seq", b"bank_id"
_U64 = struct.Struct(">Q")

#: Schema migrations: version -> function upgrading a write transaction's bank from that
#: version to the next. Versions absent here are refused with a message.
_MIGRATIONS: dict[int, Callable[[lmdb.Transaction[bytes], dict[str, Any]], None]] = {}


def encode_doc(doc: dict[str, Any]) -> bytes:
    """The stored form of a default record or a trial: JSON with sorted keys, so that
    equal documents store equal bytes."""
    return json.dumps(doc, sort_keys=True).encode()


@dataclass(frozen=True)
class Record:
    """One stored record of some kind: an entry (a serialized aoe.v1.BankEntry) or a
    default record (JSON) under its bank key, or a trial (JSON) under its history key
    (`aoe.keys.history_key`). What the store merges, whether it was written here, read
    from an exchange line or sent by a followed peer (`aoed.bank._codec` checks the last
    two); the shapes of a bank record are told in `aoe.bankrecord`."""

    kind: str
    key: bytes
    value: bytes


@dataclass(frozen=True)
class Change:
    """A record as its latest write left it: `seq`, that write's sequence number, and
    `committed_ns`, when it was committed (this host's clock)."""

    seq: int
    kind: str
    key: bytes
    value: bytes
    committed_ns: int


@dataclass(frozen=True)
class Position:
    """Where this bank stands in a peer's log: the peer bank's id and the sequence number
    of its last write applied here."""

    bank_id: str
    seq: int


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
    see `aoe.lmdbenv.MAP_SIZES`); tests pass a small one. Without `wait` a bank another
    process writes raises BankBusyError naming it; with `wait` the constructor blocks
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
                self._log = self.env.open_db(b"log")
                self._logidx = self.env.open_db(b"logidx")
                self._peers = self.env.open_db(b"peers")
            self._dbs = {ENTRY: self._entries, DEFAULT: self._defaults, TRIAL: self._history}
            self._check_schema()
            self.bank_id = self._start_log()
        except BaseException:
            # A refused bank must not stay open, nor locked, in this process.
            if self.env is not None:
                self.env.close()
            self._lock.release()
            raise

    def _open(self, map_size: int | None) -> lmdb.Environment:
        # Every page walked before LMDB maps one: the writer is the long-lived process
        # (aoed), which a bank damaged at rest must not take down (aoe.lmdbcheck).
        problems = find_damage(self.path, walk=True)
        if problems:
            raise damaged(self.path, problems)
        reserve_lock_file(self.path)
        # The smallest of MAP_SIZES (one page: what the file holds) is for readers only.
        for size in (map_size,) if map_size else MAP_SIZES[:-1]:
            try:
                # Never writemap: pages written through a map onto a full disk are SIGBUS
                # (see aoe.lmdbenv); written with pwrite, they are an ENOSPC LMDB reports.
                return lmdb.open(
                    str(self.path), map_size=size, max_dbs=MAX_DBS, subdir=True, writemap=False
                )
            except lmdb.MemoryError:
                continue  # address space limited (ulimit -v): try a smaller map
            except lmdb.Error as exc:
                raise bank_error(exc, self.path, "open") from None
        raise BankError(
            f"bank {self.path}: cannot map the bank into memory; raise the address space limit (ulimit -v)"
        )

    def _data_file(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the bank's data file; None when it is gone."""
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BankError(
                f"bank {self.path}: cannot check its data file ({exc.strerror or exc})"
            ) from None
        return st.st_dev, st.st_ino

    @contextlib.contextmanager
    def _txn(
        self, doing: str, write: bool = False, db: Any = None
    ) -> Iterator[lmdb.Transaction[bytes]]:
        """A transaction under the gate, with lmdb errors translated (see module doc); a
        write one only while the data file is the one opened."""
        assert self.env is not None, "bank store used after close()"
        if write and self._data_file() != self._data_id:
            raise BankError(
                f"bank {self.path}: its data file was removed or replaced while open, so this write "
                "would be lost; restart aoed (or rerun the command) to open the bank at that path again"
            )
        with (
            lmdb_errors(self.path, doing, self.env),
            self._gate.transaction(self.env, self.path, write=write, db=db) as txn,
        ):
            yield txn
        if write:  # so that readers find the file as long as its meta says, unwalked
            with self._gate.shared():
                cover_last_page(self.env, self.path / "data.mdb", self._data_id)

    def _check_schema(self) -> None:
        """Record the schema in a new bank; migrate an older one in one transaction, or
        refuse it (and any newer one) with a BankError that says what to do."""
        with self._txn("schema check", write=True, db=self._meta) as txn:
            raw = txn.get(b"schema_version")
            if raw is None:
                if txn.stat(self._entries)["entries"] or txn.stat(self._history)["entries"]:
                    raise BankError(
                        f"bank {self.path}: holds data but no schema version; not a bank aoed wrote"
                    )
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode())
                return
            version = parse_schema(self.path, raw)
            dbs = {
                "meta": self._meta,
                "entries": self._entries,
                "defaults": self._defaults,
                "history": self._history,
            }
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

    def _start_log(self) -> str:
        """This bank's id; a bank without one (new, or from before the log) gets one, and
        each record it holds a sequence number, in one transaction."""
        with self._txn("open", write=True, db=self._meta) as txn:
            raw = txn.get(_BANK_ID)
            if raw is not None:
                return raw.decode()
            bank_id = uuid.uuid4().hex
            w = _Writes(self, txn)
            for kind, db in self._dbs.items():
                for key, _ in txn.cursor(db=db):
                    w.relog(kind, key)
            w.close()
            txn.put(_BANK_ID, bank_id.encode())
            return bank_id

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
        entries, defaults, trials, decisions = (
            list(entries),
            list(defaults),
            list(trials),
            list(decisions),
        )
        forget = list(forget)
        with self._txn("write", write=True) as txn:
            w = _Writes(self, txn)
            for prefix in forget:
                cur = txn.cursor(db=self._decisions)
                found = cur.set_range(prefix)
                while found and cur.key().startswith(prefix):
                    found = cur.delete()
            # Decisions are this bank's own business: neither logged nor followed.
            for key, doc in decisions:
                txn.put(key, encode_doc(doc), db=self._decisions)
            for key, value in entries:
                w.put(ENTRY, key, value)
                w.delete(DEFAULT, key)
            for key, doc in defaults:
                w.put(DEFAULT, key, encode_doc(doc))
            now = time.time_ns()
            for i, (key, doc) in enumerate(trials):
                w.put(TRIAL, history_key(key, now + i), encode_doc(doc))
            w.close()

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
        handle = {"entries": self._entries, "defaults": self._defaults, "history": self._history}[
            db
        ]
        with self._txn("read", db=handle) as txn:
            yield from txn.cursor()

    def merge(
        self,
        records: Iterable[Record],
        replace: Callable[[Record, Record], bool],
        *,
        announce: bool = False,
    ) -> dict[str, MergeCounts]:
        """Merge `records` of every kind; returns the counts per kind (`KINDS`).

        An entry or default record whose key holds nothing is added. Where the key holds
        a record (of either kind) that differs, `replace(existing, incoming)` decides;
        a replacement deletes the record of the other kind under that key. A trial is
        added when its history key is absent, else kept. With `announce`, an existing
        record kept against a different incoming one is logged again (a new sequence
        number, same bytes), so that the peers following this bank are sent it: a
        follower keeps the better of two and says so. Batched transactions: an
        interrupted merge keeps whole batches, and running it again finishes it."""
        counts = {kind: [0, 0, 0] for kind in KINDS}  # added, updated, kept
        batch: list[Record] = []

        def flush() -> None:
            with self._txn("import", write=True) as txn:
                got = self._merge(_Writes(self, txn), batch, replace, announce)
            for kind in KINDS:  # counted only once the batch is committed
                counts[kind] = [a + b for a, b in zip(counts[kind], got[kind], strict=True)]
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

    def _merge(
        self,
        w: _Writes,
        records: Iterable[Record],
        replace: Callable[[Record, Record], bool],
        announce: bool,
    ) -> dict[str, list[int]]:
        """Merge `records` within `w`'s transaction and close it; counts per kind."""
        got = {kind: [0, 0, 0] for kind in KINDS}  # added, updated, kept
        for rec in records:
            n = got[rec.kind]
            if rec.kind not in _EXCLUSIVE:
                n[0 if w.put(rec.kind, rec.key, rec.value, overwrite=False) else 2] += 1
                continue
            old = self._existing(w.txn, rec.key)
            if old is None:
                n[0] += 1
            elif old == rec:
                n[2] += 1
                continue
            elif not replace(old, rec):
                n[2] += 1
                if announce:
                    w.relog(old.kind, old.key)
                continue
            else:
                n[1] += 1
            w.put(rec.kind, rec.key, rec.value)
            w.delete(_EXCLUSIVE[rec.kind], rec.key)
        w.close()
        return got

    def apply(
        self,
        peer: str,
        position: Position,
        records: Iterable[Record],
        replace: Callable[[Record, Record], bool],
    ) -> dict[str, MergeCounts]:
        """Merge `records` sent by `peer` as `merge` does with `announce`, and record
        `position` as how far this bank has applied that peer's writes, in one
        transaction: after a crash the bank holds both or neither, so the peer's
        writes are resumed from where they were applied, never applied twice or
        skipped. Returns the counts per kind."""
        records = list(records)
        for rec in records:
            if rec.kind not in KINDS:
                raise ValueError(f"unknown record kind {rec.kind!r}")
        with self._txn("follow", write=True) as txn:
            got = self._merge(_Writes(self, txn), records, replace, announce=True)
            doc = {"bank_id": position.bank_id, "seq": position.seq}
            txn.put(peer.encode(), encode_doc(doc), db=self._peers)
        return {kind: MergeCounts(*n) for kind, n in got.items()}

    def position(self, peer: str) -> Position | None:
        """How far this bank has applied `peer`'s writes; None when never."""
        with self._txn("read", db=self._peers) as txn:
            raw = txn.get(peer.encode())
        if raw is None:
            return None
        doc = json.loads(raw)
        return Position(str(doc["bank_id"]), int(doc["seq"]))

    def positions(self) -> dict[str, Position]:
        """Every followed peer's position, by target."""
        with self._txn("read", db=self._peers) as txn:
            docs = {k.decode(): json.loads(v) for k, v in txn.cursor()}
        return {k: Position(str(d["bank_id"]), int(d["seq"])) for k, d in docs.items()}

    def head(self) -> int:
        """The sequence number of the last write committed (0: none yet)."""
        with self._txn("read", db=self._meta) as txn:
            return int(txn.get(_SEQ) or 0)

    def changes(
        self, after: int, limit: int, max_bytes: int = 1 << 20
    ) -> tuple[list[Change], int, int]:
        """Records whose latest write came after sequence number `after`, in the order
        of those writes, from one read transaction: at most `limit` of them and about
        `max_bytes`. Returns (changes, upto, head): the changes cover every write up to
        `upto` (the last one's number when the page is full, else `head`), and `head` is
        the last sequence number committed."""
        out: list[Change] = []
        size = 0
        with self._txn("follow", db=self._log) as txn:
            head = int(txn.get(_SEQ, db=self._meta) or 0)
            cur = txn.cursor()
            more = cur.set_range(_U64.pack(after + 1)) if after < head else False
            while more:
                seq, (committed_ns, kind, key) = _U64.unpack(cur.key())[0], _parse_ref(cur.value())
                value = txn.get(key, db=self._dbs[kind]) if kind in self._dbs else None
                if value is not None:  # always, while the log is kept as the module says
                    out.append(Change(seq, kind, key, value, committed_ns))
                    size += len(key) + len(value)
                    if len(out) >= limit or size >= max_bytes:
                        return out, seq, head
                more = cur.next()
        return out, head, head

    def _existing(self, txn: lmdb.Transaction[bytes], key: bytes) -> Record | None:
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
                # The trials leave the log too: a follower is sent only what is here.
                prefix = TRIAL.encode() + b"\0"
                cur = txn.cursor(db=self._logidx)
                more = cur.set_range(prefix)
                while more and cur.key().startswith(prefix):
                    txn.delete(cur.value(), db=self._log)
                    more = cur.delete()
        after = self.stats() if not dry_run else before
        return PruneCounts(before.history, before.entries, before.used_bytes, after.used_bytes)

    def stats(self) -> LayerStats:
        """Counts and sizes of this bank, as the reader reports a layer's."""
        assert self.env is not None, "bank store used after close()"
        with self._txn("stats") as txn:
            dbs = (self._meta, self._entries, self._defaults, self._history)
            entries, defaults, history = (txn.stat(db)["entries"] for db in dbs[1:])
            used = used_bytes(self.env, txn, dbs)
            raw = txn.get(b"schema_version", db=self._meta)
            map_size = self.env.info()["map_size"]
        return LayerStats(
            CUSTOM,
            str(self.path),
            entries,
            defaults,
            history,
            map_size,
            used,
            int(raw or SCHEMA_VERSION),
        )

    def counts(self) -> dict[str, int]:
        st = self.stats()
        return {"entries": st.entries, "defaults": st.defaults, "history": st.history}

    def close(self) -> None:
        """Close the environment and let go of the writer lock (safe to repeat)."""
        env, self.env = self.env, None
        if env is not None:
            env.close()
        self._lock.release()


def _ref(kind: str, key: bytes) -> bytes:
    return kind.encode() + b"\0" + key


def _parse_ref(value: bytes) -> tuple[int, str, bytes]:
    """(commit time ns, kind, key) of a log line."""
    kind, _, key = value[8:].partition(b"\0")
    return _U64.unpack_from(value)[0], kind.decode(), key


class _Writes:
    """The record writes of one write transaction, each logged under the next sequence
    number (see the module doc); `close()` stores the counter before the commit."""

    def __init__(self, store: BankStore, txn: lmdb.Transaction[bytes]) -> None:
        self.txn = txn
        self._s = store
        self._start = self.seq = int(txn.get(_SEQ, db=store._meta) or 0)
        self._now = _U64.pack(time.time_ns())

    def put(self, kind: str, key: bytes, value: bytes, overwrite: bool = True) -> bool:
        """Store `value` under `key`; False (nothing written) when the key holds it
        already, or holds anything and not `overwrite`."""
        db = self._s._dbs[kind]
        old = self.txn.get(key, db=db)
        if old is not None and (old == value or not overwrite):
            return False
        self.txn.put(key, value, db=db)
        self.relog(kind, key)
        return True

    def delete(self, kind: str, key: bytes) -> bool:
        if not self.txn.delete(key, db=self._s._dbs[kind]):
            return False
        ref = _ref(kind, key)
        seq = self.txn.pop(ref, db=self._s._logidx)
        if seq is not None:
            self.txn.delete(seq, db=self._s._log)
        return True

    def relog(self, kind: str, key: bytes) -> None:
        """Give the record under `key` the next sequence number (its older one goes)."""
        ref = _ref(kind, key)
        self.seq += 1
        seq = _U64.pack(self.seq)
        old = self.txn.replace(ref, seq, db=self._s._logidx)
        if old is not None:
            self.txn.delete(old, db=self._s._log)
        self.txn.put(seq, self._now + ref, db=self._s._log)

    def close(self) -> None:
        if self.seq != self._start:
            self.txn.put(_SEQ, str(self.seq).encode(), db=self._s._meta)

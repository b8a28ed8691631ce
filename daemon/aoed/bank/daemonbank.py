"""The daemon's bank as its API serves it: reads, and imports and prunes sent to the
engine's BankWriter, the process's one writer of the custom bank.

A process opens each bank's LMDB environment once (a second open of the same files
breaks LMDB's locks), and the daemon's is its BankWriter's store. So the API does not
open a BankReader on the custom bank: `StoreLayer` presents the store's environment
with the interface of aoe.bank's reader layers, and `DaemonBank` puts it in front of
the read-only layers, so that lookups, and why they miss, are those of `aoe bank lookup`.

Invariants:
- Every transaction begins and ends inside one `trio.to_thread.run_sync` call. Long
  reads (queries, exports) go page by page, one transaction each, so a long export is
  not one snapshot: it sees what was committed while it ran.
- An import is checked whole, with `aoe bank import`'s checks, before anything of it is
  written (`check_import`, in the caller's thread), then merged by the writer; a prune
  is the writer's too. Nothing here writes the store.
- The daemon holds the bank's writer lock, so no other process grows the map and the
  store never remaps it under these reads (which therefore do without its gate).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb
import trio

from aoe.bank import CUSTOM, BankReader, Explanation, LayerStats, check_schema
from aoe.bankrecord import BankRecord, decode
from aoe.errors import OptionError
from aoe.keys import DeviceFingerprint
from aoe.lmdbenv import lmdb_errors
from aoe.recordcheck import Vocabulary
from aoed.bank.exchange import import_lines
from aoed.bank.store import KINDS, BankStore, MergeCounts, PruneCounts, Record
from aoed.bank.writer import BankMerge, BankPrune, BankWrite, BankWriter

__all__ = ["DB_NAMES", "CheckedImport", "DaemonBank", "StoreLayer", "check_import"]

#: The named databases a page can be read from.
DB_NAMES = ("entries", "defaults", "history")
#: Keys one page looks at before it returns (fewer than asked, with a key to go on
#: from), so that a selective filter never holds a transaction for the whole bank.
_SCAN = 10_000

#: Records per writer request of an import (one transaction each).
MERGE_CHUNK = 2000
#: `keep(key, value)`: whether a page includes a record.
Keep = Callable[[bytes, bytes], bool]


class StoreLayer:
    """The writer's environment seen as a read layer of a BankReader (the interface of
    aoe.bank's layers); it never closes the environment, which the store owns."""

    name = CUSTOM

    def __init__(self, store: BankStore) -> None:  # in a worker thread
        assert store.env is not None, "bank store used after close()"
        self.path = store.path
        self.env = store.env
        with self.read(None, "open") as txn:
            # The store opened these databases; LMDB hands back the same handles.
            self.meta = self.env.open_db(b"meta", txn=txn, create=False)
            self.entries, self.defaults, self.history = (
                self.env.open_db(name.encode(), txn=txn, create=False) for name in DB_NAMES
            )
            self.schema = check_schema(self.path, txn.get(b"schema_version", db=self.meta))

    @contextlib.contextmanager
    def read(self, db: Any, doing: str = "lookup") -> Iterator[lmdb.Transaction[bytes]]:
        with lmdb_errors(self.path, doing, self.env), self.env.begin(db=db) as txn:
            yield txn

    def get(self, key: bytes, db: Any = None) -> bytes | None:
        with self.read(self.entries if db is None else db) as txn:
            return txn.get(key)

    def close(self) -> None:
        pass  # the store's

    def page(
        self, db: str, after: bytes, limit: int, keep: Keep | None = None
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Up to `limit` (key, value) pairs of `db` after the key `after` (b"": from the
        first) that `keep` accepts, in key order, from one transaction; and the key to
        go on after, b"" when `db` holds nothing more."""
        out: list[tuple[bytes, bytes]] = []
        with self.read(getattr(self, db), "read") as txn:
            cur = txn.cursor()
            more = cur.set_range(after) if after else cur.first()
            if more and cur.key() == after:
                more = cur.next()
            scanned = 0
            while more:
                key, value = cur.key(), cur.value()
                scanned += 1
                if keep is None or keep(key, value):
                    out.append((key, value))
                more = cur.next()
                if more and (len(out) >= limit or scanned >= _SCAN):
                    return out, key
        return out, b""


@dataclass
class CheckedImport:
    """Records that passed an import's checks, the policy to merge them with, and the
    refused ones as (label, reason)."""

    records: list[Record] = field(default_factory=list)
    replace: Callable[[Record, Record], bool] = lambda old, new: False
    refused: list[tuple[str, str]] = field(default_factory=list)

    # `import_lines` hands what it accepted to its store's `merge`; in the store's place
    # this keeps them, so that the checks are exactly `aoe bank import`'s and nothing is
    # written until every record has been read and checked.
    def merge(
        self, records: Iterable[Record], replace: Callable[[Record, Record], bool]
    ) -> dict[str, MergeCounts]:
        self.records = list(records)
        self.replace = replace
        return {kind: MergeCounts() for kind in KINDS}


def check_import(
    lines: Iterable[str],
    policy: str,
    vocabulary: Vocabulary | None = None,
) -> CheckedImport:
    """Check exchange `lines` as `aoe bank import` does (each record against what the
    tuner of `vocabulary` writes), writing nothing (synchronous: a gRPC handler thread
    reads its request stream through it). Raises OptionError for an unknown policy, and
    whatever reading `lines` raises."""
    checked = CheckedImport()
    report = import_lines(checked, lines, policy, vocabulary)  # type: ignore[arg-type]
    checked.refused = report.refused
    return checked


class DaemonBank:
    """The custom bank the engine's `writer` holds, then its read-only layers; lookups
    made for `device` by default. Every method runs its LMDB work in a worker thread;
    cancelling a caller lets a write in flight finish (LMDB commits are atomic)."""

    def __init__(self, writer: BankWriter, device: DeviceFingerprint) -> None:
        self._writer = writer
        self._device = device
        self._layer: StoreLayer | None = None
        self._reader: BankReader | None = None
        #: LookupEntry calls answered, and how many found an entry.
        self.lookups = 0
        self.hits = 0

    async def _view(self) -> tuple[StoreLayer, BankReader]:
        store = await self._writer.store()  # (raises while the writer refuses the bank)
        if self._layer is None or self._reader is None:
            layer = await trio.to_thread.run_sync(StoreLayer, store)
            layers = await self._writer.layers()
            # The read-only layers are the writer's (opened once); this reader borrows
            # them and is never closed.
            self._reader = (
                layers.under(layer, self._device)
                if layers is not None
                else BankReader([layer], self._device)
            )
            self._layer = layer
        return self._layer, self._reader

    async def lookup(
        self, key: str, signature_digest: str, device_digest: str, precision: str
    ) -> tuple[Explanation, bytes | None]:
        """Why `key` (or the key of the digests; this device by default) matches or not,
        and the matching entry's bytes (None on a miss), custom bank first."""
        if not key and not signature_digest:
            raise OptionError("lookup: give a key, or a signature digest")
        _, reader = await self._view()

        def look() -> tuple[Explanation, bytes | None]:
            ex = reader.lookup_explain(
                key or None,
                signature_digest=signature_digest or None,
                device_digest=device_digest or None,
                precision=precision,
            )
            return ex, reader.lookup_raw(ex.key.encode())[0] if ex.found else None

        ex, raw = await trio.to_thread.run_sync(look)
        self.lookups += 1
        self.hits += raw is not None
        return ex, raw

    async def page(
        self, db: str, after: bytes, limit: int, keep: Keep | None = None
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """One page of the custom bank's `db` (see `StoreLayer.page`)."""
        if db not in DB_NAMES:
            raise ValueError(f"no database {db!r}")
        layer, _ = await self._view()
        return await trio.to_thread.run_sync(layer.page, db, after, limit, keep)

    async def entries(self) -> list[BankRecord]:
        """Every entry of the custom bank (one snapshot), decoded."""
        store = await self._writer.store()
        return await trio.to_thread.run_sync(lambda: [decode(v) for _, v in store.items("entries")])

    async def stats(self) -> list[LayerStats]:
        """Counts and sizes of the custom bank, then of each read-only layer."""
        store = await self._writer.store()
        layers = await self._writer.layers()
        custom = await trio.to_thread.run_sync(store.stats)
        return [
            custom,
            *(await trio.to_thread.run_sync(layers.stats) if layers is not None else ()),
        ]

    async def prune(self, dry_run: bool) -> PruneCounts:
        """Drop the custom bank's history (or count what would go), through the writer's
        queue, between the engine's writes."""
        return await self._writer.prune(BankPrune(dry_run))

    async def merge(self, checked: CheckedImport) -> dict[str, MergeCounts]:
        """Merge checked records into the custom bank, through the writer's queue (so its
        followers are sent them at once), a transaction's worth at a time so that the
        engine's writes are not held up behind a large import; counts per kind."""
        totals = {kind: MergeCounts() for kind in KINDS}
        records = checked.records
        for i in range(0, len(records), MERGE_CHUNK):
            got = await self._writer.merge(
                BankMerge(tuple(records[i : i + MERGE_CHUNK]), checked.replace)
            )
            for kind, c in got.items():
                t = totals[kind]
                totals[kind] = MergeCounts(
                    t.added + c.added, t.updated + c.updated, t.kept + c.kept
                )
        return totals

    async def record(self, trials: Iterable[tuple[bytes, dict[str, Any]]]) -> None:
        """Append measured trials to the history, through the writer's queue."""
        await self._writer.write(BankWrite(trials=tuple(trials)))

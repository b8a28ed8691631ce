"""Bank writer agent: the one task that commits to the LMDB bank.

Writes arrive on a bounded channel and are committed one transaction at a time in a
worker thread; each carries a one-shot reply channel, so the sender knows its entry is
durable. Writes are what the engine decided (`BankWrite`), merges of records from
elsewhere (`BankMerge`: an import, or a peer's writes with how far they were applied)
and prunes of the history (`BankPrune`): every write of the custom bank, from a job, the
API or a follower, goes through this one queue.
Every record written takes the bank's next sequence number (`aoed.bank.store`); after
each commit the writer wakes whoever waits in `wait_beyond(seq)` (the streams sending
this bank's writes to its followers), so nobody polls. Reads (`lookup`, `known_default`) go straight to a read transaction in a worker
thread; LMDB readers never block the writer.

Read-only layers (a system bank, team banks) sit under the custom bank: `lookup_layered`
consults the custom bank first, then each layer in order, and says which one answered.
Layers are opened on first use, read-only, and never written.

The custom bank is written by one process at a time (`aoed.bank.lock`). The writer takes
the bank's lock when it first needs the bank, and holds it until `close()`. When another
process holds it, the writer waits for it (by default, `WriterLock.wait()`: cancelling
the caller ends the wait) or fails with BankBusyError.

A bank whose data file is damaged (aoe.lmdbcheck) is refused, and stays refused while
the file there is the one refused: every call that needs it raises the same
BankDamagedError (a job fails with it, the daemon goes on), and the refusal is logged
once. A file restored or moved into its place is checked anew at the next call. Damage
met after the bank opened (LMDB reported a damaged page, or gave up on the bank) refuses
it until the writer is closed: the open environment is not closed under the readers of
this process that may still use it, and LMDB would meet the same pages again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import trio

from aoe.bank import CUSTOM, BankReader, layer_paths_from_env, open_bank
from aoe.bankrecord import BankRecord, decode, encode
from aoe.errors import BankDamagedError, BankError, BankWriteError
from aoe.lmdbcheck import damaged, find_damage
from aoed.bank.lock import WriterLock
from aoed.bank.store import BankStore, Change, MergeCounts, Position, PruneCounts, Record

__all__ = ["BankMerge", "BankPrune", "BankWrite", "BankWriter"]

log = logging.getLogger("aoed.bank")
T = TypeVar("T")


@dataclass(frozen=True)
class BankWrite:
    entries: tuple[BankRecord, ...] = ()
    defaults: tuple[tuple[bytes, dict[str, Any]], ...] = ()
    trials: tuple[tuple[bytes, dict[str, Any]], ...] = field(default=())
    #: what a run decided for a task (engine/resume.py), committed with its trials
    decisions: tuple[tuple[bytes, dict[str, Any]], ...] = ()
    #: key prefixes of decisions to delete (a run that ended)
    forget: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class BankMerge:
    """Records to merge under `replace` (see `BankStore.merge`); with `position`, the
    writes of the peer `peer` and how far they go (see `BankStore.apply`)."""

    records: tuple[Record, ...]
    replace: Callable[[Record, Record], bool]
    peer: str = ""
    position: Position | None = None


@dataclass(frozen=True)
class BankPrune:
    """Drop the history (see `BankStore.prune`); with `dry_run`, count what would go."""

    dry_run: bool = False


#: What the writer's queue carries.
Op = BankWrite | BankMerge | BankPrune
#: what the writer's task sends back for an op: its value, or the error it raised
_Reply = tuple[Any, BaseException | None]


@dataclass(frozen=True)
class _Refusal:
    """Why the writer refuses its bank: `message` (a BankDamagedError's), for as long as
    the data file there is `file` (its identity when refused; None: until close)."""

    message: str
    file: tuple[int, int, int, int] | None


def _file_id(path: os.PathLike[str] | str) -> tuple[int, int, int, int] | None:
    """(st_dev, st_ino, st_size, st_mtime_ns) of the bank's data file; None if absent."""
    try:
        st = os.stat(Path(path) / "data.mdb")
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class BankWriter:
    """Owns the bank at `path`. The store opens on first use, so a job that fails before
    it reaches the bank (a bad model, a wrong option) leaves no trace there."""

    def __init__(
        self,
        path: os.PathLike[str] | str,
        layers: Sequence[os.PathLike[str] | str] | None = None,
        *,
        wait: bool = True,
        on_wait: Callable[[str], None] | None = None,
    ):
        """`layers`: read-only banks under this one, in lookup order; None means those
        named in AOED_BANK_LAYERS. A layer that is the custom bank itself is skipped.
        `wait`: when another process writes the bank, wait for it (saying so once
        through `on_wait`, with a line naming that process) rather than raise
        BankBusyError from the first call that needs the bank."""
        self.path = path
        self.wait = wait
        self.on_wait = on_wait
        self.layer_paths = [Path(p) for p in (layer_paths_from_env() if layers is None else layers)]
        self._store: BankStore | None = None
        self._layers: BankReader | None = None
        self._refusal: _Refusal | None = None
        self._open_lock = trio.Lock()
        self._send, self._recv = trio.open_memory_channel[
            tuple[Op, trio.MemorySendChannel[_Reply]]
        ](16)
        self._head = 0  # the last sequence number committed, once the store is open
        self._committed = trio.Event()  # set (and replaced) when the head moves
        #: The engine's bank decisions (one per task of each job whose result was written,
        #: aoe.outcome's bank tally) and how many of them the bank knew.
        self.lookups = 0
        self.hits = 0

    @property
    def queued(self) -> int:
        """Writes waiting in the queue, not yet taken by `run`."""
        return self._send.statistics().current_buffer_used

    async def store(self) -> BankStore:
        """The custom bank's store, opened (and its writer lock taken) on first use.
        Raises BankBusyError (without `wait`) or BankError; BankDamagedError while the
        bank is refused as damaged (see the module doc). Cancellation while waiting for
        another writer leaves nothing held."""
        async with self._open_lock:
            await self._check_refusal()
            if self._store is None:
                try:
                    store = await self._open_store()
                    try:
                        self._head = await trio.to_thread.run_sync(store.head)
                    except BaseException:
                        store.close()
                        raise
                except BankDamagedError as exc:
                    self._refuse(exc, await trio.to_thread.run_sync(_file_id, self.path))
                    raise
                self._store = store
            return self._store

    async def check(self) -> None:
        """Check the bank's data file as every open does, without opening it (no lock
        taken, nothing created): a damaged one is refused and logged now rather than at
        the first job. Raises nothing."""
        async with self._open_lock:
            if self._store is not None or self._refusal is not None:
                return
            try:
                problems = await trio.to_thread.run_sync(find_damage, Path(self.path))
            except BankError:
                return  # another process kept writing it: it is not refused on a guess
            if problems:
                error = damaged(Path(self.path), problems)
                self._refuse(error, await trio.to_thread.run_sync(_file_id, self.path))

    @property
    def refused(self) -> str:
        """Why the bank is refused as damaged; "" while it is not."""
        return self._refusal.message if self._refusal is not None else ""

    def _refuse(self, exc: BankDamagedError, file: tuple[int, int, int, int] | None) -> None:
        """Refuse the bank for `exc` while its data file is `file` (None: until close),
        saying so in the log once; a refusal until close is never shortened."""
        if self._refusal is None or self._refusal.message != str(exc):
            log.error(
                "%s. Until then the bank is not used: jobs that need it fail with this%s",
                exc,
                "" if file is not None else "; restart aoed once it is repaired",
            )
        if self._refusal is None or self._refusal.file is not None:
            self._refusal = _Refusal(str(exc), file)

    async def _check_refusal(self) -> None:
        """Raise the refusal while it stands; forget it once another file is there."""
        r = self._refusal
        if r is None:
            return
        if r.file is None or r.file == await trio.to_thread.run_sync(_file_id, self.path):
            raise BankDamagedError(r.message)  # (a new one each time: tracebacks pile up)
        self._refusal = None

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, a call on the open store, in a worker thread; the damage it meets
        refuses the bank until close (see the module doc)."""
        try:
            return await trio.to_thread.run_sync(fn, *args)
        except BankDamagedError as exc:
            self._refuse(exc, None)
            raise

    async def _open_store(self) -> BankStore:
        lock = await trio.to_thread.run_sync(WriterLock, self.path)
        try:
            if not await trio.to_thread.run_sync(lock.try_acquire):
                if not self.wait:
                    raise lock.busy_error()
                if self.on_wait is not None:
                    self.on_wait(lock.waiting_message())
                await lock.wait()
            return await trio.to_thread.run_sync(functools.partial(BankStore, self.path, lock=lock))
        except BaseException:
            lock.release()  # (BankStore lets go of it too when it fails: release is idempotent)
            raise

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for op, reply in self._recv:
                result: tuple[Any, BaseException | None]
                try:
                    store = await self.store()
                    value, head = await self._in_thread(self._commit, store, op)
                    result = (value, None)
                    if head > self._head:
                        self._head = head
                        self._committed.set()
                        self._committed = trio.Event()
                except Exception as exc:  # reported to the sender, the writer goes on
                    result = (None, exc)
                with contextlib.suppress(trio.BrokenResourceError):
                    reply.send_nowait(result)

    @staticmethod
    def _commit(store: BankStore, op: Op) -> tuple[Any, int]:
        """Run `op` on `store` (in a worker thread); (its result, the head after it)."""
        value: Any = None
        if isinstance(op, BankPrune):
            value = store.prune(op.dry_run)
        elif isinstance(op, BankMerge):
            if op.position is not None:
                value = store.apply(op.peer, op.position, op.records, op.replace)
            else:
                value = store.merge(op.records, op.replace)
        else:
            store.commit(
                entries=[(r.key, encode(r)) for r in op.entries],
                defaults=op.defaults,
                trials=op.trials,
                decisions=op.decisions,
                forget=op.forget,
            )
        return value, store.head()

    @overload
    async def _submit(self, op: BankWrite) -> None: ...
    @overload
    async def _submit(self, op: BankMerge) -> dict[str, MergeCounts]: ...
    @overload
    async def _submit(self, op: BankPrune) -> PruneCounts: ...
    async def _submit(self, op: Op) -> Any:
        reply_send, reply_recv = trio.open_memory_channel[_Reply](1)
        await self._send.send((op, reply_send))
        async with reply_recv:
            value, exc = await reply_recv.receive()
        if exc is not None:
            raise exc
        return value

    async def write(self, write: BankWrite) -> None:
        """Commit `write` durably; raises the store's BankError if it failed (a
        BankWriteError when the disk or the map had no room: then nothing of it is in
        the bank, and a later write may succeed)."""
        await self._submit(write)

    async def merge(self, merge: BankMerge) -> dict[str, MergeCounts]:
        """Merge records durably (see `BankMerge`); returns the counts per kind of
        record. Raises the store's BankError if it failed (nothing of a failed
        transaction is written)."""
        return await self._submit(merge)

    async def prune(self, prune: BankPrune) -> PruneCounts:
        """Drop the history durably, or count what would go (see `BankPrune`); raises
        the store's BankError if it failed."""
        return await self._submit(prune)

    async def head(self) -> int:
        """The sequence number of the bank's last committed write."""
        await self.store()
        return self._head

    async def wait_beyond(self, seq: int) -> int:
        """Wait until a write after sequence number `seq` is committed; returns the
        head then. Cancellation ends the wait and nothing else."""
        await self.store()
        while self._head <= seq:
            await self._committed.wait()
        return self._head

    async def changes(self, after: int, limit: int) -> tuple[list[Change], int, int]:
        """One page of the bank's writes after `after` (see `BankStore.changes`)."""
        return await self._in_thread((await self.store()).changes, after, limit)

    async def position(self, peer: str) -> Position | None:
        """How far the bank has applied `peer`'s writes (see `BankStore.position`)."""
        return await self._in_thread((await self.store()).position, peer)

    async def bank_id(self) -> str:
        return (await self.store()).bank_id

    async def _readable(self) -> BankStore | None:
        """The store for a read; None when the bank does not exist yet and cannot be
        created (its disk is full): a bank that is not there holds nothing, and the
        job's writes will say why they were not kept."""
        try:
            return await self.store()
        except BankWriteError:
            if (Path(self.path) / "data.mdb").exists():
                raise
            return None

    async def lookup(self, key: bytes) -> BankRecord | None:
        store = await self._readable()
        raw = None if store is None else await self._in_thread(store.get, key)
        return decode(raw) if raw is not None else None

    async def known_default(self, key: bytes) -> dict[str, Any] | None:
        store = await self._readable()
        return None if store is None else await self._in_thread(store.get_default, key)

    async def decisions(self, prefix: bytes) -> list[tuple[bytes, dict[str, Any]]]:
        """The decisions stored under `prefix` in the custom bank (never in a layer)."""
        store = await self._readable()
        return [] if store is None else await self._in_thread(store.decisions, prefix)

    async def layers(self) -> BankReader | None:
        """The read-only layers as one reader (None when there are none)."""
        async with self._open_lock:
            if self._layers is None and self.layer_paths:
                self._layers = await trio.to_thread.run_sync(self._open_layers)
            return self._layers

    def _open_layers(self) -> BankReader | None:
        own = Path(self.path).resolve()
        paths = [p for p in self.layer_paths if p.resolve() != own]
        return open_bank(paths, use_env=False, custom=False) if paths else None

    def count_decisions(self, hits: int, total: int) -> None:
        """Count a finished job's bank tally (aoe.outcome.bank_tally: `total` tasks, `hits`
        of them known to the bank) into the figures the metrics serve, so that a job's
        summary and the daemon's lookup series say the same. A lookup alone is not
        counted: one task is looked up, re-checked, perhaps gated again, and only the
        decision it ends in is the job's."""
        self.lookups += total
        self.hits += hits

    async def lookup_layered(self, key: bytes) -> tuple[BankRecord | None, str]:
        """The record for `key` from the custom bank, else from the first read-only layer
        that has it, with the answering layer's name ("custom" or the layer's path);
        (None, "") when none has it."""
        rec = await self.lookup(key)
        if rec is not None:
            return rec, CUSTOM
        reader = await self.layers()
        if reader is None:
            return None, ""
        raw, layer = await trio.to_thread.run_sync(reader.lookup_raw, key)
        return (decode(raw), layer) if raw is not None else (None, "")

    async def known_default_layered(self, key: bytes) -> tuple[dict[str, Any] | None, str]:
        """Like `known_default`, consulting the read-only layers after the custom bank."""
        doc = await self.known_default(key)
        if doc is not None:
            return doc, CUSTOM
        reader = await self.layers()
        if reader is None:
            return None, ""
        return await trio.to_thread.run_sync(reader.lookup_default, key)

    def close(self) -> None:
        """Close the LMDB environments and let go of the bank (after run() has returned)."""
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._layers is not None:
            self._layers.close()
            self._layers = None

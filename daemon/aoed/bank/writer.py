"""Bank writer agent: the one task that commits to the LMDB bank.

Writes arrive on a bounded channel and are committed one transaction at a time in a
worker thread; each carries a one-shot reply channel, so the sender knows its entry is
durable. Reads (`lookup`, `known_default`) go straight to a read transaction in a worker
thread; LMDB readers never block the writer.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import trio

from aoed.bank._codec import BankRecord, decode, encode
from aoed.bank.store import BankStore

__all__ = ["BankWrite", "BankWriter"]


@dataclass(frozen=True)
class BankWrite:
    entries: tuple[BankRecord, ...] = ()
    defaults: tuple[tuple[bytes, dict[str, Any]], ...] = ()
    trials: tuple[tuple[bytes, dict[str, Any]], ...] = field(default=())


class BankWriter:
    """Owns the bank at `path`. The store opens on first use, so a job that fails before
    it reaches the bank (a bad model, a wrong option) leaves no trace there."""

    def __init__(self, path: os.PathLike[str] | str):
        self.path = path
        self._store: BankStore | None = None
        self._open_lock = trio.Lock()
        self._send, self._recv = trio.open_memory_channel[tuple[BankWrite, trio.MemorySendChannel]](16)

    async def store(self) -> BankStore:
        async with self._open_lock:
            if self._store is None:
                self._store = await trio.to_thread.run_sync(BankStore, self.path)
            return self._store

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for write, reply in self._recv:
                try:
                    store = await self.store()
                    await trio.to_thread.run_sync(self._commit, store, write)
                    result: BaseException | None = None
                except Exception as exc:  # reported to the sender, the writer goes on
                    result = exc
                with contextlib.suppress(trio.BrokenResourceError):
                    reply.send_nowait(result)

    @staticmethod
    def _commit(store: BankStore, write: BankWrite) -> None:
        store.commit(
            entries=[(r.key, encode(r)) for r in write.entries],
            defaults=write.defaults,
            trials=write.trials,
        )

    async def write(self, write: BankWrite) -> None:
        """Commit `write` durably; raises the store's BankError if it failed."""
        reply_send, reply_recv = trio.open_memory_channel[BaseException | None](1)
        await self._send.send((write, reply_send))
        async with reply_recv:
            result = await reply_recv.receive()
        if result is not None:
            raise result

    async def lookup(self, key: bytes) -> BankRecord | None:
        raw = await trio.to_thread.run_sync((await self.store()).get, key)
        return decode(raw) if raw is not None else None

    async def known_default(self, key: bytes) -> dict[str, Any] | None:
        return await trio.to_thread.run_sync((await self.store()).get_default, key)

    def close(self) -> None:
        """Close the LMDB environment (after run() has returned)."""
        if self._store is not None:
            self._store.close()
            self._store = None

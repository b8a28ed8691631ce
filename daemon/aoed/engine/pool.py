"""Compile pool agent: N worker processes building candidate artifacts concurrently.

Requests arrive on one bounded channel; each worker slot takes the next request when
it is free, so a slow compile never holds up the others. A worker that crashes or hangs
costs the candidate it was compiling: the slot answers with a failure and starts a fresh
worker for the next request. While the device measures on a CPU, `paused()` stops the
workers (SIGSTOP) so compile work never runs on the measuring cores.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from aoed.engine._child import Child, ChildDiedError

__all__ = ["CompilePool"]


class CompilePool:
    def __init__(self, workers: int, logdir: Path, timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError("a compile pool needs at least one worker")
        self.timeout_s = timeout_s
        self._children = [
            Child("aoed.backends.ort.worker", f"compile worker {i}", logdir / f"worker-{i}.log")
            for i in range(workers)
        ]
        self._send, self._recv = trio.open_memory_channel[tuple[dict, trio.MemorySendChannel]](workers)
        self.crashes = 0

    @property
    def size(self) -> int:
        return len(self._children)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for child in self._children:
                    nursery.start_soon(self._slot, child, self._recv.clone())
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                for child in self._children:
                    await child.aclose()

    async def _slot(self, child: Child, requests: trio.MemoryReceiveChannel) -> None:
        async with requests:
            async for request, reply in requests:
                try:
                    with trio.fail_after(self.timeout_s):
                        result = await child.call(request)
                except trio.TooSlowError:
                    self.crashes += 1
                    result = {"ok": False, "applicable": True, "error": f"compile timed out after {self.timeout_s:g}s"}
                except ChildDiedError as exc:
                    self.crashes += 1
                    result = {"ok": False, "applicable": True, "error": f"worker crashed: {exc}"}
                with contextlib.suppress(trio.BrokenResourceError):
                    reply.send_nowait(result)

    async def compile(self, request: dict[str, Any]) -> dict[str, Any]:
        """Compile one candidate; returns the worker's reply (never raises for a failed
        candidate). Cancellation abandons the reply; the worker finishes or is killed."""
        reply_send, reply_recv = trio.open_memory_channel[dict](1)
        await self._send.send((request, reply_send))
        async with reply_recv:
            return await reply_recv.receive()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Stop every worker process for the duration of the block."""
        for child in self._children:
            child.pause()
        try:
            yield
        finally:
            for child in self._children:
                child.resume()

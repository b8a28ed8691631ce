"""Requests waiting for an agent: a bounded queue whose entries can be abandoned.

A job that is cancelled while its request waits in an agent's queue, or while the agent
serves it, must not keep the agent busy: `RequestQueue.submit()` marks its request
abandoned when it leaves early (cancelled, or its deadline passed), the agent skips
abandoned requests, and `serve()` runs the one in flight inside a cancel scope that the
abandoning submitter cancels, so the child process working on it is killed at once.

Invariant: a request is answered at most once, and only while its submitter waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

__all__ = ["Pending", "RequestQueue", "serve"]

T = TypeVar("T")


class Pending(Generic[T]):
    """One request, who sent it (`job`, may be None), and its one-shot reply."""

    def __init__(self, request: T, job: Any = None):
        self.request = request
        self.job = job
        self._send, self._recv = trio.open_memory_channel[Any](1)
        self._scope: trio.CancelScope | None = None
        self.abandoned = False

    def abandon(self) -> None:
        """The submitter is gone: never serve this, and stop serving it if in flight."""
        self.abandoned = True
        if self._scope is not None:
            self._scope.cancel()

    def reply(self, value: Any) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
            self._send.send_nowait(value)


class RequestQueue(Generic[T]):
    """A bounded queue of `Pending` requests: submitters wait when it is full."""

    def __init__(self, capacity: int):
        self._send, self._recv = trio.open_memory_channel[Pending[T]](capacity)

    async def submit(self, request: T, job: Any = None) -> Any:
        """Queue `request` and return the agent's reply. Cancellation abandons it."""
        pending = Pending(request, job)
        try:
            await self._send.send(pending)
            return await pending._recv.receive()
        finally:
            pending.abandon()

    def receiver(self) -> trio.MemoryReceiveChannel[Pending[T]]:
        """A receive end for one serving task (clone per task)."""
        return self._recv.clone()


async def serve(pending: Pending[T], handler: Callable[[T, Any], Awaitable[Any]]) -> bool:
    """Answer `pending` with `handler(request, job)`, unless it is (or becomes) abandoned;
    returns True when the handler was cut short by an abandonment.

    An abandonment cancels the handler; the agent's own cancellation still propagates.
    """
    if pending.abandoned:
        return False
    with trio.CancelScope() as scope:
        pending._scope = scope
        try:
            result = await handler(pending.request, pending.job)
        finally:
            pending._scope = None
    if scope.cancelled_caught:
        return True
    pending.reply(result)
    return False

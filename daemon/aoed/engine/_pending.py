"""Requests waiting for an agent: a bounded queue whose entries can be abandoned.

A job that is cancelled while its request waits in an agent's queue, or while the agent
serves it, must not keep the agent busy: `RequestQueue.submit()` marks its request
abandoned when it leaves early (cancelled, or its deadline passed), the agent skips
abandoned requests, and `serve()` runs the one in flight inside a cancel scope that the
abandoning submitter cancels, so the child process working on it is killed at once.

Invariant: a request is answered at most once, and only while its submitter waits.
"""

from __future__ import annotations

import collections
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
    """A bounded queue of `Pending` requests, served fairly among jobs.

    Submitters wait when `capacity` requests are already waiting (backpressure). The
    serving tasks take requests job by job, in weighted round robin (stride scheduling):
    each job's turn advances its virtual time by 1/weight, and the job with the smallest
    virtual time goes next, so a job with many requests in flight cannot starve one with
    few, and a job of weight 2 gets twice the turns of one of weight 1. A job's weight is
    its submitter's `weight` attribute (the JobLedger's), 1 when absent. Within one job
    requests keep their order.
    """

    def __init__(self, capacity: int):
        self._capacity = max(1, capacity)
        self._queues: dict[Any, collections.deque[Pending[T]]] = {}
        self._vtime: dict[Any, float] = {}
        self._clock = 0.0  # virtual time of the last turn: where a newly active job starts
        self._count = 0
        self._work = trio.lowlevel.ParkingLot()
        self._space = trio.lowlevel.ParkingLot()

    async def submit(self, request: T, job: Any = None) -> Any:
        """Queue `request` and return the agent's reply. Cancellation abandons it."""
        pending = Pending(request, job)
        try:
            while self._count >= self._capacity:
                await self._space.park()
            key = getattr(job, "job_id", None)
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = collections.deque()
                self._vtime[key] = max(self._vtime.get(key, 0.0), self._clock)
            queue.append(pending)
            self._count += 1
            self._work.unpark()
            return await pending._recv.receive()
        finally:
            pending.abandon()

    async def get(self) -> Pending[T]:
        """The next request to serve (waits for one)."""
        while not self._queues:
            await self._work.park()
        key = min(self._queues, key=self._vtime.__getitem__)
        queue = self._queues[key]
        pending = queue.popleft()
        if not queue:
            del self._queues[key]
        self._clock = self._vtime[key]
        weight = max(1, int(getattr(pending.job, "weight", 1) or 1))
        self._vtime[key] += 1.0 / weight
        if len(self._vtime) > 4 * len(self._queues) + 64:  # forget jobs long gone
            self._vtime = {k: v for k, v in self._vtime.items() if k in self._queues}
        self._count -= 1
        self._space.unpark()
        return pending

    def receiver(self) -> _Receiver[T]:
        """An async iterator of requests for one serving task (one per task)."""
        return _Receiver(self)


class _Receiver(Generic[T]):
    def __init__(self, queue: RequestQueue[T]):
        self._queue = queue

    async def __aenter__(self) -> _Receiver[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> _Receiver[T]:
        return self

    async def __anext__(self) -> Pending[T]:
        return await self._queue.get()


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

"""The one place where gRPC's threads cross into trio.

grpcio's sync server runs each RPC on a thread of its pool; the daemon's state lives in
one trio run. A servicer method calls `bridge.call(context, afn, ...)` (unary answers) or
`bridge.stream(context, agen_fn, ...)` (server streams), and nothing else in `api/` may
touch trio from a thread.

Invariants:
- The trio side of an RPC runs inside its own cancel scope. When the client cancels,
  disconnects or its deadline passes, grpc runs the context's callback, which cancels
  that scope from the thread through the run's token; the trio code sees an ordinary
  trio.Cancelled and cleans up as on any cancellation.
- An AoedError raised on the trio side ends the RPC with the status of its class and
  its one-line message; anything else is INTERNAL with a message saying so (and is
  logged with its traceback, because it is a bug).
- When the trio run is gone (shutting down), calls end with UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import trio

from aoe.errors import AoedError

__all__ = ["Bridge", "status_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def status_of(exc: AoedError) -> grpc.StatusCode:
    """The gRPC status of `exc`'s class (aoe.errors): the one mapping of errors to
    statuses on the daemon side."""
    return getattr(grpc.StatusCode, exc.grpc_status, grpc.StatusCode.INTERNAL)


class _Call:
    """One RPC's link to its trio scope; safe to cancel before the scope exists."""

    def __init__(self, token: trio.lowlevel.TrioToken):
        self._token = token
        self._lock = threading.Lock()
        self._scope: trio.CancelScope | None = None
        self.cancelled = False

    def attach(self, scope: trio.CancelScope) -> None:  # trio thread
        with self._lock:
            self._scope = scope
            if self.cancelled:
                scope.cancel()

    def cancel(self) -> None:  # any thread (grpc's callback)
        with self._lock:
            self.cancelled = True
            scope = self._scope
        if scope is not None:
            try:
                self._token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass


class Bridge:
    """Runs trio code for gRPC handler threads; created inside the trio run. Stream
    producers run in `nursery` (the api agent's), so they end with it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery

    def _link(self, context: grpc.ServicerContext) -> _Call:
        call = _Call(self._token)
        # Runs when the RPC ends for any reason; after a normal end it cancels nothing.
        if not context.add_callback(call.cancel):
            call.cancelled = True  # the RPC already ended
        return call

    def _deadline(self, context: grpc.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else max(0.0, remaining)

    def call(
        self, context: grpc.ServicerContext, afn: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        """Run `await afn(*args)` in trio and return its value; ends the RPC with the
        mapped status when it raises. Client cancellation cancels it."""
        call = self._link(context)
        remaining = self._deadline(context)

        done: list[T] = []  # afn's value, once it has one; empty when cancelled

        async def scoped() -> None:
            with trio.CancelScope() as scope:
                if remaining is not None:
                    scope.deadline = trio.current_time() + remaining
                call.attach(scope)
                done.append(await afn(*args))

        try:
            trio.from_thread.run(scoped, trio_token=self._token)
        except AoedError as exc:
            _abort(context, exc)
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("internal error in %s", getattr(afn, "__qualname__", afn))
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in the daemon: {type(exc).__name__}: {exc}",
            )
        if not done:
            if (
                remaining is not None
                and context.time_remaining() is not None
                and context.time_remaining() <= 0
            ):
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            context.abort(grpc.StatusCode.CANCELLED, "cancelled")
        return done[0]

    def stream(
        self,
        context: grpc.ServicerContext,
        agen_fn: Callable[..., AsyncGenerator[T, None]],
        *args: Any,
        buffer: int = 16,
        stall: tuple[float, AoedError] | None = None,
    ) -> Iterator[T]:
        """Yield what the async generator `agen_fn(*args)` yields, produced by a trio task;
        the producer is cancelled when the client goes away, and its errors end the RPC
        with their mapped status. At most `buffer` items wait for a slow client; with
        `stall` = (seconds, error), a client that takes no item for that long while the
        buffer is full is cut off: the producer stops, and the RPC ends with `error`
        once the client has read what was buffered."""
        call = self._link(context)
        remaining = self._deadline(context)
        send, recv = trio.from_thread.run_sync(
            lambda: trio.open_memory_channel[Any](buffer), trio_token=self._token
        )
        stalled: list[AoedError] = []

        async def put(item: Any) -> bool:
            if stall is None:
                await send.send(item)
                return True
            with trio.move_on_after(stall[0]):
                await send.send(item)
                return True
            stalled.append(stall[1])
            return False

        async def produce() -> None:
            async with send:
                with trio.CancelScope() as scope:
                    if remaining is not None:
                        scope.deadline = trio.current_time() + remaining
                    call.attach(scope)
                    try:
                        # aclosing: a producer cancelled at a yield is finalized here, now,
                        # not later by the garbage collector
                        async with contextlib.aclosing(agen_fn(*args)) as agen:
                            async for item in agen:
                                if not await put(("item", item)):
                                    break
                    except AoedError as exc:
                        await send.send(("error", exc))
                    except Exception as exc:
                        log.exception(
                            "internal error in stream %s", getattr(agen_fn, "__qualname__", agen_fn)
                        )
                        await send.send(
                            (
                                "error",
                                AoedError(
                                    f"internal error in the daemon: {type(exc).__name__}: {exc}"
                                ),
                            )
                        )

        try:
            trio.from_thread.run_sync(self._nursery.start_soon, produce, trio_token=self._token)
            while True:
                try:
                    kind, value = trio.from_thread.run(recv.receive, trio_token=self._token)
                except trio.EndOfChannel:
                    if stalled:
                        _abort(context, stalled[0])
                    break
                if kind == "error":
                    _abort(context, value)
                yield value
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        finally:
            call.cancel()
            try:
                trio.from_thread.run_sync(recv.close, trio_token=self._token)
            except trio.RunFinishedError:
                pass

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a quick synchronous `fn(*args)` in the trio thread (reads of trio-owned
        state); AoedErrors propagate to the caller to map."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)


def _abort(context: grpc.ServicerContext, exc: AoedError) -> NoReturn:
    context.abort(status_of(exc), str(exc))
    raise AssertionError("unreachable")  # context.abort raises

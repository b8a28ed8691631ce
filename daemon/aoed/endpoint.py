"""A small HTTP/1.1 server for read-only pages (the metrics endpoint, aoed.metrics), run
in the daemon's trio run, that whoever can reach its port cannot use to wedge the daemon.

Invariants:
- At most `max_connections` connections are open at once. One more is accepted and
  closed at once (a reset), never left waiting, so a flood costs the daemon no more
  than `max_connections` descriptors and a few KiB each.
- No connection is kept while fewer than aoed.fdlimit.FD_RESERVE descriptors are left
  to the process: those are for gRPC, the job store, the bank and the inboxes.
- A connection has `timeout_s` in all, from its accept to its close: to send its
  request (a request line and headers of at most MAX_REQUEST_BYTES, parsed by h11),
  for the page to be made, and for the answer to be read. One request per connection
  (`Connection: close`), so a client cannot keep a slot by idling between requests.
- Every accepted socket is closed on every path (answered, refused, timed out, the
  client gone, the server cancelled), so none is left in CLOSE-WAIT.

Only GET of the pages given is answered; any other method gets 405, any other path 404,
a malformed or oversized request 400 or 431.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import h11
import trio

from aoed.fdlimit import FD_RESERVE, descriptors_left

__all__ = ["Endpoint", "Limits", "Page"]

log = logging.getLogger(__name__)

#: A page: its body and its content type, made when it is asked for.
Page = Callable[[], Awaitable[tuple[bytes, str]]]

#: The request line and headers together; a GET needs a few hundred bytes.
MAX_REQUEST_BYTES = 8192
_RECEIVE_BYTES = 4096
#: Connections the kernel may hold before they are accepted (and then served or closed).
_BACKLOG = 128
#: Errors of accept() that mean "out of descriptors or memory for now": wait, then go on.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_CAPACITY_PAUSE_S = 0.1
#: Refused connections are logged at most this often.
_WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class Limits:
    max_connections: int = 16
    timeout_s: float = 10.0


class Endpoint:
    """Serves `pages` (path -> Page) over HTTP within `limits` (see the module doc).
    `refused` counts connections closed unanswered because a limit was reached."""

    def __init__(self, pages: Mapping[str, Page], limits: Limits) -> None:
        self.pages = dict(pages)
        self.limits = limits
        self.refused = 0
        self._open = 0
        self._next_warning = 0.0

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on `host`:`port` and serve until cancelled; reports the port bound
        (the one chosen, for port 0) through `task_status`. Raises OSError when it
        cannot listen. On cancellation every connection open is closed."""
        listeners = await trio.open_tcp_listeners(port, host=host or None, backlog=_BACKLOG)
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept, listener, nursery)
                task_status.started(listeners[0].socket.getsockname()[1])
        finally:
            for listener in listeners:
                listener.socket.close()

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                self._refusing(f"accept failed ({exc.strerror})")
                await trio.sleep(_CAPACITY_PAUSE_S)
                continue
            # From here the socket is ours: every path below closes it.
            if self._open >= self.limits.max_connections:
                self._refusing(f"{self._open} connections open (max_connections)")
                _drop(stream)
            elif descriptors_left() < FD_RESERVE:
                self._refusing(f"fewer than {FD_RESERVE} file descriptors left to the daemon")
                _drop(stream)
            else:
                self._open += 1
                nursery.start_soon(self._serve, stream)

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed."""
        return self._open

    def _refusing(self, why: str) -> None:
        self.refused += 1
        now = trio.current_time()
        if now >= self._next_warning:
            self._next_warning = now + _WARN_EVERY_S
            log.warning(
                "aoed: metrics endpoint: refusing connections: %s (%d refused so far)",
                why,
                self.refused,
            )

    async def _serve(self, stream: trio.SocketStream) -> None:
        answered = False
        try:
            with trio.move_on_after(self.limits.timeout_s):
                answered = await self._exchange(stream)
        except (trio.BrokenResourceError, OSError):
            pass  # the client reset the connection
        finally:
            self._open -= 1
            if not answered:
                _drop(stream)
            # SocketStream.aclose closes the socket before its checkpoint, so even a
            # cancelled close has closed it.
            await stream.aclose()

    async def _exchange(self, stream: trio.SocketStream) -> bool:
        """Read one request and answer it; True once the answer is sent whole."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            event = await _next_event(conn, stream)
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            await _answer(conn, stream, status, f"{status} {exc}\n".encode(), "text/plain")
            return True
        if not isinstance(event, h11.Request):
            return False  # the client went away before asking
        target = event.target.decode("ascii", "replace").split("?", 1)[0]
        page = self.pages.get(target)
        if event.method != b"GET":
            await _answer(conn, stream, 405, b"405 only GET\n", "text/plain", allow="GET")
        elif page is None:
            await _answer(conn, stream, 404, b"404 not found\n", "text/plain")
        else:
            try:
                body, content_type = await page()
            except Exception:
                log.exception("aoed: metrics endpoint: the page %s could not be made", target)
                await _answer(conn, stream, 500, b"500 internal error\n", "text/plain")
                return True
            await _answer(conn, stream, 200, body, content_type)
        return True


async def _next_event(conn: h11.Connection, stream: trio.SocketStream):
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(_RECEIVE_BYTES))


async def _answer(
    conn: h11.Connection,
    stream: trio.SocketStream,
    status: int,
    body: bytes,
    content_type: str,
    **extra: str,
) -> None:
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(body))),
        ("connection", "close"),
        *extra.items(),
    ]
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers))
    except h11.LocalProtocolError:  # a request too broken to answer
        return
    data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


def _drop(stream: trio.SocketStream) -> None:
    """Close the connection at once with a reset: nothing more is sent, and the socket
    leaves no TIME-WAIT behind on this side."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # reset by the peer already: the close is all there is to do
        pass
    stream.socket.close()

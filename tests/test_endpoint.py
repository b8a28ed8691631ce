"""The metrics endpoint's HTTP server (aoed.endpoint) on real loopback sockets: its
connection limit, its time limit, its request limit, its descriptor reserve, and that it
closes every socket it accepts."""

from __future__ import annotations

import http.client
import resource
import socket

import pytest
import trio

from aoed.endpoint import MAX_REQUEST_BYTES, Endpoint, Limits
from aoed.fdlimit import FD_RESERVE, descriptors_left
from tests.helpers import wait_until

HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slow"


async def _page() -> tuple[bytes, str]:
    return b"aoed_up 1\n", "text/plain; version=0.0.4"


def _connect(port: int, send: bytes = HALF_A_REQUEST) -> socket.socket | None:
    """A connection that sent `send` (half a request: then it stalls); None when the
    server reset it before connect() returned."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
    except ConnectionResetError:
        return None
    try:
        s.sendall(send)
    except OSError:  # already refused: the reset arrived first
        pass
    return s


def _closed_by_server(s: socket.socket | None) -> bool:
    """Blocks until the server ends the connection (EOF or reset); True then. Closes
    this side."""
    if s is None:
        return True
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return True


def _get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _tcp_states(port: int) -> list[str]:
    """The states (hex, as /proc/net/tcp writes them) of the sockets whose local port is
    `port`: the server's side of its connections, and its listener (0A)."""
    out = []
    with open("/proc/self/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                out.append(fields[3])
    return out


CLOSE_WAIT, ESTABLISHED, LISTEN = "08", "01", "0A"


async def test_connections_beyond_the_limit_are_closed_at_once() -> None:
    endpoint = Endpoint({"/metrics": _page}, Limits(max_connections=3, timeout_s=300.0))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(endpoint.run, "127.0.0.1", 0)

        def flood() -> None:
            held = [_connect(port) for _ in range(3)]
            more = [_connect(port) for _ in range(40)]
            try:
                # The 40 beyond the limit are closed by the server without an answer,
                # while the 3 it took are still within their time.
                assert all(_closed_by_server(s) for s in more)
                assert endpoint.refused == 40
                assert endpoint.open_connections == 3
            finally:
                for s in (*held, *more):
                    if s is not None:
                        s.close()

        await trio.to_thread.run_sync(flood)
        # The 3 clients gone, their slots are free again: a whole request is answered.
        await wait_until(
            lambda: not endpoint.open_connections, 30, "the flood's connections closed"
        )
        status, body = await trio.to_thread.run_sync(_get, port)
        assert (status, body) == (200, b"aoed_up 1\n")
        # Nothing of the flood is left on the server's side: no connection open, none
        # in CLOSE-WAIT (the scrape's own close may linger in TIME-WAIT, which holds no
        # descriptor).
        states = _tcp_states(port)
        assert LISTEN in states and ESTABLISHED not in states and CLOSE_WAIT not in states
        nursery.cancel_scope.cancel()


async def test_a_connection_that_stalls_is_closed_when_its_time_is_up() -> None:
    endpoint = Endpoint({"/metrics": _page}, Limits(max_connections=3, timeout_s=0.5))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(endpoint.run, "127.0.0.1", 0)
        stalled = [_connect(port) for _ in range(3)]
        for s in stalled:
            assert await trio.to_thread.run_sync(_closed_by_server, s)
        assert endpoint.refused == 0 and endpoint.open_connections == 0
        states = _tcp_states(port)
        assert ESTABLISHED not in states and CLOSE_WAIT not in states, states
        nursery.cancel_scope.cancel()


async def test_only_a_get_of_a_page_is_answered_and_a_huge_request_is_refused() -> None:
    endpoint = Endpoint({"/metrics": _page}, Limits(max_connections=4, timeout_s=30.0))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(endpoint.run, "127.0.0.1", 0)
        assert (await trio.to_thread.run_sync(_get, port, "/metrics?x=1"))[0] == 200
        assert (await trio.to_thread.run_sync(_get, port, "/other"))[0] == 404
        assert (await trio.to_thread.run_sync(_get, port, "/metrics", "POST"))[0] == 405

        def huge() -> bytes:
            # Over the limit, under h11's own default (16 KiB), and never ended.
            header = b"X-Big: " + b"a" * (MAX_REQUEST_BYTES + 6000)
            s = _connect(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + header)
            assert s is not None
            with s:
                return s.recv(64)

        # The request never ends: the server stops reading at its limit and answers.
        assert (await trio.to_thread.run_sync(huge)).startswith(b"HTTP/1.1 431")
        nursery.cancel_scope.cancel()


async def test_no_connection_is_kept_while_the_process_is_within_its_descriptor_reserve() -> None:
    endpoint = Endpoint({"/metrics": _page}, Limits(max_connections=4, timeout_s=30.0))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(endpoint.run, "127.0.0.1", 0)
        open_now = soft - descriptors_left()
        # Few descriptors left: a scrape is refused, unanswered.
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + FD_RESERVE // 2, hard))
        try:
            with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
                await trio.to_thread.run_sync(_get, port)
            assert endpoint.refused == 1
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # The reserve back: served.
        assert (await trio.to_thread.run_sync(_get, port))[0] == 200
        nursery.cancel_scope.cancel()


async def test_cancelling_the_endpoint_closes_every_connection_it_holds() -> None:
    endpoint = Endpoint({"/metrics": _page}, Limits(max_connections=8, timeout_s=300.0))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(endpoint.run, "127.0.0.1", 0)
        held = [_connect(port) for _ in range(8)]
        try:
            await wait_until(  # the accepts happen in this trio run
                lambda: endpoint.open_connections >= 8, 30, "8 connections accepted"
            )
            nursery.cancel_scope.cancel()
        except BaseException:
            for s in held:
                if s is not None:
                    s.close()
            raise
    for s in held:
        assert await trio.to_thread.run_sync(_closed_by_server, s)
    states = _tcp_states(port)
    assert ESTABLISHED not in states and CLOSE_WAIT not in states, states

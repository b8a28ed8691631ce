"""The gRPC-to-trio bridge: client deadlines and cancellation reach the trio side, and
errors become status codes. A real grpc server on a temporary unix socket, in-process."""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import trio

from aoe.errors import BankError, NotFoundError, OptionError
from aoed.api._bridge import Bridge
from tests.helpers import wait_until


class _Probe:
    """What the trio side saw."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = trio.Event()
        self.items_sent = 0
        self.tasks: trio.Nursery | None = None  # where the bridge runs stream producers


def _handlers(bridge: Bridge, probe: _Probe):
    async def forever() -> None:
        probe.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            probe.cancelled.set()
            raise

    async def fail(kind: str) -> None:
        raise {
            "option": OptionError("--x 3: bad"),
            "bank": BankError("bank /b: full"),
            "missing": NotFoundError("no job 'j'"),
            "bug": ZeroDivisionError("division by zero"),
        }[kind]

    async def numbers():
        try:
            for i in range(1_000_000):
                probe.items_sent += 1
                yield i
                await trio.sleep(0.01)
        except trio.Cancelled:
            probe.cancelled.set()
            raise

    def unary_forever(request, context):
        bridge.call(context, forever)
        return b""

    def unary_fail(request, context):
        bridge.call(context, fail, request.decode())
        return b""

    def stream(request, context):
        for i in bridge.stream(context, numbers):
            yield str(i).encode()

    return grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Forever": grpc.unary_unary_rpc_method_handler(unary_forever),
            "Fail": grpc.unary_unary_rpc_method_handler(unary_fail),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def _with_server(test) -> None:
    probe = _Probe()
    folder = Path(tempfile.mkdtemp(prefix="bridge-", dir="/tmp"))
    target = f"unix:{folder / 's'}"
    async with trio.open_nursery() as nursery:
        bridge = Bridge(nursery)
        probe.tasks = nursery
        server = grpc.server(ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers((_handlers(bridge, probe),))
        server.add_insecure_port(target)
        server.start()
        try:
            with grpc.insecure_channel(target) as channel:
                await test(channel, probe)
        finally:
            await trio.to_thread.run_sync(lambda: server.stop(0).wait())
            nursery.cancel_scope.cancel()


async def test_a_client_deadline_cancels_the_trio_side() -> None:
    async def test(channel: grpc.Channel, probe: _Probe) -> None:
        call = channel.unary_unary("/t.T/Forever")
        with pytest.raises(grpc.RpcError) as err:
            await trio.to_thread.run_sync(lambda: call(b"", timeout=0.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with trio.fail_after(5):
            await probe.cancelled.wait()

    await _with_server(test)


async def test_a_client_cancel_reaches_the_trio_side() -> None:
    async def test(channel: grpc.Channel, probe: _Probe) -> None:
        future = channel.unary_unary("/t.T/Forever").future(b"")
        await probe.started.wait()
        future.cancel()
        with trio.fail_after(5):
            await probe.cancelled.wait()

    await _with_server(test)


async def test_a_stream_stops_producing_when_the_client_goes() -> None:
    async def test(channel: grpc.Channel, probe: _Probe) -> None:
        stream = channel.unary_stream("/t.T/Stream")(b"")
        got = await trio.to_thread.run_sync(lambda: [int(next(stream)) for _ in range(5)])
        assert got == [0, 1, 2, 3, 4]
        assert probe.tasks is not None and probe.tasks.child_tasks  # the producer runs
        stream.cancel()
        with trio.fail_after(5):
            await probe.cancelled.wait()
        # The producer's task ends: nothing can produce more.
        await wait_until(lambda: not probe.tasks.child_tasks, 5, "the producer's task ended")

    await _with_server(test)


@pytest.mark.parametrize(
    ("kind", "code", "text"),
    [
        ("option", grpc.StatusCode.INVALID_ARGUMENT, "--x 3: bad"),
        ("bank", grpc.StatusCode.FAILED_PRECONDITION, "bank /b: full"),
        ("missing", grpc.StatusCode.NOT_FOUND, "no job 'j'"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error in the daemon: ZeroDivisionError"),
    ],
)
async def test_errors_become_status_codes(kind: str, code: grpc.StatusCode, text: str) -> None:
    async def test(channel: grpc.Channel, probe: _Probe) -> None:
        call = channel.unary_unary("/t.T/Fail")
        with pytest.raises(grpc.RpcError) as err:
            await trio.to_thread.run_sync(lambda: call(kind.encode(), timeout=5))
        assert err.value.code() == code and text in err.value.details()

    await _with_server(test)

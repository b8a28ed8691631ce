"""sd_notify: what the daemon tells systemd, read from a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import trio

from aoe.v1 import daemon_pb2, tuning_pb2
from aoed import samples
from aoed.api._bridge import Bridge
from aoed.notify import Notifier, Watchdog
from tests.daemon_util import DaemonProcess, upload
from tests.helpers import wait_for


class Listener:
    """A datagram socket standing in for systemd's notify socket; a thread records each
    message with the time it arrived (so it keeps counting while trio is blocked)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="notify-", dir="/tmp"))
        self.path = self.dir / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def wait_for(
        self,
        key: str,
        value: str | None = None,
        timeout: float = 60,
        after: float = 0.0,
        prefix: str | None = None,
    ) -> tuple[float, dict]:
        """The first message since `after` with `key` (equal to `value`, or starting with
        `prefix`, when given): (arrival time, fields)."""

        def found() -> tuple[float, dict] | None:
            for t, m in list(self.messages):
                if (
                    t >= after
                    and key in m
                    and (value is None or m[key] == value)
                    and (prefix is None or m[key].startswith(prefix))
                ):
                    return t, m
            return None

        return wait_for(
            found,
            timeout,
            f"{key}={value or prefix}",
            detail=lambda: f"got {[m for _, m in self.messages][-8:]}",
        )

    def times(self, key: str) -> list[float]:
        return [t for t, m in self.messages if key in m]

    def mark(self, name: str) -> None:
        """Send `MARK=name` to the socket from the calling thread: datagrams queue in the
        order they were sent, so the mark falls after every message sent before it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"MARK={name}\n".encode(), str(self.path))

    def between(self, key: str, first: str, last: str) -> list[dict[str, str]]:
        """The messages with `key` received after the mark `first` and before `last`."""
        names = [m.get("MARK") for _, m in self.messages]
        i, j = names.index(first), names.index(last)
        return [m for _, m in self.messages[i + 1 : j] if key in m]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener():
    lis = Listener()
    yield lis
    lis.close()


def test_outside_systemd_nothing_is_sent() -> None:
    n = Notifier(env={})
    assert not n.enabled and n.watchdog_s is None
    assert n.send(READY=1) is False


def test_the_variables_leave_the_environment(listener: Listener) -> None:
    env = {"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000", "PATH": "/bin"}
    n = Notifier(env=env)
    assert env == {"PATH": "/bin"}, "children can not speak for the daemon"
    assert n.watchdog_s == 2.0
    n.ready("up")
    _, m = listener.wait_for("READY", "1", timeout=5)
    assert m["STATUS"] == "up"
    n.close()


def test_another_process_s_watchdog_is_not_ours(listener: Listener) -> None:
    n = Notifier(
        env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}
    )
    assert n.watchdog_s is None
    n.close()


async def test_no_watchdog_ping_while_the_event_loop_is_blocked(listener: Listener) -> None:
    """The pings need a round trip through gRPC *and* the trio loop: a thread that pings
    regardless would keep pinging while the loop is stuck."""
    folder = Path(tempfile.mkdtemp(prefix="wd-", dir="/tmp"))
    target = f"unix:{folder / 's'}"

    async with trio.open_nursery() as nursery:
        bridge = Bridge(nursery)

        async def answer() -> bytes:
            return b"ok"

        def handler(request, context):
            return bridge.call(context, answer)

        server = grpc.server(ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.T", {"Ping": grpc.unary_unary_rpc_method_handler(handler)}
                ),
            )
        )
        server.add_insecure_port(target)
        server.start()
        channel = grpc.insecure_channel(target)

        def probe() -> bool:
            try:
                return channel.unary_unary("/t.T/Ping")(b"", timeout=5) == b"ok"
            except grpc.RpcError:
                return False

        notifier = Notifier(env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "400000"})
        watchdog = Watchdog(notifier, probe, lambda: "status")
        try:
            await nursery.start(watchdog.run)
            await trio.to_thread.run_sync(lambda: listener.wait_for("WATCHDOG", "1", timeout=10))
            listener.mark("blocked")
            # blocks the trio loop (and nothing else): ten ping periods
            time.sleep(2.0)  # noqa: ASYNC251
            listener.mark("unblocked")
            t_unblocked, _ = await trio.to_thread.run_sync(
                lambda: listener.wait_for("MARK", "unblocked", timeout=10)
            )
            await trio.to_thread.run_sync(
                lambda: listener.wait_for("WATCHDOG", "1", timeout=10, after=t_unblocked)
            )
            during = listener.between("WATCHDOG", "blocked", "unblocked")
            assert not during, f"{len(during)} pings while the loop was blocked"
        finally:
            channel.close()
            await trio.to_thread.run_sync(lambda: server.stop(0).wait())
            notifier.close()
            nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_the_daemon_tells_systemd_ready_status_watchdog_reloading_stopping(
    tmp_path: Path, listener: Listener
) -> None:
    d = DaemonProcess(tmp_path / "d")
    env = d.env()
    env.update(NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC="1000000")
    d.env = lambda: env  # type: ignore[method-assign]
    model = d.models / "cnn.onnx"
    samples.save(samples.build("cnn"), model)
    try:
        d.start()
        t_ready, ready = listener.wait_for("READY", "1")
        # READY is sent only once the socket accepts calls: one answers right away.
        info = d.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest(), timeout=5)
        assert info.pid == d.proc.pid
        assert "serving on unix://" in ready.get("STATUS", "")

        assert ready["STATUS"].startswith("0 running, 0 queued; cpu idle"), ready
        job_id = (
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=upload(d.tuning(), model), options=tuning_pb2.JobOptions(budget_s=4.0)
                )
            )
            .job_id
        )
        # The status follows the job: running while it runs, idle again once it ended.
        t_run, _ = listener.wait_for(
            "STATUS", prefix="1 running, 0 queued; cpu busy", after=t_ready
        )
        job = d.wait_job(job_id)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED
        t_idle, _ = listener.wait_for("STATUS", prefix="0 running, 0 queued; cpu idle", after=t_run)
        # The watchdog went on pinging while the job ran (systemd would restart a daemon
        # whose pings stopped): the job ran seconds, each ping answers a call every 0.5 s.
        pings = [t for t in listener.times("WATCHDOG") if t_run < t < t_idle]
        assert len(pings) >= 2, f"{len(pings)} pings while the job ran"

        before_hup = time.monotonic()
        d.proc.send_signal(signal.SIGHUP)
        t_rel, rel = listener.wait_for("RELOADING", "1", after=before_hup)
        assert rel.get("MONOTONIC_USEC", "").isdigit()
        listener.wait_for("READY", "1", after=t_rel)

        before_stop = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING", "1", after=before_stop)
        assert d.proc.wait(60) == 0
    finally:
        d.close()
    assert not os.environ.get("NOTIFY_SOCKET")

"""Telling systemd the truth: the sd_notify protocol, and a watchdog that pings only when
the daemon really answers.

The protocol (sd_notify(3)) is one datagram of `KEY=value` lines to the AF_UNIX socket
named by NOTIFY_SOCKET (a path, or an abstract name when it starts with `@`). It is small
enough to speak directly; a library would add a dependency for twenty lines. Outside
systemd (no NOTIFY_SOCKET) every call does nothing.

The service manager's variables are taken out of the environment when read, so no
process the daemon starts can speak for it (children are also started without them).

`Watchdog.run` is a trio task: every half interval it makes one real gRPC call to the
daemon's own socket, which crosses into the trio loop through the bridge, and sends
WATCHDOG=1 only when that call answered. A blocked event loop, a wedged gRPC server or
an exhausted thread pool therefore stop the pings, and systemd restarts the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping

import trio

__all__ = ["Notifier", "Watchdog"]

log = logging.getLogger(__name__)

_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, env: MutableMapping[str, str] | None = None):
        env = os.environ if env is None else env
        values: Mapping[str, str] = {k: env.pop(k) for k in _VARS if k in env}
        addr = values.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_s: float | None = None
        pid = values.get("WATCHDOG_PID", "")
        usec = values.get("WATCHDOG_USEC", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send `KEY=value` lines; returns False outside systemd or when the send failed
        (logged once per failure: a notification is never worth stopping for)."""
        if self._sock is None or self._addr is None:
            return False
        text = "".join(f"{k}={str(v).replace(chr(10), ' ')}\n" for k, v in fields.items())
        try:
            self._sock.sendto(text.encode(), self._addr)
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._addr, exc)
            return False

    def ready(self, status: str = "") -> None:
        self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> None:
        self.send(STATUS=text)

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd tell this reload from the next (systemd >= 253).
        self.send(RELOADING=1, MONOTONIC_USEC=int(time.monotonic() * 1e6))

    def stopping(self, status: str = "") -> None:
        self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def watchdog(self) -> None:
        self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """Pings systemd's watchdog from the trio loop, after a real call to the daemon."""

    def __init__(self, notifier: Notifier, probe: Callable[[], bool], status: Callable[[], str]):
        self._notifier = notifier
        self._probe = probe  # a blocking call to the daemon's own gRPC socket
        self._status = status
        self.pings = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        interval = self._notifier.watchdog_s
        last_status = ""
        while True:
            period = interval / 2 if interval else 5.0
            if interval:
                # The probe runs in a thread, but its answer needs this loop (the bridge):
                # a blocked loop never gets here, and a hung server never answers.
                with trio.move_on_after(period):
                    ok = await trio.to_thread.run_sync(self._probe, abandon_on_cancel=True)
                    if ok:
                        self._notifier.watchdog()
                        self.pings += 1
                    else:
                        log.warning(
                            "watchdog: the daemon's own gRPC socket did not answer; not pinging"
                        )
            status = self._status()
            if status != last_status:
                self._notifier.status(status)
                last_status = status
            await trio.sleep(period)

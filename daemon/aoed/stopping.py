"""The daemon's stop deadline: after SIGTERM or SIGINT the process ends within
`[daemon] shutdown_grace_s` + STOP_MARGIN_S, whatever it is doing.

A graceful stop runs in trio (daemon.py: running jobs get their grace, then are
cancelled and requeued; the server, the engine's children and the stores close), and it
can begin only once trio's loop gets to it. A loop kept busy (a job starting a world of
thousands of rank processes, each started from the loop's thread) or a cleanup that
waits on something that never ends would keep the stop waiting, and systemd would
SIGKILL the daemon mid-write when TimeoutStopSec ran out. So:

- The deadline is armed in the signal handler itself, which Python runs in the main
  thread between any two bytecodes, busy loop or not; it then hands the signal on to
  the handler that was in place (trio's receiver, which starts the graceful stop).
- A thread of its own keeps it. When the deadline passes, that thread logs why, kills
  every child process still there (SIGKILL; each would die with the daemon anyway,
  through PR_SET_PDEATHSIG, but none is left to outlive it by a moment), and ends the
  process (os._exit), without waiting on the loop.
- The deadline outlives `Daemon.run()`: an exit that hangs after it (a thread that does
  not end) is cut short too.

Invariant: the handler takes no lock (it writes a byte to a pipe the thread waits on),
so it cannot deadlock whatever the main thread was doing when the signal came, a second
signal in the middle of the first one's handler included.

The unit's TimeoutStopSec (45 s) is above the default deadline (20 + 15 s), so systemd
sees the daemon exit on its own, with the reason in the journal.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["EXIT_STATUS", "STOP_MARGIN_S", "StopDeadline", "child_pids"]

log = logging.getLogger("aoed.service")

#: Seconds after `shutdown_grace_s` for what a stop does once the grace is over:
#: cancelling the jobs (up to 10 s), the server (1 s), the engine's children (killed and
#: reaped) and the stores.
STOP_MARGIN_S = 15.0
#: The exit status of a stop the deadline cut short (EX_SOFTWARE: it did not stop cleanly).
EXIT_STATUS = 70


def child_pids(parent: int | None = None) -> list[int]:
    """The pids of the processes whose parent is `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid ...: the name may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(parent):
            out.append(int(entry.name))
    return out


class StopDeadline:
    def __init__(self, grace_s: float, margin_s: float = STOP_MARGIN_S):
        self.limit_s = grace_s + margin_s
        self.margin_s = margin_s
        self._why = ""
        # Non-inheritable (PEP 446): no child holds it.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None

    @property
    def armed(self) -> bool:
        return bool(self._why)

    def arm(self, why: str) -> None:
        """Start the countdown (once; later calls change nothing). Safe in a signal
        handler: it takes no lock."""
        if not self._why:
            self._why = why
            with contextlib.suppress(OSError):  # (a full pipe: it is armed already)
                os.write(self._wake_w, b"!")

    def _watch(self) -> None:
        os.read(self._wake_r, 1)
        # Nothing ends this wait but the deadline: a process that stopped in time has
        # ended, and this thread (a daemon thread) with it.
        time.sleep(self.limit_s)
        self._expire()

    def _expire(self) -> None:
        pids = child_pids()
        log.error(
            "aoed: still stopping %.0f s after %s ([daemon] shutdown_grace_s + %.0f s); killing %d child "
            "process(es) and exiting",
            self.limit_s,
            self._why,
            self.margin_s,
            len(pids),
        )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(EXIT_STATUS)

    @contextlib.contextmanager
    def armed_by(self, *signals: signal.Signals) -> Iterator[None]:
        """Within: each of `signals` arms the deadline the moment it arrives, then goes
        on to the handler that was in place when this was entered (restored on exit)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="aoed-stop", daemon=True)
            self._thread.start()
        previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig, prev in previous.items():
            signal.signal(sig, functools.partial(self._on_signal, prev))
        try:
            yield
        finally:
            for sig, prev in previous.items():
                signal.signal(sig, prev)

    def _on_signal(self, prev: object, signum: int, frame: object) -> None:
        self.arm(signal.Signals(signum).name)
        if callable(prev):
            prev(signum, frame)

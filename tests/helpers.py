"""Waiting for a condition, the one way the tests do it.

    wait_for(lambda: out.exists(), 120, f"{out} written", detail=d.log_tail)
    await wait_until(lambda: watcher.idle, 5, "the watcher idle")

The timeout is a deadline for a condition, never a speed promise: set it far above what
the condition needs on a busy machine. A test that must show that something does *not*
happen waits first for a sign that the daemon got that far (a log line, a job, a file),
then asserts the absence; only where no such sign exists does it wait out a named quiet
period.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["wait_for", "wait_until"]

T = TypeVar("T")


def _failure(timeout: float, what: str, detail: Callable[[], object] | None) -> AssertionError:
    text = f"not within {timeout} s: {what}"
    if detail is not None:
        text += f"\n{detail()}"
    return AssertionError(text)


def wait_for(
    pred: Callable[[], T],
    timeout: float,
    what: str,
    *,
    poll: float = 0.05,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `pred` until it returns something true; returns it. After `timeout` seconds
    raises AssertionError naming `what` and, when given, `detail()` (a daemon's log tail,
    the last value seen). An exception from `pred` ends the wait at once: a pred asserts
    there what must hold while it waits (a process still alive, a job not failed)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise _failure(timeout, what, detail)
        time.sleep(poll)


async def wait_until(
    pred: Callable[[], T],
    timeout: float,
    what: str,
    *,
    poll: float = 0.02,
    detail: Callable[[], object] | None = None,
) -> T:
    """`wait_for` for a test inside trio: sleeps with trio, so that the tasks under test
    run while it waits."""
    with trio.move_on_after(timeout):
        while True:
            got = pred()
            if got:
                return got
            await trio.sleep(poll)
    raise _failure(timeout, what, detail)

"""The event log: each job's events, stored before any watcher sees them, and streamed.

An event gets the job's next sequence number and goes to the job store through the
backlog (jobs/backlog.py: what the store refuses waits there, and is read from there,
until the store takes it), then wakes the job's watchers. A watcher reads the events
after the last sequence number it has, so a client that reconnects (or a daemon that
restarts) resumes the stream where it stopped; the stream ends once the job is final
and its last event was sent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import trio

from aoe.outcome import JobOutcome
from aoed.jobs.backlog import Backlog
from aoed.jobs.store import EventRow, JobStore

__all__ = ["EventLog"]


class EventLog:
    def __init__(self, store: JobStore, backlog: Backlog):
        self._store = store
        self._backlog = backlog
        #: per watched job, the event set (and replaced) when the job has news
        self._changed: dict[str, trio.Event] = {}

    def append(
        self, job_id: str, kind: str, data: dict[str, Any], outcome: JobOutcome | None = None
    ) -> None:
        """Record the job's next event and wake its watchers."""
        seq = self._backlog.last_seq(job_id) + 1
        self._backlog.append_event(EventRow(job_id, seq, time.time(), kind, data, outcome))
        self._wake(job_id)

    def wake_all(self) -> None:
        """Wake every watcher (the backlog wrote what it held: they read it)."""
        for job_id in self._changed:
            self._wake(job_id)

    def _wake(self, job_id: str) -> None:
        changed = self._changed.get(job_id)
        if changed is not None:
            changed.set()
            self._changed[job_id] = trio.Event()

    async def stream(
        self, job_id: str, after_seq: int = 0, logs: bool = False
    ) -> AsyncGenerator[EventRow, None]:
        """The job's events after `after_seq` (log events only with `logs`), then new
        ones as they happen; ends once the job is final (or gone) and everything up to
        its last event was sent."""
        self._changed.setdefault(job_id, trio.Event())
        seq = after_seq
        while True:
            changed = self._changed[job_id]
            for ev in [*self._store.events(job_id, seq), *self._backlog.events(job_id, seq)]:
                seq = ev.seq
                if ev.kind == "log" and not logs:
                    continue
                yield ev
            row = self._store.get(job_id)
            if row is None or (
                self._backlog.overlay(row).final and self._backlog.last_seq(job_id) <= seq
            ):
                return
            await changed.wait()

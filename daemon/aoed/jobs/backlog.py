"""Job-store writes the store could not take (a full disk), kept in memory until it can.

A running job's state changes and its final state must not be lost, nor end the daemon,
when the disk under the job store is full. The job manager writes them through a
`Backlog`: a write the store refuses (DiskFullError, or any StoreError) is kept here, in
order, and `flush()` (called every few seconds by the manager) writes what is kept once
the store takes writes again. State and result events are kept; log and progress events
that arrive meanwhile are dropped (counted in `dropped`): they are commentary, and
keeping every one would move the full disk into memory.

Invariants, per job:
- While a job has writes here, they are newer than its row and events in the store, so
  readers see the job as `overlay(row)`, and its events as the store's followed by
  `events(job_id)`.
- A new write of a job that has writes here goes behind them, never straight to the
  store: fields would otherwise be overwritten by older values at the flush, and an
  event would reach the store before one with a lower sequence number (a client
  resuming after that number would never get the earlier one).
- `flush()` writes a job's fields and events in order and stops at the first refusal.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from aoe.errors import DiskFullError
from aoed.jobs.store import EventRow, JobRow, JobStore, StoreError

__all__ = ["KEPT_EVENTS", "Backlog"]

log = logging.getLogger(__name__)

#: Event kinds kept while the store refuses writes; the others are dropped.
KEPT_EVENTS = ("state", "result")

_REFUSED = (StoreError, DiskFullError)


class Backlog:
    def __init__(self, store: JobStore):
        self._store = store
        self._fields: dict[str, dict[str, Any]] = {}
        self._events: dict[str, list[EventRow]] = {}
        #: events dropped since the store last refused a write
        self.dropped = 0
        self._refusing = False

    def __bool__(self) -> bool:
        return bool(self._fields or self._events)

    def jobs(self) -> int:
        """How many jobs have writes kept here."""
        return len(self._fields.keys() | self._events.keys())

    def _held(self, job_id: str) -> bool:
        return job_id in self._fields or job_id in self._events

    def _refused(self, exc: Exception) -> None:
        if not self._refusing:
            log.warning(
                "%s; job states are kept in memory and written once the store takes writes again",
                exc,
            )
        self._refusing = True

    # ---------------------------------------------------------------- writes

    def update(self, job_id: str, **fields: Any) -> None:
        """Write `fields` of the job's row now, or keep them for `flush()`."""
        if self._held(job_id):
            self._fields.setdefault(job_id, {}).update(fields)
            return
        try:
            self._store.update(job_id, **fields)
        except _REFUSED as exc:
            self._refused(exc)
            self._fields[job_id] = dict(fields)

    def append_event(self, event: EventRow) -> None:
        """Store `event` now, or keep it for `flush()` (a kind not in KEPT_EVENTS is
        dropped instead)."""
        if not self._held(event.job_id):
            try:
                self._store.append_event(event)
                return
            except _REFUSED as exc:
                self._refused(exc)
        if event.kind in KEPT_EVENTS:
            self._events.setdefault(event.job_id, []).append(event)
        else:
            self.dropped += 1

    def flush(self) -> int:
        """Write what is kept, job by job, in order; returns how many writes reached the
        store. Stops at the first the store refuses (the rest stays kept)."""
        done = 0
        try:
            for job_id in list(self._fields.keys() | self._events.keys()):
                events = self._events.get(job_id, [])
                while events:
                    self._store.append_event(events[0])
                    events.pop(0)
                    done += 1
                self._events.pop(job_id, None)
                fields = self._fields.get(job_id)
                if fields:
                    self._store.update(job_id, **fields)
                    done += 1
                self._fields.pop(job_id, None)
        except _REFUSED:
            return done
        if self._refusing:
            log.info(
                "job store: takes writes again; %d kept write(s) written, %d log or progress event(s) were "
                "dropped meanwhile",
                done,
                self.dropped,
            )
        self._refusing, self.dropped = False, 0
        return done

    # ---------------------------------------------------------------- reads

    def overlay(self, row: JobRow) -> JobRow:
        """`row` (as the store has it) with the fields kept for it applied."""
        fields = self._fields.get(row.id)
        return replace(row, **fields) if fields else row

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRow]:
        """The job's kept events after `after_seq` (all newer than the store's)."""
        return [e for e in self._events.get(job_id, ()) if e.seq > after_seq]

    def last_seq(self, job_id: str) -> int:
        """The job's last event sequence number, kept events included."""
        kept = self._events.get(job_id)
        return kept[-1].seq if kept else self._store.last_seq(job_id)

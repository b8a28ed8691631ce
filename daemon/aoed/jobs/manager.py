"""The job manager: the daemon's job table, its queue, and the jobs running on the engine.

One agent owns every job's state. Submissions are checked, deduplicated (the same model
content with the same tuning options joins the active job instead of tuning twice) and
recorded in the job store before they are acknowledged; the scheduler starts queued
jobs, highest priority first and oldest first within a priority, while fewer than
`max_running_jobs` run. Running jobs share the engine's compile pool and device agent,
whose queues serve them by weight (fair share), so a long job cannot starve a short one.

Every event of a job is stored with a sequence number before watchers see it, so a
client that reconnects (or a daemon that restarts) resumes the stream where it stopped
(jobs/events.py).

Resume: at start, jobs the store says were running are queued again and run with
`resumes` = their own id, so tasks their first run decided (committed to the bank as
each was decided, with the decision itself: engine/resume.py) are not measured again. On shutdown, running jobs get
`shutdown_grace_s` to finish; then they are cancelled and left queued for the next start.

Admission (jobs/admission.py, over jobs/limits.py): what a job asks for (its world's
ranks, its shapes, its memory) is checked against the configuration at submit, and again
before a stored job starts, so a job over a limit is refused (or, stored, failed) before
any of its processes or files exist. A job starts only while its memory estimate fits
beside those of the jobs running, and waits in the queue until it does; jobs start in
the queue's order, so the ones behind a waiting job wait with it. Every start is counted
in the store before the job runs: a job that was running when the daemon stopped or
died `max_job_attempts` times is failed rather than started again, so a job that wedges
or crashes the daemon cannot do so at every start.

A full disk: below `[limits] min_free_mb` free in the state dir, submissions are refused
(DiskFullError: RESOURCE_EXHAUSTED naming the folder and its free space) and queued jobs
wait. A write of a call in hand that the job store refuses fails that call; the state
changes of running jobs go through a `Backlog`, which keeps what the store refuses and
writes it once the store takes writes again, so neither a full disk nor a failing store
ends the manager.

Inputs (jobs/inputs.py): an uploaded model is kept once per content and name,
`inputs/<sha256>/<name>` in the state dir, and jobs refer to it; it is removed with the
last job that does (retention), and at start when none does.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.errors import (
    AoedError,
    DaemonUnavailableError,
    DiskFullError,
    JobCancelledError,
    NotFoundError,
    first_error,
)
from aoe.outcome import JobOutcome
from aoed import space
from aoed.config import DaemonConfig
from aoed.engine.engine import Engine
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.messages import JobEvent
from aoed.jobs import admission, states
from aoed.jobs import store as st
from aoed.jobs.admission import MemoryShare, Submission
from aoed.jobs.backlog import Backlog
from aoed.jobs.events import EventLog
from aoed.jobs.inputs import Inputs, shown_path
from aoed.jobs.states import JobState
from aoed.jobs.store import Claim, EventRow, JobRow, JobStore, StoreError, Upload

# Submission and shown_path live in jobs/admission.py and jobs/inputs.py; the manager's
# callers may import them from here.
__all__ = ["JobManager", "Submission", "shown_path"]

log = logging.getLogger(__name__)

#: Seconds between attempts to write what the job store refused, and between looks at
#: the free space while queued jobs wait for it.
RETRY_S = 2.0


@dataclass
class _Live:
    """What the manager keeps in memory for a job while it runs."""

    handle: JobHandle = field(default_factory=JobHandle)
    user_cancelled: bool = False


class JobManager:
    def __init__(self, cfg: DaemonConfig, store: JobStore, engine: Engine):
        self.cfg = cfg
        self.store = store
        self.engine = engine
        self._backlog = Backlog(store)
        self._events = EventLog(store, self._backlog)
        self.inputs = Inputs(store, cfg)
        #: the upload quotas' accounting (UploadModel reserves, consuming releases)
        self.uploads = self.inputs.uploads
        self._live: dict[str, _Live] = {}
        #: each running job's id, with the event set once it has ended (its final state
        #: recorded, its output folder tidied): what `cancel` and `stop` wait on
        self._running: dict[str, trio.Event] = {}
        self._wakeup = trio.Event()
        self._stopping = False
        self._limits_lock = trio.Lock()
        self._waiting_for_space = False
        #: the memory estimates of the running jobs
        self._memory = MemoryShare()
        #: called with each job that reaches a final state (the inbox delivers outputs)
        self.on_final: list[Callable[[JobRow], None]] = []

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Requeue what a previous run left running, then schedule until cancelled."""
        await self.inputs.sweep()
        for left in self.store.jobs(st.RUNNING, limit=100000):
            self._transition(left, states.Requeue(), "the daemon restarted: the job resumes")
        queued = len(self.store.jobs([st.QUEUED], limit=100000))
        if queued:
            log.info("jobs: %d queued job(s) from the store", queued)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._housekeeping)
            nursery.start_soon(self._retry_loop)
            task_status.started()
            while True:
                while (
                    not self._stopping
                    and len(self._running) < self.cfg.max_running_jobs
                    and self._room_to_start()
                ):
                    row = self._next_queued()
                    if row is None:
                        break
                    if not self._may_start(row):
                        continue  # failed instead: the next one
                    if not self._admit_memory(row):
                        break  # waits for a running job to end
                    self._running[row.id] = trio.Event()
                    nursery.start_soon(self._run_job, row)
                await self._wakeup.wait()
                self._wakeup = trio.Event()

    def wake(self) -> None:
        """Look at the queue again (a job may start: a reload raised a limit)."""
        self._wakeup.set()

    def _room_to_start(self) -> bool:
        """Whether the state dir has its floor of free space; says once when jobs wait."""
        try:
            space.check_floor(self.cfg.state_dir, self.cfg.min_free_bytes, "queued jobs wait")
        except DiskFullError as exc:
            if not self._waiting_for_space and self._next_queued() is not None:
                log.warning("jobs: %s", exc)
                self._waiting_for_space = True
            return False
        if self._waiting_for_space:
            log.info(
                "jobs: %s has its floor of free space again; queued jobs start", self.cfg.state_dir
            )
        self._waiting_for_space = False
        return True

    def _may_start(self, row: JobRow) -> bool:
        """Whether a queued job may start (or resume): under the limits and the attempts
        the configuration allows now. A job that may not is failed, saying why."""
        try:
            admission.check_start(row, self.cfg, self.engine.memory)
        except AoedError as exc:
            log.warning("job %s: not started: %s", row.id, exc)
            self._finish(row, states.Fail(), error=str(exc), kind=type(exc).__name__)
            return False
        return True

    def _admit_memory(self, row: JobRow) -> bool:
        """Whether the job's memory estimate fits beside the running jobs' (then it is
        held for it until it ends); else it waits, and is told so once."""
        fits, message = self._memory.admit(row, self.engine.memory)
        if message:
            log.info("job %s: %s", row.id, message)
            self._event(row, "log", {"level": "info", "logger": "wait", "message": message})
        return fits

    async def _retry_loop(self) -> None:
        """Write what the job store refused, once it takes writes again; look at the free
        space again while queued jobs wait for it."""
        while True:
            await trio.sleep(RETRY_S)
            if self._backlog.flush():
                self._events.wake_all()  # watchers read the events just written
                self.wake()
            if self._waiting_for_space:
                self.wake()

    async def stop(self, grace_s: float) -> None:
        """Start no more jobs; give running ones `grace_s` to finish, then cancel them
        (they stay queued and resume at the next start)."""
        self._stopping = True
        with trio.move_on_after(grace_s):
            await self._all_ended()
        for job_id in list(self._running):
            self._live[job_id].handle.cancel("the daemon is shutting down", resumable=True)
        with trio.move_on_after(10):
            await self._all_ended()
        self._backlog.flush()
        if self._backlog:
            # The store still refuses them: the next start finds those jobs as it last had them.
            log.warning(
                "jobs: the job store (%s) could not take the last states of %d job(s); the next start "
                "resumes them from the states it has",
                self.store.path,
                self._backlog.jobs(),
            )

    async def _all_ended(self) -> None:
        """Return once no job runs (none starts meanwhile: the manager is stopping)."""
        while self._running:
            await next(iter(self._running.values())).wait()

    async def _housekeeping(self) -> None:
        """Expired uploads and finished jobs past retention go, at start and then hourly
        (more often when a limit is shorter than two hours)."""
        while True:
            now = time.time()
            try:
                self.inputs.expire(now - self.cfg.upload_ttl_s)
                for row in self.store.finished_before(now - self.cfg.retention_s):
                    out = Path(row.output_dir)
                    if out.is_relative_to(self.cfg.jobs_dir):
                        await trio.to_thread.run_sync(shutil.rmtree, out, True)
                    self.store.delete(row.id)
                    await self.inputs.release(Path(row.model_path))
                    log.info("job %s: removed after retention", row.id)
            except (
                StoreError,
                DiskFullError,
            ) as exc:  # (what was removed is removed; the rest next time)
                log.warning("jobs: housekeeping stopped for now: %s", exc)
            await trio.sleep(
                max(1.0, min(3600.0, self.cfg.upload_ttl_s / 2, self.cfg.retention_s / 2))
            )

    # ------------------------------------------------------------- queries

    def get(self, job_id: str) -> JobRow:
        row = self.store.get(job_id)
        if row is None:
            raise NotFoundError(f"no job {job_id!r} (aoe jobs lists them)")
        return self._backlog.overlay(row)

    def list(self, states: list[str], limit: int, before: tuple[float, str] | None) -> list[JobRow]:
        return [self._backlog.overlay(r) for r in self.store.jobs(states, limit, before)]

    def queue_position(self, row: JobRow) -> int:
        if row.state != st.QUEUED:
            return 0
        order = self._queued_order()
        return next((i for i, r in enumerate(order) if r.id == row.id), 0)

    def counts(self) -> tuple[int, int]:
        """(jobs queued, jobs running)."""
        return len(self.store.jobs([st.QUEUED], limit=100000)), len(self._running)

    # builtins.list: in this class's annotations `list` is the method below.
    def running(self) -> builtins.list[JobRow]:
        """The jobs running now, newest first."""
        return self.store.jobs(st.RUNNING, limit=100000)

    # ------------------------------------------------------------- uploads and claims

    def upload(self, upload_id: str) -> Upload | None:
        """The upload `upload_id`, None when there is none (expired, or used)."""
        return self.inputs.get_upload(upload_id)

    def add_upload(self, up: Upload) -> None:
        """Record a received upload (its file complete, its sha256 checked)."""
        self.inputs.add_upload(up)

    def claims(self, state: str | None = None) -> builtins.list[Claim]:
        """The drop folders' claims (all, or those in `state`: claiming | claimed)."""
        return self.store.claims(state)

    def claim_begin(self, src: str, dst: str, inbox: str) -> None:
        """Record the intent to move the dropped `src` to `dst` (before the rename)."""
        self.store.claim_begin(src, dst, inbox)

    def claim_done(self, src: str, job_id: str) -> None:
        """The claimed file was moved and its job recorded."""
        self.store.claim_done(src, job_id)

    def claim_drop(self, src: str) -> None:
        """Forget the claim of `src` (delivered, or never moved)."""
        self.store.claim_drop(src)

    def _queued_order(self) -> builtins.list[JobRow]:
        # Active rows seen through the backlog: a job requeued while the store refused
        # the write is queued all the same.
        rows = [r for r in self.list(list(st.ACTIVE), 100000, None) if r.state == st.QUEUED]
        return sorted(rows, key=lambda r: (-r.priority, r.created, r.id))

    def _next_queued(self) -> JobRow | None:
        return next((r for r in self._queued_order() if r.id not in self._running), None)

    # ------------------------------------------------------------- commands

    async def submit(self, sub: Submission) -> tuple[JobRow, bool]:
        """Record a job for `sub` (or join the active one with the same content and
        options); returns (job, joined). Before any file of the job exists, refuses what
        `admission.admit` refuses (a device not this daemon's, a spec over its limits, a
        file with several hard links or over [engine] max_model_mb, a job whose memory
        estimate could never fit). Raises ResourceExhaustedError when the client's or
        the queue's limit is reached, DaemonUnavailableError while shutting down."""
        if self._stopping:
            raise DaemonUnavailableError(
                "the daemon is shutting down; submit again after it restarts"
            )
        admitted = await admission.admit(sub, self.cfg, self.engine)
        spec, sha, key, info = admitted.spec, admitted.sha256, admitted.key, admitted.checked
        async with self._limits_lock:
            same = self.store.active_with_key(key)
            if same is not None:
                self.store.update(same.id, joined=same.joined + 1)
                if sub.upload is not None:
                    await self.inputs.consume(sub.upload, keep=False)
                log.info("job %s: an identical submission joined it", same.id)
                return self.get(same.id), True
            admission.check_client(self.cfg, sub.source, self.store.count_active(sub.source))
            queued, _ = self.counts()
            admission.check_queue(self.cfg, queued)
            job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            out = sub.output_dir or self.cfg.jobs_dir / job_id
            model = sub.model
            if sub.upload is not None:
                model = await self.inputs.consume(sub.upload, keep=True)
                info = await trio.to_thread.run_sync(model.stat)
            assert info is not None, (
                "admission checks a daemon-side file; an upload is stat'ed here"
            )
            # The file checked here (one link, its sha256): the job's first read checks that
            # it reads this very file (see engine.modelio.load_model's `expect`). A job
            # that others may not join gets a key of its own (see Submission.joinable).
            row = JobRow(
                id=job_id,
                state=JobState.QUEUED,
                model_path=str(model),
                model_name=sub.model.name if sub.upload is None else sub.upload.file_name,
                model_sha256=sha,
                dedup_key=key if sub.joinable else f"{key}/{job_id}",
                spec=spec,
                output_dir=str(out),
                priority=spec.priority,
                source=sub.source,
                model_file=(info.st_dev, info.st_ino),
            )
            try:
                self.store.insert(row)
            except AoedError:
                await self.inputs.release(model)
                raise
        self._event(
            row,
            "state",
            {"previous": "", "state": st.QUEUED, "message": f"submitted ({sub.source})"},
        )
        log.info("job %s: queued %s (%s)", job_id, row.model_name, sub.source)
        self.wake()
        return row, False

    async def cancel(self, job_id: str, reason: str = "cancelled by a client") -> JobRow:
        row = self.get(job_id)
        if row.final:
            return row
        live = self._live.get(job_id)
        ended = self._running.get(job_id)
        if ended is not None and live is not None:
            live.user_cancelled = True
            live.handle.cancel(reason)
            with trio.move_on_after(30):
                await ended.wait()
        elif row.state == st.QUEUED:
            self._finish(row, states.Cancel(), error=reason)
        return self.get(job_id)

    # ------------------------------------------------------------- events

    def _live_for(self, job_id: str) -> _Live:
        live = self._live.get(job_id)
        if live is None:
            live = self._live[job_id] = _Live()
        return live

    def _event(
        self, row: JobRow, kind: str, data: dict[str, Any], outcome: JobOutcome | None = None
    ) -> None:
        self._events.append(row.id, kind, data, outcome)

    def events(
        self, job_id: str, after_seq: int = 0, logs: bool = False
    ) -> AsyncGenerator[EventRow, None]:
        """The job's events after `after_seq`, then new ones as they happen; ends once
        the job is final and everything up to its last event was sent (EventLog.stream).
        NotFoundError for no such job."""
        self.get(job_id)
        return self._events.stream(job_id, after_seq, logs)

    def _transition(self, row: JobRow, event: states.Event, message: str = "") -> bool:
        """Move the job on by `event` (states.apply: TransitionError for one the machine
        does not allow); records the change and its event. False when it stays."""
        state = states.apply(row.state, event)
        if state == row.state:
            return False
        self._event(
            row, "state", {"previous": str(row.state), "state": str(state), "message": message}
        )
        row.state = state
        self._backlog.update(row.id, state=state)
        return True

    def _on_engine_event(self, row: JobRow, ev: JobEvent) -> None:
        if ev.kind == "stage":
            if ev.stage is not None:
                self._transition(row, states.Entered(ev.stage), ev.message)
            self._event(row, "log", {"level": "info", "logger": "stage", "message": ev.message})
        elif ev.kind == "progress":
            row.progress = {**row.progress, "done": ev.done, "total": ev.total, "what": ev.message}
            if ev.total and ev.done >= ev.total:
                row.progress["current_task"] = ""
            self._backlog.update(row.id, progress=row.progress)
            self._event(row, "progress", row.progress)
        elif ev.kind == "task":
            task = ev.message.split(":", 1)[0]
            row.progress = {**row.progress, "current_task": task}
            self._event(row, "log", {"level": "info", "logger": "task", "message": ev.message})
        else:  # wait | log
            level = "warning" if ev.kind == "wait" else "info"
            self._event(row, "log", {"level": level, "logger": ev.kind, "message": ev.message})

    def _finish(
        self,
        row: JobRow,
        event: states.Succeed | states.Fail | states.Cancel,
        error: str = "",
        kind: str = "",
        outcome: JobOutcome | None = None,
    ) -> None:
        now = time.time()
        state = states.apply(row.state, event)
        if outcome is not None:
            self._event(row, st.RESULT, {}, outcome)
        self._event(
            row, "state", {"previous": str(row.state), "state": str(state), "message": error}
        )
        row.state, row.error, row.error_kind, row.outcome, row.finished = (
            state,
            error,
            kind,
            outcome,
            now,
        )
        self._backlog.update(
            row.id, state=state, finished=now, error=error, error_kind=kind, outcome=outcome
        )
        for fn in self.on_final:
            try:
                fn(row)
            except Exception:
                log.exception("job %s: a final-state listener failed", row.id)

    # ------------------------------------------------------------- running

    def _run_of(self, row: JobRow) -> JobRun:
        return JobRun(
            model=Path(row.model_path),
            output=Path(row.output_dir),
            spec=row.spec,
            job_id=row.id,
            resumes=row.id if row.attempts > 1 else "",  # counted before it starts
            attempt=max(1, row.attempts),
            model_file=row.model_file,
            shown=shown_path(row),
        )

    async def _run_job(self, row: JobRow) -> None:
        live = self._live_for(row.id)
        live.handle = JobHandle()
        live.user_cancelled = False
        try:
            now = time.time()
            row.started = row.started or now
            self._backlog.update(row.id, started=row.started, attempts=row.attempts + 1)
            self._transition(row, states.Start(), "resumed" if row.attempts else "started")
            row.attempts += 1
            try:
                await trio.Path(row.output_dir).mkdir(parents=True, exist_ok=True)
                outcome = await self.engine.run_job(
                    self._run_of(row), lambda ev: self._on_engine_event(row, ev), live.handle
                )
            except BaseExceptionGroup as group:
                raise first_error(group, JobCancelledError, AoedError, OSError) from None
        except JobCancelledError as exc:
            if live.user_cancelled or not self._stopping:
                self._finish(row, states.Cancel(), error=str(exc))
            else:
                self._transition(
                    row,
                    states.Requeue(),
                    "interrupted by the daemon's shutdown; resumes at the next start",
                )
        except AoedError as exc:
            log.info("job %s failed: %s", row.id, exc)
            self._finish(row, states.Fail(), error=str(exc), kind=type(exc).__name__)
        except OSError as exc:
            self._finish(
                row,
                states.Fail(),
                error=f"{exc.filename or row.output_dir}: {exc.strerror or exc}",
                kind="OSError",
            )
        except Exception as exc:
            log.exception("job %s: internal error", row.id)
            self._finish(
                row,
                states.Fail(),
                error=f"internal error: {type(exc).__name__}: {exc}",
                kind="InternalError",
            )
        else:
            self._finish(row, states.Succeed(), outcome=outcome)
        finally:
            ended = self._running.pop(row.id)
            self._memory.release(row.id)
            out = Path(row.output_dir)
            if row.state == st.FAILED and out.is_relative_to(self.cfg.jobs_dir):
                with contextlib.suppress(OSError):
                    # empty when the job failed before tuning (engine.run_job)
                    out.rmdir()  # noqa: ASYNC240 (a `finally` that also runs on cancel)
            ended.set()
            self.wake()

"""The job manager: the daemon's job table, its queue, and the jobs running on the engine.

One agent owns every job's state. Submissions are checked, deduplicated (the same model
content with the same tuning options joins the active job instead of tuning twice) and
recorded in the job store before they are acknowledged; the scheduler starts queued
jobs, highest priority first and oldest first within a priority, while fewer than
`max_running_jobs` run. Running jobs share the engine's compile pool and device agent,
whose queues serve them by weight (fair share), so a long job cannot starve a short one.

Every event of a job is stored with a sequence number before watchers see it, so a
client that reconnects (or a daemon that restarts) resumes the stream where it stopped.

Resume: at start, jobs the store says were running are queued again and run with
`resumes` = their own id, so tasks their first run decided (committed to the bank as
each was decided, with the decision itself: engine/resume.py) are not measured again. On shutdown, running jobs get
`shutdown_grace_s` to finish; then they are cancelled and left queued for the next start.

Limits (jobs/limits.py): what a job asks for (its world's ranks, its shapes, its memory)
is checked against the configuration at submit, and again before a stored job starts,
so a job over a limit is refused (or, stored, failed) before any of its processes or
files exist. A job starts only while its memory estimate fits beside those of the jobs
running, and waits in the queue until it does; jobs start in the queue's order, so the
ones behind a waiting job wait with it. Every start is counted in the store before the
job runs: a job that was running when the daemon stopped or died `max_job_attempts`
times is failed rather than started again, so a job that wedges or crashes the daemon
cannot do so at every start.

A full disk: below `[limits] min_free_mb` free in the state dir, submissions are refused
(DiskFullError: RESOURCE_EXHAUSTED naming the folder and its free space) and queued jobs
wait. A write of a call in hand that the job store refuses fails that call; the state
changes of running jobs go through a `Backlog`, which keeps what the store refuses and
writes it once the store takes writes again, so neither a full disk nor a failing store
ends the manager.

Inputs: an uploaded model is kept once per content and name, `inputs/<sha256>/<name>` in
the state dir, and jobs refer to it; it is removed with the last job that does
(retention), and at start when none does.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
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
    OptionError,
    PermissionDeniedError,
    ResourceExhaustedError,
    first_error,
)
from aoe.outcome import JobOutcome
from aoe.spec import JobSpec, JobType, check_model_kind
from aoed import safefs, space
from aoed.config import DaemonConfig
from aoed.engine.engine import Engine
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.messages import JobEvent
from aoed.engine.modelio import check_size
from aoed.jobs import limits, states
from aoed.jobs import store as st
from aoed.jobs.backlog import Backlog
from aoed.jobs.states import JobState
from aoed.jobs.store import Claim, EventRow, JobRow, JobStore, StoreError, Upload
from aoed.jobs.uploads import UploadLedger

__all__ = ["JobManager", "Submission", "shown_path"]

log = logging.getLogger(__name__)

#: Seconds between attempts to write what the job store refused, and between looks at
#: the free space while queued jobs wait for it.
RETRY_S = 2.0


def _hash_checked(path: Path, checked: os.stat_result) -> str:
    """The sha256 of the file at `path`, read through a descriptor that must still be
    the file `checked` was (the same inode, one link): a file swapped in since the
    check, a hard link to a file from elsewhere included, is refused
    (PermissionDeniedError), and so is a link at `path`."""
    why = ""
    try:
        fd = safefs.open_file(path, single_link=True)
    except (safefs.LinkedError, safefs.LinkRefusedError) as exc:
        why = exc.strerror
    else:
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_dev, now.st_ino) == (checked.st_dev, checked.st_ino):
                return hashlib.file_digest(f, "sha256").hexdigest()
            why = "another file took its name"
    raise PermissionDeniedError(
        f"{path}: the file changed while it was checked ({why}); the daemon reads only the "
        "file it checked: submit it again once nobody changes it"
    )


def _dedup_key(sha: str, spec: JobSpec) -> str:
    return hashlib.sha256((sha + json.dumps(spec.tuning, sort_keys=True)).encode()).hexdigest()


@dataclass(frozen=True)
class Submission:
    """A model and its spec (checked where it was built): `model` is a daemon-side file."""

    model: Path
    spec: JobSpec
    #: who submitted it: "rpc:<client>" (see api.tuning.client_of) or "inbox:<folder>";
    #: the per-client limit counts active jobs of one source
    source: str = "rpc:local"
    #: an upload to consume: the file is moved into the job's folder
    upload: Upload | None = None
    #: a daemon-side folder for the outputs (confined by the caller); None: the job's own
    output_dir: Path | None = None
    #: `model` is a file of the daemon's own that nobody else can write (a claimed drop;
    #: an upload is one too): what was hashed is what the job runs
    private: bool = False

    @property
    def joinable(self) -> bool:
        """Whether later identical submissions may join this one's job. Only when its
        model is the daemon's own: a file named by path may be rewritten after it was
        hashed (its owner, or anyone who may write it, keeps that right), and a
        submission that joined would then get the result of bytes it never sent."""
        return self.private or self.upload is not None


@dataclass
class _Live:
    """What the manager keeps in memory for a job while it runs or is watched."""

    handle: JobHandle = field(default_factory=JobHandle)
    changed: trio.Event = field(default_factory=trio.Event)
    user_cancelled: bool = False


class JobManager:
    def __init__(self, cfg: DaemonConfig, store: JobStore, engine: Engine):
        self.cfg = cfg
        self.store = store
        self.engine = engine
        self._backlog = Backlog(store)
        #: the upload quotas' accounting (UploadModel reserves, consuming releases)
        self.uploads = UploadLedger(store.uploads_before(float("inf")))
        self._live: dict[str, _Live] = {}
        #: each running job's id, with the event set once it has ended (its final state
        #: recorded, its output folder tidied): what `cancel` and `stop` wait on
        self._running: dict[str, trio.Event] = {}
        self._wakeup = trio.Event()
        self._stopping = False
        self._limits_lock = trio.Lock()
        self._waiting_for_space = False
        #: the memory estimate (MiB) of each running job, and the job told it waits for memory
        self._held_mb: dict[str, int] = {}
        self._waiting_for_memory = ""
        #: called with each job that reaches a final state (the inbox delivers outputs)
        self.on_final: list[Callable[[JobRow], None]] = []

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Requeue what a previous run left running, then schedule until cancelled."""
        await trio.to_thread.run_sync(_sweep_inputs, self.cfg.inputs_dir, self.store.model_paths())
        for row in self.store.jobs(st.RUNNING, limit=100000):
            self._transition(row, states.Requeue(), "the daemon restarted: the job resumes")
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
            limits.check_attempts(row.attempts, self.cfg)
            limits.check_spec(row.spec, self.cfg)
            limits.check_memory(
                shown_path(row), row.spec, limits.model_bytes(row.model_path), self.engine.memory
            )
        except AoedError as exc:
            log.warning("job %s: not started: %s", row.id, exc)
            self._finish(row, states.Fail(), error=str(exc), kind=type(exc).__name__)
            return False
        return True

    def _admit_memory(self, row: JobRow) -> bool:
        """Whether the job's memory estimate fits beside the running jobs' (then it is
        held for it until it ends); else it waits, and is told so once."""
        need = limits.need_mb(row.spec, limits.model_bytes(row.model_path))
        total, held = self.engine.memory.total_mb(), sum(self._held_mb.values())
        if total is None or not self._held_mb or held + need <= total:
            self._held_mb[row.id] = need
            if self._waiting_for_memory == row.id:
                self._waiting_for_memory = ""
            return True
        if self._waiting_for_memory != row.id:
            self._waiting_for_memory = row.id
            message = (
                f"waits for memory: it needs about {need} MiB, and {held} of the {total} MiB jobs "
                f"may use here are held by {len(self._held_mb)} running job(s); it starts when one ends"
            )
            log.info("job %s: %s", row.id, message)
            self._event(row, "log", {"level": "info", "logger": "wait", "message": message})
        return False

    async def _retry_loop(self) -> None:
        """Write what the job store refused, once it takes writes again; look at the free
        space again while queued jobs wait for it."""
        while True:
            await trio.sleep(RETRY_S)
            if self._backlog.flush():
                for live in self._live.values():  # watchers read the events just written
                    live.changed.set()
                    live.changed = trio.Event()
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
                for up in self.store.uploads_before(now - self.cfg.upload_ttl_s):
                    self._remove_upload_file(Path(up.path))
                    self.uploads.release(up.id)
                    self.store.delete_upload(up.id)
                    log.info("upload %s (%s) expired", up.id, up.file_name)
                for row in self.store.finished_before(now - self.cfg.retention_s):
                    out = Path(row.output_dir)
                    if out.is_relative_to(self.cfg.jobs_dir):
                        await trio.to_thread.run_sync(shutil.rmtree, out, True)
                    self.store.delete(row.id)
                    await self._release_input(Path(row.model_path))
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
        return self.store.get_upload(upload_id)

    def add_upload(self, up: Upload) -> None:
        """Record a received upload (its file complete, its sha256 checked)."""
        self.store.add_upload(up)

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
        options); returns (job, joined). OptionError for a spec naming another device
        than this daemon's, or asking for more than its limits allow (jobs/limits.py),
        before any file of the job exists. Raises ResourceExhaustedError when the
        queue is full, DaemonUnavailableError while shutting down; PermissionDeniedError for a
        daemon-side file with several hard links (before anything opens it); ModelError
        for one over [engine] max_model_mb, or whose estimated peak is more than an
        engine process (a GDAT job: all of the engine) may use (memory.py)."""
        if self._stopping:
            raise DaemonUnavailableError(
                "the daemon is shutting down; submit again after it restarts"
            )
        mine = [a.device.name for a in self.engine.device_set]
        # A spec's device name is normalized: it compares as it is.
        if sub.spec.device is not None and sub.spec.device not in mine:
            raise OptionError(
                f"device {sub.spec.device}: this daemon measures on {', '.join(mine)} (see aoe devices)"
            )
        # The kind is the file name's: an upload's as uploaded, a path's own.
        check_model_kind(
            sub.upload.file_name if sub.upload is not None else sub.model.name,
            sub.spec.job_type,
            sub.spec.entry,
            daemon=True,
        )
        # A GDAT job's devices are its world's (the backend's), not the engine's.
        spec = sub.spec if sub.spec.job_type == JobType.GDAT else sub.spec.on(mine[0])
        limits.check_spec(spec, self.cfg)
        space.check_floor(self.cfg.state_dir, self.cfg.min_free_bytes, "SubmitJob")
        size = sub.upload.size if sub.upload is not None else 0
        if sub.upload is None:
            # The size is refused before the file is hashed: the limit is there so that
            # nobody reads 9 GiB.
            info = await trio.to_thread.run_sync(os.lstat, sub.model)
            size = info.st_size
            if info.st_nlink > 1:
                # The daemon reads what its submitter names; a hard link (which no path check
                # sees) would make it read a file the submitter could not. Uploads have one link.
                raise PermissionDeniedError(
                    f"{sub.model}: the file has {info.st_nlink} hard links, and a hard link can make the daemon "
                    "read a file its submitter could not; copy the file (cp, not ln) or upload it"
                )
            check_size(
                sub.model,
                info.st_size,
                self.engine.config.max_model_mb << 20,
                "[engine] max_model_mb",
            )
        name = sub.upload.file_name if sub.upload is not None else str(sub.model)
        limits.check_memory(name, spec, size, self.engine.memory)
        if sub.upload is None:
            sha = await trio.to_thread.run_sync(_hash_checked, sub.model, info)
        else:
            sha = sub.upload.sha256
        key = _dedup_key(sha, spec)
        async with self._limits_lock:
            same = self.store.active_with_key(key)
            if same is not None:
                self.store.update(same.id, joined=same.joined + 1)
                if sub.upload is not None:
                    await self._consume_upload(sub.upload, keep=False)
                log.info("job %s: an identical submission joined it", same.id)
                return self.get(same.id), True
            mine = self.store.count_active(sub.source)
            if mine >= self.cfg.max_jobs_per_client:
                raise ResourceExhaustedError(
                    f"{sub.source} has {mine} jobs queued or running (the limit per client is "
                    f"{self.cfg.max_jobs_per_client}); submit again when one has finished"
                )
            queued, _ = self.counts()
            if queued >= self.cfg.max_queued_jobs:
                raise ResourceExhaustedError(
                    f"{queued} jobs are queued (the limit is {self.cfg.max_queued_jobs}); try again later"
                )
            job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            out = sub.output_dir or self.cfg.jobs_dir / job_id
            model = sub.model
            if sub.upload is not None:
                model = await self._consume_upload(sub.upload, keep=True)
                info = await trio.to_thread.run_sync(model.stat)
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
                await self._release_input(model)
                raise
        self._event(
            row,
            "state",
            {"previous": "", "state": st.QUEUED, "message": f"submitted ({sub.source})"},
        )
        log.info("job %s: queued %s (%s)", job_id, row.model_name, sub.source)
        self.wake()
        return row, False

    async def _consume_upload(self, up: Upload, keep: bool) -> Path:
        """Take `up` out of the uploads; with `keep`, its content stays in the inputs,
        once (returns where)."""
        src = Path(up.path)
        dst = src
        if keep:
            dst = await trio.to_thread.run_sync(
                _keep_input, self.cfg.inputs_dir, src, up.sha256, up.file_name, up.size
            )
        self._remove_upload_file(src)
        self.uploads.release(up.id)
        self.store.delete_upload(up.id)
        return dst

    async def _release_input(self, path: Path) -> None:
        """Remove a kept input (and its folder, once empty) that no job refers to."""
        if path.parent.parent != self.cfg.inputs_dir or self.store.model_refs(str(path)):
            return
        await trio.to_thread.run_sync(_remove_input, path)

    def _remove_upload_file(self, path: Path) -> None:
        """An upload is `uploads/<id>/<name>`: the file and its folder go."""
        path.unlink(missing_ok=True)
        if path.parent.parent == self.cfg.uploads_dir:
            with contextlib.suppress(OSError):
                path.parent.rmdir()

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
        seq = self._backlog.last_seq(row.id) + 1
        self._backlog.append_event(EventRow(row.id, seq, time.time(), kind, data, outcome))
        live = self._live.get(row.id)
        if live is not None:
            live.changed.set()
            live.changed = trio.Event()

    async def events(
        self, job_id: str, after_seq: int = 0, logs: bool = False
    ) -> AsyncGenerator[EventRow, None]:
        """The job's events after `after_seq`, then new ones as they happen; ends once
        the job is final and everything up to its last event was sent."""
        self.get(job_id)
        live = self._live_for(job_id)
        seq = after_seq
        while True:
            changed = live.changed
            for ev in [*self.store.events(job_id, seq), *self._backlog.events(job_id, seq)]:
                seq = ev.seq
                if ev.kind == "log" and not logs:
                    continue
                yield ev
            row = self.store.get(job_id)
            if row is None or (
                self._backlog.overlay(row).final and self._backlog.last_seq(job_id) <= seq
            ):
                return
            await changed.wait()

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
        shown = shown_path(row)
        if shown != row.model_path:  # the engine names the copy it read; the user knows the file
            error = error.replace(row.model_path, shown)
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
            self._held_mb.pop(row.id, None)
            out = Path(row.output_dir)
            if row.state == st.FAILED and out.is_relative_to(self.cfg.jobs_dir):
                with contextlib.suppress(OSError):
                    # empty when the job failed before tuning (engine.run_job)
                    out.rmdir()  # noqa: ASYNC240 (a `finally` that also runs on cancel)
            ended.set()
            self.wake()


def _keep_input(inputs: Path, src: Path, sha: str, name: str, size: int) -> Path:
    """Where the uploaded `src` (`size` bytes with digest `sha`, named `name`) is kept:
    `inputs/<sha>/<name>`, from the upload itself unless those bytes are kept under that
    name already. The same bytes uploaded under another name are kept again under it:
    the job's workspace and outputs are named after its model file, and a hard link
    would make the model a file with several links, which a job does not read."""
    folder = inputs / sha
    dst = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    if _size(dst) != size:
        os.replace(src, dst)
    return dst


def _size(path: Path) -> int:
    """The size of the regular file at `path`, -1 when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def _remove_input(path: Path) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # only once no other name is in it


def _sweep_inputs(inputs: Path, referenced: set[str]) -> None:
    """Remove the kept inputs no job refers to (a crash between keeping one and
    recording its job, or a job store restored from before)."""
    if not inputs.is_dir():
        return
    for folder in inputs.iterdir():
        if folder.is_dir() and not folder.is_symlink():
            for f in folder.iterdir():
                if str(f) not in referenced:
                    _remove_input(f)


def shown_path(row: JobRow) -> str:
    """The model's path as its submitter knows it: for a drop-folder job the file as it
    was dropped (the daemon works on a claimed copy inside its state dir, a path that
    means nothing to the user), else the path the job reads."""
    if row.source.startswith("inbox:"):
        return str(Path(row.source.removeprefix("inbox:")) / row.model_name)
    return row.model_path

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
each was decided) are not measured again. On shutdown, running jobs get
`shutdown_grace_s` to finish; then they are cancelled and left queued for the next start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.jobtypes import DEFAULT_JOB_TYPE, parse_job_type
from aoe.device import Device
from aoe.errors import AoedError, JobCancelledError, OptionError
from aoed.config import DaemonConfig
from aoed.errors import NotFoundError, PermissionDeniedError, RpcError
from aoed.engine.engine import Engine
from aoed.engine.job import JobHandle, JobOptions, JobResult
from aoed.engine.messages import JobEvent
from aoed.engine.modelio import check_size
from aoed.engine.policy import policy
from aoed.jobs import store as st
from aoed.jobs.store import EventRow, JobRow, JobStore, Upload

__all__ = ["JobManager", "Submission", "options_from_dict", "sha256_file"]

log = logging.getLogger(__name__)

#: Options that change what a job computes (and so whether two submissions are the same).
_TUNING_KEYS = ("precision", "job_type", "input_shapes", "repeat_tune", "device", "budget_s", "min_cosine",
                "max_rel_error", "calibration_dir")  # fmt: skip

_STAGE_STATES = (
    ("preparing", st.PREPARING), ("calibrating", st.PREPARING), ("profiling", st.TUNING), ("tuning", st.TUNING),
    ("checking accuracy", st.VERIFYING), ("verifying", st.VERIFYING), ("confirming", st.VERIFYING),
)  # fmt: skip


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def options_from_dict(raw: dict[str, Any], default_device: Device) -> dict[str, Any]:
    """Checked, normalized job options (plain JSON types). Raises OptionError."""
    opts: dict[str, Any] = {
        "precision": str(raw.get("precision") or "exact"),
        "job_type": str(raw.get("job_type") or DEFAULT_JOB_TYPE),
        "input_shapes": {str(k): [int(d) for d in v] for k, v in (raw.get("input_shapes") or {}).items()},
        "repeat_tune": bool(raw.get("repeat_tune", False)),
        "device": str(raw.get("device") or default_device.name),
        "budget_s": float(raw["budget_s"]) if raw.get("budget_s") else None,
        "min_cosine": float(raw["min_cosine"]) if raw.get("min_cosine") else None,
        "max_rel_error": float(raw["max_rel_error"]) if raw.get("max_rel_error") else None,
        "calibration_dir": str(raw.get("calibration_dir") or ""),
        "priority": int(raw.get("priority") or 0),
        "labels": {str(k): str(v) for k, v in (raw.get("labels") or {}).items()},
    }
    opts["job_type"] = parse_job_type(opts["job_type"], "job_type")
    policy(opts["precision"], opts["min_cosine"], opts["max_rel_error"])
    if Device.parse(opts["device"]).name != default_device.name:
        raise OptionError(f"device {opts['device']}: this daemon measures on {default_device.name} (see aoe devices)")
    if not -10 <= opts["priority"] <= 10:
        raise OptionError(f"priority {opts['priority']}: must be between -10 and 10")
    if opts["budget_s"] is not None and opts["budget_s"] <= 0:
        raise OptionError("budget_s must be a positive number of seconds")
    for name, dims in opts["input_shapes"].items():
        if not dims or any(d <= 0 for d in dims):
            raise OptionError(f"input shape {name}: dimensions must be positive")
    return opts


def _dedup_key(sha: str, opts: dict[str, Any]) -> str:
    tuning = {k: opts.get(k) for k in _TUNING_KEYS}
    return hashlib.sha256((sha + json.dumps(tuning, sort_keys=True)).encode()).hexdigest()


@dataclass(frozen=True)
class Submission:
    """A model and options, already checked: `model` is a daemon-side file."""

    model: Path
    options: dict[str, Any]
    #: who submitted it: "rpc:<client>" (see api.tuning.client_of) or "inbox:<folder>";
    #: the per-client limit counts active jobs of one source
    source: str = "rpc:local"
    #: an upload to consume: the file is moved into the job's folder
    upload: Upload | None = None
    #: a daemon-side folder for the outputs (confined by the caller); None: the job's own
    output_dir: Path | None = None


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
        self._live: dict[str, _Live] = {}
        self._running: set[str] = set()
        self._wakeup = trio.Event()
        self._stopping = False
        self._limits_lock = trio.Lock()
        #: called with each job that reaches a final state (the inbox delivers outputs)
        self.on_final: list[Callable[[JobRow], None]] = []

    # ------------------------------------------------------------- lifecycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Requeue what a previous run left running, then schedule until cancelled."""
        for row in self.store.jobs(st.RUNNING, limit=100000):
            self._event(row, "state", {"previous": row.state, "state": st.QUEUED,
                                       "message": "the daemon restarted: the job resumes"})  # fmt: skip
            self.store.update(row.id, state=st.QUEUED)
        queued = len(self.store.jobs([st.QUEUED], limit=100000))
        if queued:
            log.info("jobs: %d queued job(s) from the store", queued)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._housekeeping)
            task_status.started()
            while True:
                while not self._stopping and len(self._running) < self.cfg.max_running_jobs:
                    row = self._next_queued()
                    if row is None:
                        break
                    self._running.add(row.id)
                    nursery.start_soon(self._run_job, row)
                await self._wakeup.wait()
                self._wakeup = trio.Event()

    def _poke(self) -> None:
        self._wakeup.set()

    async def stop(self, grace_s: float) -> None:
        """Start no more jobs; give running ones `grace_s` to finish, then cancel them
        (they stay queued and resume at the next start)."""
        self._stopping = True
        with trio.move_on_after(grace_s):
            while self._running:
                await trio.sleep(0.1)
        for job_id in list(self._running):
            self._live[job_id].handle.cancel("the daemon is shutting down")
        with trio.move_on_after(10):
            while self._running:
                await trio.sleep(0.05)

    async def _housekeeping(self) -> None:
        """Expired uploads and finished jobs past retention go, at start and then hourly
        (more often when a limit is shorter than two hours)."""
        while True:
            now = time.time()
            for up in self.store.uploads_before(now - self.cfg.upload_ttl_s):
                self._remove_upload_file(Path(up.path))
                self.store.delete_upload(up.id)
                log.info("upload %s (%s) expired", up.id, up.file_name)
            for row in self.store.finished_before(now - self.cfg.retention_s):
                out = Path(row.output_dir)
                if out.is_relative_to(self.cfg.jobs_dir):
                    await trio.to_thread.run_sync(shutil.rmtree, out, True)
                self.store.delete(row.id)
                log.info("job %s: removed after retention", row.id)
            await trio.sleep(max(1.0, min(3600.0, self.cfg.upload_ttl_s / 2, self.cfg.retention_s / 2)))

    # ------------------------------------------------------------- queries

    def get(self, job_id: str) -> JobRow:
        row = self.store.get(job_id)
        if row is None:
            raise NotFoundError(f"no job {job_id!r} (aoe jobs lists them)")
        return row

    def list(self, states: list[str], limit: int, before: tuple[float, str] | None) -> list[JobRow]:
        return self.store.jobs(states, limit, before)

    def queue_position(self, row: JobRow) -> int:
        if row.state != st.QUEUED:
            return 0
        order = self._queued_order()
        return next((i for i, r in enumerate(order) if r.id == row.id), 0)

    def counts(self) -> tuple[int, int]:
        return len(self.store.jobs([st.QUEUED], limit=100000)), len(self._running)

    def _queued_order(self) -> list[JobRow]:
        rows = self.store.jobs([st.QUEUED], limit=100000)
        return sorted(rows, key=lambda r: (-r.priority, r.created, r.id))

    def _next_queued(self) -> JobRow | None:
        return next((r for r in self._queued_order() if r.id not in self._running), None)

    # ------------------------------------------------------------- commands

    async def submit(self, sub: Submission) -> tuple[JobRow, bool]:
        """Record a job for `sub` (or join the active one with the same content and
        options); returns (job, joined). Raises RpcError(RESOURCE_EXHAUSTED) when the
        queue is full, UNAVAILABLE while shutting down; PermissionDeniedError for a
        daemon-side file with several hard links (before anything opens it); ModelError
        for one over [engine] max_model_mb."""
        if self._stopping:
            raise RpcError("UNAVAILABLE", "the daemon is shutting down; submit again after it restarts")
        if sub.upload is None:  # refused before hashing it: the limit is there so nobody reads 9 GiB
            info = await trio.to_thread.run_sync(sub.model.stat)
            if info.st_nlink > 1:
                # The daemon reads what its submitter names; a hard link (which no path check
                # sees) would make it read a file the submitter could not. Uploads have one link.
                raise PermissionDeniedError(
                    f"{sub.model}: the file has {info.st_nlink} hard links, and a hard link can make the daemon "
                    "read a file its submitter could not; copy the file (cp, not ln) or upload it")  # fmt: skip
            check_size(sub.model, info.st_size, self.engine.config.max_model_mb << 20, "[engine] max_model_mb")
        sha = sub.upload.sha256 if sub.upload else await trio.to_thread.run_sync(sha256_file, sub.model)
        key = _dedup_key(sha, sub.options)
        async with self._limits_lock:
            same = self.store.active_with_key(key)
            if same is not None:
                self.store.update(same.id, joined=same.joined + 1)
                if sub.upload is not None:
                    await self._consume_upload(sub.upload, None)
                log.info("job %s: an identical submission joined it", same.id)
                return self.get(same.id), True
            mine = self.store.count_active(sub.source)
            if mine >= self.cfg.max_jobs_per_client:
                raise RpcError("RESOURCE_EXHAUSTED",
                               f"{sub.source} has {mine} jobs queued or running (the limit per client is "
                               f"{self.cfg.max_jobs_per_client}); submit again when one has finished")  # fmt: skip
            queued, _ = self.counts()
            if queued >= self.cfg.max_queued_jobs:
                raise RpcError("RESOURCE_EXHAUSTED",
                               f"{queued} jobs are queued (the limit is {self.cfg.max_queued_jobs}); try again later")  # fmt: skip
            job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            out = sub.output_dir or self.cfg.jobs_dir / job_id
            model = sub.model
            if sub.upload is not None:
                model = await self._consume_upload(sub.upload, self.cfg.jobs_dir / job_id / "model")
            row = JobRow(
                id=job_id, state=st.QUEUED, model_path=str(model), model_name=sub.model.name if sub.upload is None
                else sub.upload.file_name, model_sha256=sha, dedup_key=key, options=sub.options, output_dir=str(out),
                priority=int(sub.options.get("priority", 0)), source=sub.source,
            )  # fmt: skip
            self.store.insert(row)
        self._event(row, "state", {"previous": "", "state": st.QUEUED, "message": f"submitted ({sub.source})"})
        log.info("job %s: queued %s (%s)", job_id, row.model_name, sub.source)
        self._poke()
        return row, False

    async def _consume_upload(self, up: Upload, into: Path | None) -> Path:
        src = Path(up.path)
        dst = src
        if into is not None:
            into.mkdir(parents=True, exist_ok=True)
            dst = into / up.file_name
            src.replace(dst)
        self._remove_upload_file(src)
        self.store.delete_upload(up.id)
        return dst

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
        if job_id in self._running and live is not None:
            live.user_cancelled = True
            live.handle.cancel(reason)
            with trio.move_on_after(30):
                while job_id in self._running:
                    await trio.sleep(0.02)
        elif row.state == st.QUEUED:
            self._finish(row, st.CANCELLED, error=reason)
        return self.get(job_id)

    # ------------------------------------------------------------- events

    def _live_for(self, job_id: str) -> _Live:
        live = self._live.get(job_id)
        if live is None:
            live = self._live[job_id] = _Live()
        return live

    def _event(self, row: JobRow, kind: str, data: dict[str, Any]) -> None:
        seq = self.store.last_seq(row.id) + 1
        self.store.append_event(EventRow(row.id, seq, time.time(), kind, data))
        live = self._live.get(row.id)
        if live is not None:
            live.changed.set()
            live.changed = trio.Event()

    async def events(self, job_id: str, after_seq: int = 0, logs: bool = False) -> AsyncIterator[EventRow]:
        """The job's events after `after_seq`, then new ones as they happen; ends once
        the job is final and everything up to its last event was sent."""
        self.get(job_id)
        live = self._live_for(job_id)
        seq = after_seq
        while True:
            changed = live.changed
            for ev in self.store.events(job_id, seq):
                seq = ev.seq
                if ev.kind == "log" and not logs:
                    continue
                yield ev
            row = self.store.get(job_id)
            if row is None or (row.final and self.store.last_seq(job_id) <= seq):
                return
            await changed.wait()

    def _set_state(self, row: JobRow, state: str, message: str = "") -> None:
        if row.state == state:
            return
        self._event(row, "state", {"previous": row.state, "state": state, "message": message})
        row.state = state
        self.store.update(row.id, state=state)

    def _on_engine_event(self, row: JobRow, ev: JobEvent) -> None:
        if ev.kind == "stage":
            low = ev.message.lower()
            for prefix, state in _STAGE_STATES:
                if low.startswith(prefix):
                    self._set_state(row, state, ev.message)
                    break
            self._event(row, "log", {"level": "info", "logger": "stage", "message": ev.message})
        elif ev.kind == "progress":
            row.progress = {**row.progress, "done": ev.done, "total": ev.total, "what": ev.message}
            if ev.total and ev.done >= ev.total:
                row.progress["current_task"] = ""
            self.store.update(row.id, progress=row.progress)
            self._event(row, "progress", row.progress)
        elif ev.kind == "task":
            task = ev.message.split(":", 1)[0]
            row.progress = {**row.progress, "current_task": task}
            self._event(row, "log", {"level": "info", "logger": "task", "message": ev.message})
        else:  # wait | log
            level = "warning" if ev.kind == "wait" else "info"
            self._event(row, "log", {"level": level, "logger": ev.kind, "message": ev.message})

    def _finish(self, row: JobRow, state: str, error: str = "", kind: str = "", result: dict | None = None) -> None:
        now = time.time()
        if result is not None:
            self._event(row, "result", result)
        self._event(row, "state", {"previous": row.state, "state": state, "message": error})
        row.state, row.error, row.error_kind, row.result, row.finished = state, error, kind, result, now
        self.store.update(row.id, state=state, finished=now, error=error, error_kind=kind, result=result)
        for fn in self.on_final:
            try:
                fn(row)
            except Exception:
                log.exception("job %s: a final-state listener failed", row.id)

    # ------------------------------------------------------------- running

    def _engine_options(self, row: JobRow) -> JobOptions:
        o = row.options
        return JobOptions(
            model=Path(row.model_path),
            output=Path(row.output_dir),
            precision=o["precision"],
            job_type=o["job_type"],
            input_shapes={k: tuple(v) for k, v in o.get("input_shapes", {}).items()},
            repeat_tune=bool(o.get("repeat_tune")),
            device=self.engine.device.device,
            calibration=Path(o["calibration_dir"]) if o.get("calibration_dir") else None,
            min_cosine=o.get("min_cosine"),
            max_rel_error=o.get("max_rel_error"),
            budget_s=o.get("budget_s"),
            job_id=row.id,
            resumes=row.id if row.attempts > 1 else "",  # counted before it starts
            weight=max(1, 1 + int(o.get("priority", 0))) if int(o.get("priority", 0)) > 0 else 1,
        )

    async def _run_job(self, row: JobRow) -> None:
        live = self._live_for(row.id)
        live.handle = JobHandle()
        live.user_cancelled = False
        try:
            now = time.time()
            row.started = row.started or now
            self.store.update(row.id, started=row.started, attempts=row.attempts + 1)
            self._set_state(row, st.PREPARING, "resumed" if row.attempts else "started")
            row.attempts += 1
            try:
                Path(row.output_dir).mkdir(parents=True, exist_ok=True)
                result = await self.engine.run_job(self._engine_options(row), lambda ev: self._on_engine_event(row, ev),
                                                   live.handle)  # fmt: skip
            except BaseExceptionGroup as group:
                raise _single(group) from None
        except JobCancelledError as exc:
            if live.user_cancelled or not self._stopping:
                self._finish(row, st.CANCELLED, error=str(exc))
            else:
                self._set_state(row, st.QUEUED, "interrupted by the daemon's shutdown; resumes at the next start")
        except AoedError as exc:
            log.info("job %s failed: %s", row.id, exc)
            self._finish(row, st.FAILED, error=str(exc), kind=type(exc).__name__)
        except OSError as exc:
            self._finish(row, st.FAILED, error=f"{exc.filename or row.output_dir}: {exc.strerror or exc}", kind="OSError")
        except Exception as exc:
            log.exception("job %s: internal error", row.id)
            self._finish(row, st.FAILED, error=f"internal error: {type(exc).__name__}: {exc}", kind="InternalError")
        else:
            self._finish(row, st.SUCCEEDED, result=result_dict(result))
        finally:
            self._running.discard(row.id)
            self._poke()


def _single(group: BaseExceptionGroup) -> BaseException:
    for cls in (JobCancelledError, AoedError, OSError):
        match, _ = group.split(cls)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        if match is not None:
            return match
    return group


def result_dict(r: JobResult) -> dict[str, Any]:
    """The part of a JobResult a client sees (JSON types only)."""
    return {
        "baseline_ms": r.baseline_ms,
        "tuned_ms": r.tuned_ms,
        "improvement": r.improvement,
        "tuned_model": r.tuned_model,
        "result_json": r.result_json,
        "repo": dict(r.repo),
        "verdict": str(r.confirmation.get("verdict", "")),
        "shipped": str(r.confirmation.get("shipped", "")),
        "improvement_ci95": list(r.confirmation.get("improvement_ci95", (0.0, 0.0))),
        "confirm_rounds": int(r.confirmation.get("rounds", 0) or 0),
        "confirmed_by": str(r.confirmation.get("from_bank", "") or ""),
        "tuning_time_s": r.tuning_time_s,
        "resources": {k: v for k, v in r.resources.items() if isinstance(v, int | float | str)},
        "tasks": [
            {"task_id": t.task_id, "op_type": t.op_type, "op_name": t.op_name, "strategy": t.strategy,
             "before_us": t.before_us, "after_us": t.after_us, "improvement": t.improvement,
             "update_mode": t.update_mode, "bank_layer": t.bank_layer, "error": t.error,
             "accuracy": {k: float(v) for k, v in t.accuracy.items() if isinstance(v, int | float)}}
            for t in r.tasks
        ],  # fmt: skip
    }

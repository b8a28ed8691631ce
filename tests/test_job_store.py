"""The job store's schema version and migrations: a store written before versions were
recorded opens with every job, its model file moved out of the options into its own
column; a store a newer aoed wrote is refused, unchanged, naming the file and both
versions; a result event reads back as the outcome it holds; and a daemon restarted over
a migrated store serves and runs the old jobs.

Old stores are built here as the code before versions wrote them: its tables, and rows
whose options JSON holds the model file's [device, inode] under "model_file"."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from aoe.outcome import JobOutcome
from aoe.spec import JobSpec
from aoe.v1 import tuning_pb2
from aoed import samples
from aoed.jobs.states import JobState
from aoed.jobs.store import RESULT, SCHEMA_VERSION, EventRow, JobStore, StoreError
from tests.daemon_util import DaemonProcess

#: The layout of a store before versions were recorded (user_version 0), as written.
_OLD_TABLES = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, priority INTEGER NOT NULL DEFAULT 0,
    source TEXT NOT NULL DEFAULT 'rpc', model_path TEXT NOT NULL, model_name TEXT NOT NULL,
    model_sha256 TEXT NOT NULL, dedup_key TEXT NOT NULL, options TEXT NOT NULL,
    output_dir TEXT NOT NULL, created REAL NOT NULL, started REAL, finished REAL,
    error TEXT NOT NULL DEFAULT '', error_kind TEXT NOT NULL DEFAULT '', result TEXT,
    progress TEXT NOT NULL DEFAULT '{}', joined INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created DESC, id DESC);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_by_dedup ON jobs (dedup_key, state);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS uploads (
    id TEXT PRIMARY KEY, path TEXT NOT NULL, file_name TEXT NOT NULL, sha256 TEXT NOT NULL,
    size INTEGER NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS claims (
    src TEXT PRIMARY KEY, dst TEXT NOT NULL, inbox TEXT NOT NULL, state TEXT NOT NULL,
    job_id TEXT NOT NULL DEFAULT '', time REAL NOT NULL
);
"""


def _old_job(
    job_id: str,
    state: str,
    model: Path,
    model_file: list[int] | None,
    created: float,
    spec: JobSpec | None = None,
    error: str = "",
) -> dict[str, Any]:
    options = (spec or JobSpec(budget_s=1.0)).to_dict()
    if model_file:  # the code before versions wrote the key only when it had one
        options["model_file"] = model_file
    return {
        "id": job_id,
        "state": state,
        "model_path": str(model),
        "model_name": model.name,
        "model_sha256": "0" * 64,
        "dedup_key": f"key/{job_id}",
        "options": json.dumps(options),
        "output_dir": str(model.parent / "out" / job_id),
        "created": created,
        "finished": created + 1 if state in ("failed", "succeeded") else None,
        "error": error,
        "result": "null",
        "progress": "{}",
    }


#: A finished job's outcome as the code before versions stored it (`to_dict`), in the
#: job's row and in its result event.
_OLD_OUTCOME = {
    "job_id": "job-s",
    "tuned_model": "/o/t.onnx",
    "result_json": "/o/r.json",
    "baseline_ms": 2.0,
    "improvement": 0.25,
}


def _write_old_store(path: Path, jobs: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    with db:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_OLD_TABLES)
        for job in jobs:
            db.execute(
                f"INSERT INTO jobs ({','.join(job)}) VALUES ({','.join('?' * len(job))})",
                list(job.values()),
            )
            db.execute(
                "INSERT INTO events (job_id, seq, time, kind, data) VALUES (?, 1, ?, 'state', ?)",
                (job["id"], job["created"], json.dumps({"previous": "", "state": "queued"})),
            )
            if job["result"] != "null":
                db.execute(
                    "INSERT INTO events (job_id, seq, time, kind, data) VALUES (?, 2, ?, 'result', ?)",
                    (job["id"], job["created"], job["result"]),
                )
    db.close()


def _raw(path: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def test_a_job_store_from_before_versions_keeps_every_job_and_its_model_file(
    tmp_path: Path,
) -> None:
    path, model = tmp_path / "state" / "jobs.sqlite3", tmp_path / "m.onnx"
    big_inode = 2**63 + 5  # past SQLite's signed 64 bits, as some file systems number them
    _write_old_store(
        path,
        [
            _old_job("job-q", "queued", model, [66311, big_inode], 1.0, JobSpec(budget_s=7.0)),
            _old_job("job-f", "failed", model, [66311, 12], 2.0, error="the model is too big"),
            {
                **_old_job("job-s", "succeeded", model, None, 3.0),
                "result": json.dumps(JobOutcome.from_dict(_OLD_OUTCOME).to_dict()),
            },
            {**_old_job("job-d", "queued", model, [1, 2], 4.0), "options": '{"budget_s": 1, "mo'},
        ],
    )
    store = JobStore(path)
    try:
        rows = {r.id: r for r in store.jobs()}
        assert sorted(rows) == ["job-f", "job-q", "job-s"]
        assert rows["job-q"].model_file == (66311, big_inode)
        assert (
            rows["job-q"].spec == JobSpec(budget_s=7.0) and rows["job-q"].state == JobState.QUEUED
        )
        assert (
            rows["job-f"].model_file == (66311, 12)
            and rows["job-f"].error == "the model is too big"
        )
        assert rows["job-s"].model_file is None
        assert [e.data["state"] for e in store.events("job-q")] == ["queued"]
        # A result event reads back as the outcome itself, as the job's row does.
        outcome = JobOutcome.from_dict(_OLD_OUTCOME)
        result = store.events("job-s", after_seq=1)
        assert [(e.kind, e.outcome) for e in result] == [("result", outcome)]
        assert rows["job-s"].outcome == outcome
        store.append_event(EventRow("job-s", 3, 5.0, RESULT, {}, outcome))
        assert store.events("job-s", after_seq=2)[0].outcome == outcome
        # The row that was damaged before is still damaged, reported, and still there.
        assert store.damaged == ["job-d"]
    finally:
        store.close()
    assert _raw(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert _raw(path, "SELECT options FROM jobs WHERE id = 'job-d'") == [('{"budget_s": 1, "mo',)]
    assert not _raw(path, "SELECT id FROM jobs WHERE options LIKE '%model_file%'")
    # Each migration does nothing to a store that has what it adds: run again, the same.
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 0")
    db.close()
    before = _raw(path, "SELECT * FROM jobs ORDER BY id")
    JobStore(path).close()
    assert _raw(path, "SELECT * FROM jobs ORDER BY id") == before
    assert _raw(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]


def test_a_job_store_of_a_newer_version_is_refused_unchanged_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    _write_old_store(path, [_old_job("job-1", "queued", tmp_path / "m.onnx", [1, 2], 1.0)])
    JobStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = _raw(path, "SELECT * FROM jobs")
    with pytest.raises(StoreError) as err:
        JobStore(path)
    message = str(err.value)
    assert str(path) in message, message
    assert f"schema version {SCHEMA_VERSION + 1} is newer than this aoed's ({SCHEMA_VERSION})" in (
        message
    )
    assert "move the file aside" in message
    assert _raw(path, "SELECT * FROM jobs") == before
    assert _raw(path, "PRAGMA user_version") == [(SCHEMA_VERSION + 1,)]


@pytest.mark.slow
def test_a_daemon_restarted_over_a_migrated_job_store_serves_and_runs_the_old_jobs(
    tmp_path: Path,
) -> None:
    """The old queued jobs run with the model file their submit checked: the one whose
    file is still that file succeeds; the one whose recorded inode is another file's is
    refused before anything is read, which it could not be had its model file been lost."""
    d = DaemonProcess(tmp_path / "d")
    model = d.models / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    info, now = os.stat(model), time.time()  # (finished jobs older than a week are removed)
    store = d.state / "jobs.sqlite3"
    _write_old_store(
        store,
        [
            _old_job(
                "job-old-failed", "failed", model, [info.st_dev, info.st_ino], now - 3, error="x"
            ),
            _old_job("job-old-same", "queued", model, [info.st_dev, info.st_ino], now - 2),
            _old_job("job-old-other", "queued", model, [info.st_dev, info.st_ino + 1], now - 1),
        ],
    )
    try:
        d.start()
        same, other = d.wait_job("job-old-same"), d.wait_job("job-old-other")
        assert same.state == tuning_pb2.JOB_STATE_SUCCEEDED, same.error
        assert other.state == tuning_pb2.JOB_STATE_FAILED
        assert "not the file that was submitted" in other.error, other.error
        listed = d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
        assert [j.job_id for j in listed] == ["job-old-other", "job-old-same", "job-old-failed"]
        assert listed[2].state == tuning_pb2.JOB_STATE_FAILED and listed[2].error == "x"
        assert "damaged" not in d.log()
        watched = d.tuning().WatchJob(tuning_pb2.WatchJobRequest(job_id="job-old-same"), timeout=60)
        (result,) = [m.event.result for m in watched if m.event.WhichOneof("event") == "result"]
        assert result == same.result
        assert d.stop() == 0
        # A newer aoed's store: this one does not start, and says why and what to do.
        db = sqlite3.connect(store)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        db.close()
        with pytest.raises(RuntimeError, match="aoed exited"):
            d.start()
        assert f"job store {store}: schema version {SCHEMA_VERSION + 1} is newer" in d.log()
        assert _raw(store, "SELECT COUNT(*) FROM jobs") == [(3,)]
    finally:
        d.close()

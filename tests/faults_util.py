"""What the fault tests and bench/soak*.py share: a daemon's children and their states,
submitting and following a job, a kill -9 round with its checks, the bank's keys and the
job store's integrity, and filling a filesystem."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from aoe.bank import open_bank
from aoe.errors import BankError
from aoe.v1 import tuning_pb2
from aoed import samples
from tests.daemon_util import DaemonProcess

__all__ = [
    "FINAL",
    "RUNNER",
    "WORKER",
    "Round",
    "S",
    "bank_keys",
    "child_pid",
    "children",
    "clearly_ended",
    "fill",
    "job",
    "kill9_round",
    "model",
    "proc_state",
    "store_integrity",
    "submit",
    "wait_stage",
]


S = tuning_pb2


FINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)


WORKER, RUNNER = "aoed.backends.ort.worker", "aoed.backends.ort.runner"


def children(pid: int) -> dict[int, str]:
    """The child processes of `pid`, each with its command line."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for kid in map(int, kids):
            try:
                out[kid] = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                pass
    return out


def child_pid(d: DaemonProcess, module: str) -> int | None:
    """The pid of the daemon's child running `python -m module`, if one runs."""
    assert d.proc is not None
    return next(
        (pid for pid, cmd in children(d.proc.pid).items() if f"-m {module} " in cmd + " "), None
    )


def proc_state(pid: int) -> str:
    """R, S, T, Z ... from /proc/PID/stat; "" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def job(d: DaemonProcess, job_id: str) -> tuning_pb2.Job:
    return d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id), timeout=10).job


def submit(d: DaemonProcess, model: Path, budget: float, **opts) -> str:
    """Submit `model` (a file in the daemon's allowed dir) by path; returns the job id."""
    reply = d.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_path=str(model), options=tuning_pb2.JobOptions(budget_s=budget, **opts)
        ),
        timeout=30,
    )
    return reply.job_id


def model(d: DaemonProcess, name: str, **kw) -> Path:
    """Sample `name` (with `kw`) saved in the daemon's allowed dir; different `kw` give
    different tasks, so a job of it finds nothing in the bank."""
    path = d.models / ("_".join([name, *(f"{k}{v}" for k, v in sorted(kw.items()))]) + ".onnx")
    if not path.exists():
        samples.save(samples.SAMPLES[name](**kw), path)
    return path


def bank_keys(bank: Path) -> set[str]:
    """Keys of the entries and default records in the bank at `bank` (empty before the
    daemon first wrote it); opening it is itself a check that LMDB accepts its files."""
    if not (bank / "data.mdb").exists():
        return set()
    with open_bank(bank, use_env=False) as reader:
        return {
            f"{kind}:{getattr(rec, kind).key}"
            for _, rec in reader.records(history=False)
            if (kind := rec.WhichOneof("record"))
        }


def store_integrity(state: Path) -> str:
    """SQLite's integrity_check of the job store, read-only (no checkpoint, no repair)."""
    db = sqlite3.connect(f"file:{state / 'jobs.sqlite3'}?mode=ro", uri=True)
    try:
        return "; ".join(row[0] for row in db.execute("PRAGMA integrity_check"))
    finally:
        db.close()


def clearly_ended(j: tuning_pb2.Job) -> bool:
    """SUCCEEDED, or FAILED with a message and the class of the failure (not an internal error)."""
    if j.state == S.JOB_STATE_SUCCEEDED:
        return True
    return (
        j.state == S.JOB_STATE_FAILED
        and bool(j.error)
        and j.error_kind not in ("", "InternalError")
    )


@dataclass
class Round:
    """One kill -9 of the daemon during a job, and what the restart found."""

    seed: int
    delay_s: float
    state_at_kill: str
    state: str = ""
    error: str = ""
    bank_at_kill: int = 0
    bank_after: int = 0
    problems: list[str] = field(default_factory=list)


def kill9_round(
    d: DaemonProcess, path: Path, seed: int, max_delay_s: float, budget_s: float
) -> Round:
    """Submit `path`, kill -9 the daemon a random time in [0.2, max_delay_s] later (from
    `seed`), snapshot the bank, restart, wait for the job; returns the Round with every
    check that failed in `problems` (empty: the job ended clearly, the bank kept every
    entry it had at the kill, the job store and the bank open clean)."""
    delay = random.Random(seed).uniform(0.2, max_delay_s)
    job_id = submit(d, path, budget_s)
    time.sleep(delay)
    at_kill = S.JobState.Name(job(d, job_id).state)
    d.kill()
    r = Round(seed, delay, at_kill)
    try:
        before = bank_keys(d.bank)
    except BankError as exc:
        before = set()
        r.problems.append(f"the bank did not open after the kill: {exc}")
    if (d.state / "jobs.sqlite3").exists() and (check := store_integrity(d.state)) != "ok":
        r.problems.append(f"job store after the kill: {check}")
    d.start()
    j = d.wait_job(job_id, timeout=240)
    after = bank_keys(d.bank)
    r.state, r.error, r.bank_at_kill, r.bank_after = (
        S.JobState.Name(j.state),
        j.error,
        len(before),
        len(after),
    )
    if not clearly_ended(j):
        r.problems.append(f"job {job_id} ended {r.state} ({j.error_kind}: {j.error})")
    if lost := before - after:
        r.problems.append(
            f"{len(lost)} bank entries committed before the kill are gone: {sorted(lost)[:3]}"
        )
    if (check := store_integrity(d.state)) != "ok":
        r.problems.append(f"job store after the restart: {check}")
    return r


def wait_stage(d: DaemonProcess, job_id: str, prefix: str, timeout: float = 60) -> None:
    """Return once the job announces a stage whose message starts with `prefix`."""
    stream = d.tuning().WatchJob(
        tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=timeout
    )
    for msg in stream:
        e = msg.event
        if (
            e.WhichOneof("event") == "log"
            and e.log.logger == "stage"
            and e.log.message.startswith(prefix)
        ):
            stream.cancel()
            return
    raise AssertionError(f"job {job_id} ended before a stage {prefix!r}: {job(d, job_id)}")


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill the filesystem at `fs` but `leave` bytes; returns the filler file."""
    filler = fs / "filler"
    with open(filler, "ab") as f:
        try:
            while True:
                st = os.statvfs(fs)
                free = st.f_bavail * st.f_frsize - leave
                if free <= 0:
                    break
                f.write(b"\0" * min(free, 1 << 20))
                f.flush()
        except OSError:  # ENOSPC: as full as it gets
            pass
    return filler

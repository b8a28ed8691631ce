"""Faults through a real daemon, and what must hold after each.

A compile worker that segfaults mid-job, a worker over its memory limit, the measurement
runner killed mid-measurement, a damaged job-store row, a full disk under the outputs
and under the bank, and `kill -9` of the daemon at random points of a job. After each:
the daemon (or its restart) serves, the job ends SUCCEEDED or FAILED with a message that
names the cause, and every bank entry committed before the fault is still there.

A worker that hangs mid-compile is tested through the daemon too, with the compile limit
set low (`[engine] compile_timeout_s`) and a plugin strategy that sleeps in the worker.

The engine-level versions (a strategy that crashes or hangs its worker, a worker over
its limit) are in test_engine_processes.py; here the faults hit the daemon's own child
processes from outside, as a crash or the kernel would, or come from a plugin.

`kill9_round` is shared with bench/soak.py, which runs it for many seeds.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from aoe.bank import open_bank
from aoe.errors import BankError
from aoe.v1 import tuning_pb2
from aoed import samples
from tests.daemon_util import DaemonProcess, wait_for

pytestmark = pytest.mark.slow

S = tuning_pb2
FINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED)
WORKER, RUNNER = "aoed.backends.ort.worker", "aoed.backends.ort.runner"


# ---------------------------------------------------------------- helpers (bench/soak.py uses them too)


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
    return next((pid for pid, cmd in children(d.proc.pid).items() if f"-m {module} " in cmd + " "), None)


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
    reply = d.tuning().SubmitJob(tuning_pb2.SubmitJobRequest(
        model_path=str(model), options=tuning_pb2.JobOptions(budget_s=budget, **opts)), timeout=30)  # fmt: skip
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
        return {f"{kind}:{getattr(rec, kind).key}" for _, rec in reader.records(history=False)
                if (kind := rec.WhichOneof("record"))}  # fmt: skip


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
    return j.state == S.JOB_STATE_FAILED and bool(j.error) and j.error_kind not in ("", "InternalError")


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


def kill9_round(d: DaemonProcess, path: Path, seed: int, max_delay_s: float, budget_s: float) -> Round:
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
    r.state, r.error, r.bank_at_kill, r.bank_after = S.JobState.Name(j.state), j.error, len(before), len(after)
    if not clearly_ended(j):
        r.problems.append(f"job {job_id} ended {r.state} ({j.error_kind}: {j.error})")
    if lost := before - after:
        r.problems.append(f"{len(lost)} bank entries committed before the kill are gone: {sorted(lost)[:3]}")
    if (check := store_integrity(d.state)) != "ok":
        r.problems.append(f"job store after the restart: {check}")
    return r


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the faults that leave it running (each test checks it still serves)."""
    d = DaemonProcess(tmp_path_factory.mktemp("faults") / "d")
    d.start()
    yield d
    d.close()


def wait_stage(d: DaemonProcess, job_id: str, prefix: str, timeout: float = 60) -> None:
    """Return once the job announces a stage whose message starts with `prefix`."""
    stream = d.tuning().WatchJob(tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=timeout)
    for msg in stream:
        e = msg.event
        if e.WhichOneof("event") == "log" and e.log.logger == "stage" and e.log.message.startswith(prefix):
            stream.cancel()
            return
    raise AssertionError(f"job {job_id} ended before a stage {prefix!r}: {job(d, job_id)}")


def _busy(pid: int) -> bool:
    return proc_state(pid) == "R"


def _busy_a_while(pid: int, polls: int = 5, gap: float = 0.005) -> bool:
    """Running at each of `polls` looks over ~25 ms: a measurement round, not a blip of
    a process between requests (a kill then is a restart without a crash to report)."""
    for _ in range(polls):
        if not _busy(pid):
            return False
        time.sleep(gap)
    return True


# ---------------------------------------------------------------- child processes


def test_a_worker_that_segfaults_mid_compile_costs_a_candidate_not_the_job(daemon: DaemonProcess) -> None:
    d = daemon
    job_id = submit(d, model(d, "cnn", width=24), budget=2.0)
    wait_stage(d, job_id, "tuning ")  # the tasks are extracted; what the worker does now is compile
    worker = wait_for(lambda: child_pid(d, WORKER), 10, "a compile worker")
    # While it works on a request (R), not while it waits for one: then nothing is lost.
    wait_for(lambda: _busy(worker), 30, "the worker compiling", poll=0.002)
    os.kill(worker, signal.SIGSEGV)
    j = d.wait_job(job_id)
    assert j.state == S.JOB_STATE_SUCCEEDED, j
    crash = f"compile worker 0 exited with status -{signal.SIGSEGV.value}"
    assert crash in d.log(), "the crash is logged"
    assert f"worker crashed: {crash}" in Path(j.result.result_json_path).read_text(), "the report says what it cost"
    assert not proc_state(worker)
    nxt = submit(d, model(d, "mlp", hidden=96), budget=0.5)
    assert d.wait_job(nxt).state == S.JOB_STATE_SUCCEEDED
    assert child_pid(d, WORKER) not in (None, worker), "a fresh worker took over"


def test_a_runner_killed_mid_measurement_costs_that_measurement_and_is_restarted(daemon: DaemonProcess) -> None:
    d = daemon
    job_id = submit(d, model(d, "cnn", width=40), budget=2.0)
    wait_stage(d, job_id, "tuning ")  # candidates are measured now
    runner = wait_for(lambda: child_pid(d, RUNNER), 10, "the measurement runner")
    wait_for(lambda: _busy_a_while(runner), 30, "the runner measuring", poll=0.002)
    os.kill(runner, signal.SIGKILL)
    j = d.wait_job(job_id)
    assert j.state == S.JOB_STATE_SUCCEEDED, j  # the task measured then costs its candidates
    assert child_pid(d, RUNNER) not in (None, runner), "the job's next measurement started a fresh runner"
    assert f"the measurement runner crashed: runner for cpu exited with status -{signal.SIGKILL.value}" in d.log()
    assert "measurement runner crashed" in Path(j.result.result_json_path).read_text(), "the report says so"
    nxt = submit(d, model(d, "mlp", hidden=112), budget=0.5)
    assert d.wait_job(nxt).state == S.JOB_STATE_SUCCEEDED
    assert child_pid(d, RUNNER) not in (None, runner)


def test_a_worker_over_its_memory_limit_fails_the_job_saying_so(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(d.config.read_text().replace("[engine]\n", "[engine]\nworker_memory_mb = 1024\n"))
    try:
        d.start()
        big = samples.save(samples.mlp(features=4096, hidden=4096, layers=7), d.models / "big.onnx")  # 403 MB
        # The deadline only catches a job that never ends (a worker swapping instead of
        # failing); the job's end and its reason are the checks.
        j = d.wait_job(submit(d, big, budget=2.0), timeout=300)
        assert j.state == S.JOB_STATE_FAILED, j
        assert "out of memory" in j.error and "1024 MiB" in j.error and "worker_memory_mb" in j.error, j.error
        small = model(d, "mlp")  # fits: the same daemon and limit go on serving
        assert d.wait_job(submit(d, small, budget=0.5)).state == S.JOB_STATE_SUCCEEDED
    finally:
        d.close()


HANG_PLUGIN = textwrap.dedent(
    """
    import os, time
    from aoed.engine.registry import Strategy

    def _hang_once(view):
        # The first call writes its worker's pid and hangs; later ones do not apply.
        try:
            fd = os.open(os.environ["AOED_TEST_HUNG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(600)

    def register(registry):
        registry.register(Strategy("hang_once", "matmul", "exact", _hang_once))
    """
)


def test_a_worker_that_hangs_is_cut_off_at_the_compile_limit_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's [engine] limits are its config's: the compile limit here, and a model
    size limit that SubmitJob applies."""
    (tmp_path / "aoed_hang_plugin.py").write_text(HANG_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, sys.path)]))
    monkeypatch.setenv("AOED_TEST_HUNG", str(tmp_path / "hung.pid"))
    d = DaemonProcess(tmp_path / "d")
    text = d.config.read_text().replace("[engine]\n", "[engine]\ncompile_timeout_s = 3\nmax_model_mb = 1\n")
    d.config.write_text(text.replace("[tuning]\n", '[tuning]\nplugins = ["aoed_hang_plugin"]\n'))
    try:
        d.start()
        j = d.wait_job(submit(d, model(d, "mlp", hidden=64), budget=1.0), timeout=120)
        assert j.state == S.JOB_STATE_SUCCEEDED, j  # the hang cost one candidate
        hung = int((tmp_path / "hung.pid").read_text())
        cut = "compile timed out after 3s (compile_timeout_s=3)"
        assert "compile: timed out after 3s (compile_timeout_s=3); worker restarted" in d.log(), d.log()
        assert cut in Path(j.result.result_json_path).read_text(), "the report says what it cost"
        assert not proc_state(hung), "the hung worker is gone"
        assert child_pid(d, WORKER) not in (None, hung), "a fresh worker took over"
        big = samples.save(samples.mlp(features=1024, hidden=512, layers=2), d.models / "big.onnx")  # 2 MiB
        with pytest.raises(grpc.RpcError) as err:
            submit(d, big, budget=1.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "over the limit of 1.0 MiB ([engine] max_model_mb)" in (err.value.details() or ""), err.value
        assert d.serving()
    finally:
        d.close()


# ---------------------------------------------------------------- the job store


def test_a_damaged_job_row_is_reported_and_the_rest_is_served(daemon: DaemonProcess) -> None:
    d = daemon
    listed = d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
    while len(listed) < 2:
        d.wait_job(submit(d, model(d, "mlp", hidden=80 + 16 * len(listed)), budget=1.0))
        listed = d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
    bad, *good = [j.job_id for j in listed]
    assert d.stop() == 0
    db = sqlite3.connect(d.state / "jobs.sqlite3")
    with db:
        db.execute("UPDATE jobs SET options = ? WHERE id = ?", ('{"precision": "exact", "budg', bad))
    db.close()
    d.start()
    after = [j.job_id for j in d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs]
    assert after == good
    assert f"row for job {bad} is damaged and ignored" in d.log()
    with pytest.raises(grpc.RpcError) as err:
        job(d, bad)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert store_integrity(d.state) == "ok" and d.serving()


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[Path, int], Path]]:
    """mount(dir, bytes): a tmpfs of that size at `dir`; skips where mounting is refused."""
    mounted: list[Path] = []

    def mount(where: Path, size: int) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           check=False, capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here (needs root and mount rights): {r.stderr.strip()}")
        mounted.append(where)
        return where

    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


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


def test_a_full_disk_fails_the_job_naming_it_and_keeps_the_bank(tmp_path: Path, small_fs) -> None:
    bank_fs = small_fs(tmp_path / "bankfs", 2 << 20)
    out_fs = small_fs(tmp_path / "d" / "models" / "out", 2 << 20)  # in the daemon's allowed dir
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(d.config.read_text().replace(f'path = "{d.bank}"', f'path = "{bank_fs / "bank"}"'))
    d.bank = bank_fs / "bank"
    try:
        d.start()
        first = d.wait_job(submit(d, model(d, "mlp"), budget=1.0))
        assert first.state == S.JOB_STATE_SUCCEEDED, first
        before = bank_keys(d.bank)
        assert before

        # Outputs on a full disk: the job fails naming it; nothing else is touched.
        fill(out_fs)
        j = d.wait_job(submit(d, model(d, "mlp", hidden=128), budget=1.0, output_dir=str(out_fs)))
        assert clearly_ended(j) and j.state == S.JOB_STATE_FAILED, j
        assert "No space left on device" in j.error and str(out_fs) in j.error, j.error
        assert before <= bank_keys(d.bank) and d.serving()

        # The bank on a full disk: the task's commit fails, naming the bank and the disk.
        filler = fill(bank_fs)
        j = d.wait_job(submit(d, model(d, "mlp", hidden=160), budget=1.0))
        assert j.state == S.JOB_STATE_FAILED and j.error_kind == "BankError", j
        assert str(d.bank) in j.error and "No space left on device" in j.error, j.error
        assert before <= bank_keys(d.bank) and d.serving()

        # Space again: the same daemon writes the bank again, no restart needed.
        filler.unlink()
        j = d.wait_job(submit(d, model(d, "mlp", hidden=176), budget=1.0))
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert before < bank_keys(d.bank)
    finally:
        d.close()


# ---------------------------------------------------------------- places that vanish


def test_an_output_dir_removed_mid_job_fails_the_job_naming_it(daemon: DaemonProcess) -> None:
    d = daemon
    out = (d.models / "vanishing").resolve()
    out.mkdir()
    job_id = submit(d, model(d, "cnn", width=16), budget=2.0, output_dir=str(out))
    wait_stage(d, job_id, "tuning ")  # candidates are compiled into it and measured now
    while out.exists():  # (the job may write into it while it goes)
        shutil.rmtree(out, ignore_errors=True)
    j = d.wait_job(job_id)
    assert j.state == S.JOB_STATE_FAILED and j.error_kind == "AoedError", j
    assert j.error.startswith(f"output directory {out}: ") and "removed while the job ran" in j.error, j.error
    nxt = submit(d, model(d, "mlp", hidden=208), budget=0.5)
    assert d.wait_job(nxt).state == S.JOB_STATE_SUCCEEDED and d.serving()


def test_a_bank_removed_under_the_daemon_fails_the_job_naming_it(tmp_path: Path) -> None:
    """LMDB would go on writing into the removed file: every later entry silently lost."""
    d = DaemonProcess(tmp_path / "d")
    try:
        d.start()
        assert d.wait_job(submit(d, model(d, "mlp"), budget=0.5)).state == S.JOB_STATE_SUCCEEDED
        assert bank_keys(d.bank)
        shutil.rmtree(d.bank)
        j = d.wait_job(submit(d, model(d, "mlp", hidden=128), budget=0.5))
        assert j.state == S.JOB_STATE_FAILED and j.error_kind == "BankError", j
        assert str(d.bank) in j.error and "removed or replaced while open" in j.error, j.error
        assert d.serving() and len(d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs) == 2
    finally:
        d.close()


# ---------------------------------------------------------------- kill -9


@pytest.mark.soak
def test_kill9_at_random_points_keeps_every_committed_entry(daemon: DaemonProcess) -> None:
    """Three seeds, run by `make soak` (with bench/soak.py's twenty); `make test` kills the
    daemon once mid-job in test_daemon.py."""
    d = daemon
    rounds = [kill9_round(d, model(d, "mlp", hidden=48 + 16 * seed), seed, 2.5, 1.0) for seed in range(3)]
    assert not [r for r in rounds if r.problems], rounds
    assert sum(r.bank_at_kill for r in rounds) > 0, f"no kill came after a commit: {rounds}"
    assert d.serving()

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

import errno
import json
import math
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import onnx
import pytest

from aoe.device import CPU
from aoe.v1 import tuning_pb2
from aoed import samples
from aoed.engine.messages import CompileRequest, PingRequest, encode
from tests.daemon_util import DaemonProcess, upload
from tests.faults_util import (
    FINAL,
    RUNNER,
    WORKER,
    S,
    bank_keys,
    child_pid,
    children,
    clearly_ended,
    fill,
    job,
    kill9_round,
    model,
    proc_state,
    store_integrity,
    submit,
    wait_stage,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- helpers (bench/soak.py uses them too)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the faults that leave it running (each test checks it still serves)."""
    d = DaemonProcess(tmp_path_factory.mktemp("faults") / "d")
    d.start()
    yield d
    d.close()


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


def test_a_worker_that_segfaults_mid_compile_costs_a_candidate_not_the_job(
    daemon: DaemonProcess,
) -> None:
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
    assert f"worker crashed: {crash}" in Path(j.result.result_json_path).read_text(), (
        "the report says what it cost"
    )
    assert not proc_state(worker)
    nxt = submit(d, model(d, "mlp", hidden=96), budget=0.5)
    assert d.wait_job(nxt).state == S.JOB_STATE_SUCCEEDED
    assert child_pid(d, WORKER) not in (None, worker), "a fresh worker took over"


def test_a_runner_killed_mid_measurement_costs_that_measurement_and_is_restarted(
    daemon: DaemonProcess,
) -> None:
    d = daemon
    job_id = submit(d, model(d, "cnn", width=40), budget=2.0)
    wait_stage(d, job_id, "tuning ")  # candidates are measured now
    runner = wait_for(lambda: child_pid(d, RUNNER), 10, "the measurement runner")
    wait_for(lambda: _busy_a_while(runner), 30, "the runner measuring", poll=0.002)
    os.kill(runner, signal.SIGKILL)
    j = d.wait_job(job_id)
    assert j.state == S.JOB_STATE_SUCCEEDED, j  # the task measured then costs its candidates
    assert child_pid(d, RUNNER) not in (None, runner), (
        "the job's next measurement started a fresh runner"
    )
    assert (
        f"the measurement runner crashed: runner for cpu exited with status -{signal.SIGKILL.value}"
        in d.log()
    )
    assert "measurement runner crashed" in Path(j.result.result_json_path).read_text(), (
        "the report says so"
    )
    nxt = submit(d, model(d, "mlp", hidden=112), budget=0.5)
    assert d.wait_job(nxt).state == S.JOB_STATE_SUCCEEDED
    assert child_pid(d, RUNNER) not in (None, runner)


def test_a_worker_over_its_memory_limit_fails_the_job_saying_so(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text().replace("[engine]\n", "[engine]\nworker_memory_mb = 1024\n")
    )
    try:
        d.start()
        # Small weights (the admission's estimate fits), but a 1 GiB input once the batch
        # is fixed: only the worker's limit can stop it. The deadline only catches a job
        # that never ends (a worker swapping instead of failing); the job's end and its
        # reason are the checks.
        big = samples.save(
            samples.mlp(features=4096, hidden=64, dynamic_batch=True), d.models / "big_input.onnx"
        )
        j = d.wait_job(
            submit(
                d, big, budget=2.0, input_shapes=[S.InputShape(name="input", dims=[65536, 4096])]
            ),
            timeout=300,
        )
        assert j.state == S.JOB_STATE_FAILED, j
        assert (
            "out of memory" in j.error and "1024 MiB" in j.error and "worker_memory_mb" in j.error
        ), j.error
        small = model(d, "mlp")  # fits: the same daemon and limit go on serving
        assert d.wait_job(submit(d, small, budget=0.5)).state == S.JOB_STATE_SUCCEEDED
    finally:
        d.close()


def test_the_derived_worker_limit_is_what_the_formula_says() -> None:
    from aoe.config import load_config
    from aoed.engine.memory import DAEMON_RESERVE_MB, available_mb, plan_memory

    base = load_config(env={})
    for n in (1, 2, 3, 7):
        plan = plan_memory(base.replace(parallel=n, memory_mb=16384))
        assert (plan.workers, plan.child_mb) == (n, (16384 - DAEMON_RESERVE_MB) // (n + 1)), n
        assert plan.child_mb * plan.children + DAEMON_RESERVE_MB <= 16384
    # Too little for 7 workers of 1024 MiB beside the runner: fewer workers start.
    plan = plan_memory(base.replace(parallel=7, memory_mb=4096))
    assert (plan.workers, plan.child_mb) == (2, (4096 - DAEMON_RESERVE_MB) // 3)
    # A limit set by hand is kept.
    assert (
        plan_memory(base.replace(parallel=3, memory_mb=4096, worker_memory_mb=2048)).child_mb
        == 2048
    )
    # Unset, the figure is the machine's: MemAvailable, or what the cgroup leaves.
    got, source = available_mb(base)
    total = next(
        int(ln.split()[1]) // 1024
        for ln in Path("/proc/meminfo").read_text().splitlines()
        if ln.startswith("MemTotal:")
    )
    assert (
        got is not None
        and 0 < got <= total
        and source in ("MemAvailable", "what the cgroup's memory.max leaves")
    )


def test_a_model_that_cannot_fit_the_memory_is_refused_with_both_figures(tmp_path: Path) -> None:
    # The daemon believes it has 2560 MiB: one worker and the runner get (2560 - 256) / 2
    # = 1152 MiB each, and a job may need 512 + 6 x its model's MiB: about 1400 for this one.
    d = DaemonProcess(tmp_path / "d", parallel=1)
    d.config.write_text(d.config.read_text().replace("[engine]\n", "[engine]\nmemory_mb = 2560\n"))
    try:
        d.start()
        # 147 MiB
        big = samples.save(samples.mlp(features=3584, hidden=3584, layers=4), d.models / "big.onnx")
        with pytest.raises(grpc.RpcError) as info:
            submit(d, big, budget=1.0)
        need = 512 + math.ceil(6 * big.stat().st_size / (1 << 20))
        err = info.value.details()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert f"needs about {need} MiB" in err and "more than the 1152 MiB" in err, err
        assert "2560 MiB available" in err and "[engine] memory_mb" in err, err
        # The same weights beside a small model file: counted when the job reads them.
        ext = d.models / "external" / "big.onnx"
        ext.parent.mkdir()
        onnx.save_model(onnx.load(big), ext, save_as_external_data=True, location="weights.bin")
        j = d.wait_job(submit(d, ext, budget=1.0), timeout=120)
        assert (j.state, j.error_kind) == (S.JOB_STATE_FAILED, "ModelError"), j
        ext_need = 512 + math.ceil(
            6 * (ext.stat().st_size + (ext.parent / "weights.bin").stat().st_size) / (1 << 20)
        )
        assert f"needs about {ext_need} MiB" in j.error and "more than the 1152 MiB" in j.error, (
            j.error
        )
        # What fits still runs, in children limited as the formula says.
        assert d.wait_job(submit(d, model(d, "mlp"), budget=0.5)).state == S.JOB_STATE_SUCCEEDED
        assert d.proc is not None
        kids = [pid for pid, cmd in children(d.proc.pid).items() if WORKER in cmd or RUNNER in cmd]
        assert len(kids) == 2, children(d.proc.pid)
        for pid in kids:
            line = next(
                ln
                for ln in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if ln.startswith("Max address space")
            )
            assert line.split()[3:5] == [str(1152 << 20)] * 2, line
    finally:
        d.close()


# `make test-long`, which runs cases one at a time: its bound on a measurement's overrun
# (a tenth of a 0.36 s share) holds for turns as steady as the last one, and beside another
# pytest worker a turn can run past it.
@pytest.mark.long
def test_a_big_model_with_a_tiny_budget_says_where_it_went_over_and_keeps_search_within(
    tmp_path: Path,
) -> None:
    from tests.conftest import run_aoe

    # 48 MiB
    big = samples.save(samples.mlp(features=2048, hidden=2048, layers=4), tmp_path / "big.onnx")
    r = run_aoe(
        "tune",
        str(big),
        "--budget",
        "0.6",
        "--job-type",
        "opat",
        "--no-progress",
        "--local",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "out"),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(next((tmp_path / "out").glob("aoe_result_*.json")).read_text())
    b = doc["budget"]
    st = b["stages"]
    # Given against spent, per stage, in the order run; what the budget does not cover
    # is outside it (docs/tuning.md), never over it.
    assert list(st)[:3] == ["prepare", "bank", "profile"] and "confirm" in st, list(st)
    for name in ("prepare", "profile", "confirm"):
        assert not st[name]["counted"] and st[name]["given_s"] == 0.0 and st[name]["spent_s"] > 0, (
            name,
            st[name],
        )
        assert st[name]["over_s"] == 0.0, (name, st[name])
        assert st[name]["estimate_s"] > 0, f"{name} was not estimated before it started: {st[name]}"
    assert abs(b["elapsed_s"] - sum(s["spent_s"] for s in st.values())) < 0.01 * len(st)
    assert b["outside_s"] == pytest.approx(
        sum(s["spent_s"] for s in st.values() if not s["counted"]), abs=0.01
    )
    assert b["over_s"] == pytest.approx(max(0.0, b["spent_s"] - 0.6), abs=0.002)
    # The search keeps to its share: loading the candidates' sessions counts against it.
    assert st["search"]["counted"] and st["search"]["given_s"] <= 0.6
    # A measurement starts no turn that its last one says would end past its deadline;
    # a turn slower than the last may still pass it: within a tenth of the share, never
    # the budget's overrun.
    assert b["search_s"] <= st["search"]["given_s"] * 1.10, b
    untuned = [t["error"] for t in doc["tasks"] if t["update_mode"] == "skipped"]
    assert untuned and all(e.startswith("not tuned:") for e in untuned), doc["tasks"]
    # ... and the command line says the same.
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("  budget "))
    assert (
        f"the job took {b['elapsed_s']:.1f} s, {b['outside_s']:.1f} s of it outside the budget: "
        "preparing" in line
    ), line
    assert "confirming" in line and "estimated" in line, line


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
    text = d.config.read_text().replace(
        "[engine]\n", "[engine]\ncompile_timeout_s = 3\nmax_model_mb = 1\n"
    )
    d.config.write_text(text.replace("[tuning]\n", '[tuning]\nplugins = ["aoed_hang_plugin"]\n'))
    try:
        d.start()
        j = d.wait_job(submit(d, model(d, "mlp", hidden=64), budget=1.0), timeout=120)
        assert j.state == S.JOB_STATE_SUCCEEDED, j  # the hang cost one candidate
        hung = int((tmp_path / "hung.pid").read_text())
        cut = "compile timed out after 3s (compile_timeout_s=3)"
        assert "compile: timed out after 3s (compile_timeout_s=3); worker restarted" in d.log(), (
            d.log()
        )
        assert cut in Path(j.result.result_json_path).read_text(), "the report says what it cost"
        assert not proc_state(hung), "the hung worker is gone"
        assert child_pid(d, WORKER) not in (None, hung), "a fresh worker took over"
        # 2 MiB
        big = samples.save(samples.mlp(features=1024, hidden=512, layers=2), d.models / "big.onnx")
        with pytest.raises(grpc.RpcError) as err:
            submit(d, big, budget=1.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "over the limit of 1.0 MiB ([engine] max_model_mb)" in (err.value.details() or ""), (
            err.value
        )
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
        db.execute(
            "UPDATE jobs SET options = ? WHERE id = ?", ('{"precision": "exact", "budg', bad)
        )
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
    """mount(dir, bytes, inodes=0): a tmpfs of that size (and that many inodes, when
    given) at `dir`; skips where mounting is refused."""
    mounted: list[Path] = []

    def mount(where: Path, size: int, inodes: int = 0) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            check=False,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(
                f"cannot mount a small filesystem here (needs root and mount rights): {r.stderr.strip()}"
            )
        mounted.append(where)
        return where

    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill_inodes(fs: Path) -> list[Path]:
    """Take every inode left on the filesystem at `fs` with empty files; returns them."""
    taken: list[Path] = []
    while True:
        path = fs / f"inode-filler-{len(taken)}"
        try:
            path.touch(exist_ok=False)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return taken
        taken.append(path)


def test_a_full_disk_fails_the_job_naming_it_and_keeps_the_bank(tmp_path: Path, small_fs) -> None:
    bank_fs = small_fs(tmp_path / "bankfs", 2 << 20)
    out_fs = small_fs(tmp_path / "d" / "models" / "out", 2 << 20)  # in the daemon's allowed dir
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text().replace(f'path = "{d.bank}"', f'path = "{bank_fs / "bank"}"')
    )
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

        # The bank on a full disk: each task's commit fails, naming the bank and the disk,
        # and is logged; the job keeps what it decided and says what the bank did not take.
        filler = fill(bank_fs)
        # A budget a busy machine still tunes a task in (on 1 s, under load, none was).
        j = d.wait_job(submit(d, model(d, "mlp", hidden=160), budget=3.0))
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert_unkept(d, j, d.bank, "write")
        assert before <= bank_keys(d.bank) and d.serving()

        # Space again: the same daemon writes the bank again, no restart needed.
        filler.unlink()
        j = d.wait_job(submit(d, model(d, "mlp", hidden=176), budget=1.0))
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert before < bank_keys(d.bank)
    finally:
        d.close()


def du(folder: Path) -> int:
    """Bytes of disk the files under `folder` occupy."""
    return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*"))


def refused_for_space(call: Callable[[], object], folder: Path) -> str:
    """Run `call`, which must fail RESOURCE_EXHAUSTED naming `folder` and its free space;
    returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    msg = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert str(folder) in msg and " free" in msg, msg
    return msg


def answers_reads(d: DaemonProcess, job_ids: list[str]) -> None:
    """The daemon is alive, healthy, and lists and gets `job_ids`."""
    assert d.proc is not None and d.proc.poll() is None, d.log()
    assert d.serving()
    listed = {j.job_id for j in d.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=10).jobs}
    assert set(job_ids) <= listed, (job_ids, listed)
    assert all(job(d, j).job_id == j for j in job_ids)


def test_a_full_state_dir_fails_the_calls_and_jobs_in_hand_never_the_daemon(
    tmp_path: Path, small_fs
) -> None:
    """A job store write on a full disk ("database or disk is full") used to escape and
    end aoed. Now: below `min_free_mb`, submissions and uploads are refused naming the
    folder; a job tuning while the disk fills ends (its state kept in memory until the
    store takes it); health, ListJobs and GetJob answer throughout; freeing the space
    is all it takes to work again."""
    d = DaemonProcess(tmp_path / "d", "[limits]\nmin_free_mb = 4\n")
    state = small_fs(d.state, 48 << 20)
    try:
        d.start()
        done = d.wait_job(submit(d, model(d, "mlp"), budget=1.0))
        assert done.state == S.JOB_STATE_SUCCEEDED, done
        tuning = submit(d, model(d, "cnn", width=24), budget=3.0)
        wait_stage(d, tuning, "tuning ")
        filler = fill(state)  # every byte: the store's writes fail too, not just the floor

        refused_for_space(lambda: submit(d, model(d, "mlp", hidden=64), budget=1.0), state)
        msg = refused_for_space(
            lambda: upload(d.tuning(), model(d, "mlp", hidden=80)), state / "uploads"
        )
        assert "min_free_mb" in msg, msg
        answers_reads(d, [done.job_id, tuning])
        ended = wait_for(
            lambda: (j := job(d, tuning)).state in FINAL and j, 120, "the tuning job to end"
        )
        assert clearly_ended(ended), ended
        answers_reads(d, [done.job_id, tuning])

        filler.unlink()  # the same daemon, no restart
        j = d.wait_job(submit(d, model(d, "mlp", hidden=96), budget=1.0))
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        model_id = upload(d.tuning(), model(d, "mlp", hidden=112))
        j = d.wait_job(
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=model_id, options=tuning_pb2.JobOptions(budget_s=1.0)
                ),
                timeout=30,
            )
            .job_id
        )
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert d.stop() == 0  # what was kept in memory while the disk was full is in the store
        assert store_integrity(d.state) == "ok"
        d.start()
        assert job(d, tuning).state == ended.state
    finally:
        d.close()


def test_drop_folders_missing_on_a_full_disk_are_made_and_watched_once_there_is_room(
    tmp_path: Path, small_fs
) -> None:
    """A drop folder's filesystem full to its last byte and its last inode, and the inbox,
    outbox and failed folders removed while the daemon was down: the daemon starts
    (health, ListJobs), says which folder it cannot make and why, and once there is room
    makes them with their mode and watches them, with no restart. (The folders have a
    filesystem of their own here: one whose last inode is taken fails the job store's
    open too, which is not what this is about.)"""
    d = DaemonProcess(tmp_path / "d")
    drops = small_fs(tmp_path / "drops", 4 << 20, inodes=64)
    inbox = drops / "inbox"
    d.config.write_text(d.config.read_text().replace(f'path = "{d.inbox}"', f'path = "{inbox}"'))
    folders = [inbox, drops / "outbox", drops / "failed"]
    try:
        d.start()
        assert all(f.is_dir() for f in folders)
        d.stop()
        for f in folders:
            shutil.rmtree(f)
        filler, inodes = fill(drops), fill_inodes(drops)
        d.start()
        answers_reads(d, [])
        said = f"inbox {inbox}: not watched ({inbox}: cannot make it: No space left on device)"
        wait_for(lambda: said in d.log(), 30, "the folder it cannot make, and why, logged")
        assert not any(f.exists() for f in folders)

        filler.unlink()
        for p in inodes:
            p.unlink()
        wait_for(lambda: all(f.is_dir() for f in folders), 60, "the drop folders made")
        for f in folders:
            assert oct(stat.S_IMODE(f.stat().st_mode)) == oct(0o2770), f
        wait_for(lambda: f"inbox {inbox}: its folders are there now" in d.log(), 30, "the watch")
        samples.save(samples.mlp(hidden=48), inbox / ".m.onnx.part")
        (inbox / ".m.onnx.part").rename(inbox / "m.onnx")
        report = drops / "outbox" / "m_report.txt"
        wait_for(report.exists, 180, "the dropped model tuned and delivered")
        answers_reads(d, [])
    finally:
        d.close()


@pytest.mark.long
def test_the_daemon_starts_on_a_full_state_dir_and_recovers_by_itself(
    tmp_path: Path, small_fs
) -> None:
    """Killed mid-job, then the disk filled: it used to refuse to start until someone
    deleted files. Now it comes up serving health and listing jobs; the interrupted job
    waits, and resumes once there is space."""
    d = DaemonProcess(tmp_path / "d", "[limits]\nmin_free_mb = 4\n")
    state = small_fs(d.state, 48 << 20)
    try:
        d.start()
        done = d.wait_job(submit(d, model(d, "mlp"), budget=1.0))
        interrupted = submit(d, model(d, "cnn", width=20), budget=2.0)
        wait_stage(d, interrupted, "tuning ")
        d.kill()
        filler = fill(state)
        d.start()
        answers_reads(d, [done.job_id, interrupted])
        assert job(d, interrupted).state == S.JOB_STATE_QUEUED  # waits for space, does not fail
        refused_for_space(lambda: submit(d, model(d, "mlp", hidden=64), budget=1.0), state)
        assert "queued jobs wait" in d.log()
        assert d.stop() == 0  # and once more, from a clean stop on the full disk
        d.start()
        answers_reads(d, [done.job_id, interrupted])

        filler.unlink()
        j = d.wait_job(interrupted)
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert (
            d.wait_job(submit(d, model(d, "mlp", hidden=64), budget=1.0)).state
            == S.JOB_STATE_SUCCEEDED
        )
    finally:
        d.close()


def test_the_job_store_opens_and_reads_on_a_full_disk_and_writes_again_with_room(
    tmp_path: Path, small_fs
) -> None:
    """After a clean close SQLite has no WAL index (-shm) left, and creating one at open
    needs room: on a full disk the store could not open ("disk I/O error"), so aoed could
    not start. Now it opens (in exclusive mode), reads, refuses writes naming the folder
    and its free space, and writes again once there is room."""
    from aoe.errors import DiskFullError
    from aoe.spec import JobSpec
    from aoed.jobs.states import JobState
    from aoed.jobs.store import JobRow, JobStore

    fs = small_fs(tmp_path / "state", 1 << 20)
    row = JobRow(
        id="job-1",
        state=JobState.SUCCEEDED,
        model_path="/m.onnx",
        model_name="m.onnx",
        model_sha256="0" * 64,
        dedup_key="k",
        spec=JobSpec(),
        output_dir="/out",
    )
    store = JobStore(fs / "jobs.sqlite3")
    store.insert(row)
    store.close()
    assert not (fs / "jobs.sqlite3-shm").exists()
    filler = fill(fs)
    store = JobStore(fs / "jobs.sqlite3")
    try:
        assert store.get("job-1") == row and [r.id for r in store.jobs()] == ["job-1"]
        with pytest.raises(DiskFullError) as err:
            for i in range(1000):  # (the first pages may still fit in the WAL)
                store.insert(JobRow(**{**row.__dict__, "id": f"job-{i + 2}", "error": "x" * 4000}))
        assert str(fs) in str(err.value) and "0 bytes free" in str(err.value), err.value
        assert err.value.grpc_status == "RESOURCE_EXHAUSTED"
        filler.unlink()
        store.update("job-1", error="written again")
        assert store.get("job-1").error == "written again"
    finally:
        store.close()


def test_a_worker_whose_log_is_on_a_full_disk_answers_a_failed_request_and_lives(
    tmp_path: Path, small_fs
) -> None:
    """A worker prints the traceback of a request that failed into its log, in the state
    dir; on a full disk that print raised, and the worker died without answering: every
    failure while the disk was full cost a worker restart and the request's reason."""
    import json

    fs = small_fs(tmp_path / "logs", 1 << 20)
    with open(fs / "worker-0.log", "ab") as log:
        fill(fs)
        with subprocess.Popen(
            [sys.executable, "-m", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            try:
                # The first fails in the worker (its model is not there), with a traceback.
                missing = CompileRequest(
                    tmp_path / "missing.onnx", "matmul", "default", "p", tmp_path / "o.onnx"
                )
                for n, request in enumerate((missing, PingRequest(CPU)), 1):
                    proc.stdin.write(json.dumps({"id": n, "request": encode(request)}) + "\n")
                    proc.stdin.flush()
                    reply = json.loads(proc.stdout.readline() or "null")
                    assert reply is not None and reply["id"] == n, (reply, proc.poll())
                    assert reply["ok"] == (n == 2) and ("FileNotFoundError" in reply["error"]) == (
                        n == 1
                    ), reply
                assert proc.poll() is None
            finally:
                proc.kill()


def _stream(
    name: str, size: int, declared: int, chunk: int = 64 << 10
) -> Iterator[tuning_pb2.UploadModelRequest]:
    yield tuning_pb2.UploadModelRequest(
        header=tuning_pb2.ModelUploadHeader(file_name=name, size_bytes=declared)
    )
    for i in range(0, size, chunk):
        yield tuning_pb2.UploadModelRequest(chunk=b"\0" * min(chunk, size - i))


def test_uploads_over_a_quota_are_refused_before_their_bytes_are_written(tmp_path: Path) -> None:
    """Uploads never submitted were kept 24 h without a bound: any socket client could fill
    the disk. The quotas (in all and per client; every caller on the unix socket is one
    client) refuse an upload that would pass them, the declared size before the first
    byte, an undeclared one at the chunk that would pass; and what was refused leaves
    nothing behind."""
    d = DaemonProcess(
        tmp_path / "d",
        "[limits]\nmax_uploads_mb = 3\nmax_uploads = 3\n"
        "max_client_uploads = 2\nmax_client_uploads_mb = 100\n",
    )
    uploads = d.state / "uploads"

    def send(size: int, declared: int) -> str:
        return d.tuning().UploadModel(_stream("m.onnx", size, declared), timeout=60).model_id

    try:
        d.start()
        first = send(1 << 20, 1 << 20)
        before = du(uploads)
        # Over the bytes of all uploads: refused on the header, nothing written.
        with pytest.raises(grpc.RpcError) as err:
            d.tuning().UploadModel(_stream("m.onnx", 0, 2100 << 10), timeout=60)
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "max_uploads_mb" in err.value.details()
        )
        assert du(uploads) == before
        # Undeclared: refused at the chunk that would pass it, and the part written goes.
        with pytest.raises(grpc.RpcError) as err:
            send(3 << 20, 0)
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "max_uploads_mb" in err.value.details()
        )
        assert du(uploads) == before and not list(uploads.glob("*.part"))
        # The number per client (the unix socket's callers are one client, "local").
        second = send(1000, 1000)
        with pytest.raises(grpc.RpcError) as err:
            send(1000, 1000)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert (
            "client local has 2 uploads" in err.value.details()
            and "max_client_uploads" in err.value.details()
        )
        # A submitted upload no longer counts.
        d.tuning().SubmitJob(tuning_pb2.SubmitJobRequest(model_id=first), timeout=30)
        assert send(1000, 1000) and second and d.serving()
    finally:
        d.close()


def assert_unkept(d: DaemonProcess, j: tuning_pb2.Job, bank: Path, doing: str) -> None:
    """A task `j` tuned did not reach `bank`, and the job's report and the daemon's log say
    that the disk holding it is full (a task's own error may say why its choice was
    then reverted in the model). A commit that fits in pages LMDB freed earlier (the
    file cannot grow, but pages of deleted records are reused) may still go through:
    such a task is reported as written, never as failed."""
    tuned = [t for t in j.result.tasks if t.update_mode not in ("hit", "skipped")]
    unkept = [t for t in tuned if t.update_mode == "failed"]
    assert unkept, j.result
    assert all(
        t.update_mode in ("add", "update", "reserved", "unsatisfied")
        for t in tuned
        if t not in unkept
    ), j.result
    why = f"bank {bank}: {doing} failed, the disk holding it is full"
    assert all(
        "not kept in the bank: " + why in t.error or t.error.startswith("reverted in context")
        for t in unkept
    ), [t.error for t in unkept]
    assert "not kept in the bank: " + why in Path(j.result.result_json_path).read_text()
    assert why in d.log()


def test_a_new_bank_on_a_full_disk_costs_its_writes_not_the_daemon(
    tmp_path: Path, small_fs
) -> None:
    """LMDB writes a new bank's reader table through a map of a sparse lock file: on a
    full disk that was SIGBUS, the daemon gone without a word."""
    bank_fs = small_fs(tmp_path / "bankfs", 1 << 20)
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text().replace(f'path = "{d.bank}"', f'path = "{bank_fs / "bank"}"')
    )
    d.bank = bank_fs / "bank"
    try:
        filler = fill(bank_fs)
        d.start()
        # A budget a busy machine still tunes a task in (on 1 s, under load, none was).
        j = d.wait_job(submit(d, model(d, "mlp"), budget=3.0))
        assert d.proc is not None and d.proc.poll() is None and d.serving()
        assert j.state == S.JOB_STATE_SUCCEEDED, j
        assert_unkept(d, j, d.bank, "open")

        filler.unlink()  # room again: the same daemon creates the bank and writes it
        j = d.wait_job(submit(d, model(d, "mlp", hidden=128), budget=1.0))
        assert j.state == S.JOB_STATE_SUCCEEDED and not [
            t for t in j.result.tasks if "not kept" in t.error
        ], j
        assert bank_keys(d.bank)
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
    assert (
        j.error.startswith(f"output directory {out}: ") and "removed while the job ran" in j.error
    ), j.error
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
    rounds = [
        kill9_round(d, model(d, "mlp", hidden=48 + 16 * seed), seed, 2.5, 1.0) for seed in range(3)
    ]
    assert not [r for r in rounds if r.problems], rounds
    assert sum(r.bank_at_kill for r in rounds) > 0, f"no kill came after a commit: {rounds}"
    assert d.serving()

"""What a job may ask of the daemon, and how the daemon stops whatever a job asked.

- Every count a client sets is bounded: a world of 100000 ranks (over gRPC, in a drop
  folder's aoed.toml, from `aoe tune`) is refused at submit naming world_size and the
  limit, before any rank process or file exists; so is every other count over its limit.
- A stored job over today's limits, or interrupted `max_job_attempts` times, is failed
  when the daemon would start it, not started.
- SIGTERM stops the daemon while a job starts a huge world; and whatever the loop does,
  the process ends at its stop deadline.
- A job whose memory estimate does not fit beside the running jobs waits in the queue;
  one that could never fit is refused with both figures.

Real daemons on temporary sockets, real job stores, real rank processes (torch, where a
test needs a world to start).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aoe import sizes
from aoe.errors import ModelError, OptionError
from aoe.spec import JobSpec
from aoe.v1 import tuning_pb2
from aoe.wire import MAX_PARALLEL, spec_from_pb, spec_to_pb
from aoed.config import load_daemon_config
from aoed.engine.memory import MemoryPlan, world_need_mb
from aoed.engine.worldsize import WorldLimits, cores, default_max_world_size
from aoed.jobs import limits
from aoed.jobs.states import JobState
from aoed.jobs.store import JobRow, JobStore
from aoed.stopping import EXIT_STATUS, StopDeadline

from .conftest import run_aoe
from .daemon_util import DaemonProcess, submit_sample, upload
from .helpers import wait_for

RANK_MODULE = "aoed.backends.torch.rank"
FINAL = (
    tuning_pb2.JOB_STATE_SUCCEEDED,
    tuning_pb2.JOB_STATE_FAILED,
    tuning_pb2.JOB_STATE_CANCELLED,
)
RUNNING = (
    tuning_pb2.JOB_STATE_PREPARING,
    tuning_pb2.JOB_STATE_TUNING,
    tuning_pb2.JOB_STATE_VERIFYING,
)


def _config(tmp_path: Path, toml: str = ""):
    path = tmp_path / "aoed.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n' + toml)
    return load_daemon_config(path, env={})


def _ranks_of(pid: int) -> set[int]:
    """Rank processes a daemon `pid` started that still exist, whoever their parent is
    now (they are told the daemon's pid: `--parent PID`)."""
    out = set()
    mark = f"{RANK_MODULE}\0--parent\0{pid}\0".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                continue
    return out


def _rank_logs(root: Path) -> list[Path]:
    return [*root.rglob("*-rank*.log"), *root.rglob("inspect.log")]


# --------------------------------------------------------------------------- the checks


@given(st.integers(1, 1 << 40), st.integers(1, 64), st.integers(1, 64))
def test_a_world_over_a_limit_is_refused_naming_the_field_and_the_limit(
    n: int, max_world: int, per_device: int
) -> None:
    lim = WorldLimits(max_world, per_device, "[limits] ")
    fits = n <= max_world and n <= cores() * per_device
    try:
        lim.check(n, "gloo")
    except OptionError as exc:
        assert not fits
        if n > max_world:
            words = f"over the limit of {max_world} ranks ([limits] max_world_size)"
        else:
            words = f"([limits] max_ranks_per_device), so at most {cores() * per_device} ranks"
        assert str(exc).startswith(f"world_size {n}: ") and words in str(exc), exc
    else:
        assert fits
    # nccl and hccl run one rank per device: only the world's own limit applies there
    if n <= max_world:
        lim.check(n, "nccl")


def test_the_default_world_limits_fit_the_machine(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert cfg.max_world_size == default_max_world_size() == max(2, cores())
    cfg.world_limits.check(None, "gloo")  # GDAT's default world runs anywhere
    cfg.world_limits.check(2, "gloo")
    with pytest.raises(OptionError, match=r"world_size 100000: over the limit of \d+ ranks"):
        cfg.world_limits.check(100000, "gloo")
    cfg = _config(tmp_path, "[limits]\nmax_world_size = 8\nmax_ranks_per_device = 1\n")
    assert (cfg.max_world_size, cfg.max_ranks_per_device) == (8, 1)
    with pytest.raises(OptionError) as err:
        _config(
            tmp_path,
            "max_job_attempts = 0\n[limits]\nmax_world_size = 0\nmax_ranks_per_device = 1.5\n",
        )
    text = "\n".join(err.value.problems)
    for key in ("max_world_size = 0", "max_ranks_per_device = 1.5", "max_job_attempts = 0"):
        assert key in text, text


@given(
    st.dictionaries(
        st.text("xyz", min_size=1, max_size=3),
        st.lists(st.integers(1, 1 << 40), min_size=1, max_size=4),
        min_size=1,
        max_size=3,
    )
)
def test_an_input_shape_larger_than_a_tensor_may_be_is_refused_at_submit(shapes) -> None:
    cfg = load_daemon_config(None, env={})  # the defaults (nothing is created)
    spec = JobSpec(input_shapes=shapes)
    over = [
        n
        for n, dims in spec.input_shapes.items()
        if math.prod(dims) > cfg.engine.max_tensor_mb << 20
    ]
    if not over:
        limits.check_spec(spec, cfg)
        return
    with pytest.raises(OptionError) as err:
        limits.check_spec(spec, cfg)
    assert str(err.value).startswith("input_shapes ") and "[engine] max_tensor_mb = 4096" in str(
        err.value
    )


def test_each_count_a_client_sets_is_bounded_in_the_spec() -> None:
    """Counts no machine can run are refused by the spec itself, naming the field."""
    for fields, field in (
        ({"input_shapes": {"x": [1 << 63]}}, "input shape"),
        ({"priority": 11}, "priority"),
        ({"budget_s": 1e12}, "budget_s"),
        ({"job_type": "gdat", "world_size": 0}, "world_size"),
        ({"labels": {str(i): "" for i in range(sizes.MAX_LABELS + 1)}}, "labels"),
    ):
        with pytest.raises(OptionError) as err:
            JobSpec(**fields)
        assert str(err.value).startswith(field), err.value
    pb = spec_to_pb(JobSpec())
    pb.parallel = MAX_PARALLEL + 1
    with pytest.raises(OptionError, match=rf"^parallel {MAX_PARALLEL + 1}: at most {MAX_PARALLEL}"):
        spec_from_pb(pb)
    pb.parallel = MAX_PARALLEL
    assert spec_from_pb(pb) == JobSpec()


def test_a_gdat_job_whose_worlds_could_never_fit_in_memory_is_refused_with_both_figures() -> None:
    plan = MemoryPlan(4096, "[engine] memory_mb", 1, 1024, derived=True)
    small = JobSpec(job_type="gdat", world_size=2)
    limits.check_memory("net.pt2", small, 1 << 20, plan)
    big = JobSpec(job_type="gdat", world_size=16)
    need = world_need_mb(16, 1 << 20)
    with pytest.raises(ModelError) as err:
        limits.check_memory("net.pt2", big, 1 << 20, plan)
    assert f"about {need} MiB together" in str(err.value) and "3840 MiB" in str(err.value)
    # an ONNX job against what one child may use, as before
    with pytest.raises(ModelError, match="more than the 1024 MiB one may use"):
        limits.check_memory("m.onnx", JobSpec(), 200 << 20, plan)


def test_the_embedded_command_refuses_a_huge_world_before_anything_starts(tmp_path: Path) -> None:
    model = tmp_path / "net.pt2"
    model.write_bytes(b"not read: the world size is refused first")
    out = tmp_path / "out"
    r = run_aoe(
        "tune", str(model), "--local", "--job-type", "gdat", "--world-size", "100000",
        "--output", str(out), "--no-progress", env={"TUNE_BANK_PATH": str(tmp_path / "bank")},
    )  # fmt: skip
    assert r.returncode != 0
    assert "--world-size 100000: over the limit of" in r.stderr, r.stderr
    assert not _rank_logs(tmp_path)


def test_a_calibration_folder_is_read_up_to_its_limit(tmp_path: Path) -> None:
    import numpy as np

    from aoe.signature import TensorInfo
    from aoed.engine.calibration import MAX_SAMPLES, load_samples

    for i in range(MAX_SAMPLES + 6):
        np.save(tmp_path / f"{i:05d}.npy", np.full((1, 2), i, dtype=np.float32))
    got = load_samples({"x": TensorInfo("float32", (1, 2))}, tmp_path)
    samples = [*got.calibrate, *got.held_back]
    assert len(samples) == MAX_SAMPLES and samples[-1]["x"][0, 0] == MAX_SAMPLES - 1
    assert f"the first {MAX_SAMPLES} of {MAX_SAMPLES + 6} by name (the limit)" in got.source


# --------------------------------------------------------------------------- at submit


def test_a_world_of_100000_is_refused_at_submit_over_grpc_and_from_a_drop_folder(
    tmp_path: Path,
) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text('job_type = "gdat"\nworld_size = 100000\n')
    # Never read: everything is refused before the program is opened.
    program = d.models / "net.pt2"
    program.write_bytes(b"a torch.export program")
    limit = default_max_world_size()
    d.start()
    try:
        stub = d.tuning()
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=upload(stub, program),
                    options=spec_to_pb(JobSpec(job_type="gdat", world_size=100000)),
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"world_size 100000: over the limit of {limit} ranks ([limits] max_world_size)"
            in err.value.details()
        ), err.value.details()

        (d.inbox / "net.pt2").write_bytes(program.read_bytes())
        failed = d.inbox.parent / "failed"
        reason = wait_for(
            lambda: (
                (failed / "net.pt2.error.txt").exists()
                and (failed / "net.pt2.error.txt").read_text()
            ),
            60,
            f"the refusal in failed/:\n{d.log()}",
        )
        assert "world_size 100000: over the limit of" in reason and "max_world_size" in reason, (
            reason
        )

        # Every other count a request carries, over its limit, is refused naming the field.
        shape = tuning_pb2.InputShape
        for options, field in (
            ({"parallel": 100000}, "parallel 100000"),
            ({"priority": 11}, "priority 11"),
            ({"budget_s": 1e9}, "budget_s 1e+09"),
            ({"input_shapes": [shape(name="x", dims=[1 << 20, 1 << 20])]}, "input_shapes 'x'"),
            (
                {"input_shapes": [shape(name=str(i), dims=[1]) for i in range(1025)]},
                "input_shapes: 1025 inputs",
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                submit_sample(d, "mlp", options.pop("budget_s", 1.0), **options)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert err.value.details().startswith(field), err.value.details()

        # Nothing was started or created for any of them, and the daemon serves on.
        assert not _ranks_of(d.proc.pid) and not _rank_logs(d.root)
        assert not list((d.state / "jobs").iterdir())
        assert stub.ListJobs(tuning_pb2.ListJobsRequest(), timeout=10).jobs == []
        assert d.serving()
    finally:
        d.close()


# --------------------------------------------------------------------------- at resume


def _stored(
    state: Path, job_id: str, spec: JobSpec, model: Path, attempts: int, state_: JobState
) -> None:
    """A job row as a daemon (an older one, or one with other limits) left it."""
    store = JobStore(state / "jobs.sqlite3")
    try:
        store.insert(
            JobRow(
                id=job_id,
                state=state_,
                model_path=str(model),
                model_name=model.name,
                model_sha256="0" * 64,
                dedup_key=job_id,
                spec=spec,
                output_dir=str(state / "jobs" / job_id),
                attempts=attempts,
            )
        )
    finally:
        store.close()


def test_a_stored_job_over_the_limits_or_interrupted_too_often_fails_instead_of_starting(
    tmp_path: Path,
) -> None:
    d = DaemonProcess(tmp_path / "d", "[limits]\nmax_world_size = 2\n")
    (d.state / "jobs").mkdir(parents=True)
    program = d.models / "net.pt2"
    program.write_bytes(b"a torch.export program")
    onnx_model = d.models / "m.onnx"
    onnx_model.write_bytes(b"never read")
    huge = JobSpec(job_type="gdat", world_size=100000)
    _stored(d.state, "job-huge", huge, program, 1, JobState.TUNING)
    _stored(d.state, "job-queued-huge", huge.replace(budget_s=5.0), program, 0, JobState.QUEUED)
    _stored(d.state, "job-wedged", JobSpec(budget_s=5.0), onnx_model, 3, JobState.PREPARING)
    d.start()
    try:
        for job_id in ("job-huge", "job-queued-huge"):
            job = d.wait_job(job_id, 60)
            assert job.state == tuning_pb2.JOB_STATE_FAILED, job
            assert (
                "world_size 100000: over the limit of 2 ranks ([limits] max_world_size)"
                in job.error
            )
            assert job.error_kind == "OptionError"
        job = d.wait_job("job-wedged", 60)
        assert job.state == tuning_pb2.JOB_STATE_FAILED, job
        assert "started 3 times and each run was interrupted" in job.error, job.error
        assert "[daemon] max_job_attempts = 3" in job.error
        assert not _ranks_of(d.proc.pid) and not _rank_logs(d.root)
        assert len(d.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=10).jobs) == 3
        assert d.serving()
    finally:
        d.close()


def _wait_running(d: DaemonProcess, job_id: str) -> tuning_pb2.Job:
    def running():
        job = d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id), timeout=10).job
        assert job.state not in FINAL, (job, d.log())
        return job if job.state in RUNNING else None

    return wait_for(running, 120, f"job {job_id} to run")


@pytest.mark.slow
def test_a_job_the_daemon_dies_under_again_and_again_is_failed_after_max_job_attempts(
    tmp_path: Path,
) -> None:
    """Each start is counted in the store before the job runs: a daemon killed during
    the run still counts it, and after `max_job_attempts` the job is failed, not started."""
    d = DaemonProcess(tmp_path / "d", "", max_running_jobs=1)
    d.config.write_text(
        d.config.read_text().replace("[daemon]\n", "[daemon]\nmax_job_attempts = 2\n", 1)
    )
    d.start()
    try:
        job_id = submit_sample(d, "mlp", 60.0)
        for _ in range(2):
            _wait_running(d, job_id)
            d.kill()  # SIGKILL while it runs: nothing of the run is recorded after this
            d.start()
        job = d.wait_job(job_id, 60)
        assert job.state == tuning_pb2.JOB_STATE_FAILED, job
        assert "started 2 times and each run was interrupted" in job.error, job.error
        assert d.serving()
    finally:
        d.close()


# --------------------------------------------------------------------------- stopping


_WEDGED = textwrap.dedent("""
    import logging, signal, subprocess, sys
    from aoed.stopping import StopDeadline

    logging.basicConfig(level=logging.INFO)
    child = subprocess.Popen(["sleep", "1000"])
    deadline = StopDeadline(0.0, margin_s=0.5)
    signal.signal(signal.SIGTERM, lambda *a: None)  # a stop that never gets its turn
    with deadline.armed_by(signal.SIGTERM):
        print(child.pid, flush=True)
        while True:  # a loop that is never free to stop
            pass
""")


def test_the_stop_deadline_ends_a_process_whose_loop_never_gets_to_stop() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _WEDGED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None
            child = int(p.stdout.readline())
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)  # generous: the deadline is 0.5 s
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == EXIT_STATUS, err
    assert "still stopping" in err and "after SIGTERM" in err and "killing 1 child" in err, err
    wait_for(lambda: not Path(f"/proc/{child}").exists(), 30, f"child {child} to be gone")


def test_the_deadline_is_armed_once_and_gives_back_the_handlers_it_wrapped() -> None:
    """(Its thread is never started here: armed, it would end this process.)"""
    deadline = StopDeadline(0.0)
    deadline.arm("SIGTERM")
    deadline.arm("SIGINT")
    assert deadline.armed and deadline.limit_s == 15.0
    mine = StopDeadline(0.0)
    before = signal.getsignal(signal.SIGUSR1)
    with mine.armed_by(signal.SIGUSR1):
        assert signal.getsignal(signal.SIGUSR1) is not before and not mine.armed
    assert signal.getsignal(signal.SIGUSR1) is before and not mine.armed


@pytest.fixture
def pids_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A fresh pids cgroup (v1) to put a daemon in: the fork limit a real deployment has
    (TasksMax), here so that a regression forks no more than a few rank processes."""
    root = Path("/sys/fs/cgroup/pids")
    group = root / f"aoed-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"no pids cgroup to make here ({exc.strerror or exc})")
    try:
        yield group
    finally:
        procs = group / "cgroup.procs"
        for pid in procs.read_text().split() if procs.exists() else []:
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        wait_for(lambda: not (group / "cgroup.procs").read_text().split(), 30, "the group to empty")
        group.rmdir()


@pytest.mark.slow
def test_sigterm_stops_a_daemon_while_a_job_starts_a_world_of_100000(
    tmp_path: Path, pids_cgroup: Path
) -> None:
    """The wedge: a world as large as the limits allow starts every rank in the loop's
    thread. SIGTERM still stops the daemon: the start loop sees the stop between two
    ranks, so only the few ranks started by then ever ran, every one of them is gone,
    and the daemon exits on its own."""
    torch = pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    d = DaemonProcess(
        tmp_path / "d", "[limits]\nmax_world_size = 100000\nmax_ranks_per_device = 100000\n"
    )
    text = d.config.read_text().replace("shutdown_grace_s = 5", "shutdown_grace_s = 0")
    # Memory admission would refuse such a world: the engine is told it may use plenty.
    text = text.replace(
        "[engine]\n", "[engine]\nmemory_mb = 1073741824\nworker_memory_mb = 1024\n", 1
    )
    d.config.write_text(text)
    program = d.models / "tiny.pt2"
    torch.export.save(
        torch.export.export(torch.nn.Linear(8, 2), (torch.randn(4, 8),)), str(program)
    )
    d.start()
    try:
        tasks = len(os.listdir(f"/proc/{d.proc.pid}/task"))
        (pids_cgroup / "pids.max").write_text(str(tasks + 32))
        (pids_cgroup / "cgroup.procs").write_text(str(d.proc.pid))
        stub = d.tuning()
        reply = stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_id=upload(stub, program),
                options=spec_to_pb(JobSpec(job_type="gdat", world_size=100000, budget_s=5.0)),
            ),
            timeout=30,
        )
        wait_for(
            lambda: list(d.state.rglob("world0-rank*.log")),
            120,
            f"the world to start starting:\n{d.log()}",
        )
        pid = d.proc.pid
        d.proc.send_signal(signal.SIGTERM)
        status = d.proc.wait(120)  # generous: the stop deadline is 15 s
        assert status == 0, d.log()
        wait_for(lambda: not _ranks_of(pid), 30, "every rank to be gone")
        started = len(list(d.state.rglob("world0-rank*.log")))
        assert started < 100, f"{started} ranks were started of a world of 100000"
        # Stopped by the stop, not by the fork limit: the job waits for the next start.
        store = JobStore(d.state / "jobs.sqlite3")
        try:
            row = store.get(reply.job_id)
        finally:
            store.close()
        assert row is not None and row.state == JobState.QUEUED, (row, d.log())
    finally:
        d.close()


# --------------------------------------------------------------------------- memory


@pytest.mark.slow
def test_a_job_that_does_not_fit_beside_the_running_one_waits_and_one_that_never_fits_is_refused(
    tmp_path: Path,
) -> None:
    """[engine] memory_mb = 2048: jobs may hold 1792 MiB together. A world of 3 ranks
    needs about 3 x 385 MiB: the second such job waits in the queue while the first runs,
    then runs; a world of 5 (1925 MiB) could never run and is refused at submit."""
    torch = pytest.importorskip("torch", reason="GDAT needs torch: pip install '.[gdat]'")
    d = DaemonProcess(tmp_path / "d", "[limits]\nmax_world_size = 8\nmax_ranks_per_device = 4\n")
    d.config.write_text(
        d.config.read_text().replace("[engine]\n", "[engine]\nmemory_mb = 2048\n", 1)
    )
    program = d.models / "tiny.pt2"
    torch.export.save(
        torch.export.export(torch.nn.Linear(8, 2), (torch.randn(4, 8),)), str(program)
    )
    need = world_need_mb(3, program.stat().st_size)
    assert need <= 1792 < 2 * need
    d.start()
    try:
        stub = d.tuning()

        def submit(world: int, budget: float) -> str:
            spec = JobSpec(job_type="gdat", world_size=world, budget_s=budget)
            return stub.SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=upload(stub, program), options=spec_to_pb(spec)
                ),
                timeout=30,
            ).job_id

        first, second = submit(3, 3.0), submit(3, 4.0)
        waits = next(
            e.event.log.message
            for e in stub.WatchJob(
                tuning_pb2.WatchJobRequest(job_id=second, include_logs=True), timeout=240
            )
            if e.event.HasField("log") and "waits for memory" in e.event.log.message
        )
        assert f"needs about {need} MiB, and {need} of the 1792 MiB" in waits, waits
        assert stub.GetJob(tuning_pb2.GetJobRequest(job_id=second)).job.state == (
            tuning_pb2.JOB_STATE_QUEUED
        )
        a = d.wait_job(first, 240)
        assert a.state == tuning_pb2.JOB_STATE_SUCCEEDED, (a.error, d.log())
        # The second starts once the first has ended (then it is cancelled: what it would
        # measure is the first's job again).
        b = wait_for(
            lambda: (
                job
                if (job := stub.GetJob(tuning_pb2.GetJobRequest(job_id=second)).job).started.seconds
                else None
            ),
            240,
            "the second job to start",
        )
        assert b.started.ToNanoseconds() >= a.finished.ToNanoseconds()
        stub.CancelJob(tuning_pb2.CancelJobRequest(job_id=second), timeout=60)
        assert d.wait_job(second, 240).state == tuning_pb2.JOB_STATE_CANCELLED

        with pytest.raises(grpc.RpcError) as err:
            submit(5, 3.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text = err.value.details()
        assert f"about {world_need_mb(5, program.stat().st_size)} MiB together" in text, text
        assert "more than the 1792 MiB jobs may use here" in text, text
        assert d.serving()
    finally:
        d.close()

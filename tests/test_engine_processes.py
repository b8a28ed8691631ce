"""The compile pool and the device agent with their real child processes: crashes,
hangs, pausing, dedicated cores, the machine-wide device lock, cancellation that
reaches the children, and children that die with a killed engine."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import trio

from aoe.device import CPU
from aoe.errors import CandidateError, DeviceError
from aoe.partition import partition
from aoed import samples
from aoed.backends.ort.runtime import ORT
from aoed.engine.device import DeviceAgent
from aoed.engine.ledger import JobLedger, time_scale
from aoed.engine.messages import (
    Candidate,
    CompileRequest,
    MeasurePlan,
    MeasureReply,
    MeasureRequest,
    ProfileReply,
    ProfileRequest,
)
from aoed.engine.pool import CompilePool, WorkerCrashedError, WorkerTimeoutError
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.tasks import Constants, task_model
from tests.helpers import wait_for, wait_until

PLUGIN = textwrap.dedent(
    """
    import os, time
    from aoed.engine.registry import Strategy

    def _started(name):
        # Tells the test this strategy is running in a worker: a file named `name`.
        folder = os.environ.get("AOED_TEST_STARTED")
        if folder:
            open(os.path.join(folder, name), "w").close()

    def _crash(view):
        os.abort()

    def _hang(view):
        _started("hang")
        time.sleep(600)

    def _slow(view):
        _started("slow")
        time.sleep(1.0)
        return None

    def _slower(view):
        time.sleep(1.5)
        return None

    def _hog(view):
        import numpy as np
        return np.ones(4 << 30, dtype=np.uint8)  # 4 GiB

    def register(registry):
        registry.register(Strategy("crash_in_worker", "matmul", "exact", _crash))
        registry.register(Strategy("hang_in_worker", "matmul", "exact", _hang))
        registry.register(Strategy("slow_in_worker", "matmul", "exact", _slow))
        registry.register(Strategy("slower_in_worker", "matmul", "exact", _slower))
        registry.register(Strategy("hog_in_worker", "matmul", "exact", _hog))
    """
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A plugin module whose strategies crash, hang or take a second, for workers only;
    those that hang or take a second say when they start (see `_started_in_worker`)."""
    (tmp_path / "aoed_crash_plugin.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(p for p in sys.path if p))
    (tmp_path / "started").mkdir()
    monkeypatch.setenv("AOED_TEST_STARTED", str(tmp_path / "started"))
    return ["aoed_crash_plugin"]


def _started_in_worker(tmp_path: Path, name: str) -> bool:
    """Whether the plugin strategy `name` (hang, slow) has started in a worker."""
    return (tmp_path / "started" / name).exists()


@pytest.fixture
def mlp_task(tmp_path: Path) -> tuple[Path, Path]:
    """(task model path, inputs.npz) for the first task of the MLP sample."""
    src = samples.save(samples.mlp(), tmp_path / "mlp.onnx")
    prep = prepare(src, tmp_path / "prep")
    task = partition(prep.model, prep.ctx)[0]
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    tm = task_model(prep.model, task, consts, prep.ctx.tensors)
    path = tmp_path / "task.onnx"
    onnx.save(tm, str(path))
    feeds = {
        i.name: np.random.default_rng(0)
        .standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
        .astype(np.float32)
        for i in tm.graph.input
    }
    np.savez(tmp_path / "inputs.npz", **feeds)
    return path, tmp_path / "inputs.npz"


def _compile(task: Path, strategy: str, out: Path, family: str = "matmul") -> CompileRequest:
    return CompileRequest(task, family, strategy, "t", out)


def _measure(task: Path, inputs: Path, budget_s: float = 0.5, **kw) -> MeasureRequest:
    cands = (Candidate("default", task), Candidate("t1", task, {"intra_op_num_threads": 1}))
    return MeasureRequest(cands, inputs, "default", CPU, MeasurePlan(budget_s, **kw))


def _state(pid: int) -> str:
    # Field 3 of /proc/PID/stat; the command name (field 2) is parenthesized.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _cpus(pid: int) -> set[int]:
    """The cores a process may run on, from its Cpus_allowed_list (e.g. "0,2-3")."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError("no Cpus_allowed_list")


def _alive(pid: int) -> bool:
    try:
        return _state(pid) != "Z"
    except FileNotFoundError:
        return False


async def test_worker_crash_and_hang_cost_one_candidate(plugin, mlp_task, tmp_path):
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, plugins=plugin, timeouts={"compile": 5.0})
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        ok = await pool.call(_compile(task, "default", tmp_path / "a.onnx"))
        assert ok.applicable, ok
        with pytest.raises(WorkerCrashedError, match="crashed"):
            await pool.call(_compile(task, "crash_in_worker", tmp_path / "b.onnx"))
        again = await pool.call(_compile(task, "fused_gemm", tmp_path / "c.onnx"))
        assert again.applicable, again  # a fresh worker took over
        with pytest.raises(WorkerTimeoutError, match="timed out"):
            await pool.call(_compile(task, "hang_in_worker", tmp_path / "d.onnx"))
        after = await pool.call(_compile(task, "gemm_pretransposed", tmp_path / "e.onnx"))
        assert after.applicable, after
        assert pool.crashes == 2
        nursery.cancel_scope.cancel()
    assert onnx.load(str(tmp_path / "c.onnx")).graph.node[0].op_type == "FusedGemm"


def test_a_jobs_time_limits_grow_with_its_model() -> None:
    assert (time_scale(0), time_scale(100 << 10), time_scale(256 << 20), time_scale(2 << 30)) == (
        1.0,
        1.0,
        2.0,
        9.0,
    )
    job = JobLedger("job-test")
    assert job.scaled(120.0, "compile_timeout_s=120") == (120.0, "compile_timeout_s=120")
    job.scale_to_model(512 << 20)
    assert job.scaled(120.0, "compile_timeout_s=120") == (
        360.0,
        "compile_timeout_s=120 x 3 for a 512 MiB model",
    )


@pytest.mark.long
async def test_the_pool_scales_its_limit_by_the_jobs_model(plugin, mlp_task, tmp_path):
    """The same 1 s limit: a 1.5 s compile overruns it for a small model's job, and fits
    in a 512 MiB model's (3 s); a hang is cut off at the scaled limit, saying how it came."""
    task, _ = mlp_task
    big = JobLedger("job-big")
    big.scale_to_model(512 << 20)
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, plugins=plugin, timeouts={"compile": 1.0})
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        assert (
            await pool.call(_compile(task, "default", tmp_path / "a.onnx"), timeout_s=60)
        ).applicable  # worker is up
        fits = await pool.call(_compile(task, "slower_in_worker", tmp_path / "s.onnx"), big)
        with pytest.raises(WorkerTimeoutError) as small:
            await pool.call(
                _compile(task, "slower_in_worker", tmp_path / "t.onnx"), JobLedger("job-small")
            )
        t0 = trio.current_time()
        with pytest.raises(WorkerTimeoutError) as hung:
            await pool.call(_compile(task, "hang_in_worker", tmp_path / "h.onnx"), big)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert fits.applicable is False, fits  # it finished (not applicable), not "timed out"
    assert str(small.value) == "compile timed out after 1s (compile_timeout_s=1)"
    assert (
        str(hung.value)
        == "compile timed out after 3s (compile_timeout_s=1 x 3 for a 512 MiB model)"
    )
    assert took >= 3.0 and pool.crashes == 2


async def test_a_worker_over_its_memory_limit_costs_one_candidate(plugin, mlp_task, tmp_path):
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, plugins=plugin, memory_mb=1536)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with pytest.raises(CandidateError, match="memory") as hog:
            await pool.call(_compile(task, "hog_in_worker", tmp_path / "h.onnx"))
        after = await pool.call(_compile(task, "fused_gemm", tmp_path / "f.onnx"))
        pid = pool.pids[0]
        limit = [
            ln
            for ln in Path(f"/proc/{pid}/limits").read_text().splitlines()
            if "address space" in ln
        ]
        nursery.cancel_scope.cancel()
    assert type(hog.value) is CandidateError, hog.value  # the request's failure, not a crash
    assert after.applicable, after  # the same worker goes on
    assert limit and str(1536 << 20) in limit[0]


async def test_inapplicable_strategy_is_not_a_failure(mlp_task, tmp_path):
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        res = await pool.call(
            _compile(task, "conv1x1_as_matmul", tmp_path / "x.onnx", family="conv")
        )
        nursery.cancel_scope.cancel()
    assert res.applicable is False


async def test_paused_time_does_not_count_against_a_compile_deadline(plugin, mlp_task, tmp_path):
    task, _ = mlp_task
    # The strategy works for 1 s; the deadline is 3 s; the pool is paused for 2.5 s of it,
    # once the strategy runs: counted, the pause would put it past the deadline.
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, plugins=plugin, timeouts={"compile": 3.0})
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        # Worker is up (its start, importing onnxruntime, can take more than 1.5 s on a busy machine).
        assert (
            await pool.call(_compile(task, "default", tmp_path / "a.onnx"), timeout_s=60)
        ).applicable
        replies = []

        async def slow() -> None:
            replies.append(await pool.call(_compile(task, "slow_in_worker", tmp_path / "s.onnx")))

        nursery.start_soon(slow)
        await wait_until(
            lambda: _started_in_worker(tmp_path, "slow"), 60, "the slow strategy running"
        )
        async with pool.paused():
            await trio.sleep(2.5)
        await wait_until(lambda: replies, 60, "the slow compile's reply")
        nursery.cancel_scope.cancel()
    (reply,) = replies
    assert reply.applicable is False, reply  # it finished (not applicable), not "timed out"
    assert pool.crashes == 0


async def test_device_serializes_and_pauses_compile_workers(mlp_task, tmp_path):
    task, inputs = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT)
    replies: list[MeasureReply] = []
    seen_states: list[str] = []
    ledger = JobLedger("job-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        device = DeviceAgent(CPU, pool, tmp_path / "logs", tmp_path / "run", runtime=ORT)
        await nursery.start(device.run)
        assert device.pausing
        assert (await pool.call(_compile(task, "default", tmp_path / "a.onnx"))).applicable
        worker_pid = pool.pids[0]

        async def submit():
            # A budget the six rounds fit in on a loaded machine too (a budget ends the rounds
            # before min_rounds when it runs out: 5 of 6 fit in 0.5 s beside a busy loop).
            replies.append(
                await device.call(_measure(task, inputs, budget_s=5.0, min_rounds=6), ledger)
            )

        async with trio.open_nursery() as inner:
            for _ in range(3):
                inner.start_soon(submit)
            while len(replies) < 3:
                seen_states.append(_state(worker_pid))
                await trio.sleep(0.02)
        assert _state(worker_pid) != "T"  # resumed once the device is idle
        nursery.cancel_scope.cancel()
    spans = sorted(ledger.device_intervals)  # while the agent held the device, per request
    assert len(spans) == 3
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two measurements overlapped on one device"
    assert "T" in seen_states, "compile worker kept running while the device measured"
    for r in replies:
        res = r.results
        assert res["default"].max_abs_error == 0.0 and res["default"].cosine == pytest.approx(1.0)
        assert res["t1"].max_rel_error < 1e-5
        assert res["default"].median_us > 0 and len(res["default"].rounds_us) >= 6
    assert device.requests == 3 and device.busy_s > 0
    # Each request was charged to the job that sent it.
    assert ledger.device_requests == 3 and ledger.device_s == pytest.approx(device.busy_s)
    assert ledger.peak_child_rss_mb > 10


async def test_dedicated_cores_pin_the_runner_and_never_pause_workers(mlp_task, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores to dedicate one")
    task, inputs = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, cpus=cpus[1:])
    states: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        device = DeviceAgent(
            CPU,
            pool,
            tmp_path / "logs",
            tmp_path / "run",
            cpus=cpus[:1],
            pause_pool=False,
            runtime=ORT,
        )
        await nursery.start(device.run)
        assert not device.pausing and device.cores == 1
        assert (await pool.call(_compile(task, "default", tmp_path / "a.onnx"))).applicable
        worker_pid, runner_pid = pool.pids[0], device.runner_pid
        assert _cpus(runner_pid) == {cpus[0]}
        assert _cpus(worker_pid) == set(cpus[1:])
        done = []

        async def submit():
            done.append(await device.call(_measure(task, inputs, min_rounds=6)))

        nursery.start_soon(submit)
        while not done:
            states.append(_state(worker_pid))
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert states and "T" not in states


async def test_cancel_drops_queued_requests_and_kills_the_one_in_flight(plugin, mlp_task, tmp_path):
    task, inputs = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT, plugins=plugin)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        device = DeviceAgent(CPU, pool, tmp_path / "logs", tmp_path / "run", runtime=ORT)
        await nursery.start(device.run)
        await device.call(_measure(task, inputs, budget_s=0.1, min_rounds=1, max_rounds=1))
        runner_before, served_before = device.runner_pid, device.requests
        assert (await pool.call(_compile(task, "default", tmp_path / "a.onnx"))).applicable
        worker_before = pool.pids[0]

        # One job: a compile that hangs, a long measurement in flight, two more queued.
        # Left alone the measurement runs 600 s, so the deadlines below (far above what
        # cancelling needs) fail a cancellation that waits for it instead of killing it.
        long = _measure(task, inputs, budget_s=600.0, min_rounds=10_000, max_rounds=10_000)
        with trio.fail_after(120):
            with trio.CancelScope() as job:
                async with trio.open_nursery() as inner:
                    inner.start_soon(
                        pool.call, _compile(task, "hang_in_worker", tmp_path / "h.onnx")
                    )
                    await wait_until(
                        lambda: _started_in_worker(tmp_path, "hang"), 60, "the worker hanging"
                    )
                    for _ in range(3):
                        inner.start_soon(device.call, long)
                    # The device stops the compile worker while it measures.
                    await wait_until(
                        lambda: _state(worker_before) == "T", 60, "the runner measuring"
                    )
                    assert device.requests == served_before  # still measuring the first
                    job.cancel()
        # The next job's request is served by fresh children, without waiting for the old.
        with trio.fail_after(120):
            reply = await device.call(
                _measure(task, inputs, budget_s=0.1, min_rounds=1, max_rounds=1)
            )
            assert (await pool.call(_compile(task, "fused_gemm", tmp_path / "f.onnx"))).applicable
        served = device.requests
        runner_after, worker_after = device.runner_pid, pool.pids[0]
        nursery.cancel_scope.cancel()
    assert reply.results["default"].ok
    assert runner_after != runner_before and not _alive(runner_before)
    assert worker_after != worker_before and not _alive(worker_before)
    # The abandoned one and the next job's: the two queued requests never ran.
    assert served == served_before + 2


async def test_device_lock_is_machine_wide_and_says_who_holds_it(mlp_task, tmp_path):
    task, inputs = mlp_task
    run = tmp_path / "run"
    holder = subprocess.Popen(  # noqa: ASYNC220 (driven by hand across the awaits below)
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import fcntl, os, sys, time
            os.makedirs({str(run)!r}, exist_ok=True)
            fd = os.open({str(run / "device-cpu.lock")!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, b"pid %d (a measuring test process)" % os.getpid())
            print("held", flush=True)
            sys.stdin.read()  # until the test closes it
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    waits: list[str] = []
    ledger = JobLedger("job-test", lambda e: waits.append(e.message) if e.kind == "wait" else None)

    released: list[float] = []

    async def release_once_waiting() -> None:
        await wait_until(lambda: waits, 60, "the device agent waiting for the lock")
        assert holder.stdin is not None
        # The holder lets go after this, as it exits; the runner stamps on this clock too.
        released.append(time.monotonic())
        holder.stdin.close()

    async with trio.open_nursery() as nursery:
        device = DeviceAgent(CPU, None, tmp_path / "logs", run, runtime=ORT)
        await nursery.start(device.run)
        nursery.start_soon(release_once_waiting)
        reply = await device.call(
            _measure(task, inputs, budget_s=0.1, min_rounds=1, max_rounds=1), ledger
        )
        nursery.cancel_scope.cancel()
    holder.wait(timeout=10)
    holder.stdout.close()
    assert reply.results["default"].ok
    ((held_from, _),) = ledger.device_intervals  # from when the agent held the device
    assert held_from > released[0], "measured while another process held the device"
    assert len(waits) == 1 and f"pid {holder.pid}" in waits[0] and "cpu" in waits[0]


@pytest.mark.slow
async def test_children_live_as_long_as_the_engine_not_a_thread(mlp_task, tmp_path, monkeypatch):
    """Children die with the engine (PR_SET_PDEATHSIG), which names the thread that
    started them: it must be the engine's own, not a worker thread trio retires once it
    has idled for its timeout (ten seconds; one here, so the test waits two, not twelve)."""
    from trio._core import _thread_cache

    monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 1.0)  # read each time a thread idles
    task, _ = mlp_task
    pool = CompilePool(1, tmp_path / "logs", runtime=ORT)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        assert (await pool.call(_compile(task, "default", tmp_path / "a.onnx"))).applicable
        pid = pool.pids[0]
        await trio.to_thread.run_sync(time.sleep, 0.1)  # a worker thread exists, then idles
        await trio.sleep(2 * _thread_cache.IDLE_TIMEOUT)
        alive = _alive(pid)
        again = await pool.call(_compile(task, "fused_gemm", tmp_path / "b.onnx"))
        same = pool.pids == [pid]
        nursery.cancel_scope.cancel()
    assert alive and same, "the worker died when a thread of the engine retired"
    assert again.applicable and pool.crashes == 0


def test_children_die_with_a_killed_engine(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, trio
        from pathlib import Path
        from aoe.device import CPU
        from aoed.backends.ort.runtime import ORT
        from aoed.engine.device import DeviceAgent
        from aoed.engine.messages import PingRequest
        from aoed.engine.pool import CompilePool

        async def main():
            logs = Path({str(tmp_path / "logs")!r})
            pool = CompilePool(2, logs, runtime=ORT)
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                device = DeviceAgent(CPU, pool, logs, Path({str(tmp_path / "run")!r}), runtime=ORT)
                await nursery.start(device.run)
                for child in pool._children:  # start the workers
                    await child.call(PingRequest(CPU))
                async with pool.paused():  # workers stopped, as during a measurement
                    print(" ".join(map(str, [*pool.pids, device.runner_pid])), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

        trio.run(main)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 3
    wait_for(
        lambda: not any(_alive(p) for p in pids),
        5,
        "the children gone with the engine",
        detail=lambda: [p for p in pids if _alive(p)],
    )


async def test_runner_reports_wrong_outputs_and_broken_candidates(tmp_path):
    src = samples.save(samples.mlp(), tmp_path / "mlp.onnx")
    other = samples.mlp()
    # Same interface, different weights: outputs differ, which the gate must see.
    for init in other.graph.initializer:
        arr = onnx.numpy_helper.to_array(init) * 1.5
        init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    wrong = samples.save(other, tmp_path / "wrong.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    prep = prepare(src, tmp_path / "prep")
    np.savez(tmp_path / "in.npz", **make_inputs(prep.inputs))
    inputs = tmp_path / "in.npz"
    async with trio.open_nursery() as nursery:
        device = DeviceAgent(CPU, None, tmp_path / "logs", tmp_path / "run", runtime=ORT)
        await nursery.start(device.run)
        cands = (
            Candidate("ref", src),
            Candidate("wrong", wrong),
            Candidate("broken", tmp_path / "broken.onnx"),
        )
        reply = await device.call(MeasureRequest(cands, inputs, "ref", CPU, MeasurePlan(0.3)))
        with pytest.raises(DeviceError, match="reference"):
            await device.call(
                MeasureRequest(
                    (Candidate("broken", tmp_path / "broken.onnx"),),
                    inputs,
                    "broken",
                    CPU,
                    MeasurePlan(0.3),
                )
            )
        prof = await device.call(ProfileRequest(prep.path, inputs, tmp_path, CPU, runs=3))
        nursery.cancel_scope.cancel()
    res = reply.results
    assert res["ref"].ok and res["wrong"].ok
    assert res["wrong"].max_rel_error > 0.1 and res["ref"].max_rel_error == 0.0
    assert not res["broken"].ok and "load" in res["broken"].error
    node_names = {n.name for n in prep.model.graph.node}
    assert isinstance(prof, ProfileReply)
    nodes = prof.nodes
    assert nodes and set(nodes) <= node_names


async def test_a_device_whose_provider_is_missing_fails_to_start_with_a_clear_error(tmp_path):
    from aoe.device import Device

    with pytest.raises(DeviceError) as err:
        await DeviceAgent(
            Device("cann", 0), None, tmp_path / "logs", tmp_path / "run", runtime=ORT
        ).run()
    msg = str(err.value)
    assert "CANNExecutionProvider" in msg and "onnxruntime-cann" in msg and "cann:0" in msg


def test_a_childs_temp_folder_goes_with_it_killed_or_not(tmp_path):
    """Each child runs with a temp folder of its own (TMPDIR), removed once it is reaped:
    what a runner killed mid-measurement leaves there (its candidates' scratch) is not
    left in the machine's temp folder, and a restart starts with a fresh one."""
    import contextlib

    from aoed.engine._child import Child, ChildDiedError
    from aoed.engine.messages import PingRequest

    async def main() -> None:
        child = Child("aoed.backends.ort.runner", "runner", tmp_path / "runner.log")
        assert (await child.call(PingRequest(CPU))).ok
        first, pid = child.tmp, child.pid
        assert first is not None and first.is_dir() and pid is not None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"TMPDIR={first}".encode() in environ
        (first / "aoe-deployed-x").mkdir()  # as a killed measurement leaves its scratch
        os.kill(pid, signal.SIGKILL)
        # The next call finds it dead (ChildDiedError: it was reaped then) or, where it
        # was reaped already, starts a fresh one; either way its folder is gone.
        with contextlib.suppress(ChildDiedError):
            await child.call(PingRequest(CPU))
        assert not first.exists()
        assert (await child.call(PingRequest(CPU))).ok  # a fresh runner
        assert child.tmp is not None and child.tmp != first and child.tmp.is_dir()
        second = child.tmp
        await child.aclose()
        assert not second.exists()

    trio.run(main)

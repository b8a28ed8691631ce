"""The daemon under load: many clients at once, many watchers, more RPCs than it admits,
and every core taken by other processes. A real `aoed` on a temporary unix socket.

The counts here are small so that the file stays well under a minute on 2 cores;
bench/bench_daemon.py runs the same checks at full size and times them.
"""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from aoe.v1 import bank_pb2, daemon_pb2, tuning_pb2, tuning_pb2_grpc
from aoed import samples
from tests.daemon_util import DaemonProcess, mixed_calls

from .bank_util import make_bank, rec
from .helpers import wait_for

pytestmark = pytest.mark.slow

MIX = ("GetJob", "ListJobs", "LookupEntry hit", "LookupEntry miss", "GetDaemonInfo", "WatchJob")


def _connect(d: DaemonProcess) -> grpc.Channel:
    """A channel with a connection of its own: by default, channels to one target share a
    subchannel, and "10 clients" would be 10 streams on one connection."""
    return grpc.insecure_channel(d.target, options=[("grpc.use_local_subchannel_pool", 1)])


def _model(d: DaemonProcess, name: str, tag: str) -> Path:
    """Sample `name` with `tag` in its doc string: the same graph, different bytes, so that
    it is a job of its own rather than joining an active one."""
    model = samples.build(name)
    model.doc_string = tag
    return samples.save(model, d.models / f"{name}-{tag}.onnx")


def _submit(d: DaemonProcess, path: Path, budget: float) -> str:
    return (
        d.tuning()
        .SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(path),
                options=tuning_pb2.JobOptions(budget_s=budget, repeat_tune=True),
            ),
            timeout=30,
        )
        .job_id
    )


def _mixed(
    d: DaemonProcess, n: int, job_id: str, hit: str, miss: str, seed: int
) -> list[tuple[str, str]]:
    """`n` calls drawn from MIX on a connection of its own; (kind, outcome) for each, the
    outcome being a status code name, or WRONG for an OK answer that says the wrong thing."""
    rng = random.Random(seed)
    out = []
    with _connect(d) as ch:
        calls = mixed_calls(ch, d.proc.pid, job_id, [hit], [miss], rng, timeout=30)
        for _ in range(n):
            kind = rng.choice(MIX)
            try:
                out.append((kind, "OK" if calls[kind]() else "WRONG"))
            except grpc.RpcError as exc:
                out.append((kind, exc.code().name))
    return out


def _watch_to_end(d: DaemonProcess, job_id: str) -> list[tuning_pb2.JobEvent]:
    """Every event of the job, logs included, on a connection of its own, until it ends."""
    with _connect(d) as ch:
        stream = tuning_pb2_grpc.TuningServiceStub(ch).WatchJob(
            tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=120
        )
        return [m.event for m in stream]


def _keys(d: DaemonProcess) -> tuple[str, str]:
    """A key the bank holds and a well-formed one it does not."""
    entries = (
        d.bank_stub().QueryEntries(bank_pb2.QueryEntriesRequest(page_size=1), timeout=30).entries
    )
    assert entries, "the bank was filled before the daemon started"
    hit = entries[0].key
    version, sig, dev, precision = hit.split("/")
    return hit, "/".join((version, "0" * len(sig), dev, precision))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the tests that stay within its limits; its bank holds one entry."""
    d = DaemonProcess(tmp_path_factory.mktemp("load") / "d", listen_toml="max_rpcs = 64\n")
    make_bank(d.bank, [rec()])
    d.start()
    yield d
    d.close()


def test_mixed_rpcs_from_ten_connections_while_a_job_runs(daemon: DaemonProcess) -> None:
    hit, miss = _keys(daemon)
    job_id = _submit(daemon, _model(daemon, "mlp", "mixed"), budget=2.0)
    started = time.time()
    with ThreadPoolExecutor(10) as pool:
        per_client = list(
            pool.map(lambda i: _mixed(daemon, 40, job_id, hit, miss, seed=i), range(10))
        )
    results = [r for rs in per_client for r in rs]
    job = daemon.wait_job(job_id)
    outcomes = collections.Counter(code for _, code in results)
    assert outcomes == {"OK": 400}, outcomes
    assert {kind for kind, _ in results} == set(MIX)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    assert job.finished.ToNanoseconds() / 1e9 > started, (
        "the job was still running when the load began"
    )


def test_forty_watchers_all_see_the_final_state(daemon: DaemonProcess) -> None:
    job_id = _submit(daemon, _model(daemon, "mlp", "watched"), budget=2.0)
    with ThreadPoolExecutor(40) as pool:
        streams = list(pool.map(lambda _: _watch_to_end(daemon, job_id), range(40)))
    job = daemon.wait_job(job_id)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    for events in streams:
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))
        assert events[-1].state_change.state == tuning_pb2.JOB_STATE_SUCCEEDED, events[-1]
    assert len({len(events) for events in streams}) == 1, "every watcher saw every event"


def test_calls_beyond_max_rpcs_are_refused_at_once_and_then_served(tmp_path: Path) -> None:
    limit, extra = 8, 4
    d = DaemonProcess(tmp_path / "d", listen_toml=f"max_rpcs = {limit}\n")
    try:
        d.start()
        job_id = _submit(d, _model(d, "mlp", "held"), budget=60.0)
        release = threading.Event()
        outcomes: list[str] = []
        lock = threading.Condition()

        def hold() -> None:
            # An admitted watch stays open while the job runs; it reports once it has an
            # event, then waits to be released. A refused one reports its status.
            with _connect(d) as ch:
                stream = tuning_pb2_grpc.TuningServiceStub(ch).WatchJob(
                    tuning_pb2.WatchJobRequest(job_id=job_id), timeout=60
                )
                try:
                    next(stream)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                with lock:
                    outcomes.append(outcome)
                    lock.notify_all()
                release.wait(60)
                stream.cancel()

        threads = [threading.Thread(target=hold) for _ in range(limit + extra)]
        for t in threads:
            t.start()
        try:
            with lock:
                # Queued calls would never report while the admitted streams are held open.
                answered = lock.wait_for(lambda: len(outcomes) == limit + extra, timeout=30)
            assert answered, (
                f"only {len(outcomes)} of {limit + extra} calls were answered: some were queued"
            )
            counts = collections.Counter(outcomes)
            assert counts == {"OK": limit, "RESOURCE_EXHAUSTED": extra}, counts
        finally:
            release.set()
            for t in threads:
                t.join(30)
        # The slots come back once the streams end (each one's handler finishes after its
        # cancel arrives, later on a busy machine); then `limit` calls at once are served.
        infos: list[daemon_pb2.GetDaemonInfoResponse] = []

        def all_served() -> bool:
            def info(_: int) -> daemon_pb2.GetDaemonInfoResponse | None:
                try:
                    return d.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest(), timeout=10)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    return None

            with ThreadPoolExecutor(limit) as pool:
                got = list(pool.map(info, range(limit)))
            infos[:] = [i for i in got if i is not None]
            return len(infos) == limit

        wait_for(
            all_served,
            15,
            f"{limit} GetDaemonInfo calls at once served once the streams ended",
            poll=0.1,
        )
        assert [i.pid for i in infos] == [d.proc.pid] * limit
        job = d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60).job
        assert job.state == tuning_pb2.JOB_STATE_CANCELLED
    finally:
        d.close()


def test_a_tune_succeeds_while_every_core_is_busy(daemon: DaemonProcess) -> None:
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        job = daemon.wait_job(
            _submit(daemon, _model(daemon, "mlp", "hogged"), budget=2.0), timeout=120
        )
        running = [h.poll() is None for h in hogs]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert all(running), "every busy loop ran until the job ended"
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    assert Path(job.result.tuned_model_path).is_file()

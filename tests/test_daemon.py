"""The daemon end to end: a real `aoed` process on a temporary unix socket, driven over gRPC.

Models are the built-in samples (random weights, synthetic inputs) with small budgets,
so each job takes seconds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from aoe.bank import open_bank
from aoe.v1 import daemon_pb2, devices_pb2, tuning_pb2
from aoed import samples
from tests.daemon_util import DaemonProcess, upload
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

FINAL = (
    tuning_pb2.JOB_STATE_SUCCEEDED,
    tuning_pb2.JOB_STATE_FAILED,
    tuning_pb2.JOB_STATE_CANCELLED,
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """One daemon for the tests that need no fresh one (its own start, stop, config or
    limits): they share its bank, so a test whose job must measure says repeat_tune, and
    a test that lists jobs or uploads looks for its own."""
    d = DaemonProcess(tmp_path_factory.mktemp("daemon") / "d")
    d.start()
    yield d
    d.close()


def _model(d: DaemonProcess, name: str, seed: int = 0) -> Path:
    path = d.models / f"{name}.onnx"
    if not path.exists():
        samples.save(samples.build(name), path)
    return path


def _submit(d: DaemonProcess, path: Path, budget: float = 2.0, **opts) -> str:
    model_id = upload(d.tuning(), path)
    reply = d.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_id=model_id, options=tuning_pb2.JobOptions(budget_s=budget, **opts)
        ),
        timeout=30,
    )
    return reply.job_id


def _events(
    d: DaemonProcess, job_id: str, after: int = 0, logs: bool = True, limit: int | None = None
):
    out = []
    stream = d.tuning().WatchJob(
        tuning_pb2.WatchJobRequest(job_id=job_id, after_sequence=after, include_logs=logs),
        timeout=300,
    )
    for msg in stream:
        out.append(msg.event)
        if limit is not None and len(out) >= limit:
            stream.cancel()
            break
    return out


def _wait_event(d: DaemonProcess, job_id: str, pred, timeout: float = 120):
    stream = d.tuning().WatchJob(
        tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=timeout
    )
    seen = []
    for msg in stream:
        seen.append(msg.event)
        if pred(msg.event):
            stream.cancel()
            return seen
    raise AssertionError(
        f"the stream ended without the awaited event: {[str(e) for e in seen][-5:]}"
    )


def _bank_keys(bank: Path) -> set[str]:
    """Keys of the entries and default records of the bank at `bank`."""
    reader = open_bank(bank, use_env=False)
    try:
        keys = set()
        for _, rec in reader.records(history=False):
            kind = rec.WhichOneof("record")
            keys.add(f"{kind}:{getattr(rec, kind).key}")
    finally:
        reader.close()
    return keys


def test_upload_submit_watch_fetch(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = _model(daemon, "mlp")
    # OPAT alone: its section of the result JSON counts the whole job (sgat+opat splits it)
    job_id = _submit(daemon, path, job_type=tuning_pb2.JOB_TYPE_OPAT)
    events = _events(daemon, job_id)
    seqs = [e.sequence for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), "sequence numbers start at 1 and have no gaps"
    states = [e.state_change.state for e in events if e.WhichOneof("event") == "state_change"]
    assert states[0] == tuning_pb2.JOB_STATE_QUEUED and states[-1] == tuning_pb2.JOB_STATE_SUCCEEDED
    assert tuning_pb2.JOB_STATE_TUNING in states and tuning_pb2.JOB_STATE_VERIFYING in states
    results = [e.result for e in events if e.WhichOneof("event") == "result"]
    assert len(results) == 1 and results[0].baseline_ms > 0 and results[0].tasks

    job = daemon.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id)).job
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED and job.model_name == "mlp.onnx"
    # One decision per task (aoe.outcome): the model-wide record is not a task's.
    assert job.result.repo_summary.total_num == len(job.result.tasks)

    chunks = list(
        daemon.tuning().DownloadResult(
            tuning_pb2.DownloadResultRequest(
                job_id=job_id, artifact=tuning_pb2.RESULT_ARTIFACT_TUNED_MODEL
            )
        )
    )
    head, data = chunks[0].header, b"".join(c.chunk for c in chunks[1:])
    assert hashlib.sha256(data).hexdigest() == head.sha256 and len(data) == head.size_bytes
    onnx.checker.check_model(onnx.load_from_string(data))
    chunks = list(
        daemon.tuning().DownloadResult(
            tuning_pb2.DownloadResultRequest(
                job_id=job_id, artifact=tuning_pb2.RESULT_ARTIFACT_RESULT_JSON
            )
        )
    )
    report = json.loads(b"".join(c.chunk for c in chunks[1:]))
    # The result JSON downloaded is this job's, and its bank counts are the ones GetJob gives.
    assert report["basic"]["job_id"] == job_id
    counts = report["OPAT"]["repo_summary"]
    assert counts["total_num"] == len(job.result.tasks)
    summary = job.result.repo_summary
    assert {f.name: counts[f.name] for f in summary.DESCRIPTOR.fields} == {
        f.name: getattr(summary, f.name) for f in summary.DESCRIPTOR.fields
    }

    listed = [j.job_id for j in daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs]
    assert listed.count(job_id) == 1 and len(set(listed)) == len(listed), listed


def test_identical_submissions_join_one_job(daemon: DaemonProcess) -> None:
    path = _model(daemon, "mlp")
    first = _submit(daemon, path, budget=1.0)
    by_path = daemon.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_path=str(path), options=tuning_pb2.JobOptions(budget_s=1.0)
        ),
        timeout=30,
    )
    assert by_path.job_id == first and by_path.job.joined == 1
    other = daemon.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_path=str(path), options=tuning_pb2.JobOptions(budget_s=1.5)
        ),
        timeout=30,
    )
    assert other.job_id != first, "different options are a different job"
    for j in (first, other.job_id):
        assert daemon.wait_job(j).state == tuning_pb2.JOB_STATE_SUCCEEDED


def test_errors_have_status_codes_and_messages(daemon: DaemonProcess, tmp_path: Path) -> None:
    stub = daemon.tuning()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetJob(tuning_pb2.GetJobRequest(job_id="job-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "job-nope" in err.value.details()
    outside = tmp_path / "outside.onnx"
    samples.save(samples.build("mlp"), outside)
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitJob(tuning_pb2.SubmitJobRequest(model_path=str(outside)))
    assert (
        err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "allowed" in err.value.details()
    )
    link = daemon.models / "link.onnx"
    link.symlink_to(outside)
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitJob(tuning_pb2.SubmitJobRequest(model_path=str(link)))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (
        "a symlink out of the allowed dirs is refused"
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(_model(daemon, "mlp")),
                options=tuning_pb2.JobOptions(device="cuda:3"),
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cuda:3" in err.value.details()
    bad = tuning_pb2.UploadModelRequest
    data = b"not a model"
    uploads = set(daemon.state.joinpath("uploads").iterdir())  # other tests' uploads
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadModel(
            iter(
                [
                    bad(header=tuning_pb2.ModelUploadHeader(file_name="x.onnx", sha256="0" * 64)),
                    bad(chunk=data),
                ]
            )
        )
    assert (
        err.value.code() == grpc.StatusCode.DATA_LOSS
        and hashlib.sha256(data).hexdigest() in err.value.details()
    )
    assert set(daemon.state.joinpath("uploads").iterdir()) == uploads, (
        "a failed upload leaves nothing behind"
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.ListJobs(tuning_pb2.ListJobsRequest(page_token="garbage"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.serving()


def test_health_reflection_info_and_devices(daemon: DaemonProcess) -> None:
    ch = daemon.channel()
    assert (
        health_pb2_grpc.HealthStub(ch)
        .Check(health_pb2.HealthCheckRequest(service="aoe.v1.TuningService"))
        .status
        == health_pb2.HealthCheckResponse.SERVING
    )
    services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {
        "aoe.v1.TuningService",
        "aoe.v1.BankService",
        "aoe.v1.DeviceService",
        "aoe.v1.DaemonService",
        "grpc.health.v1.Health",
    } <= services
    info = daemon.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest())
    assert info.listen == [f"unix://{daemon.socket}"] and info.bank_path == str(daemon.bank)
    assert info.pid == daemon.proc.pid and [i.path for i in info.inboxes] == [str(daemon.inbox)]
    devices = daemon.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
    assert [d.id for d in devices] == ["cpu"] and devices[0].fingerprint.digest
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode == 0o660, oct(mode)


def test_two_jobs_share_the_device_one_measurement_at_a_time(daemon: DaemonProcess) -> None:
    # repeat_tune: measured here, whatever the shared bank already holds of these models.
    a = _submit(daemon, _model(daemon, "mlp"), budget=4.0, repeat_tune=True)
    b = _submit(daemon, _model(daemon, "cnn"), budget=4.0, repeat_tune=True)
    ja, jb = daemon.wait_job(a), daemon.wait_job(b)
    assert ja.state == jb.state == tuning_pb2.JOB_STATE_SUCCEEDED
    wa = (ja.started.ToNanoseconds(), ja.finished.ToNanoseconds())
    wb = (jb.started.ToNanoseconds(), jb.finished.ToNanoseconds())
    assert wa[0] < wb[1] and wb[0] < wa[1], "the two jobs ran at the same time"
    spans = []
    for job in (ja, jb):
        doc = json.loads(Path(job.result.result_json_path).read_text())
        spans += [(s, e, job.job_id) for s, e in doc["resources"]["device_intervals"]]
    spans.sort()
    assert len({j for *_, j in spans}) == 2 and len(spans) > 10
    overlaps = [(p, n) for p, n in itertools.pairwise(spans) if n[0] < p[1]]
    assert not overlaps, f"measurements overlapped: {overlaps[:3]}"
    # Fair share: while both ran, neither job had all of the device to itself.
    both = (max(wa[0], wb[0]) / 1e9, min(wa[1], wb[1]) / 1e9)
    inside = [j for s, e, j in spans if both[0] <= s and e <= both[1]]
    assert inside.count(a) > 0 and inside.count(b) > 0


def test_cancel_mid_measurement(daemon: DaemonProcess) -> None:
    # Left alone the job measures for its whole budget, far past the cancel's deadline:
    # a cancel that waited for the job instead of stopping it ends in DEADLINE_EXCEEDED.
    job_id = _submit(daemon, _model(daemon, "cnn"), budget=300.0, repeat_tune=True)
    _wait_event(
        daemon,
        job_id,
        lambda e: (
            e.WhichOneof("event") == "state_change"
            and e.state_change.state == tuning_pb2.JOB_STATE_TUNING
        ),
    )
    job = daemon.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60).job
    assert job.state == tuning_pb2.JOB_STATE_CANCELLED, job
    # The device is free for the next job at once, and the daemon still serves.
    nxt = _submit(daemon, _model(daemon, "mlp"), budget=2.0)
    assert daemon.wait_job(nxt).state == tuning_pb2.JOB_STATE_SUCCEEDED


def test_kill9_mid_job_resumes_and_keeps_the_bank(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    try:
        d.start()
        job_id = _submit(d, _model(d, "cnn"), budget=6.0)
        seen = _wait_event(
            d,
            job_id,
            lambda e: (
                e.WhichOneof("event") == "log" and e.log.logger == "task" and "(" in e.log.message
            ),
        )
        decided = {
            e.log.message.split(":", 1)[0]
            for e in seen
            if e.WhichOneof("event") == "log" and e.log.logger == "task"
        }
        d.kill()
        before = _bank_keys(d.bank)
        assert before, "a decided task is committed to the bank at once"
        d.start()
        job = d.wait_job(job_id)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
        assert before <= _bank_keys(d.bank), "every entry committed before the kill is still there"
        modes = {t.task_id: t.update_mode for t in job.result.tasks}
        assert decided and all(modes[t] == "hit" for t in decided), (decided, modes)
        states = [e for e in _events(d, job_id) if e.WhichOneof("event") == "state_change"]
        assert any("restarted" in e.state_change.message for e in states)
    finally:
        d.close()


def test_watch_resumes_across_a_restart(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    try:
        d.start()
        job_id = _submit(d, _model(d, "mlp"), budget=1.5)
        seen = _wait_event(d, job_id, lambda e: e.WhichOneof("event") == "progress")
        last = seen[-1].sequence
        assert d.stop() == 0
        d.start()
        rest = _events(d, job_id, after=last)
        assert rest[0].sequence == last + 1
        assert [e.sequence for e in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1].state_change.state == tuning_pb2.JOB_STATE_SUCCEEDED
    finally:
        d.close()


#: A strategy whose compile takes ten minutes: a job that tries it is still tuning when
#: the daemon is told to stop, whatever the machine's speed, and a stop that waited for
#: it would run far past `DaemonProcess.stop`'s deadline.
SLOW_PLUGIN = """
import time
from aoed.engine.registry import Strategy


def _slow(view):
    time.sleep(600)


def register(registry):
    registry.register(Strategy("slow_compile", "matmul", "exact", _slow))
"""


def test_sigterm_stops_within_the_grace_and_requeues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "aoed_slow_plugin.py").write_text(SLOW_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, sys.path)]))
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text().replace("[tuning]\n", '[tuning]\nplugins = ["aoed_slow_plugin"]\n')
    )
    try:
        d.start()
        job_id = _submit(d, _model(d, "cnn"), budget=60.0)
        _wait_event(
            d,
            job_id,
            lambda e: (
                e.WhichOneof("event") == "state_change"
                and e.state_change.state == tuning_pb2.JOB_STATE_TUNING
            ),
        )
        # shutdown_grace_s = 5: the compile in flight is not waited for
        assert d.stop(timeout=60) == 0
        assert not d.socket.exists()
        d.start()
        job = d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id)).job
        assert job.state not in FINAL, "an interrupted job is not lost: it runs again"
        d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60)
    finally:
        d.close()


def test_inbox_renamed_model_is_tuned_into_the_outbox(daemon: DaemonProcess) -> None:
    src = _model(daemon, "mlp")
    tmp = daemon.inbox / "mlp.onnx.part"
    shutil.copy(src, tmp)
    (daemon.inbox / "aoed.toml").write_text("budget_s = 2.0\n")
    tmp.rename(daemon.inbox / "mlp.onnx")
    outbox = daemon.root / "outbox"
    # The report is written last (docs/daemon.md): then the delivery is whole.
    wait_for((outbox / "mlp_report.txt").exists, 120, "the drop's report", detail=daemon.log_tail)
    assert (outbox / "mlp_tuned.onnx").exists() and (outbox / "mlp_report.txt").exists(), (
        daemon.log_tail()
    )
    onnx.checker.check_model(onnx.load(outbox / "mlp_tuned.onnx"))
    assert not (daemon.inbox / "mlp.onnx").exists()
    jobs = daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
    dropped = [j for j in jobs if not j.source.startswith("rpc:")]
    assert len(dropped) == 1 and dropped[0].source == f"inbox:{daemon.inbox}", jobs


def test_a_dynamic_model_dropped_with_no_options_comes_out_tuned_and_dynamic(
    daemon: DaemonProcess,
) -> None:
    """No aoed.toml names a shape: the job derives the encoder's profile, and the tuned
    model in the outbox keeps its batch and seq axes and runs, as the input does, at
    shapes the profile never named."""
    import numpy as np
    import onnxruntime as ort

    (daemon.inbox / "aoed.toml").unlink(missing_ok=True)
    src = samples.save(samples.encoder(), daemon.models / "encoder.onnx")
    tmp = daemon.inbox / "encoder.onnx.part"
    shutil.copy(src, tmp)
    tmp.rename(daemon.inbox / "encoder.onnx")
    outbox = daemon.root / "outbox"
    wait_for(
        (outbox / "encoder_report.txt").exists, 300, "the drop's report", detail=daemon.log_tail
    )
    doc = json.loads((outbox / "encoder_result.json").read_text())
    assert doc["shape_profile"]["inputs"] == {"input_ids": ["batch", "seq"]}, doc.get("notes")
    tuned = outbox / "encoder_tuned.onnx"
    dims = onnx.load(tuned).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "seq"]
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(tuned), providers=["CPUExecutionProvider"])
    for shape in [(2, 9), (1, 40)]:
        ids = np.random.default_rng(1).integers(0, 256, size=shape).astype(np.int64)
        (a,) = ref.run(None, {"input_ids": ids})
        (b,) = got.run(None, {"input_ids": ids})
        assert b.shape == a.shape and np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(a))


# ---------------------------------------------------------------- listening and TLS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aoed", "--config", str(config), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_tcp_needs_tls_except_explicit_loopback(tmp_path: Path) -> None:
    from aoe.errors import OptionError
    from aoed.config import load_daemon_config

    cfg = tmp_path / "aoed.toml"
    cfg.write_text('[listen]\ntcp = "0.0.0.0:7461"\n')
    r = _check(cfg)  # the command itself refuses, with the reason
    assert r.returncode == 2 and "needs TLS" in r.stderr, r.stderr
    cfg.write_text('[listen]\ntcp = "0.0.0.0:7461"\ninsecure_loopback = true\n')
    with pytest.raises(OptionError, match="needs TLS"):
        load_daemon_config(cfg, env={})  # insecure_loopback does not open other addresses
    cfg.write_text('[listen]\ntcp = "127.0.0.1:7461"\n')
    with pytest.raises(OptionError, match="insecure_loopback"):
        load_daemon_config(cfg, env={})
    cfg.write_text('[listen]\ntcp = "127.0.0.1:7461"\ninsecure_loopback = true\n')
    assert load_daemon_config(cfg, env={}).tcp_is_loopback()


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make a certificate"
)
def test_tls_on_tcp_serves_only_tls_clients(tmp_path: Path) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = _free_port()
    d = DaemonProcess(
        tmp_path / "d",
        listen_toml=f'tcp = "127.0.0.1:{port}"\ntls_cert = "{cert}"\ntls_key = "{key}"\n',
    )
    try:
        d.start()
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            from aoe.v1 import daemon_pb2_grpc

            info = daemon_pb2_grpc.DaemonServiceStub(ch).GetDaemonInfo(
                daemon_pb2.GetDaemonInfoRequest(), timeout=10
            )
        assert f"127.0.0.1:{port} (tls)" in info.listen
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            from aoe.v1 import daemon_pb2_grpc

            with pytest.raises(grpc.RpcError) as err:
                daemon_pb2_grpc.DaemonServiceStub(ch).GetDaemonInfo(
                    daemon_pb2.GetDaemonInfoRequest(), timeout=5
                )
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        d.close()


# ---------------------------------------------------------------- limits and scheduling


def test_limits_answer_resource_exhausted(tmp_path: Path) -> None:
    d = DaemonProcess(
        tmp_path / "d", max_running_jobs=1, extra_toml="", listen_toml="max_rpcs = 4\n"
    )
    d.config.write_text(
        d.config.read_text().replace("[daemon]\n", "[daemon]\nmax_queued_jobs = 1\n")
    )
    try:
        d.start()
        paths = [_model(d, "mlp"), _model(d, "cnn"), _model(d, "transformer")]
        running = _submit(d, paths[0], budget=30.0)
        _wait_event(
            d,
            running,
            lambda e: (
                e.WhichOneof("event") == "state_change"
                and e.state_change.state == tuning_pb2.JOB_STATE_PREPARING
            ),
        )
        queued = _submit(d, paths[1])
        with pytest.raises(grpc.RpcError) as err:
            _submit(d, paths[2])
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "queued" in err.value.details()
        )
        # Four streams hold the four RPC slots; a fifth call is refused, not queued.
        streams = [d.tuning().WatchJob(tuning_pb2.WatchJobRequest(job_id=queued)) for _ in range(4)]
        for s in streams:
            next(s)
        with pytest.raises(grpc.RpcError) as err:
            d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=queued), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in streams:
            s.cancel()
        # The slots come back as the server sees the streams go.
        job = wait_for(lambda: _get_unless_exhausted(d, queued), 30, "an RPC slot free again")
        assert job.queue_position == 0
        for j in (running, queued):
            d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=j), timeout=60)
    finally:
        d.close()


def test_priority_leaves_the_queue_first(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", max_running_jobs=1)
    try:
        d.start()
        mlp = _model(d, "mlp")  # different options make different jobs of one model
        first = _submit(d, mlp, budget=1.0)
        low = _submit(d, mlp, budget=0.5)
        high = _submit(d, mlp, budget=0.75, priority=5)
        jobs = {j: d.wait_job(j) for j in (first, low, high)}
        assert all(j.state == tuning_pb2.JOB_STATE_SUCCEEDED for j in jobs.values())
        assert jobs[high].started.ToNanoseconds() < jobs[low].started.ToNanoseconds()
        assert jobs[high].options.priority == 5
    finally:
        d.close()


def test_sighup_reloads_limits_and_inboxes(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    try:
        d.start()
        second = tmp_path / "second-inbox"
        d.config.write_text(
            d.config.read_text().replace("max_running_jobs = 2", "max_running_jobs = 3")
            + f'[[inbox]]\npath = "{second}"\n'
        )
        d.proc.send_signal(signal.SIGHUP)

        def reloaded() -> daemon_pb2.GetDaemonInfoResponse | None:
            info = d.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest())
            return info if info.max_running_jobs == 3 else None

        info = wait_for(reloaded, 20, "max_running_jobs = 3 after SIGHUP", detail=d.log_tail)
        assert str(second) in [i.path for i in info.inboxes]
        wait_for(second.is_dir, 30, f"the new inbox {second} created by its watch")
        d.config.write_text("[daemon]\nmax_running_jobs = 'many'\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "not reloaded" in d.log(), 30, "the bad reload refused in the log")
        assert d.serving()
        assert d.daemon().GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest()).max_running_jobs == 3, (
            "the old limits stay"
        )
    finally:
        d.close()


def _get_unless_exhausted(d: DaemonProcess, job_id: str) -> tuning_pb2.Job | None:
    """The job, or None while the daemon refuses calls for want of an RPC slot."""
    try:
        return d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id), timeout=10).job
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def test_children_are_exec_d_without_the_service_manager_variables(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    env = d.env()
    env.update(NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="1000000", WATCHDOG_PID="1")
    d.env = lambda: env  # type: ignore[method-assign]
    try:
        d.start()
        job_id = _submit(d, _model(d, "cnn"), budget=30.0)
        _wait_event(
            d,
            job_id,
            lambda e: (
                e.WhichOneof("event") == "state_change"
                and e.state_change.state == tuning_pb2.JOB_STATE_TUNING
            ),
        )
        kids = _children(d.proc.pid)
        assert len(kids) >= 2, "a compile worker and the device runner"
        for kid in kids:
            environ = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{kid}/environ").read_bytes().decode().split("\0")
                if "=" in item
            )
            assert environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
            assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(environ), kid
            argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            assert b"-m" in argv or b"-c" in argv, (
                "a fresh interpreter (exec), not a fork of the daemon"
            )
        d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60)
    finally:
        d.close()


def test_retention_and_upload_expiry(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text()
        .replace("[daemon]\n", "[daemon]\nretention_days = 0.00004\n")
        .replace("[listen]\n", "[limits]\nupload_ttl_h = 0.001\n[listen]\n")
    )
    try:
        d.start()
        job_id = _submit(d, _model(d, "mlp"), budget=1.0)
        job = d.wait_job(job_id)
        out = Path(job.result.tuned_model_path)
        assert out.exists()
        stale = upload(d.tuning(), _model(d, "cnn"))
        wait_for(
            lambda: not d.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs,
            30,
            "the job removed after its retention (3.5 s)",
            poll=0.1,
        )
        assert not out.exists() and not (d.state / "jobs" / job_id).exists()
        wait_for(
            lambda: f"upload {stale} (cnn.onnx) expired" in d.log(),
            60,
            "the upload's expiry in the log",
        )
        with pytest.raises(grpc.RpcError) as err:
            d.tuning().SubmitJob(tuning_pb2.SubmitJobRequest(model_id=stale))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()
        assert not any((d.state / "uploads").iterdir())
    finally:
        d.close()


def test_jobs_per_client_are_limited(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", max_running_jobs=1)
    d.config.write_text(
        d.config.read_text().replace("[daemon]\n", "[daemon]\nmax_jobs_per_client = 2\n")
    )
    try:
        d.start()
        mlp = _model(d, "mlp")
        first = _submit(d, mlp, budget=30.0)
        second = _submit(d, mlp, budget=29.0)
        with pytest.raises(grpc.RpcError) as err:
            _submit(d, mlp, budget=28.0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            "rpc:local has 2 jobs queued or running" in err.value.details()
            and "per client is 2" in err.value.details()
        )
        job = d.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=first)).job
        assert job.source == "rpc:local"
        d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=second), timeout=60)
        third = _submit(d, mlp, budget=28.0)  # a finished (cancelled) job frees its place
        for j in (first, third):
            d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=j), timeout=60)
    finally:
        d.close()

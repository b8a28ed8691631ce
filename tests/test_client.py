"""aoe.Client against real gRPC servers in this process (no daemon): error mapping,
ping, upload and download integrity, watch reconnection, the bank exchange format, and
the job commands of `aoe` when no daemon is there."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from aoe.client import Client, job_options
from aoe.errors import (
    AoedError,
    BankError,
    DaemonUnavailableError,
    JobCancelledError,
    JobStateError,
    NotFoundError,
    OptionError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from aoe.v1 import bank_pb2, bank_pb2_grpc, tuning_pb2, tuning_pb2_grpc

from .conftest import run_aoe


@contextlib.contextmanager
def serve(*handlers: grpc.GenericRpcHandler, servicers: tuple = ()) -> Iterator[Path]:
    """A real gRPC server on a fresh unix socket (short path: sun_path holds 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="aoe-t-", dir="/tmp"))
    sock = d / "s.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=handlers)
    for add, servicer in servicers:
        add(servicer, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        yield sock
    finally:
        server.stop(None)
        shutil.rmtree(d, ignore_errors=True)


def _aborting(
    service: str, method: str, request_type, response_type, code: grpc.StatusCode, message: str
):
    def handler(request, context):
        context.abort(code, message)

    rpc = grpc.unary_unary_rpc_method_handler(
        handler,
        request_deserializer=request_type.FromString,
        response_serializer=response_type.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(service, {method: rpc})


@pytest.mark.parametrize(
    ("code", "cls", "exit_code"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, OptionError, 2),
        (grpc.StatusCode.NOT_FOUND, NotFoundError, 2),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError, 1),
        (grpc.StatusCode.FAILED_PRECONDITION, JobStateError, 1),
        (grpc.StatusCode.UNAVAILABLE, DaemonUnavailableError, 7),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError, 8),
        (grpc.StatusCode.CANCELLED, JobCancelledError, 130),
        (grpc.StatusCode.INTERNAL, AoedError, 1),
    ],
)
def test_a_status_from_the_server_becomes_its_error_class_with_the_message(
    code, cls, exit_code
) -> None:
    message = f"job j-42 says {code.name.lower()}"
    handler = _aborting(
        "aoe.v1.TuningService",
        "GetJob",
        tuning_pb2.GetJobRequest,
        tuning_pb2.GetJobResponse,
        code,
        message,
    )
    with serve(handler) as sock, Client(sock) as client:
        with pytest.raises(AoedError) as info:
            client.get("j-42")
    assert type(info.value) is cls and info.value.exit_code == exit_code
    assert message in str(info.value)
    if code == grpc.StatusCode.NOT_FOUND:
        assert "not found" in str(info.value)
    if code == grpc.StatusCode.UNAVAILABLE:
        assert str(sock) in str(info.value)


def test_failed_precondition_from_the_bank_service_is_a_bank_error() -> None:
    handler = _aborting(
        "aoe.v1.BankService",
        "GetBankStats",
        bank_pb2.GetBankStatsRequest,
        bank_pb2.GetBankStatsResponse,
        grpc.StatusCode.FAILED_PRECONDITION,
        "bank /srv/bank: schema 9 is newer than this aoed",
    )
    with serve(handler) as sock, Client(sock) as client:
        with pytest.raises(BankError, match="schema 9 is newer"):
            client.bank_stats()


def test_ping_says_serving_only_when_the_health_service_does() -> None:
    status = health.HealthServicer()
    status.set("", health_pb2.HealthCheckResponse.SERVING)
    with serve(servicers=((health_pb2_grpc.add_HealthServicer_to_server, status),)) as sock:
        with Client(sock) as client:
            assert client.ping() is True
            status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert client.ping() is False


def _connectivity(channel: grpc.Channel) -> grpc.ChannelConnectivity:
    """The channel's state now (IDLE until something dials), without dialling."""
    states: list[grpc.ChannelConnectivity] = []
    seen = threading.Event()

    def note(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        seen.set()

    channel.subscribe(note, try_to_connect=False)
    try:
        assert seen.wait(10), "gRPC reports a subscriber the channel's state at once"
    finally:
        channel.unsubscribe(note)
    return states[0]


def test_ping_is_false_at_once_without_a_socket_and_soon_at_a_dead_one(tmp_path: Path) -> None:
    missing = tmp_path / "nobody.sock"
    with Client(missing) as client:
        assert client.ping() is False
        # Answered without dialling (so without waiting for PING_TIMEOUT_S): the channel
        # never left IDLE.
        assert _connectivity(client._channel) == grpc.ChannelConnectivity.IDLE
        with pytest.raises(DaemonUnavailableError, match=str(missing)):
            client.get("j-1")
    d = Path(tempfile.mkdtemp(prefix="aoe-t-", dir="/tmp"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # bound, never listening
            dead.bind(str(d / "dead.sock"))
            with Client(d / "dead.sock") as client:
                assert client.ping() is False
                assert _connectivity(client._channel) != grpc.ChannelConnectivity.IDLE, (
                    "this one was dialled"
                )
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Files(tuning_pb2_grpc.TuningServiceServicer):
    """The remote side of uploads and downloads: keeps what it receives, sends what it is given."""

    def __init__(self) -> None:
        self.header: tuning_pb2.ModelUploadHeader | None = None
        self.chunks: list[bytes] = []
        self.reply_sha = ""  # "" answers the true digest of what arrived
        self.download: tuple[tuning_pb2.DownloadHeader, bytes] = (tuning_pb2.DownloadHeader(), b"")

    def UploadModel(self, request_iterator, context):
        for r in request_iterator:
            if r.WhichOneof("payload") == "header":
                self.header = r.header
            else:
                self.chunks.append(r.chunk)
        data = b"".join(self.chunks)
        sha = self.reply_sha or hashlib.sha256(data).hexdigest()
        return tuning_pb2.UploadModelResponse(model_id="m-1", sha256=sha, size_bytes=len(data))

    def DownloadResult(self, request, context):
        header, data = self.download
        yield tuning_pb2.DownloadResultResponse(header=header)
        for i in range(0, len(data), 4096):
            yield tuning_pb2.DownloadResultResponse(chunk=data[i : i + 4096])


@pytest.fixture
def files() -> Iterator[tuple[Files, Path]]:
    servicer = Files()
    with serve(
        servicers=((tuning_pb2_grpc.add_TuningServiceServicer_to_server, servicer),)
    ) as sock:
        yield servicer, sock


def test_upload_sends_a_header_then_one_mib_chunks(files, tmp_path: Path) -> None:
    servicer, sock = files
    data = os.urandom((5 << 20) // 2)  # 2.5 MiB
    model = tmp_path / "resnet.onnx"
    model.write_bytes(data)
    with Client(sock) as client:
        assert client.upload(model) == "m-1"
    assert servicer.header is not None
    assert (servicer.header.file_name, servicer.header.size_bytes) == ("resnet.onnx", len(data))
    assert servicer.header.sha256 == hashlib.sha256(data).hexdigest()
    assert [len(c) for c in servicer.chunks] == [1 << 20, 1 << 20, 1 << 19]
    assert b"".join(servicer.chunks) == data


def test_upload_fails_when_the_daemon_received_other_bytes(files, tmp_path: Path) -> None:
    servicer, sock = files
    servicer.reply_sha = "0" * 64
    model = tmp_path / "m.onnx"
    model.write_bytes(b"onnx bytes")
    with Client(sock) as client, pytest.raises(AoedError, match="sha256"):
        client.upload(model)


def test_download_writes_the_checked_file_under_the_daemons_name(files, tmp_path: Path) -> None:
    servicer, sock = files
    data = os.urandom(10_000)
    header = tuning_pb2.DownloadHeader(
        file_name="../../model_tuned.onnx",
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )
    servicer.download = (header, data)
    with Client(sock) as client:
        path = client.download("j-1", "model", tmp_path / "out")
    assert path == tmp_path / "out" / "model_tuned.onnx"  # the name only: never outside dest_dir
    assert path.read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model_tuned.onnx"]


def test_download_with_a_wrong_sha256_says_so_and_leaves_nothing(files, tmp_path: Path) -> None:
    servicer, sock = files
    data = b"x" * 5000
    servicer.download = (
        tuning_pb2.DownloadHeader(file_name="r.json", sha256="ab" * 32, size_bytes=len(data)),
        data,
    )
    with Client(sock) as client, pytest.raises(AoedError) as info:
        client.download("j-7", "json", tmp_path)
    message = str(info.value)
    assert "sha256" in message and "j-7" in message and hashlib.sha256(data).hexdigest() in message
    assert list(tmp_path.iterdir()) == []  # no partial file, no temp file


class Watch(tuning_pb2_grpc.TuningServiceServicer):
    """Sends events 1-2, then goes away as a restarting daemon does; the next stream
    replays from where it is asked, 2 included, then ends the job."""

    def __init__(self, always_unavailable: bool = False) -> None:
        self.asked: list[int] = []
        self.always_unavailable = always_unavailable

    def WatchJob(self, request, context):
        self.asked.append(request.after_sequence)
        if len(self.asked) == 1 or self.always_unavailable:
            for n in (1, 2):
                yield tuning_pb2.WatchJobResponse(
                    event=tuning_pb2.JobEvent(sequence=n, job_id=request.job_id)
                )
            context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        for n in (2, 3):
            yield tuning_pb2.WatchJobResponse(
                event=tuning_pb2.JobEvent(sequence=n, job_id=request.job_id)
            )


def test_watch_resumes_after_the_last_event_when_the_daemon_comes_back() -> None:
    servicer = Watch()
    with serve(
        servicers=((tuning_pb2_grpc.add_TuningServiceServicer_to_server, servicer),)
    ) as sock:
        with Client(sock) as client:
            seen = [e.sequence for e in client.watch("j-1")]
    assert seen == [1, 2, 3]  # each once, in order
    assert servicer.asked == [0, 2]


def test_watch_gives_up_after_its_retry_time() -> None:
    servicer = Watch(always_unavailable=True)
    with serve(
        servicers=((tuning_pb2_grpc.add_TuningServiceServicer_to_server, servicer),)
    ) as sock:
        with Client(sock) as client, pytest.raises(DaemonUnavailableError, match="shutting down"):
            for _ in client.watch("j-1", retry_s=0.5):
                pass
    assert len(servicer.asked) >= 2 and servicer.asked[1:] == [2] * (len(servicer.asked) - 1)


class Bank(bank_pb2_grpc.BankServiceServicer):
    def __init__(self, records: list[bank_pb2.ExportEntriesResponse]) -> None:
        self.records = records
        self.imported: list[bank_pb2.ImportEntriesRequest] = []

    def ExportEntries(self, request, context):
        yield from self.records

    def ImportEntries(self, request_iterator, context):
        self.imported = list(request_iterator)
        return bank_pb2.ImportEntriesResponse(added=len(self.imported) - 1)


def test_bank_export_writes_the_exchange_format_and_import_sends_it_back(tmp_path: Path) -> None:
    from aoe.exchange import record_to_json

    entry = bank_pb2.BankEntry(
        schema_version=1,
        key="v1/aa/bb/exact",
        strategy=bank_pb2.Strategy(name="s", family="f"),
        winner=bank_pb2.Stats(median_us=12.5, repeats=7),
    )
    records = [
        bank_pb2.ExportEntriesResponse(entry=entry),
        bank_pb2.ExportEntriesResponse(
            default_record=bank_pb2.DefaultRecord(key="v1/cc/bb/exact", default_us=3.0)
        ),
        bank_pb2.ExportEntriesResponse(
            trial=bank_pb2.TrialRecord(
                key="v1/aa/bb/exact", time_ns=1 << 60, trial_json='{"ok": true}'
            )
        ),
    ]
    servicer = Bank(records)
    dump = tmp_path / "bank.jsonl"
    with serve(servicers=((bank_pb2_grpc.add_BankServiceServicer_to_server, servicer),)) as sock:
        with Client(sock) as client:
            counts = client.bank_export(dump)
            assert counts == {"entry": 1, "default_record": 1, "trial": 1}
            # as `aoe bank export`
            assert dump.read_text().splitlines() == [record_to_json(r) for r in records]
            reply = client.bank_import(dump, policy="overwrite", allow_foreign=True)
            dump.write_text(dump.read_text() + "{not json\n")
            with pytest.raises(OptionError, match=r"bank.jsonl:4: not a bank record"):
                client.bank_import(dump)
    assert reply.added == 3
    first, *rest = servicer.imported
    assert (
        first.options.policy == bank_pb2.MERGE_POLICY_OVERWRITE
        and first.options.allow_foreign_devices
    )
    assert [getattr(r, r.WhichOneof("payload")) for r in rest] == [
        getattr(r, r.WhichOneof("record")) for r in records
    ]


def test_job_options_from_a_dict_and_their_errors() -> None:
    opts = job_options(
        {
            "precision": "int8",
            "input_shapes": ["x:1,3,8,8;y:2"],
            "priority": -3,
            "budget_s": 5,
            "min_cosine": 0.99,
            "job_type": "2",
            "device": None,
        }
    )
    assert opts.precision == bank_pb2.PRECISION_INT8 and opts.job_type == tuning_pb2.JOB_TYPE_OPAT
    assert [(s.name, list(s.dims)) for s in opts.input_shapes] == [("x", [1, 3, 8, 8]), ("y", [2])]
    assert (opts.priority, opts.budget_s, opts.accuracy_budget.min_cosine, opts.device) == (
        -3,
        5.0,
        0.99,
        "",
    )
    with pytest.raises(OptionError, match="precision fp3: not supported"):
        job_options({"precision": "fp3"})
    with pytest.raises(OptionError, match="'colour': unknown"):
        job_options({"colour": "blue"})
    with pytest.raises(OptionError, match="input shape 'x:1,a'"):
        job_options({"input_shapes": "x:1,a"})


def test_aoe_submit_without_a_daemon_exits_7_naming_the_socket(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not even onnx: the daemon is asked first")
    sock = tmp_path / "no" / "aoed.sock"
    for args, env in (
        ([str(model), "--socket", str(sock)], {}),
        ([str(model)], {"AOED_SOCKET": str(sock)}),
    ):
        r = run_aoe("submit", *args, env=env, timeout=60)
        assert r.returncode == 7, (r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("aoe: error: ") and str(sock) in line


def test_aoe_tune_falls_back_to_embedded_and_says_why(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")  # fails in the engine, after the choice of daemon or embedded
    sock = tmp_path / "aoed.sock"
    env = {"AOED_SOCKET": str(sock), "XDG_DATA_HOME": str(tmp_path / "data")}
    r = run_aoe("tune", str(bad), "--output", str(tmp_path / "o"), env=env, timeout=120)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stderr.splitlines()[0] == f"aoe: tuning embedded (no daemon at {sock})"
    r = run_aoe(
        "tune", str(bad), "--socket", str(sock), "--bank", str(tmp_path / "bank"), timeout=60
    )
    assert r.returncode == 2 and "drop --bank or --socket" in r.stderr


def test_the_error_reported_from_a_task_group_is_the_first_of_the_classes_asked() -> None:
    import trio

    from aoe.errors import AoedError, ModelError, first_error

    async def fail(exc: BaseException) -> None:
        raise exc

    async def main() -> None:
        async with trio.open_nursery() as outer:
            outer.start_soon(fail, ValueError("not one of ours"))
            async with trio.open_nursery() as inner:
                inner.start_soon(fail, ModelError("m.onnx: not a model"))

    with pytest.raises(BaseExceptionGroup) as err:
        trio.run(main)
    found = first_error(err.value, KeyboardInterrupt, AoedError)
    assert isinstance(found, ModelError) and str(found) == "m.onnx: not a model"
    assert first_error(err.value, OSError) is err.value  # none of those: the group itself

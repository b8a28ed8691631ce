"""`aoe.Client`: the daemon's gRPC API as plain, blocking Python calls.

    with aoe.Client() as c:                   # the unix socket aoe.config.default_socket() names
        job = c.submit_file("model.onnx", precision="exact")
        for event in c.watch(job.job_id):
            ...
        c.download(job.job_id, "model", "out/")

Light: grpcio and protobuf only (no trio, no onnxruntime, nothing of the daemon). Unary
calls carry a deadline (`timeout` seconds); streams and uploads do not. Every gRPC error
comes out as an `aoe.errors` class with the daemon's message (the mapping is documented
there); only `watch` retries, and only UNAVAILABLE (the daemon restarting). A unix
socket is used only when it is one to trust (aoe.sockets: nobody but root and the
daemon's user could have put it there), checked before each call.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import grpc

from aoe.errors import (
    AoedError,
    BankError,
    DaemonUnavailableError,
    JobCancelledError,
    JobStateError,
    ModelError,
    NotFoundError,
    OptionError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from aoe.exchange import RECORD_FIELDS, record_from_json, record_to_json
from aoe.modelfile import check_model_file
from aoe.savedmodel import is_saved_model, is_saved_model_archive, pack_saved_model
from aoe.sockets import check_socket
from aoe.spec import JobSpec
from aoe.specargs import split_shapes
from aoe.v1 import (
    bank_pb2,
    bank_pb2_grpc,
    daemon_pb2,
    daemon_pb2_grpc,
    devices_pb2,
    devices_pb2_grpc,
    tuning_pb2,
    tuning_pb2_grpc,
)
from aoe.wire import spec_to_pb

__all__ = ["Client", "Stream", "job_options", "spec_of"]

CHUNK = 1 << 20
PING_TIMEOUT_S = 1.5
#: How long `watch` keeps reconnecting without receiving an event before it gives up.
WATCH_RETRY_S = 60.0
_MAX_MESSAGE = 64 << 20  # a Job of a large model lists thousands of task results
_ARTIFACTS = {
    "model": tuning_pb2.RESULT_ARTIFACT_TUNED_MODEL,
    "json": tuning_pb2.RESULT_ARTIFACT_RESULT_JSON,
    # an OpenVINO IR's .bin and compile config (aoe.ovartifact), named as its .xml is
    "weights": tuning_pb2.RESULT_ARTIFACT_TUNED_WEIGHTS,
    "config": tuning_pb2.RESULT_ARTIFACT_TUNED_CONFIG,
}
_WHAT = {
    "model": "tuned model",
    "json": "result JSON",
    "weights": "OpenVINO weights",
    "config": "OpenVINO compile config",
}
_POLICIES = {
    "keep-faster": bank_pb2.MERGE_POLICY_KEEP_FASTER,
    "overwrite": bank_pb2.MERGE_POLICY_OVERWRITE,
    "keep-existing": bank_pb2.MERGE_POLICY_KEEP_EXISTING,
}
_EXPORT_FILTERS = ("op_type", "device_digest", "precision", "entries_only", "no_history")


def _parse_target(target: str | os.PathLike[str] | None) -> tuple[str, Path | None]:
    """(gRPC target, the unix socket's path or None for TCP)."""
    if target is None:
        from aoe.config import default_socket

        target = default_socket()
    if isinstance(target, os.PathLike) or (
        "/" in target and not target.startswith(("unix:", "dns:", "ipv4:", "ipv6:"))
    ):
        path = Path(target).expanduser().absolute()
        return f"unix://{path}", path
    if target.startswith("unix:"):
        rest = target.removeprefix("unix:")
        return target, Path(rest[2:] if rest.startswith("//") else rest)
    return target, None


def _error(exc: grpc.RpcError, target: str, bank: bool = False) -> AoedError:
    """The aoe.errors exception for a failed call, with the daemon's message."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else "") or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailableError(
            f"the daemon at {target} is unavailable ({details}); is aoed running?"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return AoedError(f"the daemon at {target} did not answer in time ({details})")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return AoedError(
            f"the daemon at {target} does not offer this call ({details}); is it an older aoed?"
        )
    if code == grpc.StatusCode.NOT_FOUND and "not found" not in details.lower():
        details = f"not found: {details}"
    cls = {
        grpc.StatusCode.INVALID_ARGUMENT: OptionError,
        grpc.StatusCode.NOT_FOUND: NotFoundError,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
        grpc.StatusCode.FAILED_PRECONDITION: BankError if bank else JobStateError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
        grpc.StatusCode.CANCELLED: JobCancelledError,
    }.get(code, AoedError)
    return cls(details)


def _enum(enum: Any, prefix: str, value: Any, what: str) -> int:
    if isinstance(value, int):
        return value
    try:
        return enum.Value(prefix + str(value).strip().upper().replace("-", "_"))
    except ValueError:
        names = [
            n.removeprefix(prefix).lower() for n in enum.keys() if not n.endswith("UNSPECIFIED")
        ]
        raise OptionError(f"{what} {value!r}: expected one of {', '.join(names)}") from None


def spec_of(options: JobSpec | Mapping[str, Any] | None = None) -> JobSpec:
    """A JobSpec from a dict of its fields (precision "int8", job_type "opat" or "2",
    input_shapes {name: dims} or "NAME:D1,D2" strings, ranges "NAME:1~4,16~256" and -1
    dimensions with dynamic_dims "1,16;4,64" among them, budget_s, ...); None values are
    left unset. A JobSpec passes through. Raises OptionError naming an unknown key or a
    bad value."""
    if isinstance(options, JobSpec):
        return options
    values = {k: v for k, v in (options or {}).items() if v is not None}
    shapes, gears = values.get("input_shapes"), values.pop("dynamic_dims", None)
    if isinstance(shapes, Mapping):
        if gears is not None:  # gears fill the -1 of a profile: a spec's own field
            values["shape_profile"] = {"dims": {}, "gears": gears}
    elif shapes is not None or gears is not None:
        static, profile = split_shapes(shapes or [], gears, where="input shape")
        values["input_shapes"] = static
        if profile:
            values["shape_profile"] = profile
    return JobSpec.from_dict(values)


def job_options(
    options: tuning_pb2.JobOptions | JobSpec | Mapping[str, Any] | None = None,
) -> tuning_pb2.JobOptions:
    """The JobOptions message of a spec (or of a dict of its fields, as `spec_of` takes
    them, with output_dir: a folder on the daemon's host for the outputs). A JobOptions
    passes through. Raises OptionError naming an unknown key or a bad value."""
    if isinstance(options, tuning_pb2.JobOptions):
        return options
    values = dict(options) if isinstance(options, Mapping) else {}
    output_dir = values.pop("output_dir", None)
    msg = spec_to_pb(spec_of(options if isinstance(options, JobSpec) else values))
    if output_dir is not None:
        msg.output_dir = os.fspath(output_dir)
    return msg


@contextlib.contextmanager
def _writing(path: Path, mode: str) -> Iterator[IO[Any]]:
    """A file that appears at `path` only when the block ends without an error (written
    beside, then renamed). OptionError naming `path` when it cannot be created."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8")
    except OSError as exc:
        raise OptionError(f"{path}: {exc.strerror or exc}") from None
    try:
        with f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class Stream(Iterator[Any]):
    """A server stream being read: iterate it for its messages. `cancel()`, from any
    thread, ends it: an iteration blocked on the next message then stops. Errors come
    out as aoe.errors classes, as for any call."""

    def __init__(self, call: Any, target: str, bank: bool = False) -> None:
        self._call, self._target, self._bank = call, target, bank
        self._cancelled = False

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if self._cancelled:
                raise StopIteration from None
            raise _error(exc, self._target, self._bank) from exc

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class Client:
    """A connection to one daemon. `target`: None for the default unix socket
    (AOED_SOCKET, else aoed.sock in the runtime dir), a path (a Path, or a str with a
    '/') for a unix socket, or a gRPC target as given ("unix:/run/aoed/aoed.sock",
    "host:port"; TLS when certificates are given). Connecting is lazy: constructing
    never fails for an absent daemon; calls then raise DaemonUnavailableError."""

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = 30,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ):
        self.target, self.socket = _parse_target(target)
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
        ]
        if root_certificates or private_key or certificate_chain:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self._channel = grpc.secure_channel(self.target, creds, options)
        else:
            self._channel = grpc.insecure_channel(self.target, options)
        self._tuning = tuning_pb2_grpc.TuningServiceStub(self._channel)
        self._bank = bank_pb2_grpc.BankServiceStub(self._channel)
        self._devices = devices_pb2_grpc.DeviceServiceStub(self._channel)
        self._daemon = daemon_pb2_grpc.DaemonServiceStub(self._channel)

    def __repr__(self) -> str:
        return f"Client({self.target!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; streams still open end with CANCELLED."""
        self._channel.close()

    def _check_socket(self) -> None:
        """Before a call: the socket is there, this user may reach it, and it is one to
        trust (aoe.sockets). DaemonUnavailableError, PermissionDeniedError."""
        if self.socket is not None and not check_socket(self.socket):
            raise DaemonUnavailableError(
                f"no daemon at {self.target}: {self.socket} does not exist; is aoed running?"
            )

    def _call(self, method: Any, request: Any, *, bank: bool = False, deadline: bool = True) -> Any:
        self._check_socket()
        try:
            return method(request, timeout=self.timeout if deadline else None)
        except grpc.RpcError as exc:
            raise _error(exc, self.target, bank) from exc

    def _stream(
        self, method: Any, request: Any, *, bank: bool = False
    ) -> Generator[Any, None, None]:
        self._check_socket()
        call = method(request)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise _error(exc, self.target, bank) from exc
        finally:
            call.cancel()  # no-op when the stream ended; stops it when the caller let go

    def ping(self) -> bool:
        """True when the daemon answers the standard health check (grpc.health.v1) as
        SERVING. False when nothing answers within PING_TIMEOUT_S; a missing socket file
        returns at once, without dialling. PermissionDeniedError, without dialling, for a
        socket this user may not reach or must not trust (aoe.sockets)."""
        if self.socket is not None and not check_socket(self.socket):
            return False
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        limit = min(PING_TIMEOUT_S, self.timeout or PING_TIMEOUT_S)
        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=limit
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def info(self) -> daemon_pb2.GetDaemonInfoResponse:
        """The daemon's version, paths, limits and load."""
        return self._call(self._daemon.GetDaemonInfo, daemon_pb2.GetDaemonInfoRequest())

    def devices(self) -> list[devices_pb2.Device]:
        """The devices the daemon can tune on, with their load."""
        return list(self._call(self._devices.ListDevices, devices_pb2.ListDevicesRequest()).devices)

    def upload(self, path: str | os.PathLike[str]) -> str:
        """Send the local file at `path` (a header with its name, sha256 and size, then
        1 MiB chunks); returns the model id for `submit(model_id=...)`. Raises ModelError
        when the file cannot be read, AoedError when the daemon got other bytes,
        ResourceExhaustedError when it is larger than the daemon accepts."""
        path = Path(path)
        self._check_socket()
        try:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256")
                size = f.tell()
        except OSError as exc:
            raise ModelError(f"{path}: {exc.strerror or exc}") from None
        sha = digest.hexdigest()
        failed: list[OSError] = []

        def requests() -> Iterator[tuning_pb2.UploadModelRequest]:
            header = tuning_pb2.ModelUploadHeader(file_name=path.name, sha256=sha, size_bytes=size)
            yield tuning_pb2.UploadModelRequest(header=header)
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        yield tuning_pb2.UploadModelRequest(chunk=chunk)
            except OSError as exc:  # grpc would only say CANCELLED; say why
                failed.append(exc)
                raise

        try:
            reply = self._tuning.UploadModel(requests())
        except grpc.RpcError as exc:
            if failed:
                raise ModelError(f"{path}: {failed[0].strerror or failed[0]}") from None
            raise _error(exc, self.target) from exc
        if reply.sha256 and reply.sha256 != sha:
            raise AoedError(
                f"upload of {path}: the daemon received sha256 {reply.sha256}, not {sha}; try again"
            )
        return reply.model_id

    def submit(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        model_id: str | None = None,
        options: tuning_pb2.JobOptions | JobSpec | Mapping[str, Any] | None = None,
    ) -> tuning_pb2.Job:
        """Queue a job for `model`, a path as the daemon's host sees it, or for an uploaded
        `model_id` (exactly one); `options` as `job_options` takes them. Returns the Job
        as queued. Raises OptionError (bad options, unknown model), ResourceExhaustedError
        (the queue is full)."""
        if (model is None) == (model_id is None):
            raise OptionError("submit: give either a model path on the daemon's host or a model_id")
        request = tuning_pb2.SubmitJobRequest(options=job_options(options))
        if model_id is not None:
            request.model_id = model_id
        else:
            request.model_path = os.fspath(model)  # type: ignore[arg-type]
        reply = self._call(self._tuning.SubmitJob, request)
        if not reply.job.job_id:
            reply.job.job_id = reply.job_id
        return reply.job

    def submit_file(
        self, local_path: str | os.PathLike[str], spec: JobSpec | None = None, **options: Any
    ) -> tuning_pb2.Job:
        """`upload` the local model, then `submit` it with `spec` (or `options`, as
        `job_options` takes them); returns the Job.
        Bad options (OptionError), a socket with no daemon (DaemonUnavailableError) and
        a file that is missing or not an ONNX model (ModelError, aoe.modelfile) fail
        before anything is uploaded, in that order."""
        opts = job_options(spec if spec is not None else options)
        self._check_socket()
        if is_saved_model(local_path):
            # A TensorFlow SavedModel's directory travels as a .tar of it, the one file
            # the daemon takes a SavedModel in (its converter unpacks it).
            with tempfile.TemporaryDirectory(prefix="aoe-savedmodel-") as tmp:
                archive = pack_saved_model(Path(local_path), Path(tmp))
                return self.submit(model_id=self.upload(archive), options=opts)
        # A GDAT job's model is a torch.export program: the daemon's ranks read it; a
        # .tar, a SavedModel that the daemon's converter unpacks and checks.
        onnx = opts.job_type != tuning_pb2.JOB_TYPE_GDAT and not is_saved_model_archive(local_path)
        check_model_file(local_path, onnx=onnx)
        return self.submit(model_id=self.upload(local_path), options=opts)

    def get(self, job_id: str) -> tuning_pb2.Job:
        """The job's current snapshot; OptionError when the daemon knows no such job."""
        return self._call(self._tuning.GetJob, tuning_pb2.GetJobRequest(job_id=job_id)).job

    def jobs(self, states: Iterable[int | str] | None = None) -> list[tuning_pb2.Job]:
        """Every job (newest first), all pages; only those in `states` ("queued", ...
        or JobState values) when given."""
        picked = [_enum(tuning_pb2.JobState, "JOB_STATE_", s, "state") for s in states or ()]
        # JobState.Value's numbers
        request = tuning_pb2.ListJobsRequest(states=picked)  # type: ignore[arg-type]
        out: list[tuning_pb2.Job] = []
        while True:
            reply = self._call(self._tuning.ListJobs, request)
            out.extend(reply.jobs)
            if not reply.next_page_token:
                return out
            request.page_token = reply.next_page_token

    def cancel(self, job_id: str) -> tuning_pb2.Job:
        """Ask the daemon to stop the job; returns it as it is after the request."""
        return self._call(self._tuning.CancelJob, tuning_pb2.CancelJobRequest(job_id=job_id)).job

    def watch(
        self,
        job_id: str,
        after_sequence: int = 0,
        include_logs: bool = False,
        *,
        retry_s: float = WATCH_RETRY_S,
    ) -> Iterator[tuning_pb2.JobEvent]:
        """Yield the job's events after `after_sequence` until it reaches a final state.
        When the daemon goes away (UNAVAILABLE: a restart) it reconnects and resumes after
        the last event yielded; after `retry_s` seconds without one it raises
        DaemonUnavailableError. An unknown job: OptionError. Closing the iterator (or
        leaving the loop) cancels the stream."""
        last, failing_since, pause = after_sequence, None, 0.1
        while True:
            request = tuning_pb2.WatchJobRequest(
                job_id=job_id, include_logs=include_logs, after_sequence=last
            )
            stream = self._stream(self._tuning.WatchJob, request)
            try:
                with contextlib.closing(stream):
                    for reply in stream:
                        if reply.event.sequence and reply.event.sequence <= last:
                            continue  # replayed after a reconnect: already yielded
                        failing_since, pause = None, 0.1  # only news proves the daemon is back
                        last = reply.event.sequence or last
                        yield reply.event
                return
            except DaemonUnavailableError:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= retry_s:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def download(
        self, job_id: str, artifact: str = "model", dest_dir: str | os.PathLike[str] = "."
    ) -> Path:
        """Fetch an artifact of a finished job ("model": the tuned model, "json": the
        result report; for an OpenVINO IR, "weights" and "config" beside its .xml) into
        `dest_dir` under the daemon's file name; returns its path.
        The file appears whole or not at all: written beside, checked against the
        header's size and sha256, then renamed. Raises OptionError (unknown job or
        artifact, unwritable `dest_dir`), AoedError when the bytes do not match."""
        if artifact not in _ARTIFACTS:
            raise OptionError(f"artifact {artifact!r}: expected one of {', '.join(_ARTIFACTS)}")
        request = tuning_pb2.DownloadResultRequest(job_id=job_id, artifact=_ARTIFACTS[artifact])
        what = f"the {_WHAT[artifact]} of job {job_id}"
        stream = self._stream(self._tuning.DownloadResult, request)
        with contextlib.closing(stream):
            first = next(stream, None)
            if first is None or first.WhichOneof("payload") != "header":
                raise AoedError(f"download of {what}: the daemon sent no header first")
            header = first.header
            path = Path(dest_dir) / (Path(header.file_name).name or f"{job_id}_{artifact}")
            digest, size = hashlib.sha256(), 0
            with _writing(path, "wb") as out:
                for reply in stream:
                    out.write(reply.chunk)
                    digest.update(reply.chunk)
                    size += len(reply.chunk)
                if (size, digest.hexdigest()) != (header.size_bytes, header.sha256):
                    raise AoedError(
                        f"download of {what}: received {size} bytes with sha256 {digest.hexdigest()}, but the "
                        f"daemon announced {header.size_bytes} bytes with sha256 {header.sha256 or '(none)'}; "
                        "nothing was written, try again"
                    )
        return path

    def bank_stats(self) -> bank_pb2.GetBankStatsResponse:
        """Size and composition of the daemon's bank. Errors: BankError, as for any call."""
        return self._call(self._bank.GetBankStats, bank_pb2.GetBankStatsRequest(), bank=True)

    def bank_lookup(self, key: str) -> bank_pb2.LookupEntryResponse:
        """The entry under `key` (`found` False and a `reason` when none)."""
        return self._call(self._bank.LookupEntry, bank_pb2.LookupEntryRequest(key=key), bank=True)

    def bank_export(self, dest_file: str | os.PathLike[str], **filters: Any) -> dict[str, int]:
        """Write the daemon's bank records to `dest_file` as JSON Lines, the format of
        `aoe bank export` (written beside, then renamed). `filters`: op_type,
        device_digest, precision, entries_only, no_history. Returns counts per record
        kind (entry, default_record, trial). OptionError for an unknown filter or an
        unwritable file."""
        unknown = sorted(set(filters) - set(_EXPORT_FILTERS))
        if unknown:
            raise OptionError(
                f"export filter {unknown[0]!r}: unknown (known: {', '.join(_EXPORT_FILTERS)})"
            )
        if "precision" in filters:
            filters["precision"] = _enum(
                bank_pb2.Precision, "PRECISION_", filters["precision"], "precision"
            )
        request = bank_pb2.ExportEntriesRequest(
            **{k: v for k, v in filters.items() if v is not None}
        )
        counts = dict.fromkeys(RECORD_FIELDS, 0)
        stream = self._stream(self._bank.ExportEntries, request, bank=True)
        with contextlib.closing(stream), _writing(Path(dest_file), "w") as out:
            for record in stream:
                out.write(record_to_json(record) + "\n")
                counts[record.WhichOneof("record")] += 1
        return counts

    def bank_import(
        self,
        src_file: str | os.PathLike[str],
        policy: str = "keep-faster",
        allow_foreign: bool = False,
    ) -> bank_pb2.ImportEntriesResponse:
        """Merge a JSON Lines file (as `bank_export` writes) into the daemon's bank; every
        line is parsed before anything is sent. Records of every device are kept, each
        served to its own device; `allow_foreign` is taken from older callers and changes
        nothing. Returns the daemon's counts and refusals.
        Raises OptionError for an unknown policy, an unreadable file or a line that is
        not a bank record (naming file and line); BankError, as for any call."""
        if policy not in _POLICIES:
            raise OptionError(f"policy {policy!r}: expected one of {', '.join(_POLICIES)}")
        options = bank_pb2.ImportOptions(
            policy=_POLICIES[policy], allow_foreign_devices=allow_foreign
        )
        requests = [bank_pb2.ImportEntriesRequest(options=options)]
        try:
            with open(src_file, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = record_from_json(line)
                    except ValueError as exc:
                        raise OptionError(f"{src_file}:{n}: not a bank record ({exc})") from None
                    which = record.WhichOneof("record")
                    requests.append(
                        bank_pb2.ImportEntriesRequest(**{which: getattr(record, which)})
                    )
        except OSError as exc:
            raise OptionError(f"{src_file}: {exc.strerror or exc}") from None
        return self._call(self._bank.ImportEntries, iter(requests), bank=True, deadline=False)

    def bank_prune(self, dry_run: bool = False) -> bank_pb2.PruneBankResponse:
        """Drop the bank's measurement history, keeping winners (only count, `dry_run`)."""
        return self._call(
            self._bank.PruneBank,
            bank_pb2.PruneBankRequest(dry_run=dry_run),
            bank=True,
            deadline=False,
        )

    def bank_follow(self, after_seq: int = 0, bank_id: str = "") -> Stream:
        """The daemon's bank writes after sequence number `after_seq` of the bank
        `bank_id` (from the start when the daemon's bank is another), then each new one
        as it is committed: a Stream of FollowBankResponse that does not end by itself
        (`cancel()` ends it). Errors: DaemonUnavailableError, BankError,
        ResourceExhaustedError when this reader fell too far behind (resume from the
        last `upto_seq` applied)."""
        self._check_socket()
        request = bank_pb2.FollowBankRequest(after_seq=after_seq, bank_id=bank_id)
        return Stream(self._bank.FollowBank(request), self.target, bank=True)

    def bank_sync(self, peer: str) -> bank_pb2.SyncBankResponse:
        """Make the daemon apply, once, what the bank of `peer` (a gRPC target the daemon
        can reach) wrote since it last did; returns the counts and sequence numbers."""
        return self._call(
            self._bank.SyncBank, bank_pb2.SyncBankRequest(peer=peer), bank=True, deadline=False
        )

    def bank_verify(
        self, sample_size: int = 10, op_type: str = "", seed: int = 0, device: str = ""
    ) -> Iterator[bank_pb2.VerifyEntriesResponse]:
        """Re-measure a random sample of entries (0: all) on the daemon; yields one
        verdict per entry as it is measured. Leaving the loop cancels the rest."""
        request = bank_pb2.VerifyEntriesRequest(
            sample_size=sample_size, op_type=op_type, seed=seed, device=device
        )
        return self._stream(self._bank.VerifyEntries, request, bank=True)

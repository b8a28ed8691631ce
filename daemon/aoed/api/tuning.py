"""TuningService: submit, watch, get, list, cancel, upload and download, over the job
manager. Methods are protobuf -> domain, one bridge call, domain -> protobuf.

Uploads are written to disk in the handler's thread (no trio state is touched until the
file is complete and its sha256 checked), then registered in one bridge call. Before a
byte of an upload is written, its declared size (then each chunk beyond it) is reserved
against the upload quotas (`jobs.uploads`) and the state dir's free-space floor; a full
disk met anyway ends the call with RESOURCE_EXHAUSTED naming the folder. Paths a client
names (a model, a calibration folder, an output folder) must resolve, symlinks
included, inside the configured allowed directories.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import grpc
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.timestamp_pb2 import Timestamp

from aoe import sizes
from aoe.errors import AoedError, JobStateError, NotFoundError, OptionError, PermissionDeniedError
from aoe.ovartifact import config_path
from aoe.savedmodel import check_saved_model, is_saved_model
from aoe.v1 import tuning_pb2, tuning_pb2_grpc
from aoe.wire import outcome_to_pb, spec_from_pb, spec_to_pb
from aoed import safefs, space
from aoed.api._bridge import Bridge, status_of
from aoed.config import DaemonConfig
from aoed.jobs import store as st
from aoed.jobs.admission import Submission
from aoed.jobs.inputs import shown_path
from aoed.jobs.manager import JobManager
from aoed.jobs.store import EventRow, JobRow, Upload
from aoed.logs import cut

__all__ = ["TuningServicer", "confine"]

K = TypeVar("K", bound=int)
V = TypeVar("V")

CHUNK = 1 << 20

_STATE = {
    st.QUEUED: tuning_pb2.JOB_STATE_QUEUED,
    st.PREPARING: tuning_pb2.JOB_STATE_PREPARING,
    st.TUNING: tuning_pb2.JOB_STATE_TUNING,
    st.VERIFYING: tuning_pb2.JOB_STATE_VERIFYING,
    st.SUCCEEDED: tuning_pb2.JOB_STATE_SUCCEEDED,
    st.FAILED: tuning_pb2.JOB_STATE_FAILED,
    st.CANCELLED: tuning_pb2.JOB_STATE_CANCELLED,
}
_STATE_NAME = {v: k for k, v in _STATE.items()}
_LEVEL = {
    "debug": tuning_pb2.LOG_LEVEL_DEBUG,
    "info": tuning_pb2.LOG_LEVEL_INFO,
    "warning": tuning_pb2.LOG_LEVEL_WARNING,
    "error": tuning_pb2.LOG_LEVEL_ERROR,
}


def confine(
    raw: str, allowed: tuple[Path, ...], what: str, want_dir: bool = False, model: bool = False
) -> Path:
    """`raw` resolved (symlinks followed) if it lies inside one of `allowed`; else
    PERMISSION_DENIED (NOT_FOUND when it would lie inside them but does not exist;
    INVALID_ARGUMENT for a relative path, a NUL byte, or the wrong kind of file). With
    `model`, a TensorFlow SavedModel's directory is a model too (a folder without
    saved_model.pb is a ModelError naming it).

    Whether `raw` lies inside is decided before whether it exists, so that a client
    cannot learn which paths exist outside the allowed directories. A very long `raw` is
    cut in the messages (logs.cut)."""
    shown = repr(cut(raw))
    if not allowed:
        raise PermissionDeniedError(
            f"{what} {shown}: this daemon accepts no daemon-side paths ([daemon] allowed_dirs is empty); "
            "upload the model instead"
        )
    if "\x00" in raw:
        raise OptionError(f"{what} {shown}: a path cannot contain a NUL byte")
    if not os.path.isabs(raw):
        raise OptionError(f"{what} {shown}: must be an absolute path on the daemon host")
    roots = [Path(a).resolve() for a in allowed]
    try:
        real = Path(raw).resolve()  # `..` and every symlink that exists, followed
    except (OSError, RuntimeError):  # a symlink loop
        raise NotFoundError(f"{what} {shown}: cannot be resolved (a symlink loop?)") from None
    if not any(real.is_relative_to(r) for r in roots):
        raise PermissionDeniedError(
            f"{what} {shown}: outside the allowed directories ({', '.join(map(str, roots))})"
        )
    try:
        real.lstat()
    except FileNotFoundError:
        raise NotFoundError(f"{what} {shown}: no such file on the daemon host") from None
    except OSError as exc:  # a name too long, a component not a folder
        raise OptionError(f"{what} {shown}: {exc.strerror or exc}") from None
    if want_dir and not real.is_dir():
        raise OptionError(f"{what} {shown}: not a directory")
    if model and is_saved_model(real):
        check_saved_model(real, f"{what} {shown}")
        return real
    if not want_dir and not real.is_file():
        raise OptionError(f"{what} {shown}: not a regular file")
    return real


def client_of(context: grpc.ServicerContext) -> str:
    """Who is calling, as far as the transport tells: the subject of a TLS client
    certificate, else the peer's address on TCP, else "local" (on the unix socket every
    caller is the same client: grpcio cannot see the peer's uid, and the socket's group
    is one team)."""
    # grpcio gives each property as a list of values (its docs); the stubs say bytes.
    auth = cast("Mapping[str, Sequence[bytes]]", context.auth_context()) or {}
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names = auth.get(key) or []
        if names:
            return "tls:" + names[0].decode("utf-8", "replace")
    peer = context.peer() or ""
    if peer.startswith(("ipv4:", "ipv6:")):
        return "ip:" + peer.split(":", 1)[1].rsplit(":", 1)[0]
    return "local"


def _ts(seconds: float | None) -> Timestamp | None:
    if not seconds:
        return None
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def _name_of(table: Mapping[K, V], code: K, field: str, enum: EnumDescriptor) -> V:
    """`table[code]`; OptionError naming `field` for a number the enum does not define
    (proto3 keeps unknown enum numbers, which a lookup with a default would quietly map)."""
    if code not in table:
        names = ", ".join(f"{v.name}={v.number}" for v in enum.values if v.number in table)
        raise OptionError(f"{field} {code}: not a known value (known: {names})")
    return table[code]


def progress_pb(p: dict[str, Any]) -> tuning_pb2.JobProgress:
    return tuning_pb2.JobProgress(
        tasks_done=int(p.get("done", 0)),
        tasks_total=int(p.get("total", 0)),
        current_task=str(p.get("current_task", "")),
    )


def job_pb(row: JobRow, position: int = 0) -> tuning_pb2.Job:
    return tuning_pb2.Job(
        job_id=row.id,
        state=_STATE.get(row.state, tuning_pb2.JOB_STATE_UNSPECIFIED),
        model_name=row.model_name,
        model_path=shown_path(row),
        options=spec_to_pb(row.spec),
        created=_ts(row.created),
        started=_ts(row.started),
        finished=_ts(row.finished),
        progress=progress_pb(row.progress),
        result=outcome_to_pb(row.outcome) if row.outcome and row.state == st.SUCCEEDED else None,
        error=row.error,
        queue_position=position,
        source=row.source,
        joined=row.joined,
        error_kind=row.error_kind,
    )


def event_pb(ev: EventRow) -> tuning_pb2.JobEvent:
    msg = tuning_pb2.JobEvent(sequence=ev.seq, time=_ts(ev.time), job_id=ev.job_id)
    d = ev.data
    if ev.kind == "state":
        msg.state_change.CopyFrom(
            tuning_pb2.JobStateChange(
                previous=_STATE.get(d.get("previous", ""), tuning_pb2.JOB_STATE_UNSPECIFIED),
                state=_STATE.get(d.get("state", ""), tuning_pb2.JOB_STATE_UNSPECIFIED),
                message=str(d.get("message", "")),
            )
        )
    elif ev.kind == "progress":
        msg.progress.CopyFrom(progress_pb(d))
    elif ev.outcome is not None:
        msg.result.CopyFrom(outcome_to_pb(ev.outcome))
    else:
        msg.log.CopyFrom(
            tuning_pb2.LogLine(
                level=_LEVEL.get(d.get("level", "info"), tuning_pb2.LOG_LEVEL_UNSPECIFIED),
                logger=str(d.get("logger", "")),
                message=str(d.get("message", "")),
            )
        )
    return msg


#: Bytes of jobs in one ListJobs answer, at most (a larger job comes alone on its page):
#: well under the 4 MiB a gRPC client accepts by default, and the daemon's 8 MiB.
LIST_PAGE_BYTES = 1 << 20


def _page_token(row: JobRow) -> str:
    return base64.urlsafe_b64encode(json.dumps([row.created, row.id]).encode()).decode()


def _parse_token(token: str) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(job_id)
    except (ValueError, TypeError):
        raise OptionError("page_token: not a token this daemon gave out") from None


class TuningServicer(tuning_pb2_grpc.TuningServiceServicer):
    def __init__(self, bridge: Bridge, jobs: JobManager):
        self._bridge, self._jobs = bridge, jobs

    @property
    def _cfg(self) -> DaemonConfig:
        return self._jobs.cfg  # reloaded on SIGHUP

    # -- unary

    def SubmitJob(
        self, request: tuning_pb2.SubmitJobRequest, context: grpc.ServicerContext
    ) -> tuning_pb2.SubmitJobResponse:
        row, _ = self._bridge.call(context, self._submit, request, client_of(context))
        return tuning_pb2.SubmitJobResponse(job_id=row.id, job=job_pb(row))

    async def _submit(
        self, request: tuning_pb2.SubmitJobRequest, client: str
    ) -> tuple[JobRow, bool]:
        o = request.options
        for name, value in (
            ("model_path", request.model_path),
            ("output_dir", o.output_dir),
            ("calibration_dir", o.calibration_dir),
        ):
            sizes.check_text(name, value, sizes.MAX_PATH_BYTES)
        sizes.check_text("model_id", request.model_id, sizes.MAX_NAME_BYTES)
        spec = spec_from_pb(request.options)
        allowed = self._cfg.allowed_dirs
        if o.calibration_dir:
            spec = spec.replace(
                calibration_dir=confine(
                    o.calibration_dir, allowed, "calibration_dir", want_dir=True
                )
            )
        output = (
            confine(o.output_dir, allowed, "output_dir", want_dir=True) if o.output_dir else None
        )
        which = request.WhichOneof("model")
        if which == "model_id":
            up = self._jobs.upload(request.model_id)
            if up is None:
                raise NotFoundError(
                    f"model_id {cut(request.model_id)!r}: no such upload (expired or already used)"
                )
            return await self._jobs.submit(
                Submission(Path(up.path), spec, f"rpc:{client}", upload=up, output_dir=output)
            )
        if which == "model_path":
            model = confine(request.model_path, allowed, "model_path", model=True)
            return await self._jobs.submit(
                Submission(model, spec, f"rpc:{client}", output_dir=output)
            )
        raise OptionError("SubmitJob: set model_path or model_id")

    def GetJob(
        self, request: tuning_pb2.GetJobRequest, context: grpc.ServicerContext
    ) -> tuning_pb2.GetJobResponse:
        return self._bridge.call(context, self._get, request.job_id)

    async def _get(self, job_id: str) -> tuning_pb2.GetJobResponse:
        row = self._jobs.get(job_id)
        return tuning_pb2.GetJobResponse(job=job_pb(row, self._jobs.queue_position(row)))

    def ListJobs(
        self, request: tuning_pb2.ListJobsRequest, context: grpc.ServicerContext
    ) -> tuning_pb2.ListJobsResponse:
        return self._bridge.call(context, self._list, request)

    async def _list(self, request: tuning_pb2.ListJobsRequest) -> tuning_pb2.ListJobsResponse:
        size = min(int(request.page_size or 100), 1000)
        states: list[str] = [
            _name_of(_STATE_NAME, s, "states", tuning_pb2.JobState.DESCRIPTOR)
            for s in request.states
        ]
        rows = self._jobs.list(states, size + 1, _parse_token(request.page_token))
        jobs: list[tuning_pb2.Job] = []
        used = 0
        for row in rows[:size]:  # as many as fit in LIST_PAGE_BYTES, and at least one
            pb = job_pb(row)
            used += pb.ByteSize() + 8  # (+ the field's tag and length)
            if jobs and used > LIST_PAGE_BYTES:
                break
            jobs.append(pb)
        more = len(rows) > len(jobs)
        return tuning_pb2.ListJobsResponse(
            jobs=jobs, next_page_token=_page_token(rows[len(jobs) - 1]) if more else ""
        )

    def CancelJob(
        self, request: tuning_pb2.CancelJobRequest, context: grpc.ServicerContext
    ) -> tuning_pb2.CancelJobResponse:
        return self._bridge.call(context, self._cancel, request.job_id)

    async def _cancel(self, job_id: str) -> tuning_pb2.CancelJobResponse:
        return tuning_pb2.CancelJobResponse(job=job_pb(await self._jobs.cancel(job_id)))

    # -- streams

    def WatchJob(
        self, request: tuning_pb2.WatchJobRequest, context: grpc.ServicerContext
    ) -> Iterator[tuning_pb2.WatchJobResponse]:
        for ev in self._bridge.stream(
            context, self._jobs.events, request.job_id, request.after_sequence, request.include_logs
        ):
            yield tuning_pb2.WatchJobResponse(event=event_pb(ev))

    def UploadModel(
        self,
        request_iterator: Iterator[tuning_pb2.UploadModelRequest],
        context: grpc.ServicerContext,
    ) -> tuning_pb2.UploadModelResponse:
        cfg = self._cfg
        limit = cfg.max_upload_bytes
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "header":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "UploadModel: the first message must be the header",
            )
        head = first.header
        name = os.path.basename(head.file_name.replace("\\", "/"))
        if not name or name.startswith(".") or "\x00" in name or len(name.encode()) > 255:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"UploadModel: bad file name {cut(head.file_name)!r}",
            )
        if head.size_bytes > limit:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"UploadModel: {head.size_bytes} bytes is over this daemon's limit of {limit} bytes",
            )
        upload_id = f"up-{uuid.uuid4().hex[:16]}"
        folder = cfg.uploads_dir
        ledger, client = self._jobs.uploads, client_of(context)
        final = folder / upload_id
        h, size, reserved, kept = hashlib.sha256(), 0, head.size_bytes, False

        def receive(f: BinaryIO) -> None:
            nonlocal size, reserved
            for msg in request_iterator:
                if msg.WhichOneof("payload") != "chunk":
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "UploadModel: only the first message is a header",
                    )
                size += len(msg.chunk)
                if size > limit:
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"UploadModel: over this daemon's limit of {limit} bytes",
                    )
                if size > reserved:  # beyond what the header declared: this chunk first
                    ledger.reserve(upload_id, client, size, cfg)
                    space.check_floor(
                        folder, cfg.min_free_bytes, "UploadModel", need=size - reserved
                    )
                    reserved = size
                h.update(msg.chunk)
                f.write(msg.chunk)
            if head.sha256 and head.sha256.lower() != h.hexdigest():
                context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"UploadModel: sha256 of the received bytes is "
                    f"{h.hexdigest()}, the header said {cut(head.sha256)}",
                )
            if head.size_bytes and head.size_bytes != size:
                context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"UploadModel: received {size} bytes, the header said {head.size_bytes}",
                )

        try:
            # Refused before a byte is written: the quotas, then the free-space floor.
            ledger.reserve(upload_id, client, reserved, cfg)
            space.check_floor(folder, cfg.min_free_bytes, "UploadModel", need=reserved)
            folder.mkdir(parents=True, exist_ok=True)
            # uploads/<id>/<name>, written as safefs writes: the file appears whole or not at all.
            with safefs.opened_dir(folder) as uploads_fd:
                own = safefs.make_dir(upload_id, dir_fd=uploads_fd)
                try:
                    safefs.write_file(name, receive, dir_fd=own)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.rmdir(upload_id, dir_fd=uploads_fd)
                    raise
                finally:
                    os.close(own)
            digest = h.hexdigest()
            up = Upload(upload_id, str(final / name), name, digest, size, time.time())
            self._bridge.call(context, self._register_upload, up)
            kept = True
        except AoedError as exc:
            context.abort(status_of(exc), str(exc))
        except OSError as exc:
            if exc.errno in space.FULL_ERRNOS:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, str(space.disk_full(folder, "UploadModel"))
                )
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"UploadModel: cannot store the upload: {exc.strerror or exc}",
            )
        finally:
            if not kept:  # refused, failed or cancelled: nothing of it stays, nor counts
                with contextlib.suppress(OSError):
                    (final / name).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    final.rmdir()
                ledger.release(upload_id)
        return tuning_pb2.UploadModelResponse(model_id=upload_id, sha256=digest, size_bytes=size)

    async def _register_upload(self, up: Upload) -> None:
        self._jobs.add_upload(up)

    def DownloadResult(
        self, request: tuning_pb2.DownloadResultRequest, context: grpc.ServicerContext
    ) -> Iterator[tuning_pb2.DownloadResultResponse]:
        path = self._bridge.call(context, self._artifact, request.job_id, request.artifact)
        try:
            with open(path, "rb") as f:
                h = hashlib.file_digest(f, "sha256")
                size = f.tell()
                yield tuning_pb2.DownloadResultResponse(
                    header=tuning_pb2.DownloadHeader(
                        file_name=path.name, sha256=h.hexdigest(), size_bytes=size
                    )
                )
                f.seek(0)
                while chunk := f.read(CHUNK):
                    yield tuning_pb2.DownloadResultResponse(chunk=chunk)
        except OSError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{path.name}: {exc.strerror or exc}")

    async def _artifact(self, job_id: str, artifact: int) -> Path:
        row = self._jobs.get(job_id)
        if row.state != st.SUCCEEDED or not row.outcome:
            raise JobStateError(
                f"job {job_id} is {row.state}: only a succeeded job has results to download"
            )
        if artifact == tuning_pb2.RESULT_ARTIFACT_RESULT_JSON:
            return Path(row.outcome.result_json)
        if artifact in (
            tuning_pb2.RESULT_ARTIFACT_TUNED_MODEL,
            tuning_pb2.RESULT_ARTIFACT_UNSPECIFIED,
        ):
            return Path(row.outcome.tuned_model)
        if artifact in (
            tuning_pb2.RESULT_ARTIFACT_TUNED_WEIGHTS,
            tuning_pb2.RESULT_ARTIFACT_TUNED_CONFIG,
        ):
            if row.outcome.runtime != "openvino":
                raise OptionError(
                    f"job {job_id} shipped an ONNX model: it has no OpenVINO weights or compile "
                    "config to download"
                )
            xml = Path(row.outcome.tuned_model)
            if artifact == tuning_pb2.RESULT_ARTIFACT_TUNED_WEIGHTS:
                return xml.with_suffix(".bin")
            return config_path(xml)
        raise OptionError(f"artifact {artifact}: unknown")

import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetDaemonInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Inbox(_message.Message):
    __slots__ = ("path", "outbox", "failed")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OUTBOX_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    path: str
    outbox: str
    failed: str
    def __init__(self, path: _Optional[str] = ..., outbox: _Optional[str] = ..., failed: _Optional[str] = ...) -> None: ...

class GetDaemonInfoResponse(_message.Message):
    __slots__ = ("version", "pid", "started", "listen", "bank_path", "bank_layers", "state_dir", "inboxes", "queued_jobs", "running_jobs", "max_running_jobs", "max_queued_jobs", "max_upload_bytes", "allowed_dirs", "compile_workers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    BANK_PATH_FIELD_NUMBER: _ClassVar[int]
    BANK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    INBOXES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_DIRS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    started: _timestamp_pb2.Timestamp
    listen: _containers.RepeatedScalarFieldContainer[str]
    bank_path: str
    bank_layers: _containers.RepeatedScalarFieldContainer[str]
    state_dir: str
    inboxes: _containers.RepeatedCompositeFieldContainer[Inbox]
    queued_jobs: int
    running_jobs: int
    max_running_jobs: int
    max_queued_jobs: int
    max_upload_bytes: int
    allowed_dirs: _containers.RepeatedScalarFieldContainer[str]
    compile_workers: int
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., listen: _Optional[_Iterable[str]] = ..., bank_path: _Optional[str] = ..., bank_layers: _Optional[_Iterable[str]] = ..., state_dir: _Optional[str] = ..., inboxes: _Optional[_Iterable[_Union[Inbox, _Mapping]]] = ..., queued_jobs: _Optional[int] = ..., running_jobs: _Optional[int] = ..., max_running_jobs: _Optional[int] = ..., max_queued_jobs: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., allowed_dirs: _Optional[_Iterable[str]] = ..., compile_workers: _Optional[int] = ...) -> None: ...

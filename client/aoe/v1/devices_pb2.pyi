from aoe.v1 import bank_pb2 as _bank_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("id", "execution_provider", "description", "fingerprint", "busy", "queued_jobs", "running_job_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    execution_provider: str
    description: str
    fingerprint: _bank_pb2.DeviceFingerprint
    busy: bool
    queued_jobs: int
    running_job_id: str
    def __init__(self, id: _Optional[str] = ..., execution_provider: _Optional[str] = ..., description: _Optional[str] = ..., fingerprint: _Optional[_Union[_bank_pb2.DeviceFingerprint, _Mapping]] = ..., busy: _Optional[bool] = ..., queued_jobs: _Optional[int] = ..., running_job_id: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

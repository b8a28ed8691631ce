from aoe.v1 import bank_pb2 as _bank_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("id", "execution_provider", "description", "fingerprint", "busy", "queued_jobs", "running_job_id", "accelerator", "configured", "unusable", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    execution_provider: str
    description: str
    fingerprint: _bank_pb2.DeviceFingerprint
    busy: bool
    queued_jobs: int
    running_job_id: str
    accelerator: Accelerator
    configured: bool
    unusable: str
    versions: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., execution_provider: _Optional[str] = ..., description: _Optional[str] = ..., fingerprint: _Optional[_Union[_bank_pb2.DeviceFingerprint, _Mapping]] = ..., busy: _Optional[bool] = ..., queued_jobs: _Optional[int] = ..., running_job_id: _Optional[str] = ..., accelerator: _Optional[_Union[Accelerator, _Mapping]] = ..., configured: _Optional[bool] = ..., unusable: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Accelerator(_message.Message):
    __slots__ = ("index", "name", "compute_capability", "memory_mib", "driver_version", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    compute_capability: str
    memory_mib: int
    driver_version: str
    uuid: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., compute_capability: _Optional[str] = ..., memory_mib: _Optional[int] = ..., driver_version: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

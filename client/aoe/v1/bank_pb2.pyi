import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_EXACT: _ClassVar[Precision]
    PRECISION_INT8: _ClassVar[Precision]
    PRECISION_INT4: _ClassVar[Precision]
    PRECISION_FP16: _ClassVar[Precision]
    PRECISION_BF16: _ClassVar[Precision]
    PRECISION_LOWRANK: _ClassVar[Precision]

class MergePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MERGE_POLICY_UNSPECIFIED: _ClassVar[MergePolicy]
    MERGE_POLICY_KEEP_FASTER: _ClassVar[MergePolicy]
    MERGE_POLICY_OVERWRITE: _ClassVar[MergePolicy]
    MERGE_POLICY_KEEP_EXISTING: _ClassVar[MergePolicy]

class VerifyVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_VERDICT_UNSPECIFIED: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_CONFIRMED: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_REGRESSED: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_INACCURATE: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_SKIPPED: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_ERROR: _ClassVar[VerifyVerdict]
    VERIFY_VERDICT_INCONCLUSIVE: _ClassVar[VerifyVerdict]
PRECISION_UNSPECIFIED: Precision
PRECISION_EXACT: Precision
PRECISION_INT8: Precision
PRECISION_INT4: Precision
PRECISION_FP16: Precision
PRECISION_BF16: Precision
PRECISION_LOWRANK: Precision
MERGE_POLICY_UNSPECIFIED: MergePolicy
MERGE_POLICY_KEEP_FASTER: MergePolicy
MERGE_POLICY_OVERWRITE: MergePolicy
MERGE_POLICY_KEEP_EXISTING: MergePolicy
VERIFY_VERDICT_UNSPECIFIED: VerifyVerdict
VERIFY_VERDICT_CONFIRMED: VerifyVerdict
VERIFY_VERDICT_REGRESSED: VerifyVerdict
VERIFY_VERDICT_INACCURATE: VerifyVerdict
VERIFY_VERDICT_SKIPPED: VerifyVerdict
VERIFY_VERDICT_ERROR: VerifyVerdict
VERIFY_VERDICT_INCONCLUSIVE: VerifyVerdict

class TaskSignature(_message.Message):
    __slots__ = ("op_type", "domain", "opset", "canonical_json", "digest")
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    OPSET_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    op_type: str
    domain: str
    opset: int
    canonical_json: str
    digest: str
    def __init__(self, op_type: _Optional[str] = ..., domain: _Optional[str] = ..., opset: _Optional[int] = ..., canonical_json: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class DeviceFingerprint(_message.Message):
    __slots__ = ("execution_provider", "hardware", "isa_flags", "runtime_version", "canonical_json", "digest")
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    ISA_FLAGS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    execution_provider: str
    hardware: str
    isa_flags: _containers.RepeatedScalarFieldContainer[str]
    runtime_version: str
    canonical_json: str
    digest: str
    def __init__(self, execution_provider: _Optional[str] = ..., hardware: _Optional[str] = ..., isa_flags: _Optional[_Iterable[str]] = ..., runtime_version: _Optional[str] = ..., canonical_json: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class Strategy(_message.Message):
    __slots__ = ("name", "family", "params", "precision")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: str
    params: _containers.ScalarMap[str, str]
    precision: Precision
    def __init__(self, name: _Optional[str] = ..., family: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., precision: _Optional[_Union[Precision, str]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("median_us", "spread", "repeats", "min_us")
    MEDIAN_US_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    MIN_US_FIELD_NUMBER: _ClassVar[int]
    median_us: float
    spread: float
    repeats: int
    min_us: float
    def __init__(self, median_us: _Optional[float] = ..., spread: _Optional[float] = ..., repeats: _Optional[int] = ..., min_us: _Optional[float] = ...) -> None: ...

class Accuracy(_message.Message):
    __slots__ = ("max_abs_error", "max_rel_error", "cosine")
    MAX_ABS_ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    COSINE_FIELD_NUMBER: _ClassVar[int]
    max_abs_error: float
    max_rel_error: float
    cosine: float
    def __init__(self, max_abs_error: _Optional[float] = ..., max_rel_error: _Optional[float] = ..., cosine: _Optional[float] = ...) -> None: ...

class Provenance(_message.Message):
    __slots__ = ("host", "aoed_version", "onnxruntime_version", "created", "job_id", "model")
    HOST_FIELD_NUMBER: _ClassVar[int]
    AOED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ONNXRUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    host: str
    aoed_version: str
    onnxruntime_version: str
    created: _timestamp_pb2.Timestamp
    job_id: str
    model: str
    def __init__(self, host: _Optional[str] = ..., aoed_version: _Optional[str] = ..., onnxruntime_version: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class BankEntry(_message.Message):
    __slots__ = ("schema_version", "key", "signature", "device", "strategy", "winner", "baseline", "accuracy", "provenance")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    WINNER_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    key: str
    signature: TaskSignature
    device: DeviceFingerprint
    strategy: Strategy
    winner: Stats
    baseline: Stats
    accuracy: Accuracy
    provenance: Provenance
    def __init__(self, schema_version: _Optional[int] = ..., key: _Optional[str] = ..., signature: _Optional[_Union[TaskSignature, _Mapping]] = ..., device: _Optional[_Union[DeviceFingerprint, _Mapping]] = ..., strategy: _Optional[_Union[Strategy, _Mapping]] = ..., winner: _Optional[_Union[Stats, _Mapping]] = ..., baseline: _Optional[_Union[Stats, _Mapping]] = ..., accuracy: _Optional[_Union[Accuracy, _Mapping]] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ...) -> None: ...

class DefaultRecord(_message.Message):
    __slots__ = ("key", "default_us", "reverted", "job_id", "confirmed")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_US_FIELD_NUMBER: _ClassVar[int]
    REVERTED_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    key: str
    default_us: float
    reverted: _containers.RepeatedScalarFieldContainer[str]
    job_id: str
    confirmed: str
    def __init__(self, key: _Optional[str] = ..., default_us: _Optional[float] = ..., reverted: _Optional[_Iterable[str]] = ..., job_id: _Optional[str] = ..., confirmed: _Optional[str] = ...) -> None: ...

class TrialRecord(_message.Message):
    __slots__ = ("key", "time_ns", "trial_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    TRIAL_JSON_FIELD_NUMBER: _ClassVar[int]
    key: str
    time_ns: int
    trial_json: str
    def __init__(self, key: _Optional[str] = ..., time_ns: _Optional[int] = ..., trial_json: _Optional[str] = ...) -> None: ...

class EntryDigests(_message.Message):
    __slots__ = ("signature_digest", "device_digest", "precision")
    SIGNATURE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    signature_digest: str
    device_digest: str
    precision: Precision
    def __init__(self, signature_digest: _Optional[str] = ..., device_digest: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ...) -> None: ...

class LookupEntryRequest(_message.Message):
    __slots__ = ("key", "digests")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    key: str
    digests: EntryDigests
    def __init__(self, key: _Optional[str] = ..., digests: _Optional[_Union[EntryDigests, _Mapping]] = ...) -> None: ...

class LookupEntryResponse(_message.Message):
    __slots__ = ("found", "entry", "layer", "reason")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    found: bool
    entry: BankEntry
    layer: str
    reason: str
    def __init__(self, found: _Optional[bool] = ..., entry: _Optional[_Union[BankEntry, _Mapping]] = ..., layer: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class QueryEntriesRequest(_message.Message):
    __slots__ = ("op_type", "device_digest", "precision", "page_size", "page_token")
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    op_type: str
    device_digest: str
    precision: Precision
    page_size: int
    page_token: str
    def __init__(self, op_type: _Optional[str] = ..., device_digest: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class QueryEntriesResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[BankEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[BankEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ExportEntriesRequest(_message.Message):
    __slots__ = ("op_type", "device_digest", "precision", "entries_only", "no_history")
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_ONLY_FIELD_NUMBER: _ClassVar[int]
    NO_HISTORY_FIELD_NUMBER: _ClassVar[int]
    op_type: str
    device_digest: str
    precision: Precision
    entries_only: bool
    no_history: bool
    def __init__(self, op_type: _Optional[str] = ..., device_digest: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ..., entries_only: _Optional[bool] = ..., no_history: _Optional[bool] = ...) -> None: ...

class ExportEntriesResponse(_message.Message):
    __slots__ = ("entry", "default_record", "trial")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RECORD_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    entry: BankEntry
    default_record: DefaultRecord
    trial: TrialRecord
    def __init__(self, entry: _Optional[_Union[BankEntry, _Mapping]] = ..., default_record: _Optional[_Union[DefaultRecord, _Mapping]] = ..., trial: _Optional[_Union[TrialRecord, _Mapping]] = ...) -> None: ...

class ImportOptions(_message.Message):
    __slots__ = ("policy", "allow_foreign_devices")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FOREIGN_DEVICES_FIELD_NUMBER: _ClassVar[int]
    policy: MergePolicy
    allow_foreign_devices: bool
    def __init__(self, policy: _Optional[_Union[MergePolicy, str]] = ..., allow_foreign_devices: _Optional[bool] = ...) -> None: ...

class ImportEntriesRequest(_message.Message):
    __slots__ = ("options", "entry", "default_record", "trial")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RECORD_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    options: ImportOptions
    entry: BankEntry
    default_record: DefaultRecord
    trial: TrialRecord
    def __init__(self, options: _Optional[_Union[ImportOptions, _Mapping]] = ..., entry: _Optional[_Union[BankEntry, _Mapping]] = ..., default_record: _Optional[_Union[DefaultRecord, _Mapping]] = ..., trial: _Optional[_Union[TrialRecord, _Mapping]] = ...) -> None: ...

class RefusedEntry(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    reason: str
    def __init__(self, key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ImportCounts(_message.Message):
    __slots__ = ("added", "updated", "kept")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    added: int
    updated: int
    kept: int
    def __init__(self, added: _Optional[int] = ..., updated: _Optional[int] = ..., kept: _Optional[int] = ...) -> None: ...

class ImportEntriesResponse(_message.Message):
    __slots__ = ("added", "updated", "kept", "refused", "refused_entries", "entries", "default_records", "trials")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    added: int
    updated: int
    kept: int
    refused: int
    refused_entries: _containers.RepeatedCompositeFieldContainer[RefusedEntry]
    entries: ImportCounts
    default_records: ImportCounts
    trials: ImportCounts
    def __init__(self, added: _Optional[int] = ..., updated: _Optional[int] = ..., kept: _Optional[int] = ..., refused: _Optional[int] = ..., refused_entries: _Optional[_Iterable[_Union[RefusedEntry, _Mapping]]] = ..., entries: _Optional[_Union[ImportCounts, _Mapping]] = ..., default_records: _Optional[_Union[ImportCounts, _Mapping]] = ..., trials: _Optional[_Union[ImportCounts, _Mapping]] = ...) -> None: ...

class GetBankStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBankStatsResponse(_message.Message):
    __slots__ = ("entries", "history_trials", "layer_entries", "map_size_bytes", "used_bytes", "schema_version", "path", "defaults", "layers")
    class LayerEntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TRIALS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    history_trials: int
    layer_entries: _containers.ScalarMap[str, int]
    map_size_bytes: int
    used_bytes: int
    schema_version: int
    path: str
    defaults: int
    layers: _containers.RepeatedCompositeFieldContainer[BankLayerStats]
    def __init__(self, entries: _Optional[int] = ..., history_trials: _Optional[int] = ..., layer_entries: _Optional[_Mapping[str, int]] = ..., map_size_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., schema_version: _Optional[int] = ..., path: _Optional[str] = ..., defaults: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[BankLayerStats, _Mapping]]] = ...) -> None: ...

class BankLayerStats(_message.Message):
    __slots__ = ("name", "path", "entries", "defaults", "history_trials", "map_size_bytes", "used_bytes", "schema_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TRIALS_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    entries: int
    defaults: int
    history_trials: int
    map_size_bytes: int
    used_bytes: int
    schema_version: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., entries: _Optional[int] = ..., defaults: _Optional[int] = ..., history_trials: _Optional[int] = ..., map_size_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., schema_version: _Optional[int] = ...) -> None: ...

class PruneBankRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class PruneBankResponse(_message.Message):
    __slots__ = ("trials_removed", "entries_kept", "used_bytes_before", "used_bytes_after")
    TRIALS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_KEPT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    trials_removed: int
    entries_kept: int
    used_bytes_before: int
    used_bytes_after: int
    def __init__(self, trials_removed: _Optional[int] = ..., entries_kept: _Optional[int] = ..., used_bytes_before: _Optional[int] = ..., used_bytes_after: _Optional[int] = ...) -> None: ...

class VerifyEntriesRequest(_message.Message):
    __slots__ = ("sample_size", "op_type", "seed", "device")
    SAMPLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    sample_size: int
    op_type: str
    seed: int
    device: str
    def __init__(self, sample_size: _Optional[int] = ..., op_type: _Optional[str] = ..., seed: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class VerifyEntriesResponse(_message.Message):
    __slots__ = ("key", "op_type", "verdict", "measured_winner", "measured_baseline", "accuracy", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_WINNER_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BASELINE_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    op_type: str
    verdict: VerifyVerdict
    measured_winner: Stats
    measured_baseline: Stats
    accuracy: Accuracy
    detail: str
    def __init__(self, key: _Optional[str] = ..., op_type: _Optional[str] = ..., verdict: _Optional[_Union[VerifyVerdict, str]] = ..., measured_winner: _Optional[_Union[Stats, _Mapping]] = ..., measured_baseline: _Optional[_Union[Stats, _Mapping]] = ..., accuracy: _Optional[_Union[Accuracy, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class FollowBankRequest(_message.Message):
    __slots__ = ("after_seq", "bank_id")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    BANK_ID_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    bank_id: str
    def __init__(self, after_seq: _Optional[int] = ..., bank_id: _Optional[str] = ...) -> None: ...

class BankChange(_message.Message):
    __slots__ = ("seq", "kind", "key", "value", "committed_unix_ns")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    key: bytes
    value: bytes
    committed_unix_ns: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., committed_unix_ns: _Optional[int] = ...) -> None: ...

class FollowBankResponse(_message.Message):
    __slots__ = ("bank_id", "changes", "upto_seq", "head_seq")
    BANK_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    UPTO_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    bank_id: str
    changes: _containers.RepeatedCompositeFieldContainer[BankChange]
    upto_seq: int
    head_seq: int
    def __init__(self, bank_id: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[BankChange, _Mapping]]] = ..., upto_seq: _Optional[int] = ..., head_seq: _Optional[int] = ...) -> None: ...

class SyncBankRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: str
    def __init__(self, peer: _Optional[str] = ...) -> None: ...

class SyncBankResponse(_message.Message):
    __slots__ = ("peer_bank_id", "from_seq", "to_seq", "entries", "default_records", "trials", "refused")
    PEER_BANK_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    peer_bank_id: str
    from_seq: int
    to_seq: int
    entries: ImportCounts
    default_records: ImportCounts
    trials: ImportCounts
    refused: int
    def __init__(self, peer_bank_id: _Optional[str] = ..., from_seq: _Optional[int] = ..., to_seq: _Optional[int] = ..., entries: _Optional[_Union[ImportCounts, _Mapping]] = ..., default_records: _Optional[_Union[ImportCounts, _Mapping]] = ..., trials: _Optional[_Union[ImportCounts, _Mapping]] = ..., refused: _Optional[int] = ...) -> None: ...

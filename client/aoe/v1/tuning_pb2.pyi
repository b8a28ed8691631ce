import datetime

from aoe.v1 import bank_pb2 as _bank_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_TYPE_UNSPECIFIED: _ClassVar[JobType]
    JOB_TYPE_SGAT: _ClassVar[JobType]
    JOB_TYPE_OPAT: _ClassVar[JobType]
    JOB_TYPE_SGAT_OPAT: _ClassVar[JobType]
    JOB_TYPE_GDAT: _ClassVar[JobType]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_PREPARING: _ClassVar[JobState]
    JOB_STATE_TUNING: _ClassVar[JobState]
    JOB_STATE_VERIFYING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class LogLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_LEVEL_UNSPECIFIED: _ClassVar[LogLevel]
    LOG_LEVEL_DEBUG: _ClassVar[LogLevel]
    LOG_LEVEL_INFO: _ClassVar[LogLevel]
    LOG_LEVEL_WARNING: _ClassVar[LogLevel]
    LOG_LEVEL_ERROR: _ClassVar[LogLevel]

class ResultArtifact(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_ARTIFACT_UNSPECIFIED: _ClassVar[ResultArtifact]
    RESULT_ARTIFACT_TUNED_MODEL: _ClassVar[ResultArtifact]
    RESULT_ARTIFACT_RESULT_JSON: _ClassVar[ResultArtifact]
    RESULT_ARTIFACT_TUNED_WEIGHTS: _ClassVar[ResultArtifact]
    RESULT_ARTIFACT_TUNED_CONFIG: _ClassVar[ResultArtifact]
JOB_TYPE_UNSPECIFIED: JobType
JOB_TYPE_SGAT: JobType
JOB_TYPE_OPAT: JobType
JOB_TYPE_SGAT_OPAT: JobType
JOB_TYPE_GDAT: JobType
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_PREPARING: JobState
JOB_STATE_TUNING: JobState
JOB_STATE_VERIFYING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
LOG_LEVEL_UNSPECIFIED: LogLevel
LOG_LEVEL_DEBUG: LogLevel
LOG_LEVEL_INFO: LogLevel
LOG_LEVEL_WARNING: LogLevel
LOG_LEVEL_ERROR: LogLevel
RESULT_ARTIFACT_UNSPECIFIED: ResultArtifact
RESULT_ARTIFACT_TUNED_MODEL: ResultArtifact
RESULT_ARTIFACT_RESULT_JSON: ResultArtifact
RESULT_ARTIFACT_TUNED_WEIGHTS: ResultArtifact
RESULT_ARTIFACT_TUNED_CONFIG: ResultArtifact

class InputShape(_message.Message):
    __slots__ = ("name", "dims", "profile")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    profile: str
    def __init__(self, name: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ..., profile: _Optional[str] = ...) -> None: ...

class AccuracyBudget(_message.Message):
    __slots__ = ("min_cosine", "max_rel_error")
    MIN_COSINE_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    min_cosine: float
    max_rel_error: float
    def __init__(self, min_cosine: _Optional[float] = ..., max_rel_error: _Optional[float] = ...) -> None: ...

class JobOptions(_message.Message):
    __slots__ = ("job_type", "precision", "input_shapes", "repeat_tune", "parallel", "device", "accuracy_budget", "calibration_dir", "labels", "output_dir", "priority", "budget_s", "keep_initializer_inputs", "gdat", "dynamic_dims", "runtime")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_TYPE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPES_FIELD_NUMBER: _ClassVar[int]
    REPEAT_TUNE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_DIR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_INITIALIZER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    GDAT_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_DIMS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    job_type: JobType
    precision: _bank_pb2.Precision
    input_shapes: _containers.RepeatedCompositeFieldContainer[InputShape]
    repeat_tune: bool
    parallel: int
    device: str
    accuracy_budget: AccuracyBudget
    calibration_dir: str
    labels: _containers.ScalarMap[str, str]
    output_dir: str
    priority: int
    budget_s: float
    keep_initializer_inputs: bool
    gdat: GdatOptions
    dynamic_dims: str
    runtime: str
    def __init__(self, job_type: _Optional[_Union[JobType, str]] = ..., precision: _Optional[_Union[_bank_pb2.Precision, str]] = ..., input_shapes: _Optional[_Iterable[_Union[InputShape, _Mapping]]] = ..., repeat_tune: _Optional[bool] = ..., parallel: _Optional[int] = ..., device: _Optional[str] = ..., accuracy_budget: _Optional[_Union[AccuracyBudget, _Mapping]] = ..., calibration_dir: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., output_dir: _Optional[str] = ..., priority: _Optional[int] = ..., budget_s: _Optional[float] = ..., keep_initializer_inputs: _Optional[bool] = ..., gdat: _Optional[_Union[GdatOptions, _Mapping]] = ..., dynamic_dims: _Optional[str] = ..., runtime: _Optional[str] = ...) -> None: ...

class GdatOptions(_message.Message):
    __slots__ = ("world_size", "backend", "gradient_precision", "entry")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_PRECISION_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    backend: str
    gradient_precision: str
    entry: str
    def __init__(self, world_size: _Optional[int] = ..., backend: _Optional[str] = ..., gradient_precision: _Optional[str] = ..., entry: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("model_path", "model_id", "options")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    model_id: str
    options: JobOptions
    def __init__(self, model_path: _Optional[str] = ..., model_id: _Optional[str] = ..., options: _Optional[_Union[JobOptions, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id", "job")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job: Job
    def __init__(self, job_id: _Optional[str] = ..., job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("tasks_done", "tasks_total", "trials", "current_task", "current_op_type")
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TASK_FIELD_NUMBER: _ClassVar[int]
    CURRENT_OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    tasks_done: int
    tasks_total: int
    trials: int
    current_task: str
    current_op_type: str
    def __init__(self, tasks_done: _Optional[int] = ..., tasks_total: _Optional[int] = ..., trials: _Optional[int] = ..., current_task: _Optional[str] = ..., current_op_type: _Optional[str] = ...) -> None: ...

class RepoSummary(_message.Message):
    __slots__ = ("repo_add_num", "repo_hit_num", "repo_reserved_num", "repo_unsatisfied_num", "repo_update_num", "total_num", "repo_not_tuned_num")
    REPO_ADD_NUM_FIELD_NUMBER: _ClassVar[int]
    REPO_HIT_NUM_FIELD_NUMBER: _ClassVar[int]
    REPO_RESERVED_NUM_FIELD_NUMBER: _ClassVar[int]
    REPO_UNSATISFIED_NUM_FIELD_NUMBER: _ClassVar[int]
    REPO_UPDATE_NUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_FIELD_NUMBER: _ClassVar[int]
    REPO_NOT_TUNED_NUM_FIELD_NUMBER: _ClassVar[int]
    repo_add_num: int
    repo_hit_num: int
    repo_reserved_num: int
    repo_unsatisfied_num: int
    repo_update_num: int
    total_num: int
    repo_not_tuned_num: int
    def __init__(self, repo_add_num: _Optional[int] = ..., repo_hit_num: _Optional[int] = ..., repo_reserved_num: _Optional[int] = ..., repo_unsatisfied_num: _Optional[int] = ..., repo_update_num: _Optional[int] = ..., total_num: _Optional[int] = ..., repo_not_tuned_num: _Optional[int] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("task_id", "op_type", "node_names", "strategy", "before_us", "after_us", "improvement", "update_mode", "bank_layer", "accuracy", "error", "signature", "family", "instances", "share", "not_applied", "rejected", "attempt")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAMES_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    BEFORE_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    BANK_LAYER_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    NOT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    op_type: str
    node_names: _containers.RepeatedScalarFieldContainer[str]
    strategy: _bank_pb2.Strategy
    before_us: float
    after_us: float
    improvement: float
    update_mode: str
    bank_layer: str
    accuracy: _bank_pb2.Accuracy
    error: str
    signature: _bank_pb2.TaskSignature
    family: str
    instances: int
    share: float
    not_applied: bool
    rejected: _containers.RepeatedScalarFieldContainer[str]
    attempt: int
    def __init__(self, task_id: _Optional[str] = ..., op_type: _Optional[str] = ..., node_names: _Optional[_Iterable[str]] = ..., strategy: _Optional[_Union[_bank_pb2.Strategy, _Mapping]] = ..., before_us: _Optional[float] = ..., after_us: _Optional[float] = ..., improvement: _Optional[float] = ..., update_mode: _Optional[str] = ..., bank_layer: _Optional[str] = ..., accuracy: _Optional[_Union[_bank_pb2.Accuracy, _Mapping]] = ..., error: _Optional[str] = ..., signature: _Optional[_Union[_bank_pb2.TaskSignature, _Mapping]] = ..., family: _Optional[str] = ..., instances: _Optional[int] = ..., share: _Optional[float] = ..., not_applied: _Optional[bool] = ..., rejected: _Optional[_Iterable[str]] = ..., attempt: _Optional[int] = ...) -> None: ...

class StageBudget(_message.Message):
    __slots__ = ("stage", "given_s", "spent_s", "over_s", "counted", "device_s", "estimate_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GIVEN_S_FIELD_NUMBER: _ClassVar[int]
    SPENT_S_FIELD_NUMBER: _ClassVar[int]
    OVER_S_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    stage: str
    given_s: float
    spent_s: float
    over_s: float
    counted: bool
    device_s: float
    estimate_s: float
    def __init__(self, stage: _Optional[str] = ..., given_s: _Optional[float] = ..., spent_s: _Optional[float] = ..., over_s: _Optional[float] = ..., counted: _Optional[bool] = ..., device_s: _Optional[float] = ..., estimate_s: _Optional[float] = ...) -> None: ...

class JobBudget(_message.Message):
    __slots__ = ("budget_s", "given", "spent_s", "search_s", "session_s", "verify_s", "profile_s", "confirm_s", "load_s_per_mib", "elapsed_s", "over_s", "stages")
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    GIVEN_FIELD_NUMBER: _ClassVar[int]
    SPENT_S_FIELD_NUMBER: _ClassVar[int]
    SEARCH_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    PROFILE_S_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_PER_MIB_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    OVER_S_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    budget_s: float
    given: bool
    spent_s: float
    search_s: float
    session_s: float
    verify_s: float
    profile_s: float
    confirm_s: float
    load_s_per_mib: float
    elapsed_s: float
    over_s: float
    stages: _containers.RepeatedCompositeFieldContainer[StageBudget]
    def __init__(self, budget_s: _Optional[float] = ..., given: _Optional[bool] = ..., spent_s: _Optional[float] = ..., search_s: _Optional[float] = ..., session_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., profile_s: _Optional[float] = ..., confirm_s: _Optional[float] = ..., load_s_per_mib: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., over_s: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageBudget, _Mapping]]] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("baseline_ms", "tuned_ms", "improvement", "tuned_model_path", "result_json_path", "repo_summary", "tasks", "verdict", "shipped", "improvement_ci95_low", "improvement_ci95_high", "trials", "device_s", "tuning_time_s", "confirm_rounds", "confirmed_by", "decided_by", "precision", "job_type", "device", "notes", "calibration", "verification", "resources", "accuracy", "accuracy_budget", "session_options_json", "budget", "model_path", "details_json", "onnx", "gdat", "runtime", "runtime_options_json")
    class ResourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AccuracyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AccuracyBudgetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BASELINE_MS_FIELD_NUMBER: _ClassVar[int]
    TUNED_MS_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_FIELD_NUMBER: _ClassVar[int]
    TUNED_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_PATH_FIELD_NUMBER: _ClassVar[int]
    REPO_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_CI95_LOW_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_CI95_HIGH_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    TUNING_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    JOB_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SESSION_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    ONNX_FIELD_NUMBER: _ClassVar[int]
    GDAT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    baseline_ms: float
    tuned_ms: float
    improvement: float
    tuned_model_path: str
    result_json_path: str
    repo_summary: RepoSummary
    tasks: _containers.RepeatedCompositeFieldContainer[TaskResult]
    verdict: str
    shipped: str
    improvement_ci95_low: float
    improvement_ci95_high: float
    trials: int
    device_s: float
    tuning_time_s: float
    confirm_rounds: int
    confirmed_by: str
    decided_by: Comparison
    precision: _bank_pb2.Precision
    job_type: JobType
    device: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    calibration: str
    verification: str
    resources: _containers.ScalarMap[str, float]
    accuracy: _containers.ScalarMap[str, float]
    accuracy_budget: _containers.ScalarMap[str, float]
    session_options_json: str
    budget: JobBudget
    model_path: str
    details_json: str
    onnx: OnnxDetails
    gdat: GdatDetails
    runtime: str
    runtime_options_json: str
    def __init__(self, baseline_ms: _Optional[float] = ..., tuned_ms: _Optional[float] = ..., improvement: _Optional[float] = ..., tuned_model_path: _Optional[str] = ..., result_json_path: _Optional[str] = ..., repo_summary: _Optional[_Union[RepoSummary, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TaskResult, _Mapping]]] = ..., verdict: _Optional[str] = ..., shipped: _Optional[str] = ..., improvement_ci95_low: _Optional[float] = ..., improvement_ci95_high: _Optional[float] = ..., trials: _Optional[int] = ..., device_s: _Optional[float] = ..., tuning_time_s: _Optional[float] = ..., confirm_rounds: _Optional[int] = ..., confirmed_by: _Optional[str] = ..., decided_by: _Optional[_Union[Comparison, _Mapping]] = ..., precision: _Optional[_Union[_bank_pb2.Precision, str]] = ..., job_type: _Optional[_Union[JobType, str]] = ..., device: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ..., calibration: _Optional[str] = ..., verification: _Optional[str] = ..., resources: _Optional[_Mapping[str, float]] = ..., accuracy: _Optional[_Mapping[str, float]] = ..., accuracy_budget: _Optional[_Mapping[str, float]] = ..., session_options_json: _Optional[str] = ..., budget: _Optional[_Union[JobBudget, _Mapping]] = ..., model_path: _Optional[str] = ..., details_json: _Optional[str] = ..., onnx: _Optional[_Union[OnnxDetails, _Mapping]] = ..., gdat: _Optional[_Union[GdatDetails, _Mapping]] = ..., runtime: _Optional[str] = ..., runtime_options_json: _Optional[str] = ...) -> None: ...

class OnnxDetails(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GdatDetails(_message.Message):
    __slots__ = ("gradient_precision", "backend", "world_size", "baseline_tail_ms", "result_tail_ms", "ddp_config", "ddp_config_file", "update_mode", "bank_layer", "confirmation", "configurations", "gates", "broken_turns", "layout")
    GRADIENT_PRECISION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_TAIL_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_TAIL_MS_FIELD_NUMBER: _ClassVar[int]
    DDP_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DDP_CONFIG_FILE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    BANK_LAYER_FIELD_NUMBER: _ClassVar[int]
    CONFIRMATION_FIELD_NUMBER: _ClassVar[int]
    CONFIGURATIONS_FIELD_NUMBER: _ClassVar[int]
    GATES_FIELD_NUMBER: _ClassVar[int]
    BROKEN_TURNS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    gradient_precision: str
    backend: str
    world_size: int
    baseline_tail_ms: float
    result_tail_ms: float
    ddp_config: _struct_pb2.Struct
    ddp_config_file: str
    update_mode: str
    bank_layer: str
    confirmation: _struct_pb2.Struct
    configurations: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    gates: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    broken_turns: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    layout: _struct_pb2.Struct
    def __init__(self, gradient_precision: _Optional[str] = ..., backend: _Optional[str] = ..., world_size: _Optional[int] = ..., baseline_tail_ms: _Optional[float] = ..., result_tail_ms: _Optional[float] = ..., ddp_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., ddp_config_file: _Optional[str] = ..., update_mode: _Optional[str] = ..., bank_layer: _Optional[str] = ..., confirmation: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., configurations: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., gates: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., broken_turns: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., layout: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Comparison(_message.Message):
    __slots__ = ("subject", "against", "improvement", "improvement_ci95_low", "improvement_ci95_high")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    AGAINST_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_CI95_LOW_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_CI95_HIGH_FIELD_NUMBER: _ClassVar[int]
    subject: str
    against: str
    improvement: float
    improvement_ci95_low: float
    improvement_ci95_high: float
    def __init__(self, subject: _Optional[str] = ..., against: _Optional[str] = ..., improvement: _Optional[float] = ..., improvement_ci95_low: _Optional[float] = ..., improvement_ci95_high: _Optional[float] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "model_name", "model_path", "options", "created", "started", "finished", "progress", "result", "error", "queue_position", "source", "joined", "error_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    model_name: str
    model_path: str
    options: JobOptions
    created: _timestamp_pb2.Timestamp
    started: _timestamp_pb2.Timestamp
    finished: _timestamp_pb2.Timestamp
    progress: JobProgress
    result: JobResult
    error: str
    queue_position: int
    source: str
    joined: int
    error_kind: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., options: _Optional[_Union[JobOptions, _Mapping]] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., progress: _Optional[_Union[JobProgress, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., error: _Optional[str] = ..., queue_position: _Optional[int] = ..., source: _Optional[str] = ..., joined: _Optional[int] = ..., error_kind: _Optional[str] = ...) -> None: ...

class JobStateChange(_message.Message):
    __slots__ = ("previous", "state", "message")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    previous: JobState
    state: JobState
    message: str
    def __init__(self, previous: _Optional[_Union[JobState, str]] = ..., state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("level", "logger", "message")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOGGER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    level: LogLevel
    logger: str
    message: str
    def __init__(self, level: _Optional[_Union[LogLevel, str]] = ..., logger: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("sequence", "time", "job_id", "state_change", "progress", "task_result", "log", "result")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TASK_RESULT_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time: _timestamp_pb2.Timestamp
    job_id: str
    state_change: JobStateChange
    progress: JobProgress
    task_result: TaskResult
    log: LogLine
    result: JobResult
    def __init__(self, sequence: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_id: _Optional[str] = ..., state_change: _Optional[_Union[JobStateChange, _Mapping]] = ..., progress: _Optional[_Union[JobProgress, _Mapping]] = ..., task_result: _Optional[_Union[TaskResult, _Mapping]] = ..., log: _Optional[_Union[LogLine, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "include_logs", "after_sequence")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_LOGS_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    include_logs: bool
    after_sequence: int
    def __init__(self, job_id: _Optional[str] = ..., include_logs: _Optional[bool] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: JobEvent
    def __init__(self, event: _Optional[_Union[JobEvent, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[JobState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ModelUploadHeader(_message.Message):
    __slots__ = ("file_name", "sha256", "size_bytes")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    sha256: str
    size_bytes: int
    def __init__(self, file_name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UploadModelRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ModelUploadHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ModelUploadHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadModelResponse(_message.Message):
    __slots__ = ("model_id", "sha256", "size_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    sha256: str
    size_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class DownloadResultRequest(_message.Message):
    __slots__ = ("job_id", "artifact")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    artifact: ResultArtifact
    def __init__(self, job_id: _Optional[str] = ..., artifact: _Optional[_Union[ResultArtifact, str]] = ...) -> None: ...

class DownloadHeader(_message.Message):
    __slots__ = ("file_name", "sha256", "size_bytes")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    sha256: str
    size_bytes: int
    def __init__(self, file_name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class DownloadResultResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: DownloadHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[DownloadHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

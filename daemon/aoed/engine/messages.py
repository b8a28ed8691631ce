"""Messages: what the engine's agents and child processes say to each other.

Every request a job sends to the compile pool or to a device, every reply that comes
back, and the events a job emits are small frozen dataclasses defined here. Between
processes they travel as one JSON object per line (no pickle): `to_wire()` turns a
message into plain JSON data and `from_wire(cls, data)` checks it back into `cls`,
following the type hints, so a malformed reply fails loudly at the edge.

Requests carry their `op` name as a class variable; children dispatch on it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aoe import errors
from aoe.device import Device
from aoe.partition import Task
from aoe.signature import TaskSignature, TensorInfo
from aoe.spec import Stage
from aoed.engine.prep import Limits

__all__ = [
    "Accuracy",
    "AssembleReply",
    "AssembleRequest",
    "Build",
    "CalibrateReply",
    "CalibrateRequest",
    "Candidate",
    "CheckReply",
    "CheckRequest",
    "CompareRequest",
    "CompileReply",
    "CompileRequest",
    "VariantsReply",
    "VariantsRequest",
    "ExtractReply",
    "ExtractRequest",
    "JobEvent",
    "MeasurePlan",
    "MeasureReply",
    "MeasureRequest",
    "Measurement",
    "PingReply",
    "PingRequest",
    "PrepareReply",
    "PrepareRequest",
    "ProfileReply",
    "ProfileRequest",
    "RebuildReply",
    "RebuildRequest",
    "SamplesReply",
    "SamplesRequest",
    "error_from_wire",
    "from_wire",
    "to_wire",
]


# --------------------------------------------------------------------------- wire


def to_wire(obj: Any) -> Any:
    """`obj` as JSON data: dataclasses as objects (plus `op` for requests), paths as
    strings, tuples as lists."""
    if isinstance(obj, Device):
        return obj.to_wire()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        op = getattr(type(obj), "op", None)
        if isinstance(op, str):
            out["op"] = op
        return out
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    return obj


def _decode(tp: Any, data: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), data)
    if tp is Any:
        return data
    if origin in (tuple,):
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in data)
        return tuple(_decode(a, v) for a, v in zip(args, data, strict=True))
    if origin in (list,):
        return [_decode(typing.get_args(tp)[0], v) for v in data]
    if origin in (dict, Mapping, typing.Mapping):
        _k, v_tp = typing.get_args(tp)
        return {str(k): _decode(v_tp, v) for k, v in dict(data).items()}
    if tp is Path:
        return Path(data)
    if tp is Device:
        return Device.from_wire(data)
    if tp is Task:
        return _task(data)
    if dataclasses.is_dataclass(tp):
        return from_wire(tp, data)
    if tp is float:
        return float(data) if data is not None else float("nan")
    if tp in (int, str, bool):
        return tp(data)
    return data


def from_wire(cls: type, data: Mapping[str, Any]) -> Any:
    """Check JSON data back into the dataclass `cls`; unknown keys are ignored, missing
    ones take the field's default. Raises TypeError/ValueError/KeyError on a mismatch."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _decode(hints[f.name], data[f.name])
    return cls(**kwargs)


def _task(data: Mapping[str, Any]) -> Task:
    return Task(
        id=data["id"],
        family=data["family"],
        node_names=tuple(data["node_names"]),
        signature=from_wire(TaskSignature, data["signature"]),
        inputs=tuple(data["inputs"]),
        outputs=tuple(data["outputs"]),
        twins=[_task(t) for t in data.get("twins", [])],
    )


_ERRORS = {
    cls.__name__: cls
    for cls in (errors.OptionError, errors.ModelError, errors.BankError, errors.DeviceError, errors.CandidateError)
}


def error_from_wire(reply: Mapping[str, Any], default: type[errors.AoedError]) -> errors.AoedError:
    """The error a failed child reply reports, as the class the child raised when it is
    one of ours, else `default`."""
    cls = _ERRORS.get(str(reply.get("error_class", "")), default)
    return cls(str(reply.get("error") or "failed without a message"))


# --------------------------------------------------------------------------- compile pool


@dataclass(frozen=True)
class PrepareRequest:
    """Load, check and normalize a model; find its tunable tasks."""

    op: ClassVar[str] = "prepare"
    source: Path
    workdir: Path
    precision: str = "exact"
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    keep_initializer_inputs: bool = False
    #: which tasks to find: opat (operators), sgat (subgraphs) or sgat+opat
    job_type: str = "opat"
    #: what the model may hold (the config's [engine] limits; default: prep's MAX_*)
    limits: Limits = Limits()
    #: (device, inode) the model file must still have, with one link (JobOptions.model_file)
    model_file: tuple[int, int] | None = None
    #: the kind of device the job measures on (its strategies differ: see registry)
    device_kind: str = "cpu"


@dataclass(frozen=True)
class PrepareReply:
    prepared: Path
    inputs: dict[str, TensorInfo]
    outputs: tuple[str, ...]
    tasks: tuple[Task, ...]
    model_signature: TaskSignature
    #: integer inputs that index a table (token ids): their upper bound
    int_high: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    #: sha256 of the prepared model's files: the same model, prepared the same way
    digest: str = ""
    #: the op types of the prepared model (what an accelerator's option space depends on)
    op_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplesRequest:
    """Write the job's input samples: held back (judge, measure) and calibration."""

    op: ClassVar[str] = "samples"
    prepared: Path
    workdir: Path
    inputs: dict[str, TensorInfo]
    int_high: dict[str, int] = field(default_factory=dict)
    calibration: Path | None = None
    lossy: bool = False


@dataclass(frozen=True)
class SamplesReply:
    held_back: tuple[Path, ...]
    calibrate: tuple[Path, ...]
    source: str
    #: sha256 of the samples' arrays (names, dtypes, shapes, values), in order
    digest: str = ""


@dataclass(frozen=True)
class CalibrateRequest:
    """(min, max) of every float activation over the calibration samples."""

    op: ClassVar[str] = "calibrate"
    prepared: Path
    samples: tuple[Path, ...]
    out: Path


@dataclass(frozen=True)
class CalibrateReply:
    ranges: Path
    tensors: int


@dataclass(frozen=True)
class ExtractRequest:
    """Write each task as a standalone model with its real input activations."""

    op: ClassVar[str] = "extract"
    prepared: Path
    tasks: tuple[Task, ...]
    sample: Path
    root: Path


@dataclass(frozen=True)
class ExtractReply:
    dirs: dict[str, Path]


@dataclass(frozen=True)
class CompileRequest:
    """Build one candidate: a strategy applied to a task model, checked and loaded."""

    op: ClassVar[str] = "compile"
    task_model: Path
    family: str
    strategy: str
    prefix: str
    out: Path
    ranges: Path | None = None


@dataclass(frozen=True)
class CompileReply:
    ok: bool
    applicable: bool = True
    error: str = ""
    compile_s: float = 0.0


@dataclass(frozen=True)
class VariantsRequest:
    """Which `strategy:param` variants to try for a task: the strategy's `propose`, run
    on the task model and its real input activations (`inputs`)."""

    op: ClassVar[str] = "variants"
    task_model: Path
    family: str
    strategy: str
    prefix: str
    inputs: Path
    ranges: Path | None = None


@dataclass(frozen=True)
class VariantsReply:
    names: tuple[str, ...] = ()
    #: what the proposal measured, for the report (e.g. each Conv's error when alone int8)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Build:
    """One model to assemble: the source with `choices` (task id -> strategy) applied."""

    out: Path
    choices: dict[str, str] = field(default_factory=dict)
    #: metadata_props to set (a tuned model's session options, precision, device)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AssembleRequest:
    op: ClassVar[str] = "assemble"
    source: Path
    tasks: tuple[Task, ...]
    builds: tuple[Build, ...]
    ranges: Path | None = None


@dataclass(frozen=True)
class AssembleReply:
    sizes: dict[str, int]  # path -> bytes written (model and external data)


@dataclass(frozen=True)
class CheckRequest:
    """Do these strategies (from the bank) still apply to their tasks and twins?"""

    op: ClassVar[str] = "check"
    source: Path
    tasks: tuple[Task, ...]
    choices: dict[str, str]
    ranges: Path | None = None


@dataclass(frozen=True)
class CheckReply:
    failures: dict[str, str]  # task id -> why its strategy does not apply


@dataclass(frozen=True)
class RebuildRequest:
    """A bank entry's task rebuilt from its signature: default and strategy models."""

    op: ClassVar[str] = "rebuild"
    canonical_json: str
    digest: str
    family: str
    strategy: str
    precision: str
    workdir: Path


@dataclass(frozen=True)
class RebuildReply:
    ok: bool
    default: Path | None = None
    candidate: Path | None = None
    inputs: Path | None = None
    verdict: str = ""  # skipped | error, when not ok
    detail: str = ""


# --------------------------------------------------------------------------- device


@dataclass(frozen=True)
class PingRequest:
    """Start-up check: the device's provider is installed and answers."""

    op: ClassVar[str] = "ping"
    device: Device


@dataclass(frozen=True)
class PingReply:
    cores: int
    providers: tuple[str, ...]


@dataclass(frozen=True)
class Candidate:
    id: str
    model: Path
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MeasurePlan:
    """How candidates are measured (backends/ort/measure.py): interleaved rounds, each
    candidate taking `samples` timed batches of about `sample_s` per round, in an order
    that rotates, after a warm-up. `budget_s` bounds warm-up and rounds together: no turn
    starts after it, and samples per turn shrink so that `min_rounds` fit where they can.
    With `race`, a clear loser is dropped after `min_rounds`; with `until_stable`, the
    rounds stop once no median moved more than `rel_tol` in the last one."""

    budget_s: float = 5.0
    min_rounds: int = 8
    max_rounds: int = 25
    samples: int = 5
    sample_s: float = 0.002
    warmup_s: float = 0.02
    settle_s: float = 0.005
    rel_tol: float = 0.01
    race: bool = True
    until_stable: bool = True
    drop_margin: float = 0.05

    @classmethod
    def fixed(cls, rounds: int, budget_s: float, samples: int = 5) -> MeasurePlan:
        """Exactly `rounds` rounds (budget permitting): no racing, no early stop; what an
        A/B that reports figures needs."""
        return cls(budget_s, rounds, rounds, samples, race=False, until_stable=False)


@dataclass(frozen=True)
class MeasureRequest:
    """Measure candidates interleaved on the same inputs (see backends/ort/runner.py);
    every candidate's outputs are first compared with the `reference` candidate's."""

    op: ClassVar[str] = "measure"
    candidates: tuple[Candidate, ...]
    inputs: Path
    reference: str | None
    device: Device
    plan: MeasurePlan = field(default_factory=MeasurePlan)


@dataclass(frozen=True)
class Measurement:
    ok: bool
    error: str = ""
    dropped: bool = False
    #: why a candidate was dropped or cut short (racing, overrunning the budget)
    reason: str = ""
    median_us: float = 0.0
    spread: float = 0.0
    repeats: int = 0
    min_us: float = 0.0
    q25_us: float = 0.0
    q75_us: float = 0.0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    cosine: float = 1.0
    #: per-round medians, None where the candidate was not measured (dropped)
    rounds_us: tuple[float | None, ...] = ()

    def accuracy(self) -> dict[str, float]:
        return {"max_abs_error": self.max_abs_error, "max_rel_error": self.max_rel_error, "cosine": self.cosine}

    def summary(self) -> dict[str, Any]:
        """The fields a report keeps (no per-round data)."""
        d = to_wire(self)
        d.pop("rounds_us", None)
        return d


@dataclass(frozen=True)
class MeasureReply:
    results: dict[str, Measurement]


@dataclass(frozen=True)
class ProfileRequest:
    """Per-node run time of a model (onnxruntime's profiler)."""

    op: ClassVar[str] = "profile"
    model: Path
    inputs: Path
    workdir: Path
    device: Device
    runs: int = 10
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProfileReply:
    nodes: dict[str, float]
    total_us: float
    #: seconds the session took to load: how long a session of this model takes to make
    load_s: float = 0.0


@dataclass(frozen=True)
class CompareRequest:
    """Accuracy of `candidate` against `reference`, worst over several input files."""

    op: ClassVar[str] = "compare"
    reference: Path
    candidate: Path
    inputs: tuple[Path, ...]
    device: Device
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Accuracy:
    """Agreement with the reference over `samples` inputs: the worst of each measure,
    the 5th percentile of the cosine, and for classifier-shaped outputs ([rows, classes])
    the share of rows whose top-1 class agrees (None when there are none)."""

    max_abs_error: float
    max_rel_error: float
    cosine: float
    samples: int = 0
    cosine_p5: float = 1.0
    top1_agreement: float | None = None
    top1_rows: int = 0

    def as_dict(self) -> dict[str, float]:
        """What the accuracy gates read (worst cases)."""
        return {"max_abs_error": self.max_abs_error, "max_rel_error": self.max_rel_error, "cosine": self.cosine}

    def report(self) -> dict[str, Any]:
        """Everything, for the result document."""
        return {**self.as_dict(), "cosine_p5": self.cosine_p5, "samples": self.samples,
                "top1_agreement": self.top1_agreement, "top1_rows": self.top1_rows}  # fmt: skip


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class JobEvent:
    """What a job tells whoever watches it (a progress bar, a gRPC stream). A "stage"
    event names its `stage`: what follows it (a job's state) goes by that, never by the
    message, which is for people."""

    kind: str  # stage | progress | task | wait | log
    message: str = ""
    done: int = 0
    total: int = 0
    stage: Stage | None = None

"""Messages: what the engine's agents and child processes say to each other.

Every request a job sends to the compile pool or to a device and every reply that comes
back is a frozen msgspec Struct defined here, read back strictly: `decode` refuses an
unknown field, a missing one, or a value of the wrong type (a None where a float is
required included), naming the message type and the field's path. Requests form one
tagged union, told apart by their `op` alone, so a child reads any of its requests in
one step and never guesses between shapes. msgspec rather than cattrs: strictness
(`forbid_unknown_fields`), tagged unions and errors that name the field are what it
does by default, in C.

Between processes each message travels as one JSON object per line (no pickle): a
request inside a `Call`, its reply inside an `Answer` (the envelope: protocol.py,
re-exported here).

The client's values that messages carry (Task, TaskSignature, TensorInfo, Device) and
the engine's Limits are Structs that forbid unknown fields too, so one msgspec call
checks a message to its leaves.

The job events (`JobEvent`) never leave the engine's process: a plain dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec import field

from aoe.device import Device
from aoe.partition import Task
from aoe.signature import TaskSignature, TensorInfo
from aoe.spec import Stage
from aoed.engine.prep import Limits
from aoed.engine.protocol import (
    Answer,
    Call,
    Message,
    MessageError,
    Request,
    decode,
    encode,
    error_of,
    op_of,
)
from aoed.engine.shapeprofile import Profile

__all__ = [
    "Accuracy",
    "Answer",
    "AssembleReply",
    "AssembleRequest",
    "Build",
    "CalibrateReply",
    "CalibrateRequest",
    "Call",
    "Candidate",
    "CheckReply",
    "CheckRequest",
    "CompareRequest",
    "CompileReply",
    "CompileRequest",
    "ExtractReply",
    "ExtractRequest",
    "JobEvent",
    "MeasurePlan",
    "MeasureReply",
    "MeasureRequest",
    "Measurement",
    "Message",
    "MessageError",
    "PingReply",
    "PingRequest",
    "PointCheck",
    "PrepareReply",
    "PrepareRequest",
    "ProfileReply",
    "ProfileRequest",
    "RebuildReply",
    "RebuildRequest",
    "Request",
    "RuntimeArtifact",
    "RuntimeBuildReply",
    "RuntimeBuildRequest",
    "SamplesReply",
    "SamplesRequest",
    "VariantsReply",
    "VariantsRequest",
    "DescribeReply",
    "DescribeRequest",
    "decode",
    "encode",
    "error_of",
    "op_of",
]

# --------------------------------------------------------------------------- compile pool


class PrepareReply(Message, frozen=True):
    prepared: Path
    inputs: dict[str, TensorInfo]
    outputs: tuple[str, ...]
    tasks: tuple[Task, ...]
    model_signature: TaskSignature
    #: integer inputs that index a table (token ids): their upper bound
    int_high: dict[str, int] = {}
    notes: tuple[str, ...] = ()
    #: sha256 of the prepared model's files: the same model, prepared the same way
    digest: str = ""
    #: the op types of the prepared model (what an accelerator's option space depends on)
    op_types: tuple[str, ...] = ()
    #: the points of a model with dynamic inputs (None: static); `prepared` is fixed at
    #: its representative point, every assembled model keeps the input's dynamic axes
    profile: Profile | None = None


class PrepareRequest(Request, tag="prepare", frozen=True):
    """Load, check and normalize a model; find its tunable tasks."""

    reply = PrepareReply
    source: Path
    workdir: Path
    precision: str = "exact"
    input_shapes: dict[str, tuple[int, ...]] = {}
    keep_initializer_inputs: bool = False
    #: which tasks to find: opat (operators), sgat (subgraphs) or sgat+opat
    job_type: str = "opat"
    #: what the model may hold (the config's [engine] limits; default: prep's MAX_*)
    limits: Limits = field(default_factory=Limits)
    #: (device, inode) the model file must still have, with one link (JobRun.model_file)
    model_file: tuple[int, int] | None = None
    #: the kind of device the job measures on (its strategies differ: see registry)
    device_kind: str = "cpu"
    #: what the user gave of a dynamic model's shape profile (aoe.shapes.ShapeProfile's
    #: dims and gears); the rest is derived
    profile_dims: dict[str, str] = {}
    profile_gears: str = ""


class SamplesReply(Message, frozen=True):
    held_back: tuple[Path, ...]
    calibrate: tuple[Path, ...]
    source: str
    #: sha256 of the samples' arrays (names, dtypes, shapes, values), in order
    digest: str = ""


class SamplesRequest(Request, tag="samples", frozen=True):
    """Write the job's input samples: held back (judge, measure) and calibration."""

    reply = SamplesReply
    prepared: Path
    workdir: Path
    inputs: dict[str, TensorInfo]
    int_high: dict[str, int] = {}
    calibration: Path | None = None
    lossy: bool = False


class CalibrateReply(Message, frozen=True):
    ranges: Path
    tensors: int


class CalibrateRequest(Request, tag="calibrate", frozen=True):
    """(min, max) of every float activation over the calibration samples."""

    reply = CalibrateReply
    prepared: Path
    samples: tuple[Path, ...]
    out: Path


class ExtractReply(Message, frozen=True):
    dirs: dict[str, Path]


class ExtractRequest(Request, tag="extract", frozen=True):
    """Write each task as a standalone model with its real input activations."""

    reply = ExtractReply
    prepared: Path
    tasks: tuple[Task, ...]
    sample: Path
    root: Path


class CompileReply(Message, frozen=True):
    """A candidate built (or a strategy that does not apply to the task: not a failure).
    A build that failed is no reply: the pool raises CandidateError."""

    applicable: bool = True
    compile_s: float = 0.0


class CompileRequest(Request, tag="compile", frozen=True):
    """Build one candidate: a strategy applied to a task model, checked and loaded."""

    reply = CompileReply
    task_model: Path
    family: str
    strategy: str
    prefix: str
    out: Path
    ranges: Path | None = None


class VariantsReply(Message, frozen=True):
    names: tuple[str, ...] = ()
    #: what the proposal measured, for the report (e.g. each Conv's error when alone int8)
    notes: tuple[str, ...] = ()


class VariantsRequest(Request, tag="variants", frozen=True):
    """Which `strategy:param` variants to try for a task: the strategy's `propose`, run
    on the task model and its real input activations (`inputs`)."""

    reply = VariantsReply
    task_model: Path
    family: str
    strategy: str
    prefix: str
    inputs: Path
    ranges: Path | None = None


class DescribeReply(Message, frozen=True):
    """A task's inputs as its bank entry keeps them (engine/taskinputs.py), as params."""

    params: dict[str, str]


class DescribeRequest(Request, tag="describe", frozen=True):
    """Describe what a task was decided on: its real input activations (`inputs`) and
    the small constants of its model, inputs named in signature order (`names`)."""

    reply = DescribeReply
    task_model: Path
    inputs: Path
    names: tuple[str, ...]


class Build(Message, frozen=True):
    """One model to assemble: the source with `choices` (task id -> strategy) applied."""

    out: Path
    choices: dict[str, str] = {}
    #: metadata_props to set (a tuned model's session options, precision, device)
    metadata: dict[str, str] = {}


class PointCheck(Message, frozen=True):
    """An assembled model at one point of the shape profile, against the input model
    there: its agreement (Accuracy.as_dict's keys), or why it failed."""

    shapes: dict[str, tuple[int, ...]]
    accuracy: dict[str, float] = {}
    error: str = ""
    #: a point only checked, never measured (Profile.checks)
    checked_only: bool = False

    @property
    def ok(self) -> bool:
        return not self.error


class AssembleReply(Message, frozen=True):
    sizes: dict[str, int]  # path -> bytes written (model and external data)
    #: task id -> why its choice was left out: the model failed with it at a profile point
    refused: dict[str, str] = {}
    #: path -> the model at each point of the profile (dynamic models)
    points: dict[str, tuple[PointCheck, ...]] = {}


class AssembleRequest(Request, tag="assemble", frozen=True):
    """Whole models with chosen strategies applied. With a profile, each keeps the
    input's dynamic axes and must run at every point within `tolerance` (max relative
    error, min cosine) of the input model; a choice that fails one is left out."""

    reply = AssembleReply
    source: Path
    tasks: tuple[Task, ...]
    builds: tuple[Build, ...]
    ranges: Path | None = None
    profile: Profile | None = None
    tolerance: tuple[float, float] = (1e-3, 0.9999)
    #: the integer inputs' upper bounds (PrepareReply.int_high), for the points' inputs
    int_high: dict[str, int] = {}


class CheckReply(Message, frozen=True):
    failures: dict[str, str]  # task id -> why its strategy does not apply


class CheckRequest(Request, tag="check", frozen=True):
    """Do these strategies (from the bank, or a task's candidates) still apply to their
    tasks and twins? With a profile, each choice is also applied alone to the whole model
    (the input's dynamic axes restored), which must run at every point of the profile
    within `tolerance` of the input model (AssembleRequest's check, one choice at a
    time): a candidate that bakes the searched shape into the graph fails here."""

    reply = CheckReply
    source: Path
    tasks: tuple[Task, ...]
    choices: dict[str, str]
    ranges: Path | None = None
    profile: Profile | None = None
    tolerance: tuple[float, float] = (1e-3, 0.9999)
    int_high: dict[str, int] = {}


class RebuildReply(Message, frozen=True):
    """The entry's task rebuilt (`ok`), or the verdict on an entry that cannot be
    (skipped: its task cannot be rebuilt; error: its strategy no longer applies).
    `unlike`: why the inputs are not drawn like those the entry was decided on ("" when
    they are: engine/taskinputs.py)."""

    ok: bool
    default: Path | None = None
    candidate: Path | None = None
    inputs: Path | None = None
    verdict: str = ""  # skipped | error, when not ok
    detail: str = ""
    unlike: str = ""


class RebuildRequest(Request, tag="rebuild", frozen=True):
    """A bank entry's task rebuilt from its signature: default and strategy models."""

    reply = RebuildReply
    canonical_json: str
    digest: str
    family: str
    strategy: str
    precision: str
    workdir: Path
    #: the entry's strategy params: its description of the task's inputs among them
    params: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- device


class RuntimeArtifact(Message, frozen=True):
    """One model another runtime built (`RuntimeBuildRequest`): its name (f32, bf16,
    f16, int8, int8_bf16, int8_general), the runtime, the file it runs and the options it runs with (OpenVINO:
    compile properties); or why it could not be built."""

    name: str
    runtime: str
    model: Path | None = None
    options: dict[str, Any] = {}
    error: str = ""


class RuntimeBuildReply(Message, frozen=True):
    #: what the runtime is here (aoe.ovdevices.Offer.to_dict)
    offer: dict[str, Any]
    artifacts: tuple[RuntimeArtifact, ...] = ()
    #: why a variant asked for was not built (the CPU lacks it, the runtime is missing)
    notes: tuple[str, ...] = ()


class RuntimeBuildRequest(Request, tag="runtime_build", frozen=True):
    """Build `source` (the input model) for another runtime, in each of `variants` the
    device computes in (f32, bf16, f16; int8 calibrated on `calibrate`), under `out`."""

    reply = RuntimeBuildReply
    runtime: str
    source: Path
    out: Path
    variants: tuple[str, ...]
    calibrate: tuple[Path, ...] = ()


class PingReply(Message, frozen=True):
    cores: int
    providers: tuple[str, ...]


class PingRequest(Request, tag="ping", frozen=True):
    """Start-up check: the child answers, and a runner's device provider is installed."""

    reply = PingReply
    device: Device


class Candidate(Message, frozen=True):
    id: str
    model: Path
    options: dict[str, Any] = {}
    #: provider options that name files (TensorRT's caches: aoe.sessionopts.trt_files),
    #: from the engine's own configuration; never from `options`, which may come from data
    files: dict[str, dict[str, str]] = {}
    #: the runtime that runs it (aoed.backends.runtimes.DEPLOYED): onnxruntime, or
    #: openvino, whose `options` are compile properties (aoe.ovartifact.ALLOWED); a
    #: runtime other than onnxruntime is measured as deployed only
    runtime: str = "onnxruntime"


class MeasurePlan(Message, frozen=True):
    """How candidates are measured (backends/ort/measure.py): interleaved rounds, each
    candidate taking `samples` timed batches of about `sample_s` per round, in an order
    that rotates, after a warm-up. `budget_s` bounds warm-up and rounds together: after the
    first round no turn starts that would end past it, and samples per turn shrink so
    that `min_rounds` fit where they can. With `race`, a clear loser is dropped after
    `min_rounds`; with `until_stable`, the rounds stop once no median moved more than
    `rel_tol` in the last one. With `deployed` (on a CPU device), each candidate runs
    in a process of its own with the options `aoe.session` applies and nothing else
    (backends/ort/deployed.py), as a user deploys it; else all in the runner, with
    spinning off (runner.quiet)."""

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
    deployed: bool = False

    @classmethod
    def fixed(
        cls, rounds: int, budget_s: float, samples: int = 5, deployed: bool = False
    ) -> MeasurePlan:
        """Exactly `rounds` rounds (budget permitting): no racing, no early stop; what an
        A/B that reports figures needs."""
        return cls(
            budget_s, rounds, rounds, samples, race=False, until_stable=False, deployed=deployed
        )


class Measurement(Message, frozen=True):
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
        return {
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "cosine": self.cosine,
        }

    def summary(self) -> dict[str, Any]:
        """The fields a report keeps (no per-round data)."""
        d: dict[str, Any] = encode(self)
        d.pop("rounds_us", None)
        return d


class MeasureReply(Message, frozen=True):
    results: dict[str, Measurement]


class MeasureRequest(Request, tag="measure", frozen=True):
    """Measure candidates interleaved on the same inputs (see backends/ort/runner.py);
    every candidate's outputs are first compared with the `reference` candidate's."""

    reply = MeasureReply
    candidates: tuple[Candidate, ...]
    inputs: Path
    reference: str | None
    device: Device
    plan: MeasurePlan = field(default_factory=MeasurePlan)


class ProfileReply(Message, frozen=True):
    nodes: dict[str, float]
    total_us: float
    #: seconds the session took to load: how long a session of this model takes to make
    load_s: float = 0.0


class ProfileRequest(Request, tag="profile", frozen=True):
    """Per-node run time of a model (onnxruntime's profiler)."""

    reply = ProfileReply
    model: Path
    inputs: Path
    workdir: Path
    device: Device
    runs: int = 10
    options: dict[str, Any] = {}


class Accuracy(Message, frozen=True):
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
        return {
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "cosine": self.cosine,
        }

    def report(self) -> dict[str, Any]:
        """Everything, for the result document."""
        return {
            **self.as_dict(),
            "cosine_p5": self.cosine_p5,
            "samples": self.samples,
            "top1_agreement": self.top1_agreement,
            "top1_rows": self.top1_rows,
        }


class CompareRequest(Request, tag="compare", frozen=True):
    """Accuracy of `candidate` against `reference`, worst over several input files."""

    reply = Accuracy
    reference: Path
    candidate: Path
    inputs: tuple[Path, ...]
    device: Device
    options: dict[str, Any] = {}
    #: the candidate's runtime (Candidate.runtime); the reference runs on onnxruntime
    runtime: str = "onnxruntime"


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

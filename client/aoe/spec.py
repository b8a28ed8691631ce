"""What a tuning job is asked to do: `JobSpec`, the one shape of a job's options.

A spec is built and checked once, where it enters: `JobSpec(...)` checks every field
(`__post_init__`), so a spec that exists is one a job can run with. Each edge converts
to and from it once, as a pair:

    argparse   aoe.specargs   add_arguments / from_args / to_argv   (aoe tune, aoe submit)
    proto      aoe.wire       spec_to_pb / spec_from_pb             (the API's JobOptions)
    TOML       here           to_toml / from_toml                   (a drop folder's aoed.toml)
    JSON       here           to_dict / from_dict                   (the job store's options)

The model is not part of a spec: every edge names it apart (a positional argument, the
request's model_path or model_id, the dropped file, the job row's model_path), and the
daemon moves it (an upload becomes a kept input) while the spec stays the same.

Light on purpose (no onnx, no grpc): the CLI and the gRPC client build specs
(tests/test_light_client.py holds this).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from aoe import sizes
from aoe.device import Device
from aoe.errors import OptionError
from aoe.plain import to_plain
from aoe.shapes import ShapeError, ShapeProfile, is_static, parse_dims

__all__ = [
    "FOLDER_KEYS",
    "MAX_BUDGET_S",
    "JobSpec",
    "JobType",
    "Precision",
    "Runtime",
    "SpecError",
    "Stage",
    "check_model_kind",
    "parse_job_type",
]


class JobType(enum.StrEnum):
    """What a job tunes: operator tasks (AOE's OPAT, --job_type 2), subgraph tasks (SGAT,
    --job_type 1), or subgraphs first and operators over what they left, in one job; or
    the gradient communication of data-parallel training on PyTorch DDP (GDAT,
    AOE_MODE=4: a torch.export program, not an ONNX model)."""

    OPAT = "opat"
    SGAT = "sgat"
    SGAT_OPAT = "sgat+opat"
    GDAT = "gdat"

    @property
    def slug(self) -> str:
        """As result files spell it: aoe_result_{slug}_{ts}_{pid}.json."""
        return self.value.replace("+", "_")

    @property
    def parts(self) -> tuple[JobType, ...]:
        """The job types it runs, in order (sgat+opat: SGAT, then OPAT)."""
        return tuple(JobType(p) for p in self.value.split("+"))


class Precision(enum.StrEnum):
    """The precision policy (aoed.engine.policy): exact, or a lossy one within an accuracy
    budget."""

    EXACT = "exact"
    INT8 = "int8"
    INT4 = "int4"
    FP16 = "fp16"
    BF16 = "bf16"


class Runtime(enum.StrEnum):
    """Which runtimes a job's result may ship on: `auto` lets OpenVINO's build of the
    model compete with onnxruntime's where OpenVINO is installed (onnxruntime alone
    elsewhere, and the result says so); `onnxruntime` never starts OpenVINO;
    `openvino` needs it installed and ships on it when it passes the accuracy gate
    and beats onnxruntime's proposal."""

    AUTO = "auto"
    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"


class Stage(enum.StrEnum):
    """The stages of one job, in the order they run (some only for some jobs); the names
    of the result's budget table and of the engine's stage events."""

    PREPARE = "prepare"
    CALIBRATE = "calibrate"
    BANK = "bank"
    PROFILE = "profile"
    SEARCH = "search"
    ASSEMBLE = "assemble"
    ACCURACY = "accuracy"
    SESSION = "session"
    VERIFY = "verify"
    RUNTIME = "runtime"
    CONFIRM = "confirm"
    OUTPUTS = "outputs"


#: The job type of a job that names none: the most the tuner can find, at the tuning
#: time bench/RESULTS.md states beside OPAT's.
DEFAULT_JOB_TYPE = JobType.SGAT_OPAT
_JOB_TYPE_SPELLINGS = {
    "2": "opat",
    "1": "sgat",
    "opat+sgat": "sgat+opat",
    "1+2": "sgat+opat",
    "2+1": "sgat+opat",
    "4": "gdat",
}
#: The largest budget a user may give: a week. Past it the per-task split overflows a
#: float (1e308 s is finite, yet its shares are not).
MAX_BUDGET_S = 7 * 86400.0
#: The keys a drop folder's aoed.toml may set.
FOLDER_KEYS = (
    "budget_s",
    "input_shapes",
    "dynamic_dims",
    "job_type",
    "max_rel_error",
    "min_cosine",
    "precision",
    "priority",
    "repeat_tune",
    "runtime",
    "world_size",
    "backend",
    "gradient_precision",
)
#: GDAT's collective backends and gradient precisions (aoe.gradlayout checks them
#: again where torch is at hand).
GDAT_BACKENDS = ("gloo", "nccl", "hccl")
GRADIENT_PRECISIONS = ("exact", "fp16", "bf16", "lowrank")
#: The fields only a GDAT job reads, and the ONNX fields a GDAT job refuses (with the
#: value that means "not given").
_GDAT_FIELDS = ("world_size", "backend", "gradient_precision", "entry")
_ONNX_FIELDS: tuple[tuple[str, object], ...] = (
    ("input_shapes", {}),
    ("shape_profile", ShapeProfile()),
    ("min_cosine", None),
    ("max_rel_error", None),
    ("calibration_dir", None),
    ("keep_initializer_inputs", False),
    ("runtime", Runtime.AUTO),
    ("device", None),
)


class SpecError(OptionError):
    """A field of a spec that no job can run with. `field` is the spec's name for it and
    `detail` the rest of the message, so that an edge can name the field its own way
    (aoe tune says --budget where the API says budget_s)."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}{detail}" if detail.startswith(":") else f"{field} {detail}")
        self.field, self.detail = field, detail


def parse_job_type(raw: object, where: str = "job_type") -> JobType:
    """A job type from any of its spellings (opat or 2, sgat or 1, sgat+opat or 1+2)."""
    text = str(raw).strip().lower().replace(",", "+").replace(" ", "")
    try:
        return JobType(_JOB_TYPE_SPELLINGS.get(text, text))
    except ValueError:
        raise SpecError(
            where,
            f"{raw}: expected opat (2), sgat (1), sgat+opat (both in one job) or gdat (4: "
            "data-parallel training)",
        ) from None


def check_model_kind(
    model: str | Path, job_type: JobType, entry: str | None = None, *, daemon: bool = False
) -> None:
    """OptionError for a model file the job type does not tune: GDAT tunes a
    torch.export program (.pt2) or, with `entry`, the user's own training code (a .py
    file); the other job types an ONNX model, or a .pt2 they tune for inference as the
    ONNX model torch.onnx exports from it (aoed.engine.onnxjob). `daemon`: the job goes to a
    daemon, which runs no user code and spells the option job_type (else --job-type, as
    `aoe tune` and an embedded run do). The one statement of this rule: the CLI, the
    daemon's admission and a GDAT run each call it."""
    name = str(model)
    gdat = job_type == JobType.GDAT
    flag = "job_type" if daemon else "--job-type"
    if entry is not None and daemon:
        raise OptionError(
            f"entry {entry}: the daemon runs no user code; tune your own training code "
            "embedded (aoe tune --local --job-type gdat --entry FILE.py:FUNCTION), or export it "
            "to a .pt2 with torch.export"
        )
    if gdat and entry is not None and not name.endswith(".py"):
        raise OptionError(f"--entry {name}:{entry}: expected a .py file and a function in it")
    if gdat and entry is None and not name.endswith(".pt2"):
        raise OptionError(
            f"{name}: {flag} gdat tunes a torch.export program (.pt2, saved with "
            "torch.export.save)"
            + ("" if daemon else " or, with --entry FILE.py:FUNCTION, your own training code")
        )


def _precision(raw: object) -> Precision:
    try:
        return Precision(str(raw).strip().lower())
    except ValueError:
        raise SpecError(
            "precision", f"{raw}: not supported (choose from: {', '.join(Precision)})"
        ) from None


def _runtime(raw: object) -> Runtime:
    try:
        return Runtime(str(raw).strip().lower())
    except ValueError:
        raise SpecError(
            "runtime", f"{raw}: not supported (choose from: {', '.join(Runtime)})"
        ) from None


def _number(raw: object, name: str) -> float | None:
    """A finite number, or None for None."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SpecError(name, f"{raw!r}: expected a number")
    if not math.isfinite(raw):
        raise SpecError(name, f"{raw}: must be a finite number")
    return float(raw)


def _flag(raw: object, name: str) -> bool:
    if not isinstance(raw, bool):
        raise SpecError(name, f"{raw!r}: expected true or false")
    return raw


def _cut(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _shapes(raw: object) -> dict[str, tuple[int, ...]]:
    """{name: dims}, each a non-empty list of positive whole numbers, within the limits."""
    if not isinstance(raw, Mapping):
        raise SpecError("input_shapes", f"{raw!r}: expected a table of name = [dims]")
    if len(raw) > sizes.MAX_INPUT_SHAPES:
        raise SpecError(
            "input_shapes", f": {len(raw)} inputs, over the limit of {sizes.MAX_INPUT_SHAPES}"
        )
    out: dict[str, tuple[int, ...]] = {}
    for name, dims in raw.items():
        name = str(name)
        sizes.check_text(f"input_shapes: the input name {_cut(name)}", name, sizes.MAX_NAME_BYTES)
        if isinstance(dims, list | tuple) and len(dims) > sizes.MAX_DIMS:
            raise SpecError(
                "input shape",
                f"{_cut(name)}: {len(dims)} dimensions, over the limit of {sizes.MAX_DIMS}",
            )
        if (
            not isinstance(dims, list | tuple)
            or not dims
            or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims)
        ):
            raise SpecError(
                "input shape",
                f"{name}: dimensions must be a list of positive whole numbers, not {dims!r}",
            )
        if max(dims) > sizes.MAX_DIM:
            raise SpecError(
                "input shape",
                f"{_cut(name)}: a dimension of {max(dims)}, over the limit of {sizes.MAX_DIM} "
                "(int64, as ONNX holds dimensions)",
            )
        out[name] = tuple(dims)
    return out


def _profile(raw: object, static: Mapping[str, tuple[int, ...]]) -> ShapeProfile:
    """A ShapeProfile from itself or its plain form ({"dims": ..., "gears": ...}); an
    input is in it or in `static`, not both."""
    try:
        if isinstance(raw, Mapping):
            unknown = sorted(set(raw) - {"dims", "gears"})
            if unknown:
                raise SpecError(
                    "shape_profile", f": unknown key {unknown[0]!r} (known: dims, gears)"
                )
            raw = ShapeProfile(raw.get("dims") or {}, raw.get("gears") or "")
        if not isinstance(raw, ShapeProfile):
            raise SpecError("shape_profile", f"{raw!r}: expected dims and gears")
    except ShapeError as exc:
        raise SpecError(exc.field, exc.detail) from None
    for name in raw.dims:
        if name in static:
            raise SpecError(
                "input_shapes",
                f"{name}: given twice, as a fixed shape and as {raw.dims[name]}; keep one",
            )
    return raw


def _labels(raw: object) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        raise SpecError("labels", f"{raw!r}: expected a table of key = value")
    labels = {str(k): str(v) for k, v in raw.items()}
    if len(labels) > sizes.MAX_LABELS:
        raise SpecError("labels", f": {len(labels)} labels, over the limit of {sizes.MAX_LABELS}")
    for key, value in labels.items():
        sizes.check_text(f"labels: the key {_cut(key)}", key, sizes.MAX_LABEL_KEY_BYTES)
        sizes.check_text(f"labels[{_cut(key)}]: the value", value, sizes.MAX_LABEL_VALUE_BYTES)
    return labels


def _split_shapes(raw: object) -> tuple[dict[str, Any], dict[str, str]]:
    """(fixed shapes, a profile's dims) of an aoed.toml's input_shapes table."""
    if raw is None:
        return {}, {}
    if not isinstance(raw, Mapping):
        raise SpecError("input_shapes", f"{raw!r}: expected a table of name = [dims]")
    static: dict[str, Any] = {}
    dims: dict[str, str] = {}
    for name, value in raw.items():
        text = value if isinstance(value, str) else None
        if isinstance(value, list) and any(isinstance(d, str) or d == -1 for d in value):
            text = ",".join(str(d) for d in value)
        if text is None:
            static[name] = value
            continue
        try:
            parsed = parse_dims(text, str(name))
        except ShapeError as exc:
            raise SpecError(exc.field, exc.detail) from None
        if is_static(parsed):
            static[name] = list(parsed)
        else:
            dims[str(name)] = text
    return static, dims


@dataclass(frozen=True)
class JobSpec:
    """A job's options, checked: what to tune and how. Construct it with the values in
    any of the types the edges carry (a precision or job type as text, shapes as lists);
    the fields then hold them normalized. Raises SpecError (an OptionError) naming the
    field."""

    precision: Precision = Precision.EXACT
    job_type: JobType = DEFAULT_JOB_TYPE
    #: static shapes for inputs with dynamic dimensions (one point)
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: ranges and gears of dynamic inputs (aoe.shapes); what neither names, the daemon
    #: derives from the model
    shape_profile: ShapeProfile = field(default_factory=ShapeProfile)
    #: re-tune tasks the bank already knows
    repeat_tune: bool = False
    #: the device to measure on ("cuda:0"); None: the one the engine or daemon measures on
    device: str | None = None
    #: device seconds for search, session options, verification and the runtime
    #: comparison together; None: fitted to the model's profiled latency
    budget_s: float | None = None
    #: the end-to-end accuracy budget of a lossy precision; None: the policy's default
    min_cosine: float | None = None
    max_rel_error: float | None = None
    #: a folder of calibration samples (.npz/.npy); None: synthetic inputs
    calibration_dir: Path | None = None
    #: -10 (background) to 10 (urgent): the queue's order and the share of the device
    priority: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    #: treat initializers that old exporters list as graph inputs as real inputs
    keep_initializer_inputs: bool = False
    #: the runtimes the result may ship on (Runtime)
    runtime: Runtime = Runtime.AUTO
    #: GDAT only: ranks of the measured world (None: 2 on gloo, one per device else),
    #: the collective backend (None: gloo), the gradient precision the comm hooks may
    #: use (None: exact), and `FUNCTION` of a user's FILE.py, the model, when the job
    #: runs the user's own code (embedded runs only)
    world_size: int | None = None
    backend: str | None = None
    gradient_precision: str | None = None
    entry: str | None = None

    def __post_init__(self) -> None:
        # Sizes first: nothing repeats a value in a message before its size is known.
        set_ = object.__setattr__
        set_(self, "labels", _labels(self.labels))
        set_(self, "input_shapes", _shapes(self.input_shapes))
        set_(self, "shape_profile", _profile(self.shape_profile, self.input_shapes))
        if self.device is not None:
            sizes.check_text("device", str(self.device), sizes.MAX_NAME_BYTES)
        if self.calibration_dir is not None:
            sizes.check_text("calibration_dir", str(self.calibration_dir), sizes.MAX_PATH_BYTES)
            set_(self, "calibration_dir", Path(self.calibration_dir))
        set_(self, "precision", _precision(self.precision))
        set_(self, "runtime", _runtime(self.runtime))
        set_(self, "job_type", parse_job_type(self.job_type))
        set_(self, "repeat_tune", _flag(self.repeat_tune, "repeat_tune"))
        set_(
            self,
            "keep_initializer_inputs",
            _flag(self.keep_initializer_inputs, "keep_initializer_inputs"),
        )
        budget = _number(self.budget_s, "budget_s")
        if budget is not None and not 0 < budget <= MAX_BUDGET_S:
            raise SpecError(
                "budget_s",
                f"{budget:g}: must be a positive number of seconds, at most "
                f"{MAX_BUDGET_S:g} (a week)",
            )
        set_(self, "budget_s", budget)
        cosine, rel = (
            _number(self.min_cosine, "min_cosine"),
            _number(self.max_rel_error, "max_rel_error"),
        )
        if cosine is not None and not 0.0 < cosine <= 1.0:
            raise SpecError("min_cosine", f"{cosine}: must be in (0, 1]")
        if rel is not None and not rel > 0.0:
            raise SpecError("max_rel_error", f"{rel}: must be a finite positive number")
        set_(self, "min_cosine", cosine)
        set_(self, "max_rel_error", rel)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise SpecError("priority", f"{self.priority!r}: expected a whole number")
        if not -10 <= self.priority <= 10:
            raise SpecError("priority", f"{self.priority}: must be between -10 and 10")
        if self.device is not None:
            try:
                set_(self, "device", Device.parse(str(self.device)).name)
            except OptionError as exc:
                raise SpecError("device", str(exc).removeprefix("device ")) from None
        self._check_gdat()

    def _check_gdat(self) -> None:
        if self.job_type != JobType.GDAT:
            for name in _GDAT_FIELDS:
                if getattr(self, name) is not None:
                    raise SpecError(
                        name,
                        "applies to job_type gdat (data-parallel training), not to ONNX models",
                    )
            return
        for name, unset in _ONNX_FIELDS:
            if getattr(self, name) != unset:
                raise SpecError(name, "applies to ONNX jobs, not to job_type gdat")
        if self.precision != Precision.EXACT:
            raise SpecError(
                "precision",
                "applies to ONNX jobs, not to job_type gdat; GDAT uses gradient_precision",
            )
        n = self.world_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SpecError("world_size", f"{n!r}: must be a whole number, at least 1")
        for name, known in (
            ("backend", GDAT_BACKENDS),
            ("gradient_precision", GRADIENT_PRECISIONS),
        ):
            value = getattr(self, name)
            if value is not None:
                text = str(value).strip().lower()
                if text not in known:
                    raise SpecError(name, f"{value}: expected one of {', '.join(known)}")
                object.__setattr__(self, name, text)
        if self.entry is not None:
            entry = str(self.entry)
            sizes.check_text("entry", entry, sizes.MAX_NAME_BYTES)
            if not entry.isidentifier():
                raise SpecError("entry", f"{entry!r}: expected the name of a function")
            object.__setattr__(self, "entry", entry)

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with `changes`, checked as any spec is."""
        return dataclasses.replace(self, **changes)

    def on(self, device: str) -> JobSpec:
        """The spec with `device` where it names none."""
        return self if self.device is not None else self.replace(device=device)

    @property
    def tuning(self) -> dict[str, Any]:
        """The fields that change what a job computes (not its priority or labels): two
        submissions of one model with equal `tuning` are the same job."""
        d = self.to_dict()
        return {k: v for k, v in d.items() if k not in ("priority", "labels")}

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """Every field (None where unset) as plain data (aoe.plain: enums as their
        values, the path as text); `from_dict` reads it back. An empty shape profile is
        left out, so a spec without one keeps the layout stores held before it existed."""
        d: dict[str, Any] = to_plain(self)
        if not self.shape_profile:
            del d["shape_profile"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], keys: tuple[str, ...] | None = None) -> JobSpec:
        """A spec from `to_dict`'s keys (missing ones take their defaults; an empty
        calibration_dir or device is unset, as older stores kept them). `keys`: the
        keys allowed, else every field's. SpecError naming an unknown key or a bad
        value."""
        known = keys if keys is not None else tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise SpecError(repr(unknown[0]), f": unknown key (known: {', '.join(known)})")
        values = {k: v for k, v in d.items() if v is not None}
        for name in ("calibration_dir", "device"):
            if values.get(name) == "":
                del values[name]
        return cls(**values)

    # ------------------------------------------------------------------ TOML

    def to_toml(self) -> str:
        """The drop-folder keys (FOLDER_KEYS) of the spec as an aoed.toml; `from_toml`
        reads it back. Unset keys are left out."""
        d = self.to_dict()
        shaped = ("input_shapes", "dynamic_dims")
        table = {k: d[k] for k in FOLDER_KEYS if k not in shaped and d[k] is not None}
        shapes: dict[str, Any] = {**d["input_shapes"], **self.shape_profile.dims}
        if shapes:
            table["input_shapes"] = shapes
        if self.shape_profile.gears:
            table["dynamic_dims"] = self.shape_profile.gears
        return tomli_w.dumps(table)

    @classmethod
    def from_toml(cls, table: Mapping[str, Any]) -> JobSpec:
        """A spec from an aoed.toml's table (as tomllib parsed it): FOLDER_KEYS only. An
        input of input_shapes is fixed (a list of sizes) or a profile's (text, or a list
        with ranges "lo~hi" or -1: aoe.shapes); dynamic_dims are the gears."""
        values = dict(table)
        unknown = sorted(set(values) - set(FOLDER_KEYS))
        if unknown:
            raise SpecError(repr(unknown[0]), f": unknown key (known: {', '.join(FOLDER_KEYS)})")
        shapes, gears = values.pop("input_shapes", None), values.pop("dynamic_dims", None)
        static, dims = _split_shapes(shapes)
        if gears is not None and not isinstance(gears, str):
            raise SpecError("dynamic_dims", f'{gears!r}: expected text such as "1,16;4,64"')
        if dims or gears:
            values["shape_profile"] = {"dims": dims, "gears": gears or ""}
        if static:
            values["input_shapes"] = static
        return cls.from_dict(values)

"""Graph preparation: from a user's .onnx file to the normalized model the tuner works on.

    load (external data only from beside the model; modelio) -> limits (bytes, nodes,
    names, declared tensor sizes) -> normalize (aoe.graph: legacy fixes, unique node
    names, shape overrides, check, shape inference) -> limits on inferred sizes -> save

The normalization is the one compilers run before a bank lookup, so the signatures the
tuner stores are the ones they compute. Nothing is folded: the prepared model keeps
every weight as the input had it. Runs in a compile worker (see backends/ort/worker.py),
never in the engine's own process; the worker also loads the result into onnxruntime
and runs it once, so a model the runtime refuses fails here with a clear error.

The limits are checked before the work they bound: a hostile file must end in a
ModelError that names it and the limit, never in an allocation that takes the worker
(or the machine) down.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import onnx
from onnx import helper

from aoe.config import Config
from aoe.errors import ModelError, OptionError
from aoe.graph import normalize
from aoe.shapes import ShapeProfile
from aoe.signature import ModelContext, TensorInfo
from aoed.engine.memory import check_fits
from aoed.engine.modelio import load_model, save_model, subgraphs
from aoed.engine.shapeprofile import Profile, resolve

__all__ = [
    "MAX_MODEL_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NODES",
    "MAX_TENSOR_BYTES",
    "Limits",
    "Prepared",
    "check_declared",
    "make_inputs",
    "prepare",
]

# What a model may hold, by default; the config's [engine] max_model_mb, max_nodes and
# max_tensor_mb change them (`Limits.of`), for `aoe tune` and the daemon's jobs alike.
#: The model file and its external data together.
MAX_MODEL_BYTES = 8 << 30
#: Nodes in all of a model's graphs, subgraphs included.
MAX_NODES = 200_000
#: One tensor as declared or inferred: an input, an initializer, an activation.
MAX_TENSOR_BYTES = 4 << 30
#: One name (of a node, a tensor, a graph): every message and report repeats names.
MAX_NAME_CHARS = 4096


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one model may hold; every message about a limit names the setting that sets it.
    A msgspec Struct: it crosses into the compile pool inside PrepareRequest."""

    model_bytes: int = MAX_MODEL_BYTES
    nodes: int = MAX_NODES
    tensor_bytes: int = MAX_TENSOR_BYTES
    name_chars: int = MAX_NAME_CHARS
    #: the address space a worker may use, MiB (0: no limit), and why it is that: a model
    #: whose estimated peak (memory.job_need_mb) is more is refused before it is read
    memory_mb: int = 0
    memory_why: str = "[engine] worker_memory_mb"

    @classmethod
    def of(cls, config: Config) -> Limits:
        """The limits `config` sets ([engine] max_model_mb, max_nodes, max_tensor_mb, and
        the workers' memory once the engine has derived it)."""
        return cls(
            config.max_model_mb << 20,
            config.max_nodes,
            config.max_tensor_mb << 20,
            memory_mb=config.worker_memory_mb or 0,
            memory_why=config.sources.get("worker_memory_mb", "[engine] worker_memory_mb"),
        )


@dataclass
class Prepared:
    source: Path
    model: onnx.ModelProto  # normalized: static shapes, unique names
    path: Path  # where the prepared model is saved
    inputs: dict[str, TensorInfo]  # what a caller feeds (true graph inputs)
    outputs: list[str]
    ctx: ModelContext
    notes: list[str] = field(default_factory=list)
    #: the points a model with dynamic inputs is tuned at (None: its inputs are static);
    #: `model` is fixed at its representative point
    profile: Profile | None = None


def profile_of(
    model: onnx.ModelProto,
    static: Mapping[str, tuple[int, ...]],
    given: ShapeProfile,
    source: str,
) -> Profile | None:
    """The shape profile of `model` as loaded (shapeprofile.resolve); where the user
    fixed a dynamic input at one shape, the derived points are kept as checks, so that
    the tuned model, which keeps the input's dynamic axes, is known to run at them."""
    profile = resolve(model, static, given, source)
    if profile is None or not static:
        return profile
    derived = resolve(model, {}, given, source)
    extra = tuple(p for p in derived.points if p not in profile.points) if derived else ()
    return msgspec.structs.replace(profile, checks=extra)


def prepare(
    source: str | os.PathLike[str],
    workdir: str | os.PathLike[str],
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    keep_initializer_inputs: bool = False,
    limits: Limits = Limits(),
    expect: tuple[int, int] | None = None,
    shape_profile: ShapeProfile | None = None,
) -> Prepared:
    """Load, check and normalize the model at `source`; save it as `workdir/prepared.onnx`.
    With `expect`, the model file read must be that (device, inode), with one link. A
    model with dynamic inputs is prepared at its shape profile's representative point
    (`shape_profile`: what the user gave of it; the rest is derived).

    Raises ModelError (the model is at fault, or over one of `limits`) or OptionError
    (an override is wrong). Blocking and CPU-bound.
    """
    src = Path(source)
    # Messages name the file as the user named it, as load_model's do (a daemon's copy of
    # a model lies in its own folders under the name it was given).
    name = src.name

    def fits(model_bytes: int) -> None:
        check_fits(name, model_bytes, limits.memory_mb, limits.memory_why)

    model = load_model(
        src,
        max_bytes=limits.model_bytes,
        max_nodes=limits.nodes,
        settings=("[engine] max_model_mb", "[engine] max_nodes"),
        fits=fits,
        expect=expect,
    )
    check_declared(model, name, limits)
    static = dict(input_shapes or {})
    profile = profile_of(model, static, shape_profile or ShapeProfile(), name)
    dropped: list[str] = []
    if profile is not None:
        profile = _points_within(model, profile, name, limits, dropped)
    norm = normalize(
        model,
        {**profile.point, **static} if profile is not None else static,
        keep_initializer_inputs=keep_initializer_inputs,
        strict=True,
        source=name,
    )
    model = norm.model
    if profile is not None:
        # normalize says each dynamic dimension was fixed by --input-shape: where no
        # flag did, the profile fixed it, which its own note says
        derived = [k for k in profile.point if k not in static]
        norm.notes[:] = [
            n for n in norm.notes if not any(n.startswith(f"input {k!r}: dynamic") for k in derived)
        ]
        norm.notes.append(profile.describe())
        norm.notes.extend(dropped)
    _check_inferred(model, name, input_shapes or {}, limits)
    out = Path(workdir) / "prepared.onnx"
    save_model(model, out)
    inits = {t.name for t in model.graph.initializer}
    ctx = ModelContext(model)
    inputs = {}
    for i in model.graph.input:
        if i.name in inits:
            continue
        if i.name not in ctx.tensors:
            raise ModelError(
                f"{name}: input {i.name!r} has no static shape and type after inference"
            )
        inputs[i.name] = ctx.tensors[i.name]
        if np.dtype(inputs[i.name].dtype).kind not in "fiub":
            raise ModelError(
                f"{name}: input {i.name!r} is a tensor of {inputs[i.name].dtype}; the tuner can make up "
                "data only for numeric and boolean inputs"
            )
    return Prepared(
        source=src,
        model=model,
        path=out,
        inputs=inputs,
        outputs=[o.name for o in model.graph.output],
        ctx=ctx,
        notes=norm.notes,
        profile=profile,
    )


def _points_within(
    model: onnx.ModelProto, profile: Profile, source: str, limits: Limits, notes: list[str]
) -> Profile:
    """`profile` less its derived points where an input would be over the tensor limit
    (each dropped with a note in `notes`). OptionError naming the input and the limit
    when the point is one the user gave, or the one the model is prepared at."""
    elem = {
        i.name: i.type.tensor_type.elem_type
        for i in model.graph.input
        if i.type.HasField("tensor_type")
    }
    keep: list[dict[str, tuple[int, ...]]] = []
    checks: list[dict[str, tuple[int, ...]]] = []
    measured = len(profile.points)
    for k, point in enumerate(profile.checked):
        why = next(
            (
                w
                for n, dims in point.items()
                if n in elem and (w := _too_big("input", n, elem[n], list(dims), source, limits))
            ),
            None,
        )
        if why is None:
            (keep if k < measured else checks).append(point)
        elif k == profile.representative or (k < measured and not profile.derived):
            raise OptionError(f"--input-shape: {why.removeprefix(source + ': ')}")
        else:
            notes.append(f"shape profile: a point left out: {why.removeprefix(source + ': ')}")
    return msgspec.structs.replace(
        profile,
        points=tuple(keep),
        checks=tuple(checks),
        representative=keep.index(profile.point),
    )


def _names(g: onnx.GraphProto) -> Iterator[tuple[str, str | bytes]]:
    yield "graph", g.name
    for vi in (*g.input, *g.output, *g.value_info):
        yield "tensor", vi.name
    for t in g.initializer:
        yield "initializer", t.name
    for node in g.node:
        yield "node", node.name
        yield "operator", node.op_type
        yield "domain", node.domain
        for name in (*node.input, *node.output):
            yield f"tensor (of node {node.name!r})", name
        for a in node.attribute:
            yield f"attribute (of node {node.name!r})", a.name


def _size(n: int) -> str:
    for unit, shift in (("EiB", 60), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _declared_bytes(elem_type: int, dims: list[int]) -> tuple[int, str] | None:
    """(bytes, dtype name) of a tensor of these dims, unknown dimensions counted as 1
    (so it is a lower bound); None for a type onnx does not know (the checker says so).
    Python integers: a product past 2^63 is a number, not an overflow."""
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(max(d, 1) for d in dims) * max(dtype.itemsize, 1), str(dtype)


def _value_dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim]


def _too_big(
    what: str, name: str, elem_type: int, dims: list[int], source: str, limits: Limits
) -> str | None:
    got = _declared_bytes(elem_type, dims)
    if got is None or got[0] <= limits.tensor_bytes:
        return None
    return (
        f"{source}: {what} {name!r} has shape {list(dims)} ({_size(got[0])} of {got[1]}), over the limit of "
        f"{_size(limits.tensor_bytes)} per tensor ([engine] max_tensor_mb)"
    )


#: Element types stored two to a byte (raw_data) or two to an int32_data entry.
_PACKED = {
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
    getattr(onnx.TensorProto, "FLOAT4E2M1", -1),
}


def _stored_mismatch(t: onnx.TensorProto) -> str | None:
    """What is wrong with a constant tensor's stored data against its dims, or None.
    onnx's checker leaves this alone and numpy_helper.to_array then fails with a bare
    ValueError (a reshape, or segments) wherever a constant is read. Counted from the
    field lengths alone: no array is made. External data is read in by then
    (`load_model`); strings and unknown types are left to the checker."""
    if t.HasField("segment"):
        return "is stored in segments, which onnx cannot read"
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        field_name = helper.tensor_dtype_to_field(t.data_type)
    except (KeyError, TypeError, ValueError):
        return None
    if t.data_type == onnx.TensorProto.STRING or t.data_location == onnx.TensorProto.EXTERNAL:
        return None
    n = math.prod(t.dims)
    if t.HasField("raw_data"):
        want, got, unit = (
            ((n + 1) // 2 if t.data_type in _PACKED else n * dtype.itemsize),
            len(t.raw_data),
            "bytes",
        )
    else:
        per = 2 if dtype.kind == "c" else 1
        want, got, unit = (
            ((n + 1) // 2 if t.data_type in _PACKED else n * per),
            len(getattr(t, field_name)),
            "values",
        )
    if want == got:
        return None
    return f"has shape {list(t.dims)} of {dtype} ({want} {unit}) but stores {got} {unit}"


def _constants(g: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """The graph's own constant tensors: initializers and tensor attributes of its nodes."""
    for t in g.initializer:
        yield f"initializer {t.name!r}", t
    for node in g.node:
        for a in node.attribute:
            for t in [a.t] if a.type == onnx.AttributeProto.TENSOR else list(a.tensors):
                yield f"attribute {a.name!r} of node {node.name!r}", t


def check_declared(model: onnx.ModelProto, source: str, limits: Limits = Limits()) -> None:
    """Refuse what the file itself declares beyond `limits`, before anything sizes an
    array by it or repeats it in a message: no outputs; a name that is not UTF-8 (onnx's
    proto2 strings come back as bytes then) or longer than the name limit; an input,
    output, initializer or annotated tensor over the tensor limit; a constant whose
    stored data does not match its shape; a default-domain opset newer than onnx knows.
    ModelError naming the file and the name."""
    if not model.graph.output:
        raise ModelError(
            f"{source}: the model has no outputs, so there is nothing to run, time or check"
        )
    newest = onnx.defs.onnx_opset_version()
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version > newest:
            raise ModelError(
                f"{source}: default-domain opset {o.version} is newer than any this installation knows "
                f"({newest}); export the model with opset {newest} or older"
            )
    for g in subgraphs(model.graph):
        for what, name in _names(g):
            if isinstance(name, bytes):
                raise ModelError(
                    f"{source}: {what} name {name[:40]!r} is not valid UTF-8; rename it"
                )
            if len(name) > limits.name_chars:
                raise ModelError(
                    f"{source}: {what} name {name[:24]!r}... is {len(name)} characters long, over the "
                    f"limit of {limits.name_chars} characters"
                )
        for t in g.initializer:
            if why := _too_big("initializer", t.name, t.data_type, list(t.dims), source, limits):
                raise ModelError(why)
        for what, t in _constants(g):
            if why := _stored_mismatch(t):
                raise ModelError(
                    f"{source}: {what} {why}; the file is damaged or was written wrong"
                )
        for what, values in (("input", g.input), ("output", g.output), ("tensor", g.value_info)):
            for vi in values:
                dims = _value_dims(vi)
                elem = vi.type.tensor_type.elem_type
                if dims is not None and (
                    why := _too_big(what, vi.name, elem, dims, source, limits)
                ):
                    raise ModelError(why)


def _check_inferred(
    model: onnx.ModelProto, source: str, overrides: Mapping[str, tuple[int, ...]], limits: Limits
) -> None:
    """The same size limit on what shape inference and --input-shape made static: an
    override that makes an input too big is the option's fault (OptionError)."""
    g = model.graph
    for vi in g.input:
        dims = _value_dims(vi)
        elem = vi.type.tensor_type.elem_type
        if dims is not None and (why := _too_big("input", vi.name, elem, dims, source, limits)):
            if vi.name in overrides:
                raise OptionError(f"--input-shape {vi.name}: {why.removeprefix(source + ': ')}")
            raise ModelError(why)
    producers = None
    for vi in (*g.value_info, *g.output):
        dims = _value_dims(vi)
        elem = vi.type.tensor_type.elem_type
        if dims is None or not (why := _too_big("tensor", vi.name, elem, dims, source, limits)):
            continue
        producers = producers or {o: n.name for n in g.node for o in n.output}
        raise ModelError(f"{why} (inferred, the output of node {producers.get(vi.name, '?')!r})")


def make_inputs(
    inputs: Mapping[str, TensorInfo], seed: int = 0, int_high: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Deterministic inputs for every model input: normal floats, non-negative ints below
    `int_high[name]` (default 8)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, info in inputs.items():
        dt = np.dtype(info.dtype)
        if dt.kind == "f":
            feeds[name] = rng.standard_normal(info.shape).astype(dt)
        elif dt.kind in "iu":
            high = (int_high or {}).get(name, 8)
            feeds[name] = rng.integers(0, high, size=info.shape).astype(dt)
        elif dt.kind == "b":
            feeds[name] = rng.integers(0, 2, size=info.shape).astype(bool)
        else:
            raise ModelError(
                f"input {name!r} has dtype {dt}, which the tuner cannot generate data for"
            )
    return feeds

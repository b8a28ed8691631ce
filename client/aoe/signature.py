"""Canonical task signatures and device fingerprints: the one truth for bank keys.

A *task* is a small connected group of ONNX nodes (an anchor operator such as MatMul or
Conv, plus the elementwise epilogue fused with it). Its signature says everything that
decides how fast it can run and nothing else: op types, domains, opsets, attributes
normalized against their schema defaults, the wiring between the nodes, the shapes and
dtypes of inputs and outputs, and which inputs are constant. Tensor *names* and weight
*values* are left out, so the same layer in two models has one signature.

A *device fingerprint* names what the measurement was made on: execution provider and its
options, CPU model and ISA flags, and the runtime version. A bank entry is only ever
applied where both digests match.

Both are pure functions of their inputs; this module imports neither trio nor
onnxruntime, so compilers can compute keys in-process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import helper

__all__ = [
    "SCHEMA_VERSION",
    "DeviceFingerprint",
    "ModelContext",
    "TaskSignature",
    "TensorInfo",
    "bank_key",
    "canonical_json",
    "computes_constant",
    "device_fingerprint",
    "task_signature",
]

#: Version of the signature/key layout; part of every bank key.
SCHEMA_VERSION = 1

# ISA features that change which kernels a runtime picks on x86 and Arm CPUs.
_ISA_FLAGS = frozenset(
    {
        "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c",
        "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16",
        "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
        "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16",
    }
)  # fmt: skip


def canonical_json(obj: object) -> str:
    """Return the one JSON spelling of `obj`: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class TensorInfo:
    """Element type name (numpy spelling) and static shape of one tensor."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TaskSignature:
    op_type: str
    domain: str
    opset: int
    canonical_json: str
    digest: str


@dataclass(frozen=True)
class DeviceFingerprint:
    execution_provider: str
    hardware: str
    isa_flags: tuple[str, ...]
    runtime_version: str
    options: Mapping[str, str] = field(default_factory=dict)
    canonical_json: str = ""
    digest: str = ""


def bank_key(signature_digest: str, device_digest: str, precision: str) -> bytes:
    """Return the LMDB key of a task on a device under a precision policy.

    Layout: schema version, 128 bits of each digest, the policy; readable ASCII so that
    `mdb_dump` and exports stay diffable.
    """
    return (
        f"v{SCHEMA_VERSION}/{signature_digest[:32]}/{device_digest[:32]}/{precision}".encode()
    )


# --------------------------------------------------------------------------- signatures


def _dtype_name(elem_type: int) -> str:
    return str(helper.tensor_dtype_to_np_dtype(elem_type))


def _value_info(vi: onnx.ValueInfoProto) -> TensorInfo | None:
    t = vi.type.tensor_type
    if not t.HasField("shape") or t.elem_type == 0:
        return None
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return TensorInfo(_dtype_name(t.elem_type), tuple(dims))


#: Standard ops whose outputs differ between runs with the same inputs.
_RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


def computes_constant(node: onnx.NodeProto, constants: set[str] | frozenset[str]) -> bool:
    """True when every output of `node` is a function of `constants` alone: a standard,
    deterministic op without subgraphs whose (non-empty) inputs are all constant."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS:
        return False
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    ins = [i for i in node.input if i]
    return bool(ins) and all(i in constants for i in ins)


class ModelContext:
    """What a signature needs to know about a node's surroundings in its model.

    Built once per model: static tensor infos (graph inputs, outputs, value_info,
    initializers, Constant node outputs), the set of constant tensor names (stored, or
    computed by nodes from constants; see `computes_constant`) and the model's opset
    imports.
    """

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.opsets: dict[str, int] = {o.domain or "": o.version for o in model.opset_import}
        if "ai.onnx" in self.opsets:
            self.opsets.setdefault("", self.opsets["ai.onnx"])
        self.tensors: dict[str, TensorInfo] = {}
        for vi in [*g.input, *g.output, *g.value_info]:
            info = _value_info(vi)
            if info is not None:
                self.tensors[vi.name] = info
        # An initializer also listed as a graph input is only a default value: callers
        # may feed it, so it is not a constant.
        inputs = {i.name for i in g.input}
        self.constants: set[str] = set()
        for init in g.initializer:
            if init.name not in inputs:
                self.constants.add(init.name)
            self.tensors.setdefault(init.name, TensorInfo(_dtype_name(init.data_type), tuple(init.dims)))
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                self.constants.add(node.output[0])
                for a in node.attribute:
                    if a.name == "value":
                        self.tensors[node.output[0]] = TensorInfo(
                            _dtype_name(a.t.data_type), tuple(a.t.dims)
                        )
            elif computes_constant(node, self.constants):
                # A weight a node computes from constants (a Transpose, Reshape, Cast or
                # DequantizeLinear of an initializer) is as constant as a stored one; the
                # graph is not folded (see aoe.graph), so this is how tasks see it.
                self.constants.update(o for o in node.output if o)

    def opset(self, domain: str) -> int:
        return self.opsets.get(domain or "", 1)


_A = onnx.AttributeProto
_INT, _INTS, _FLOAT, _FLOATS = _A.INT, _A.INTS, _A.FLOAT, _A.FLOATS
_STRING, _STRINGS = _A.STRING, _A.STRINGS


def _round7(v: float) -> float:
    # Seven significant digits: the spelling existing bank keys were made with.
    return float(f"{v:.7g}")


def _attr_value(attr: onnx.AttributeProto) -> object:
    """The value of `attr` as signatures spell it: strings decoded, floats rounded to 7
    significant digits, tensors and graphs as a hash of their bytes."""
    # Fast paths for the kinds real models use, reading the field directly. They return
    # what helper.get_attribute_value and the general spelling below return: the helper
    # picks the field by `attr.type` alone (a list copy for repeated fields), and raises
    # for a reference to a function's attribute, so references take the general path.
    if not attr.ref_attr_name:
        kind = attr.type
        if kind == _INT:
            return attr.i
        if kind == _INTS:
            return list(attr.ints)
        if kind == _FLOAT:
            return _round7(attr.f)
        if kind == _FLOATS:
            return [_round7(v) for v in attr.floats]
        if kind == _STRING:
            return attr.s.decode("utf-8", "replace")
        if kind == _STRINGS:
            return [v.decode("utf-8", "replace") for v in attr.strings]
    return _attr_value_general(attr)


def _attr_value_general(attr: onnx.AttributeProto) -> object:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float):
        return _round7(value)
    if isinstance(value, onnx.TensorProto):
        return {"tensor": hashlib.sha256(value.SerializeToString()).hexdigest()[:32]}
    if isinstance(value, list):
        return [_attr_value_scalar(v) for v in value]
    if isinstance(value, onnx.GraphProto):
        return {"graph": hashlib.sha256(value.SerializeToString()).hexdigest()[:32]}
    return value


def _attr_value_scalar(v: object) -> object:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, float):
        return _round7(v)
    return v


@functools.lru_cache(maxsize=1024)
def _schema_defaults(op_type: str, domain: str, opset: int) -> Mapping[str, object]:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # unknown or contrib op: no defaults to normalize against
        return {}
    defaults = {}
    for name, attr in schema.attributes.items():
        if attr.default_value is not None and attr.default_value.type != 0:
            defaults[name] = _attr_value(attr.default_value)
    return defaults


def normalized_attributes(node: onnx.NodeProto, opset: int) -> dict[str, object]:
    """Attributes of `node` without those equal to their schema default."""
    return _normalized(node.attribute, _schema_defaults(node.op_type, node.domain or "", opset))


def _normalized(
    attrs: Iterable[onnx.AttributeProto], defaults: Mapping[str, object]
) -> dict[str, object]:
    out = {}
    for a in attrs:
        name = a.name
        value = _attr_value(a)
        # Python equality: an INT 1 where the schema says FLOAT 1.0 is the default.
        if name in defaults and defaults[name] == value:
            continue
        out[name] = value
    return out


def task_signature(nodes: Sequence[onnx.NodeProto], ctx: ModelContext) -> TaskSignature:
    """Return the canonical signature of the task made of `nodes` (in topological order).

    Raises ValueError when a tensor the task reads or writes has no static shape in `ctx`.
    """
    produced: dict[str, str] = {}
    for j, node in enumerate(nodes):
        for k, out in enumerate(node.output):
            if out:
                produced[out] = f"n{j}.{k}"
    inputs: list[str] = []
    refs: dict[str, str] = {}
    desc_nodes = []
    for node in nodes:
        wiring = []
        for name in node.input:
            if not name:
                wiring.append("")
            elif name in produced and _index(produced[name]) < len(desc_nodes):
                wiring.append(produced[name])
            else:
                if name not in refs:
                    refs[name] = f"i{len(inputs)}"
                    inputs.append(name)
                wiring.append(refs[name])
        domain = node.domain if node.domain != "ai.onnx" else ""
        desc_nodes.append(
            {
                "op": node.op_type,
                "domain": domain,
                "attrs": normalized_attributes(node, ctx.opset(domain)),
                "in": wiring,
            }
        )
    # Tasks are built so that only the last node's outputs escape (see engine.partition).
    outputs = [o for o in nodes[-1].output if o]
    desc = {
        "v": SCHEMA_VERSION,
        "nodes": desc_nodes,
        "opsets": {d: ctx.opset(d) for d in sorted({n["domain"] for n in desc_nodes})},
        "inputs": [_tensor_desc(n, ctx, const=n in ctx.constants) for n in inputs],
        "outputs": [_tensor_desc(n, ctx) for n in outputs],
    }
    text = canonical_json(desc)
    anchor = nodes[0]
    domain = anchor.domain if anchor.domain != "ai.onnx" else ""
    return TaskSignature(
        op_type="+".join(n.op_type for n in nodes),
        domain=domain,
        opset=ctx.opset(domain),
        canonical_json=text,
        digest=_digest(text),
    )


def _index(ref: str) -> int:
    return int(ref[1:].split(".")[0])


def _tensor_desc(name: str, ctx: ModelContext, const: bool = False) -> dict[str, object]:
    info = ctx.tensors.get(name)
    if info is None:
        raise ValueError(f"tensor {name!r} has no static shape")
    d: dict[str, object] = {"dtype": info.dtype, "shape": list(info.shape)}
    if const:
        d["const"] = True
    return d


# --------------------------------------------------------------------------- devices


def _cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and model in ("", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or "unknown", tuple(sorted(flags & _ISA_FLAGS))


def _runtime_version() -> str:
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        for dist in ("onnxruntime-gpu", "onnxruntime-cann", "onnxruntime-openvino"):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return "unknown"


@functools.lru_cache(maxsize=16)
def _fingerprint(execution_provider: str, options_json: str) -> DeviceFingerprint:
    hardware, flags = _cpu_model_and_flags()
    options = json.loads(options_json)
    desc = {
        "ep": execution_provider,
        "hardware": hardware,
        "isa": list(flags),
        "runtime": _runtime_version(),
        "options": options,
    }
    text = canonical_json(desc)
    return DeviceFingerprint(
        execution_provider=execution_provider,
        hardware=hardware,
        isa_flags=flags,
        runtime_version=desc["runtime"],
        options=options,
        canonical_json=text,
        digest=_digest(text),
    )


def device_fingerprint(
    execution_provider: str | None = None, options: Mapping[str, str] | None = None
) -> DeviceFingerprint:
    """Return the fingerprint of this machine's `execution_provider` (default: the CPU's;
    cached per process).

    `options` are the provider options that change which implementation runs (for CPU:
    none; for CUDA e.g. the device model), so a change to them changes the digest.
    """
    if execution_provider is None:
        from aoe.device import CPU  # aoe.device maps device kinds to providers; it imports us

        execution_provider = CPU.provider
    return _fingerprint(execution_provider, canonical_json(dict(options or {})))

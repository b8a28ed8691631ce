"""Canonical task signatures: the one truth for the task half of bank keys.

A *task* is a small connected group of ONNX nodes (an anchor operator such as MatMul or
Conv, plus the elementwise epilogue fused with it). Its signature says everything that
decides how fast it can run and nothing else: op types, domains, opsets, attributes
normalized against their schema defaults, the wiring between the nodes, the shapes and
dtypes of inputs and outputs, and which inputs are constant. Tensor *names* and weight
*values* are left out, so the same layer in two models has one signature.

The device half, what a measurement was made on, is `aoe.fingerprint`'s
(`device_fingerprint`, re-exported here); a bank entry is only ever applied where both
digests match.

A signature is a pure function of its nodes and their model; this module imports
neither trio nor onnxruntime, so compilers can compute keys in-process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import onnx
from onnx import helper

# Device fingerprints are aoe.fingerprint's; the key, the values it names and their JSON
# spelling live in the light aoe.keys. All are re-exported here, where bank keys were
# always imported from.
from aoe.fingerprint import device_fingerprint
from aoe.keys import SCHEMA_VERSION, DeviceFingerprint, TaskSignature, bank_key, canonical_json
from aoe.keys import digest as _digest

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

#: How json.dumps(ensure_ascii=True) spells a str (the C speedup where there is one).
_json_str = json.encoder.encode_basestring_ascii


def _json_float(f: float) -> str:
    # json spells a float by float.__repr__, but NaN and the infinities.
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def _json_int(i: object) -> str:
    # json spells an int by int.__repr__; an opset of any other type goes to json itself.
    return repr(i) if type(i) is int else canonical_json(i)


_SCHEMA_VERSION_JSON = canonical_json(SCHEMA_VERSION)


class TensorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Element type name (numpy spelling) and static shape of one tensor."""

    dtype: str
    shape: tuple[int, ...]


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
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)


def computes_constant(node: onnx.NodeProto, constants: set[str] | frozenset[str]) -> bool:
    """True when every output of `node` is a function of `constants` alone: a standard,
    deterministic op without subgraphs whose (non-empty) inputs are all constant."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS:
        return False
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    ):
        return False
    ins = [i for i in node.input if i]
    return bool(ins) and all(i in constants for i in ins)


class ModelContext:
    """What a signature needs to know about a node's surroundings in its model.

    Built once per model: static tensor infos (graph inputs, outputs, value_info,
    initializers, Constant node outputs), the set of constant tensor names (stored, or
    computed by nodes from constants; see `computes_constant`) and the model's opset
    imports. It also keeps the canonical JSON of the tensor infos signatures have used.
    """

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        # Name -> the info and its JSON without and with "const" (see `_tensor_json`).
        self._tensor_json: dict[str, tuple[TensorInfo, str, str]] = {}
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
            self.tensors.setdefault(
                init.name, TensorInfo(_dtype_name(init.data_type), tuple(init.dims))
            )
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
    return _attr_value_json(attr)[0]


def _attr_value_json(attr: onnx.AttributeProto) -> tuple[object, str | None]:
    """`_attr_value(attr)` and its canonical JSON, or None where json must spell it."""
    # Fast paths for the kinds real models use, reading the field directly. They return
    # what helper.get_attribute_value and the general spelling below return: the helper
    # picks the field by `attr.type` alone (a list copy for a repeated field, which a
    # slice makes in one call), and raises for a reference to a function's attribute, so
    # references take the general path. The JSON is json's own spelling of these types
    # (see `_json_float`); for a list of ints, repr's differs only by a space after each
    # comma.
    if not attr.ref_attr_name:
        kind = attr.type
        if kind == _INT:
            i = attr.i
            return i, repr(i)
        if kind == _INTS:
            ints = attr.ints[:]
            return ints, repr(ints).replace(" ", "")
        if kind == _FLOAT:
            f = _round7(attr.f)
            return f, _json_float(f)
        if kind == _FLOATS:
            floats = [_round7(v) for v in attr.floats[:]]
            return floats, "[" + ",".join(map(_json_float, floats)) + "]"
        if kind == _STRING:
            s = attr.s.decode("utf-8", "replace")
            return s, _json_str(s)
        if kind == _STRINGS:
            strings = [v.decode("utf-8", "replace") for v in attr.strings[:]]
            return strings, "[" + ",".join(map(_json_str, strings)) + "]"
    return _attr_value_general(attr), None


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
    defaults = _schema_defaults(node.op_type, node.domain or "", opset)
    return {name: value for name, (value, _) in _normalized(node.attribute, defaults).items()}


def _normalized(
    attrs: Iterable[onnx.AttributeProto], defaults: Mapping[str, object]
) -> dict[str, tuple[object, str | None]]:
    """Name -> value and JSON (see `_attr_value_json`) of the attributes not at their
    default; a later attribute of the same name replaces an earlier one."""
    out = {}
    for a in attrs:
        name = a.name
        value, spelled = _attr_value_json(a)
        # Python equality: an INT 1 where the schema says FLOAT 1.0 is the default.
        if name in defaults and defaults[name] == value:
            continue
        out[name] = (value, spelled)
    return out


def _attributes_json(attrs: dict[str, tuple[object, str | None]]) -> str:
    # Names differ, so sorting the items never compares the values.
    return (
        "{"
        + ",".join(
            [
                _json_str(name) + ":" + (canonical_json(value) if spelled is None else spelled)
                for name, (value, spelled) in sorted(attrs.items())
            ]
        )
        + "}"
    )


#: Attribute kinds `_attr_value_json` spells itself.
_SPELLED_KINDS = frozenset({_INT, _INTS, _FLOAT, _FLOATS, _STRING, _STRINGS})
#: Attributes serialized larger than this are not worth keeping as cache keys.
_MAX_CACHED_BYTES = 256


def _serialized(attrs: Sequence[onnx.AttributeProto]) -> tuple[bytes, ...] | None:
    """The serialized `attrs` when all are small and of kinds `_attr_value_json` spells."""
    out = []
    for a in attrs:
        if a.type not in _SPELLED_KINDS:
            return None
        data = a.SerializeToString()
        if len(data) > _MAX_CACHED_BYTES:
            return None
        out.append(data)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _attributes_json_of(
    op_type: str, node_domain: str, opset: int, serialized: tuple[bytes, ...]
) -> str:
    """The canonical JSON of the attributes `serialized` (see `_serialized`) of an
    `op_type` node of `node_domain` at `opset`, without those at their default.

    A function of its arguments alone (parsing an attribute gives back every field a
    signature reads), so it is cached: layers repeat their attributes (every 3x3
    convolution with padding 1), and serializing attributes costs less than reading them
    field by field. Reading raises for a reference to a function's attribute, as before.
    """
    attrs = [onnx.AttributeProto.FromString(data) for data in serialized]
    return _attributes_json(_normalized(attrs, _schema_defaults(op_type, node_domain or "", opset)))


def task_signature(nodes: Sequence[onnx.NodeProto], ctx: ModelContext) -> TaskSignature:
    """Return the canonical signature of the task made of `nodes` (in topological order).

    Raises ValueError when a tensor the task reads or writes has no static shape in `ctx`.
    """
    # The canonical text is canonical_json of
    #   {"v": SCHEMA_VERSION,
    #    "nodes": [{"op": ..., "domain": ..., "attrs": {...}, "in": [wiring refs]}, ...],
    #    "opsets": {domain: opset}, "inputs": [tensor], "outputs": [tensor]}
    # spelled here piece by piece, keys in sorted order, each value as json spells it.
    # Reading a protobuf field costs more than anything else here, so each is read once,
    # and repeated fields by slicing, which copies them in one call.
    anchor_domain = nodes[0].domain  # IndexError for an empty task, as ever
    fields = [(node, node.input[:], node.output[:]) for node in nodes]
    produced: dict[str, tuple[int, str]] = {}  # tensor -> index and wiring ref of its writer
    for j, (_, _, outs) in enumerate(fields):
        for k, out in enumerate(outs):
            if out:
                produced[out] = (j, f'"n{j}.{k}"')
    inputs: list[str] = []
    refs: dict[str, str] = {}
    opsets: dict[str, int] = {}
    op_types = []
    described = []
    for i, (node, ins, _) in enumerate(fields):
        wiring = []
        for name in ins:
            if not name:
                wiring.append('""')
                continue
            writer = produced.get(name)
            if writer is not None and writer[0] < i:
                wiring.append(writer[1])
                continue
            ref = refs.get(name)
            if ref is None:
                ref = refs[name] = f'"i{len(inputs)}"'
                inputs.append(name)
            wiring.append(ref)
        op_type, node_domain = node.op_type, node.domain
        domain = node_domain if node_domain != "ai.onnx" else ""
        opset = opsets.get(domain)
        if opset is None:
            opset = opsets[domain] = ctx.opset(domain)
        defaults, middle, tail = _op_json(op_type, node_domain, opset)
        spelled, deferred = "{}", None
        if node.attribute:
            attrs = node.attribute[:]
            serialized = _serialized(attrs)
            if serialized is not None:
                spelled = _attributes_json_of(op_type, node_domain, opset, serialized)
            else:
                deferred = _normalized(attrs, defaults)
        op_types.append(op_type)
        described.append((spelled, deferred, middle, wiring, tail))
    # Tasks are built so that only the last node's outputs escape (see engine.partition).
    outputs = [o for o in fields[-1][2] if o]
    # As when json spelled a dict of it all: first every tensor is looked up (a tensor
    # without a static shape raises ValueError), then what json may reject is spelled in
    # its key order (inputs, nodes, opsets, outputs), so the same value raises TypeError.
    constants = ctx.constants
    tensors_in = [_tensor_json(n, ctx, n in constants) for n in inputs]
    tensors_out = [_tensor_json(n, ctx, False) for n in outputs]
    inputs_json = ",".join([t if type(t) is str else canonical_json(t) for t in tensors_in])
    nodes_json = ",".join(
        [
            '{"attrs":'
            + (spelled if deferred is None else _attributes_json(deferred))
            + middle
            + ",".join(wiring)
            + tail
            for spelled, deferred, middle, wiring, tail in described
        ]
    )
    opsets_json = ",".join([_json_str(d) + ":" + _json_int(opsets[d]) for d in sorted(opsets)])
    outputs_json = ",".join([t if type(t) is str else canonical_json(t) for t in tensors_out])
    text = (
        f'{{"inputs":[{inputs_json}],"nodes":[{nodes_json}],"opsets":{{{opsets_json}}},'
        f'"outputs":[{outputs_json}],"v":{_SCHEMA_VERSION_JSON}}}'
    )
    domain = anchor_domain if anchor_domain != "ai.onnx" else ""
    return TaskSignature(
        op_type="+".join(op_types),
        domain=domain,
        opset=opsets[domain],
        canonical_json=text,
        digest=_digest(text),
    )


@functools.lru_cache(maxsize=1024)
def _op_json(op_type: str, node_domain: str, opset: int) -> tuple[Mapping[str, object], str, str]:
    """The schema defaults of an op, and the canonical JSON of a node of it around its
    attributes and wiring: '{"attrs":' ATTRIBUTES MIDDLE WIRING TAIL."""
    domain = node_domain if node_domain != "ai.onnx" else ""
    defaults = _schema_defaults(op_type, node_domain or "", opset)
    return defaults, f',"domain":{_json_str(domain)},"in":[', f'],"op":{_json_str(op_type)}}}'


def _tensor_json(name: str, ctx: ModelContext, const: bool) -> str | dict[str, object]:
    """The canonical JSON of tensor `name`; for a TensorInfo holding other types than a
    ModelContext makes (a str, ints), its description, for json to spell or reject."""
    info = ctx.tensors.get(name)
    if info is None:
        raise ValueError(f"tensor {name!r} has no static shape")
    # Spelled once per name, and again only when `ctx.tensors` holds another info for it.
    cached = ctx._tensor_json.get(name)
    if cached is None or cached[0] is not info:
        dtype, shape = info.dtype, list(info.shape)
        if type(dtype) is not str or not all(type(d) is int for d in shape):
            desc: dict[str, object] = {"dtype": dtype, "shape": shape}
            if const:
                desc["const"] = True
            return desc
        # Keys in sorted order: "const", "dtype", "shape"; repr of a list of ints is
        # json's spelling but for a space after each comma.
        spelled = f'"dtype":{_json_str(dtype)},"shape":{repr(shape).replace(" ", "")}}}'
        cached = ctx._tensor_json[name] = (info, "{" + spelled, '{"const":true,' + spelled)
    return cached[2] if const else cached[1]

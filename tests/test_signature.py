"""Tests for task signatures, device fingerprints and bank keys (aoe.signature)."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper, shape_inference

from aoe.partition import partition
from aoe.signature import (
    ModelContext,
    TaskSignature,
    TensorInfo,
    bank_key,
    device_fingerprint,
    normalized_attributes,
    task_signature,
)
from aoed import samples
from aoed.engine.prep import Prepared, prepare

_NP = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, int, list[int]]],
    output: str,
    consts: dict[str, np.ndarray],
) -> onnx.ModelProto:
    """A checked, shape-inferred opset 17 model; the output's type is left to inference."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(output, inputs[0][1], None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def _layer(
    prefix: str,
    x: str,
    k: int = 16,
    n: int = 32,
    dtype: int = TensorProto.FLOAT,
    seed: int = 0,
    act: str = "Relu",
    **act_attrs: object,
) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray], str]:
    """MatMul + bias Add + activation, with names under `prefix`; returns nodes, consts, output."""
    rng = np.random.default_rng(seed)
    w, b = f"{prefix}_w", f"{prefix}_b"
    consts = {
        w: rng.standard_normal((k, n)).astype(_NP[dtype]),
        b: rng.standard_normal(n).astype(_NP[dtype]),
    }
    nodes = [
        helper.make_node("MatMul", [x, w], [f"{prefix}_mm"], name=f"{prefix}/mm"),
        helper.make_node("Add", [f"{prefix}_mm", b], [f"{prefix}_add"], name=f"{prefix}/add"),
        helper.make_node(
            act, [f"{prefix}_add"], [f"{prefix}_y"], name=f"{prefix}/act", **act_attrs
        ),
    ]
    return nodes, consts, f"{prefix}_y"


def _layer_signature(
    prefix: str = "a", k: int = 16, dtype: int = TensorProto.FLOAT, seed: int = 0, **kw: object
) -> TaskSignature:
    nodes, consts, out = _layer(prefix, f"{prefix}_in", k=k, dtype=dtype, seed=seed, **kw)
    model = _model(nodes, [(f"{prefix}_in", dtype, [4, k])], out, consts)
    return task_signature(list(model.graph.node), ModelContext(model))


def test_same_layer_in_two_models_has_one_digest() -> None:
    # Model one: the layer alone, reading the graph input.
    nodes, consts, out = _layer("first", "x", seed=1)
    one = _model(nodes, [("x", TensorProto.FLOAT, [4, 16])], out, consts)
    # Model two: other names, other weights, and a node in front of the layer.
    pre = helper.make_node("Sigmoid", ["features"], ["features_sig"], name="pre")
    nodes2, consts2, out2 = _layer("encoder.block7.linear", "features_sig", seed=2)
    two = _model([pre, *nodes2], [("features", TensorProto.FLOAT, [4, 16])], out2, consts2)
    assert not np.array_equal(consts["first_w"], consts2["encoder.block7.linear_w"])

    sig1 = task_signature(list(one.graph.node), ModelContext(one))
    sig2 = task_signature(list(two.graph.node)[1:], ModelContext(two))
    assert sig1.digest == sig2.digest
    assert sig1.canonical_json == sig2.canonical_json
    assert sig1.op_type == "MatMul+Add+Relu"
    assert sig1.opset == 17
    assert re.fullmatch(r"[0-9a-f]{64}", sig1.digest)
    # Names and values stay out of the canonical text.
    for name in ("first", "encoder", "x"):
        assert f'"{name}' not in sig1.canonical_json


@pytest.mark.parametrize(
    ("base", "changed"),
    [
        ({}, {"k": 24}),
        ({}, {"dtype": TensorProto.DOUBLE}),
        ({"act": "LeakyRelu", "alpha": 0.1}, {"act": "LeakyRelu", "alpha": 0.2}),
    ],
    ids=["shape", "dtype", "attribute"],
)
def test_shape_dtype_and_attribute_change_the_digest(base: dict, changed: dict) -> None:
    assert _layer_signature(**base).digest == _layer_signature(seed=9, **base).digest
    assert _layer_signature(**changed).digest != _layer_signature(**base).digest


def _gemm_signature(**attrs: object) -> str:
    w = np.ones((8, 8), np.float32)
    node = helper.make_node("Gemm", ["x", "w"], ["y"], name="gemm", **attrs)
    model = _model([node], [("x", TensorProto.FLOAT, [4, 8])], "y", {"w": w})
    return task_signature([model.graph.node[0]], ModelContext(model)).digest


def test_attribute_at_schema_default_equals_omitted() -> None:
    plain = _gemm_signature()
    assert _gemm_signature(alpha=1.0) == plain
    assert _gemm_signature(alpha=1.0, beta=1.0, transA=0, transB=0) == plain
    # A value other than the default counts (same shapes: the weight is square).
    assert _gemm_signature(transB=1) != plain
    assert _gemm_signature(alpha=0.5) != plain


def test_constant_and_graph_input_weight_differ() -> None:
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    x = ("x", TensorProto.FLOAT, [4, 8])
    const = _model([node], [x], "y", {"w": np.ones((8, 8), np.float32)})
    fed = _model([node], [x, ("w", TensorProto.FLOAT, [8, 8])], "y", {})
    sig_const = task_signature([const.graph.node[0]], ModelContext(const))
    sig_fed = task_signature([fed.graph.node[0]], ModelContext(fed))
    assert sig_const.digest != sig_fed.digest
    assert '"const":true' in sig_const.canonical_json
    assert '"const":true' not in sig_fed.canonical_json


def test_dynamic_shape_raises_value_error() -> None:
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    model = _model([node], [("x", TensorProto.FLOAT, ["batch", 8])], "y", {})
    with pytest.raises(ValueError, match="'x'"):
        task_signature([model.graph.node[0]], ModelContext(model))


def test_device_fingerprint_is_stable_and_names_runtime_and_ep() -> None:
    fp = device_fingerprint()
    again = device_fingerprint("CPUExecutionProvider", {})
    assert again.digest == fp.digest
    assert again.canonical_json == fp.canonical_json
    desc = json.loads(fp.canonical_json)
    assert desc["runtime"] == ort.__version__
    assert desc["ep"] == "CPUExecutionProvider"
    assert ort.__version__ in fp.canonical_json
    assert fp.runtime_version == ort.__version__
    assert re.fullmatch(r"[0-9a-f]{64}", fp.digest)


def test_device_options_and_ep_change_the_digest() -> None:
    base = device_fingerprint()
    opt = device_fingerprint("CPUExecutionProvider", {"device_model": "X"})
    opt2 = device_fingerprint("CPUExecutionProvider", {"device_model": "Y"})
    other_ep = device_fingerprint("CUDAExecutionProvider")
    assert len({base.digest, opt.digest, opt2.digest, other_ep.digest}) == 4
    assert json.loads(opt.canonical_json)["options"] == {"device_model": "X"}
    assert dict(opt.options) == {"device_model": "X"}


def test_bank_key_layout() -> None:
    sig = _layer_signature()
    dev = device_fingerprint()
    key = bank_key(sig.digest, dev.digest, "exact")
    assert isinstance(key, bytes)
    assert re.fullmatch(rb"v1/[0-9a-f]{32}/[0-9a-f]{32}/exact", key)
    assert key == f"v1/{sig.digest[:32]}/{dev.digest[:32]}/exact".encode()
    assert bank_key(sig.digest, dev.digest, "int8") != key


# --------------------------------------------------------------------------- equivalence
#
# Signatures key existing banks, so `task_signature` must keep producing the very bytes it
# always has. What follows is a plain copy of the algorithm as it stood before it was made
# faster (helper.get_attribute_value, a dict, json.dumps); the fast code is checked against
# it on every task of every sample model, on hand-built nodes and on generated attributes.


def _ref_attr_value(attr: onnx.AttributeProto) -> object:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float):
        return float(f"{value:.7g}")
    if isinstance(value, onnx.TensorProto):
        return {"tensor": hashlib.sha256(value.SerializeToString()).hexdigest()[:32]}
    if isinstance(value, list):
        return [_ref_attr_value_scalar(v) for v in value]
    if isinstance(value, onnx.GraphProto):
        return {"graph": hashlib.sha256(value.SerializeToString()).hexdigest()[:32]}
    return value


def _ref_attr_value_scalar(v: object) -> object:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, float):
        return float(f"{v:.7g}")
    return v


def _ref_schema_defaults(op_type: str, domain: str, opset: int) -> dict[str, object]:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        return {}
    defaults = {}
    for name, attr in schema.attributes.items():
        if attr.default_value is not None and attr.default_value.type != 0:
            defaults[name] = _ref_attr_value(attr.default_value)
    return defaults


def _ref_normalized_attributes(node: onnx.NodeProto, opset: int) -> dict[str, object]:
    defaults = _ref_schema_defaults(node.op_type, node.domain or "", opset)
    out = {}
    for a in node.attribute:
        value = _ref_attr_value(a)
        if a.name in defaults and defaults[a.name] == value:
            continue
        out[a.name] = value
    return out


def _ref_tensor_desc(name: str, ctx: ModelContext, const: bool = False) -> dict[str, object]:
    info = ctx.tensors.get(name)
    if info is None:
        raise ValueError(f"tensor {name!r} has no static shape")
    d: dict[str, object] = {"dtype": info.dtype, "shape": list(info.shape)}
    if const:
        d["const"] = True
    return d


def _ref_task_signature(nodes: list[onnx.NodeProto], ctx: ModelContext) -> TaskSignature:
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
            elif name in produced and int(produced[name][1:].split(".")[0]) < len(desc_nodes):
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
                "attrs": _ref_normalized_attributes(node, ctx.opset(domain)),
                "in": wiring,
            }
        )
    outputs = [o for o in nodes[-1].output if o]
    desc = {
        "v": 1,
        "nodes": desc_nodes,
        "opsets": {d: ctx.opset(d) for d in sorted({n["domain"] for n in desc_nodes})},
        "inputs": [_ref_tensor_desc(n, ctx, const=n in ctx.constants) for n in inputs],
        "outputs": [_ref_tensor_desc(n, ctx) for n in outputs],
    }
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    anchor = nodes[0]
    domain = anchor.domain if anchor.domain != "ai.onnx" else ""
    return TaskSignature(
        op_type="+".join(n.op_type for n in nodes),
        domain=domain,
        opset=ctx.opset(domain),
        canonical_json=text,
        digest=hashlib.sha256(text.encode("ascii")).hexdigest(),
    )


def _outcome(fn, *args: object) -> object:
    """What `fn(*args)` returns, or the type and message of what it raises."""
    try:
        return fn(*args)
    except Exception as e:  # a failure must be the same failure
        return (type(e), str(e))


def assert_same_as_reference(nodes: list[onnx.NodeProto], ctx: ModelContext) -> object:
    """Check `task_signature` against the reference on `nodes`; return the outcome."""
    want = _outcome(_ref_task_signature, nodes, ctx)
    got = _outcome(task_signature, nodes, ctx)
    assert got == want, [n.op_type for n in nodes]
    return got


def assert_same_attributes_as_reference(node: onnx.NodeProto, ctx: ModelContext) -> None:
    """Check `normalized_attributes` (the engine uses it too) against the reference."""
    opset = ctx.opset(node.domain if node.domain != "ai.onnx" else "")
    want = _outcome(_ref_normalized_attributes, node, opset)
    got = _outcome(normalized_attributes, node, opset)
    # repr tells 1 from 1.0 and -0.0 from 0.0, and a NaN equals a NaN
    assert repr(got) == repr(want), node.op_type


@pytest.fixture(scope="module")
def prepared_samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Prepared]:
    """Every sample model, prepared as the tuner prepares it."""
    d = tmp_path_factory.mktemp("samples")
    out = {}
    for name in samples.SAMPLES:
        path = samples.save(samples.build(name), d / f"{name}.onnx")
        out[name] = prepare(path, d / f"prep-{name}")
    return out


@pytest.mark.parametrize("name", sorted(samples.SAMPLES))
def test_every_sample_task_has_the_reference_signature(
    prepared_samples: dict[str, Prepared], name: str
) -> None:
    prep = prepared_samples[name]
    by_name = {n.name: n for n in prep.model.graph.node}
    tasks = [t for rep in partition(prep.model, prep.ctx) for t in (rep, *rep.twins)]
    assert tasks
    for t in tasks:
        chain = [by_name[n] for n in t.node_names]
        want = _ref_task_signature(chain, prep.ctx)
        assert t.signature == want, t.id
        # Again on the same context, where caches are warm.
        assert task_signature(chain, prep.ctx) == want, t.id


@pytest.mark.parametrize("name", sorted(samples.SAMPLES))
def test_every_run_of_sample_nodes_has_the_reference_outcome(
    prepared_samples: dict[str, Prepared], name: str
) -> None:
    # Not only tasks: every run of one to three consecutive nodes, whatever its ops,
    # attributes and shapes, gives the same signature or the same error as the reference.
    prep = prepared_samples[name]
    nodes = list(prep.model.graph.node)
    signed = 0
    for size in (1, 2, 3):
        for i in range(len(nodes) - size + 1):
            signed += isinstance(
                assert_same_as_reference(nodes[i : i + size], prep.ctx), TaskSignature
            )
    assert signed > 0
    for node in nodes:
        assert_same_attributes_as_reference(node, prep.ctx)


def _hand_ctx() -> ModelContext:
    """A context for hand-built nodes: float [2, 3] tensors x, y, t, out, out2, an int64
    scalar s, a constant w, a tensor `dyn` without a static shape, and three domains."""
    static = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y", "t")]
    graph = helper.make_graph(
        [],
        "hand",
        [*static, helper.make_tensor_value_info("dyn", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("out", "out2")],
        initializer=[
            numpy_helper.from_array(np.ones((3, 3), np.float32), "w"),
            numpy_helper.from_array(np.array(3, np.int64), "s"),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    ctx = ModelContext(helper.make_model(graph, opset_imports=opsets))
    # Infos a ModelContext never makes, but a caller may put there.
    ctx.tensors["float_dim"] = TensorInfo("float32", (2.0, 3))
    ctx.tensors["bool_dim"] = TensorInfo("float32", (True, 3))
    ctx.tensors["np_dim"] = TensorInfo("float32", (np.int64(2), 3))
    ctx.tensors["np_dtype"] = TensorInfo(np.dtype("float32"), (2, 3))
    ctx.tensors["no_shape"] = TensorInfo("float32", None)
    return ctx


_A = onnx.AttributeProto
INT, FLOAT, STRING = _A.INT, _A.FLOAT, _A.STRING
INTS, FLOATS, STRINGS = _A.INTS, _A.FLOATS, _A.STRINGS


def _attr(name: str, kind: int, value: object = None) -> onnx.AttributeProto:
    """An AttributeProto of exactly `kind` (str values are UTF-8 encoded)."""
    a = onnx.AttributeProto(name=name, type=kind)
    if kind == INT:
        a.i = value
    elif kind == FLOAT:
        a.f = value
    elif kind == STRING:
        a.s = value.encode() if isinstance(value, str) else value
    elif kind == INTS:
        a.ints.extend(value)
    elif kind == FLOATS:
        a.floats.extend(value)
    elif kind == STRINGS:
        a.strings.extend(v.encode() if isinstance(v, str) else v for v in value)
    return a


def _node(
    op: str, ins: list[str], outs: list[str], *attrs: onnx.AttributeProto, domain: str = ""
) -> onnx.NodeProto:
    node = helper.make_node(op, ins, outs, domain=domain or None)
    node.attribute.extend(attrs)
    return node


def _one(
    op: str, *attrs: onnx.AttributeProto, ins: tuple[str, ...] = ("x",), domain: str = ""
) -> list[onnx.NodeProto]:
    """A task of one node reading `ins` and writing `out`."""
    return [_node(op, list(ins), ["out"], *attrs, domain=domain)]


def _made(name: str, value: object, kind: int | None = None) -> onnx.AttributeProto:
    return helper.make_attribute(name, value, attr_type=kind)


_TENSOR = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "v")
_INDICES = numpy_helper.from_array(np.array([0], np.int64))
_BRANCH = helper.make_graph(
    [helper.make_node("Identity", ["x"], ["b"])],
    "branch",
    [],
    [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])],
)
_ROUNDING = [1 / 3, 0.1, 0.01, 1e-5, 1e-7, 123456789.0, 3.4028234663852886e38, 1e-45, -0.0, 0.0]
_SPECIAL = [float("nan"), float("inf"), float("-inf")]
_TEXT = ["", "SAME_UPPER", "NOTSET", "é∑ 😀", '"quoted" \\ back\nslash\t\x00', "\u2028"]
_XW = ("x", "w")

HAND_NODES: dict[str, list[onnx.NodeProto]] = {
    # ints, at the schema default or not, and the extremes of int64
    "int_default": _one("Softmax", _attr("axis", INT, -1)),
    "int_other": _one("Softmax", _attr("axis", INT, 0)),
    "int_extremes": _one("Custom", _attr("lo", INT, -(2**63)), _attr("hi", INT, 2**63 - 1)),
    # an INT where the schema has a FLOAT default: 1 == 1.0, so it is the default
    "int_for_float_default": _one("Gemm", _attr("alpha", INT, 1), ins=_XW),
    "int_for_float_other": _one("Gemm", _attr("alpha", INT, 2), ins=_XW),
    # floats that need %.7g rounding, the defaults, and what JSON spells specially
    **{
        f"float_{i}": _one("LeakyRelu", _attr("alpha", FLOAT, v))
        for i, v in enumerate([*_ROUNDING, *_SPECIAL])
    },
    "float_defaults": _one(
        "Gemm",
        *(_attr(n, FLOAT, 1.0) for n in ("alpha", "beta")),
        *(_attr(n, INT, 0) for n in ("transA", "transB")),
        ins=_XW,
    ),
    "float_for_int_default": _one("Gemm", _attr("transB", FLOAT, 0.0), ins=_XW),
    "bn_epsilon": _one(
        "BatchNormalization",
        _attr("epsilon", FLOAT, 1e-5),
        _attr("momentum", FLOAT, 0.8),
        ins=("x", "w", "w", "w", "w"),
    ),
    # strings, at the default or not, non-ASCII, escapes, invalid UTF-8
    **{
        f"string_{i}": _one("Conv", _attr("auto_pad", STRING, v), ins=_XW)
        for i, v in enumerate([*_TEXT, b"\xff\xfe", b"caf\xc3\xa9"])
    },
    # lists, empty or not, at a list default (MeanVarianceNormalization axes=[0, 2, 3]) or not
    "ints": _one("Transpose", _attr("perm", INTS, [1, 0])),
    "ints_empty": _one("Custom", _attr("e", INTS, [])),
    "ints_default": _one("MeanVarianceNormalization", _attr("axes", INTS, [0, 2, 3])),
    "ints_other": _one("MeanVarianceNormalization", _attr("axes", INTS, [1])),
    "floats_for_ints_default": _one(
        "MeanVarianceNormalization", _attr("axes", FLOATS, [0.0, 2.0, 3.0])
    ),
    "floats": _one("Custom", _attr("f", FLOATS, [*_ROUNDING, *_SPECIAL])),
    "floats_empty": _one("Custom", _attr("f", FLOATS, [])),
    "strings": _one("Custom", _attr("s", STRINGS, [*_TEXT, b"\xff"])),
    "strings_empty": _one("Custom", _attr("s", STRINGS, [])),
    # long enough that their bytes are not kept as a cache key
    "ints_long": _one("Custom", _attr("big", INTS, [2**62 + i for i in range(40)])),
    "floats_long": _one("Custom", _attr("f", FLOATS, [i / 7 for i in range(80)])),
    "strings_long": _one("Custom", _attr("s", STRINGS, ["x" * 300])),
    # tensors and graphs are spelled by a hash of their bytes
    "tensor": _one("ConstantOfShape", _made("value", _TENSOR), ins=("s",)),
    "tensor_constant": _one("Constant", _made("value", _TENSOR), ins=()),
    "graphs": _one(
        "If",
        _made("then_branch", _BRANCH),
        _made("else_branch", helper.make_graph([], "empty", [], [])),
        ins=("s",),
    ),
    # kinds the JSON cannot spell: the same TypeError as before
    "tensors": _one("Custom", _made("ts", [_TENSOR], _A.TENSORS)),
    "graph_list": _one("Custom", _made("gs", [_BRANCH], _A.GRAPHS)),
    "sparse_tensor": _one(
        "Constant", _made("sparse_value", helper.make_sparse_tensor(_TENSOR, _INDICES, [6])), ins=()
    ),
    "type_proto": _one("Custom", _made("tp", helper.make_tensor_type_proto(FLOAT, [2]))),
    "mixed_kinds": _one(
        "Custom", _attr("k", INT, 3), _made("t", _TENSOR), _attr("a", FLOATS, [0.5])
    ),
    "undefined": _one("Custom", onnx.AttributeProto(name="u")),
    # a reference to a function's attribute has no value here: the same ValueError
    "ref_attr": _one("Softmax", onnx.AttributeProto(name="axis", ref_attr_name="a", type=INT)),
    # names: duplicates (the later one at its default), escapes, and their sort order
    "duplicate_names": _one("Softmax", _attr("axis", INT, 0), _attr("axis", INT, -1)),
    "odd_names": _one(
        "Custom", *(_attr(n, INT, i) for i, n in enumerate(["b", "B", "é", '"q"', "", "a_", "a"]))
    ),
    "odd_op_type": _one('Cüstom"\\', _attr("k", INT, 1)),
    # unknown and contrib ops, domains spelled out or not imported
    "unknown_op": _one("NoSuchOp", _attr("alpha", FLOAT, 1.0), ins=_XW),
    "contrib_op": _one(
        "FusedMatMul",
        _attr("alpha", FLOAT, 1.0),
        _attr("transA", INT, 0),
        ins=_XW,
        domain="com.microsoft",
    ),
    "ai_onnx_domain": _one("Gemm", _attr("alpha", FLOAT, 1.0), ins=_XW, domain="ai.onnx"),
    "unimported_domain": _one("Thing", domain="org.example"),
    "mixed_domains": [
        _node("FusedMatMul", ["x", "w"], ["t"], domain="com.microsoft"),
        _node("Add", ["t", "y"], ["u"]),
        _node("Thing", ["u"], ["out"], domain="org.example"),
    ],
    # wiring: repeated and optional inputs, several outputs, a name written twice
    "repeated_input": [_node("MatMul", ["x", "x"], ["t"]), _node("Add", ["t", "x"], ["out"])],
    "optional_input": _one("Clip", ins=("x", "", "s")),
    "two_outputs": [
        _node("Split", ["x"], ["t", "u"], _attr("axis", INT, 1)),
        _node("Add", ["u", "t"], ["out", "", "out2"]),
    ],
    "written_twice": [
        _node("Relu", ["x"], ["t"]),
        _node("Sigmoid", ["t"], ["u"]),
        _node("Tanh", ["y"], ["t"]),
        _node("Add", ["u", "t"], ["out"]),
    ],
    "constant_input": [_node("MatMul", ["x", "w"], ["t"]), _node("Add", ["t", "s"], ["out"])],
    # tensors without a static shape: the same ValueError, naming the same tensor
    "dynamic_input": _one("Add", ins=("x", "dyn")),
    "unknown_input": _one("Add", ins=("nowhere", "dyn")),
    "unknown_output": [_node("Relu", ["x"], ["nowhere"])],
    "dynamic_and_unspellable": _one("Custom", _made("ts", [_TENSOR], _A.TENSORS), ins=("dyn",)),
    "dynamic_and_mixed": _one(
        "Custom", _attr("k", INT, 3), _made("ts", [_TENSOR], _A.TENSORS), ins=("dyn",)
    ),
    # infos of other types than a ModelContext makes: spelled, or rejected in json's order
    "float_dim": _one("Relu", ins=("float_dim",)),
    "bool_dim": [_node("Relu", ["x"], ["bool_dim"])],
    "np_dim_then_dynamic": _one("Add", ins=("np_dim", "dyn")),
    "np_dim_then_dynamic_out": [_node("Relu", ["np_dim"], ["dyn"])],
    "np_dim_and_unspellable": _one("Custom", _made("ts", [_TENSOR], _A.TENSORS), ins=("np_dim",)),
    "unspellable_and_np_dim_out": [
        _node("Custom", ["x"], ["np_dim"], _made("ts", [_TENSOR], _A.TENSORS))
    ],
    "np_dtype": _one("Relu", ins=("np_dtype",)),
    "no_shape_then_dynamic": _one("Add", ins=("no_shape", "dyn")),
    # no nodes at all
    "empty_list": [],
}


@pytest.mark.parametrize("case", sorted(HAND_NODES))
def test_hand_built_nodes_have_the_reference_outcome(case: str) -> None:
    ctx = _hand_ctx()
    assert_same_as_reference(HAND_NODES[case], ctx)
    assert_same_as_reference(HAND_NODES[case], ctx)  # warm caches
    for node in HAND_NODES[case]:
        assert_same_attributes_as_reference(node, ctx)


def test_a_tuple_of_no_nodes_fails_as_before() -> None:
    assert assert_same_as_reference((), _hand_ctx())[0] is IndexError


def test_hand_built_cases_reach_what_they_are_meant_to() -> None:
    # The cases above exercise the paths they name (so a comparison that always fails the
    # same way on both sides cannot hide a difference).
    ctx = _hand_ctx()
    sig = {case: _outcome(_ref_task_signature, nodes, ctx) for case, nodes in HAND_NODES.items()}
    assert '"attrs":{}' in sig["int_default"].canonical_json
    assert '"attrs":{"axis":0}' in sig["int_other"].canonical_json
    assert '"attrs":{}' in sig["int_for_float_default"].canonical_json
    assert '"attrs":{}' in sig["ints_default"].canonical_json
    assert '"attrs":{}' in sig["floats_for_ints_default"].canonical_json
    assert '"alpha":0.3333333' in sig["float_0"].canonical_json
    assert '"alpha":NaN' in sig[f"float_{len(_ROUNDING)}"].canonical_json
    assert '"auto_pad":"\\u00e9\\u2211 \\ud83d\\ude00"' in sig["string_3"].canonical_json
    assert '"tensor":' in sig["tensor"].canonical_json
    assert '"graph":' in sig["graphs"].canonical_json
    assert '"u":null' in sig["undefined"].canonical_json
    assert '"alpha":1.0' in sig["ai_onnx_domain"].canonical_json
    assert (
        '"opsets":{"":17,"com.microsoft":1,"org.example":1}' in sig["mixed_domains"].canonical_json
    )
    assert '"in":["n0.1","n0.0"]' in sig["two_outputs"].canonical_json
    assert '"in":["i1"],"op":"Sigmoid"' in sig["written_twice"].canonical_json
    for case in ("tensors", "graph_list", "sparse_tensor", "type_proto"):
        assert sig[case][0] is TypeError, case
    assert sig["ref_attr"][0] is ValueError
    assert sig["dynamic_input"] == (ValueError, "tensor 'dyn' has no static shape")
    assert sig["unknown_input"] == (ValueError, "tensor 'nowhere' has no static shape")
    assert sig["dynamic_and_unspellable"] == (ValueError, "tensor 'dyn' has no static shape")
    assert sig["dynamic_and_mixed"] == (ValueError, "tensor 'dyn' has no static shape")
    assert sig["empty_list"][0] is IndexError
    assert '"shape":[2.0,3]' in sig["float_dim"].canonical_json
    assert '"shape":[true,3]' in sig["bool_dim"].canonical_json
    assert sig["np_dim_then_dynamic"] == (ValueError, "tensor 'dyn' has no static shape")
    assert sig["np_dim_then_dynamic_out"] == (ValueError, "tensor 'dyn' has no static shape")
    assert sig["np_dim_and_unspellable"][0] is TypeError
    assert "int64" in sig["np_dim_and_unspellable"][1]
    assert "TensorProto" in sig["unspellable_and_np_dim_out"][1]
    assert sig["np_dtype"][0] is TypeError
    assert sig["no_shape_then_dynamic"][0] is TypeError
    assert '"big":[4611686018427387904,' in sig["ints_long"].canonical_json
    assert '"k":3' in sig["mixed_kinds"].canonical_json


def test_the_same_attributes_at_another_opset_have_the_reference_signature() -> None:
    # Softmax's axis defaults to 1 up to opset 12 and to -1 from opset 13 on.
    ctx = _hand_ctx()
    for axis in (-1, 1):
        nodes = _one("Softmax", _attr("axis", INT, axis))
        at = {}
        for opset in (17, 11, 17, 11):
            ctx.opsets[""] = opset
            at[opset] = assert_same_as_reference(nodes, ctx)
        assert at[17].digest != at[11].digest
        assert ('"attrs":{}' in at[17].canonical_json) == (axis == -1)
        assert ('"attrs":{}' in at[11].canonical_json) == (axis == 1)


def test_a_changed_context_gives_the_reference_signature() -> None:
    # ModelContext's tables are plain attributes; whatever a signature keeps from them
    # must follow when they change.
    ctx = _hand_ctx()
    nodes = HAND_NODES["constant_input"]
    first = assert_same_as_reference(nodes, ctx)
    ctx.tensors["x"] = TensorInfo("float16", (2, 3))
    ctx.constants.add("x")
    ctx.constants.discard("s")
    ctx.opsets[""] = 13
    second = assert_same_as_reference(nodes, ctx)
    assert second.digest != first.digest


_INT64 = st.integers(-(2**63), 2**63 - 1)
_FLOAT32 = st.floats(width=32)  # NaN and the infinities included
_BYTES = st.binary(max_size=6) | st.text(max_size=6).map(str.encode)
_VALUES = {
    INT: st.sampled_from([0, 1, -1]) | _INT64,
    FLOAT: st.sampled_from([1.0, 0.01, 0.8, 0.9, 1e-5, 0.0]) | _FLOAT32,
    STRING: st.sampled_from([b"NOTSET", b"SAME_UPPER"]) | _BYTES,
    INTS: st.lists(st.sampled_from([0, 2, 3]) | _INT64, max_size=40),
    FLOATS: st.lists(_FLOAT32, max_size=4),
    STRINGS: st.lists(_BYTES, max_size=3),
}
_OPS = [
    ("Gemm", "", ["x", "w"]),
    ("Gemm", "ai.onnx", ["x", "w"]),
    ("LeakyRelu", "", ["x"]),
    ("Conv", "", ["x", "w"]),
    ("Softmax", "", ["x"]),
    ("BatchNormalization", "", ["x", "w", "w", "w", "w"]),
    ("MeanVarianceNormalization", "", ["x"]),
    ("FusedMatMul", "com.microsoft", ["x", "w"]),
    ("NoSuchOp", "", ["x"]),
]


@st.composite
def _attributes(draw: st.DrawFn, op: str, domain: str) -> onnx.AttributeProto:
    try:
        names = sorted(onnx.defs.get_schema(op, 17, domain).attributes)
    except Exception:
        names = ["alpha", "transA"]
    name = draw(st.sampled_from(names) | st.text(max_size=4))
    kind = draw(st.sampled_from([*sorted(_VALUES), _A.TENSOR]))
    if kind == _A.TENSOR:
        values = draw(st.lists(_FLOAT32, max_size=3))
        return _made(name, numpy_helper.from_array(np.array(values, np.float32)))
    return _attr(name, kind, draw(_VALUES[kind]))


@st.composite
def _tasks(draw: st.DrawFn) -> list[onnx.NodeProto]:
    nodes = []
    for out in draw(st.sampled_from([["out"], ["t", "out"]])):
        op, domain, ins = draw(st.sampled_from(_OPS))
        ins = ["t" if nodes else ins[0], *ins[1:]]
        attrs = draw(st.lists(_attributes(op, domain), max_size=5))
        nodes.append(_node(op, ins, [out], *attrs, domain=domain))
    return nodes


_HAND_CTX = _hand_ctx()  # shared, so that later examples meet what earlier ones cached


@settings(max_examples=300, deadline=None)
@given(_tasks())
def test_generated_attributes_have_the_reference_signature(nodes: list[onnx.NodeProto]) -> None:
    assert isinstance(assert_same_as_reference(nodes, _HAND_CTX), TaskSignature)

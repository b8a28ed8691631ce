"""Tests for task signatures, device fingerprints and bank keys (aoe.signature)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

from aoe.signature import (
    ModelContext,
    TaskSignature,
    bank_key,
    device_fingerprint,
    task_signature,
)

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

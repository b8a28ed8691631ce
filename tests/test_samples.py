"""Tests for the in-code sample ONNX models (aoed.samples)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from aoed import samples

NAMES = sorted(samples.SAMPLES)
#: The samples with dynamic axes (test_encoder_is_dynamic_up_to_its_positions).
DYNAMIC = ("encoder",)


def _feeds(model: onnx.ModelProto, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for the model's real (non-initializer) graph inputs: float32 normals,
    and token ids below 100 for int64 inputs (every sample's vocabulary is larger)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = [
            d.dim_value if d.HasField("dim_value") else batch for d in vi.type.tensor_type.shape.dim
        ]
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 100, size=dims).astype(np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_sane(out: np.ndarray) -> None:
    assert np.all(np.isfinite(out))
    assert float(out.std()) > 1e-3
    assert float(np.abs(out).max()) < 1e3


@pytest.mark.parametrize("name", NAMES)
def test_checker_passes(name: str) -> None:
    onnx.checker.check_model(samples.build(name), full_check=True)


@pytest.mark.parametrize("name", NAMES)
def test_runs_on_ort_cpu(name: str) -> None:
    model = samples.build(name)
    outputs = _run(model, _feeds(model))
    assert len(outputs) == len(model.graph.output) == 1
    _assert_sane(outputs[0])


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str) -> None:
    assert samples.build(name).SerializeToString() == samples.build(name).SerializeToString()


@pytest.mark.parametrize("name", NAMES)
def test_node_names_unique_and_set(name: str) -> None:
    names = [n.name for n in samples.build(name).graph.node]
    assert all(names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in DYNAMIC])
def test_shapes_static(name: str) -> None:
    inferred = onnx.shape_inference.infer_shapes(samples.build(name), strict_mode=True)
    g = inferred.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        tt = vi.type.tensor_type
        assert tt.HasField("shape"), vi.name
        assert all(d.HasField("dim_value") for d in tt.shape.dim), vi.name


def test_default_opset_and_ir() -> None:
    for name in ("mlp", "cnn", "transformer"):
        model = samples.build(name)
        assert model.ir_version == 8
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


def test_encoder_is_dynamic_up_to_its_positions() -> None:
    model = samples.encoder(max_positions=32)
    onnx.checker.check_model(model, full_check=True)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "seq"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in [(1, 1), (3, 17), (2, 32)]:
        (y,) = sess.run(None, {"input_ids": np.ones(shape, np.int64)})
        assert y.shape == (*shape, 64)
    with pytest.raises(Exception, match="out of data bounds"):  # past the position table
        sess.run(None, {"input_ids": np.ones((1, 33), np.int64)})


def test_mlp_dynamic_batch() -> None:
    model = samples.mlp(dynamic_batch=True, features=32, hidden=64, classes=8)
    onnx.checker.check_model(model, full_check=True)
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param == "batch"
    for batch in (1, 5):
        (out,) = _run(model, _feeds(model, batch=batch))
        assert out.shape == (batch, 8)
        _assert_sane(out)


def test_mlp_layout() -> None:
    model = samples.mlp(layers=4)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 4
    assert ops.count("Relu") == 3
    assert ops[-1] == "Add"
    assert model.graph.node[0].name == "fc1/MatMul"
    assert model.graph.output[0].name == "logits"


def test_builder_kwargs() -> None:
    model = samples.build("cnn", batch=2, size=16, width=8, blocks=1)
    onnx.checker.check_model(model, full_check=True)
    (out,) = _run(model, _feeds(model))
    assert out.shape == (2, 10)


def test_cnn_layout() -> None:
    model = samples.cnn()
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    kernels = [
        tuple(onnx.helper.get_attribute_value(a))
        for c in convs
        for a in c.attribute
        if a.name == "kernel_shape"
    ]
    assert (1, 1) in kernels
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("BatchNormalization") >= 5
    assert ops[-3:] == ["GlobalAveragePool", "Flatten", "Gemm"]


def test_transformer_layout() -> None:
    model = samples.transformer()
    ops = [n.op_type for n in model.graph.node]
    for op in ("LayerNormalization", "Softmax", "Erf", "Reshape", "Transpose"):
        assert op in ops
    assert ops.count("LayerNormalization") == 2
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Reshape":
            assert inits[node.input[1]].data_type == onnx.TensorProto.INT64


def test_legacy_mlp_initializers_are_inputs() -> None:
    model = samples.legacy_mlp()
    assert model.ir_version == 3
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 9)]
    inputs = {vi.name for vi in model.graph.input}
    inits = {t.name for t in model.graph.initializer}
    assert inits and inits <= inputs
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert gemms
    for node in gemms:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["transB"] == 1


def test_legacy_cnn_has_computed_conv_weight() -> None:
    model = samples.legacy_cnn()
    assert model.ir_version == 6
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 11)]
    inits = {t.name for t in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert any(c.input[1] not in inits for c in convs)
    assert "BatchNormalization" in {n.op_type for n in model.graph.node}


def test_build_unknown_name() -> None:
    with pytest.raises(ValueError, match="nope"):
        samples.build("nope")


def test_save_roundtrip(tmp_path: Path) -> None:
    model = samples.build("legacy_cnn")
    path = samples.save(model, tmp_path / "sub" / "m.onnx")
    assert path.read_bytes() == model.SerializeToString()
    assert onnx.load(str(path)).graph.name == "legacy_cnn"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "aoed.samples", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_cli_writes_files(tmp_path: Path) -> None:
    proc = _cli("mlp", "legacy_cnn", "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    expected = [tmp_path / "mlp.onnx", tmp_path / "legacy_cnn.onnx"]
    assert [Path(p) for p in printed] == expected
    for path, name in zip(expected, ("mlp", "legacy_cnn"), strict=True):
        assert path.read_bytes() == samples.build(name).SerializeToString()


def test_cli_list_and_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert samples.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == list(samples.SAMPLES)
    proc = _cli("mlp", "bogus", "-o", str(tmp_path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "bogus" in lines[0] and "transformer" in lines[0]
    assert not list(tmp_path.iterdir())

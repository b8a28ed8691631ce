"""Strategy spaces on accelerators, checked on the CPU: which candidates a model gets on a
cuda / tensorrt / cann device, that every option is one onnxruntime documents for the
provider (aoe.provider_options), and the float16 task rewrite run for real (onnxruntime's
CPU provider has float16 MatMul and Conv kernels; bfloat16 ones it has not, so the
bfloat16 rewrite is checked as a model only)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest

from aoe.device import Device
from aoe.sessionopts import normalize_options
from aoed.backends.ort import accel
from aoed.backends.ort.catalog import build_registry
from aoed.engine.session import base_options, dimensions, merge_options

CNN_OPS = frozenset({"Conv", "Relu", "MaxPool", "Gemm", "Flatten"})
BERT_OPS = frozenset({"MatMul", "Add", "Softmax", "LayerNormalization", "Reshape", "Transpose"})


def _space(device: str, precision: str = "exact", ops=CNN_OPS, table: bool = False):
    return accel.dimensions(Device.parse(device), precision, ops, table)


def _names(dims) -> list[str]:
    return [name for name, _ in dims]


def test_a_cnn_on_cuda_gets_trt_subgraphs_tf32_cudnn_search_nhwc_and_cuda_graphs() -> None:
    assert _names(_space("cuda:0")) == [
        "provider per subgraph",
        "use_tf32",
        "cudnn_conv_algo_search",
        "prefer_nhwc",
        "enable_cuda_graph",
    ]
    dims = dict(_space("cuda:0"))
    (per_subgraph,) = dims["provider per subgraph"]
    assert [p for p, _ in per_subgraph["providers"]] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
    ]
    assert [v["providers"][0][1] for v in dims["cudnn_conv_algo_search"]] == [
        {"cudnn_conv_algo_search": "HEURISTIC"},
        {"cudnn_conv_algo_search": "DEFAULT"},
    ]


def test_a_transformer_on_cuda_gets_no_convolution_options() -> None:
    assert _names(_space("cuda:0", ops=BERT_OPS)) == [
        "provider per subgraph",
        "use_tf32",
        "enable_cuda_graph",
    ]


def test_control_flow_keeps_cuda_graphs_out() -> None:
    assert "enable_cuda_graph" not in _names(_space("cuda:0", ops=CNN_OPS | {"Loop"}))
    assert "trt_cuda_graph_enable" not in _names(_space("tensorrt:0", ops=CNN_OPS | {"If"}))


def test_tensorrt_offers_reduced_precision_only_under_its_policy() -> None:
    assert _names(_space("tensorrt:0")) == [
        "trt_builder_optimization_level",
        "trt_cuda_graph_enable",
    ]
    assert _names(_space("tensorrt:0", "fp16"))[-1] == "trt_fp16_enable"
    assert _names(_space("tensorrt:0", "bf16"))[-1] == "trt_bf16_enable"
    assert "trt_int8_enable" not in _names(_space("tensorrt:0", "int8")), (
        "no calibration table, no int8"
    )
    (int8,) = dict(_space("tensorrt:0", "int8", table=True))["trt_int8_enable"]
    assert int8["providers"][0][1] == {"trt_int8_enable": "1"}, "the table is a file: not data"


def test_cann_options_are_a_space_of_their_own() -> None:
    assert _names(_space("cann:0")) == [
        "precision_mode",
        "enable_cann_graph",
        "op_select_impl_mode",
    ]
    exact = dict(_space("cann:0"))["precision_mode"]
    assert [v["providers"][0][1]["precision_mode"] for v in exact] == ["must_keep_origin_dtype"]
    lossy = dict(_space("cann:0", "fp16"))["precision_mode"]
    assert [v["providers"][0][1]["precision_mode"] for v in lossy] == [
        "force_fp16",
        "allow_mix_precision",
    ]


@pytest.mark.parametrize(
    "device,precision,ops",
    list(
        itertools.product(
            ["cuda:0", "tensorrt:0", "cann:0"],
            ["exact", "fp16", "bf16", "int8"],
            [CNN_OPS, BERT_OPS],
        )
    ),
)
def test_every_candidate_names_documented_options_of_its_provider(
    device: str, precision: str, ops
) -> None:
    """Each candidate, merged into the device's starting options as the search does, is a
    valid `providers` list: every option a documented one, every value in its choices."""
    dev = Device.parse(device)
    for _, values in _space(device, precision, ops, True):
        for v in values:
            normalize_options(merge_options(base_options(dev), v))  # raises ValueError if not


def test_the_cpu_keeps_its_own_dimensions() -> None:
    assert accel.dimensions(Device.parse("cpu"), "exact") == []
    assert _names(dimensions(2)) == ["graph_optimization_level", "execution_mode"]
    assert base_options(Device.parse("cpu")) == {}


def test_merge_keeps_order_for_options_and_takes_it_from_a_new_provider() -> None:
    cuda = base_options(Device.parse("cuda:0"))
    assert cuda == {"providers": [["CUDAExecutionProvider", {}]]}
    tf32 = merge_options(cuda, {"providers": [["CUDAExecutionProvider", {"use_tf32": "0"}]]})
    both = merge_options(
        tf32, {"providers": [["TensorrtExecutionProvider", {}], ["CUDAExecutionProvider", {}]]}
    )
    assert both["providers"] == [
        ["TensorrtExecutionProvider", {}],
        ["CUDAExecutionProvider", {"use_tf32": "0"}],
    ]
    graph = merge_options(
        both, {"providers": [["CUDAExecutionProvider", {"enable_cuda_graph": "1"}]]}
    )
    assert [p for p, _ in graph["providers"]] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
    ]
    assert graph["providers"][1][1] == {"use_tf32": "0", "enable_cuda_graph": "1"}
    assert merge_options({"config": {"a": "1"}}, {"config": {"b": "2"}}) == {
        "config": {"a": "1", "b": "2"}
    }


def test_registry_offers_cpu_rewrites_on_the_cpu_and_float16_tasks_on_gpus() -> None:
    reg = build_registry()
    cpu = {s.name for s in reg.strategies_for("matmul", "fp16", "cpu")}
    cuda = {s.name for s in reg.strategies_for("matmul", "fp16", "cuda")}
    assert "fused_gemm" in cpu and "fp16_compute" not in cpu
    assert "fp16_compute" in cuda and "fused_gemm" not in cuda and "default" in cuda
    assert {s.name for s in reg.strategies_for("matmul", "bf16", "cuda")} >= {"bf16_compute"}
    assert {s.name for s in reg.strategies_for("matmul", "exact", "cuda")} == {"default"}
    assert not reg.has_choice("matmul", "exact", "tensorrt") and reg.has_choice(
        "conv", "fp16", "tensorrt"
    )
    assert reg.session_space is accel.dimensions


def _task_view(op: str):
    from onnx import TensorProto, helper, numpy_helper

    from aoe.signature import ModelContext
    from aoed.engine.tasks import Constants, TaskView

    rng = np.random.default_rng(0)
    if op == "MatMul":
        w = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w")
        b = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
            helper.make_node("Add", ["mm", "b"], ["a"], name="add"),
            helper.make_node("Relu", ["a"], ["y"], name="relu"),
        ]
        x, y, inits = [8, 64], [8, 32], [w, b]
    else:
        w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w")
        nodes = [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ]
        x, y, inits = [1, 4, 8, 8], [1, 8, 8, 8], [w]
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
        inits,
    )
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    )
    ctx = ModelContext(model)
    view = TaskView(list(model.graph.node), Constants(model.graph), ctx.tensors, 17, "aoe/t0")
    return model, view, rng.standard_normal(x).astype(np.float32)


@pytest.mark.parametrize("op", ["MatMul", "Conv"])
def test_float16_tasks_run_in_onnxruntime_and_stay_close(op: str) -> None:
    import onnxruntime as ort

    from aoed.engine.tasks import apply_rewrites

    model, view, x = _task_view(op)
    rewrite = accel._fp16(view)
    assert rewrite is not None
    lowered = apply_rewrites(model, {tuple(n.name for n in view.nodes): rewrite})
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.op_type for n in lowered.graph.node} >= {"Cast", op}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )[0]

    ref, got = run(model), run(lowered)
    cos = float(ref.ravel() @ got.ravel() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert got.dtype == np.float32 and cos > 0.9995 and not np.array_equal(ref, got), (
        "really computed in float16"
    )


def test_bfloat16_matmul_task_is_a_valid_model() -> None:
    from aoed.engine.tasks import apply_rewrites

    model, view, _ = _task_view("MatMul")
    lowered = apply_rewrites(model, {tuple(n.name for n in view.nodes): accel._bf16(view)})
    onnx.checker.check_model(lowered, full_check=True)
    casts = [n for n in lowered.graph.node if n.op_type == "Cast"]
    assert {a.i for n in casts for a in n.attribute} == {
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.FLOAT,
    }

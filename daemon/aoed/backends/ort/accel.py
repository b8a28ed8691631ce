"""Strategy spaces on accelerators: NVIDIA GPUs (CUDA, TensorRT) and Ascend NPUs (CANN).

Each alternative is one stock onnxruntime runs, of two sorts:

- per task (registered in the strategy registry for GPU kinds): the task computed in
  float16 (`fp16_compute`: matmul and conv families) or bfloat16 (`bf16_compute`: matmul
  only; ONNX's Conv takes no bfloat16), its float inputs cast in and its output cast
  back, under the fp16 / bf16 policies and their accuracy gates;
- model-wide (`dimensions`, searched in context by aoed.engine.session, one dimension
  at a time): the providers and their options. On `cuda:N`: TensorRT for the subgraphs
  it builds with CUDA for the rest (onnxruntime's provider priority), TF32 off (CUDA's
  default is on), cuDNN's convolution algorithm search, NHWC convolutions, CUDA graphs
  (static shapes, no control flow); on `tensorrt:N`: the builder's optimisation level,
  its CUDA graphs, and under the fp16 / bf16 / int8 policies its fp16, bf16 and int8
  (with a calibration table, where the job has one) flags; on `cann:N`: the CANN
  provider's precision mode, operator implementation mode and graph mode.

Option names and values are those onnxruntime documents (aoe.provider_options checks
every one), and none names a file: the options go to the bank and into tuned models,
which are data to whoever reads them. TensorRT candidates keep their engine and timing
caches in a folder beside the bank all the same (the measuring session's own options,
aoed.engine.context.JobContext.provider_files), so engine builds happen once per model
and options, and outside the timed runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper

from aoe.device import Device
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import Rewrite, TaskView

__all__ = ["GPU_KINDS", "dimensions", "register"]

GPU_KINDS = ("cuda", "tensorrt")

#: Ops that keep a model from CUDA graphs: control flow (onnxruntime's documented limit).
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


# --------------------------------------------------------------------------- per task


def _lowered(view: TaskView, to: int) -> Rewrite | None:
    """The task's nodes computing in `to` (FLOAT16 or BFLOAT16): every float32 input is
    cast (a constant's Cast is folded when the session loads), every tensor between the
    nodes renamed (its declared type is float32), the outputs cast back to float32."""
    f32 = np.dtype(np.float32)
    produced = {o for n in view.nodes for o in n.output if o}
    renamed: dict[str, str] = {}
    casts: dict[str, str] = {}
    out_nodes = []
    for i, node in enumerate(view.nodes):
        ins = []
        for x in node.input:
            if not x or x in renamed:
                ins.append(renamed.get(x, x))
                continue
            info = view.info(x)
            if x in produced or info is None or np.dtype(info.dtype) != f32:
                ins.append(x)  # shapes, indices, integers: as they are
                continue
            if x not in casts:
                casts[x] = view.name(f"cast_in{len(casts)}")
                out_nodes.append(
                    helper.make_node("Cast", [x], [casts[x]], name=casts[x] + "_node", to=to)
                )
            ins.append(casts[x])
        outs = []
        for k, o in enumerate(node.output):
            if o:
                renamed[o] = view.name(f"n{i}_out{k}")
            outs.append(renamed.get(o, o))
        copy = helper.make_node(
            node.op_type, ins, outs, name=view.name(f"{node.op_type}{i}"), domain=node.domain
        )
        copy.attribute.extend(node.attribute)
        out_nodes.append(copy)
    if not casts:
        return None  # nothing float to lower
    last = view.nodes[-1]
    for o in last.output:
        info = view.info(o) if o else None
        if info is None or np.dtype(info.dtype) != f32:
            return None  # an output the task would hand on in another type
        out_nodes.append(
            helper.make_node(
                "Cast", [renamed[o]], [o], name=view.name(f"cast_out_{o}"), to=TensorProto.FLOAT
            )
        )
    return Rewrite(tuple(out_nodes))


def _fp16(view: TaskView) -> Rewrite | None:
    """The task computed in float16 (tensor cores), its inputs cast in and output cast back."""
    return _lowered(view, TensorProto.FLOAT16)


def _bf16(view: TaskView) -> Rewrite | None:
    """The task computed in bfloat16, its inputs cast in and output cast back."""
    return _lowered(view, TensorProto.BFLOAT16)


def register(registry: StrategyRegistry) -> None:
    """Add the per-task accelerator strategies to `registry` (for GPU kinds only)."""
    s = registry.strategy
    s("fp16_compute", "matmul", "fp16", GPU_KINDS)(_fp16)
    s("fp16_compute", "conv", "fp16", GPU_KINDS)(_fp16)
    s("bf16_compute", "matmul", "bf16", ("cuda",))(_bf16)


# --------------------------------------------------------------------------- model-wide


def _provider(kind: str) -> str:
    return Device(kind).provider


def _on(kind: str, **options: str) -> dict[str, Any]:
    """Session options setting `options` on the provider of `kind`."""
    return {"providers": [[_provider(kind), dict(options)]]}


def dimensions(
    device: Device,
    precision: str,
    op_types: frozenset[str] = frozenset(),
    calibration_table: bool = False,
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The model-wide alternatives tried on `device` under `precision` for a model of
    `op_types` (static shapes: the job fixes them), per dimension, each value merged into
    the options so far (aoed.engine.session.merge_options). [] for the CPU, whose
    dimensions are the session search's own. `calibration_table`: whether the job has a
    TensorRT int8 table (its sessions name it, as a file: aoe.sessionopts.trt_files),
    without which int8 is not offered."""
    kind = device.kind
    has_conv = "Conv" in op_types
    cuda_graph_ok = not (op_types & _CONTROL_FLOW)
    if kind == "cuda":
        dims: list[tuple[str, list[dict[str, Any]]]] = [
            (
                "provider per subgraph",
                [{"providers": [[_provider("tensorrt"), {}], [_provider("cuda"), {}]]}],
            ),
            ("use_tf32", [_on("cuda", use_tf32="0")]),
        ]
        if has_conv:
            dims.append(
                (
                    "cudnn_conv_algo_search",
                    [_on("cuda", cudnn_conv_algo_search=v) for v in ("HEURISTIC", "DEFAULT")],
                )
            )
            dims.append(("prefer_nhwc", [_on("cuda", prefer_nhwc="1")]))
        if cuda_graph_ok:
            dims.append(("enable_cuda_graph", [_on("cuda", enable_cuda_graph="1")]))
        return dims
    if kind == "tensorrt":
        dims = [
            (
                "trt_builder_optimization_level",
                [_on("tensorrt", trt_builder_optimization_level=v) for v in ("5", "2")],
            ),
        ]
        if cuda_graph_ok:
            dims.append(("trt_cuda_graph_enable", [_on("tensorrt", trt_cuda_graph_enable="1")]))
        # Reduced precisions are lossy: offered only under their policy, and judged by its gate.
        if precision == "fp16":
            dims.append(("trt_fp16_enable", [_on("tensorrt", trt_fp16_enable="1")]))
        elif precision == "bf16":
            dims.append(("trt_bf16_enable", [_on("tensorrt", trt_bf16_enable="1")]))
        elif precision == "int8" and calibration_table:
            dims.append(("trt_int8_enable", [_on("tensorrt", trt_int8_enable="1")]))
        return dims
    if kind == "cann":
        dims = [
            ("enable_cann_graph", [_on("cann", enable_cann_graph="0")]),
            ("op_select_impl_mode", [_on("cann", op_select_impl_mode="high_performance")]),
        ]
        # CANN's default (force_fp16 where an operator has no float32 kernel) is already
        # lossy; exact keeps float32, the lossy policies may try float16 throughout.
        if precision == "exact":
            dims.insert(
                0, ("precision_mode", [_on("cann", precision_mode="must_keep_origin_dtype")])
            )
        else:
            dims.insert(
                0,
                (
                    "precision_mode",
                    [_on("cann", precision_mode=v) for v in ("force_fp16", "allow_mix_precision")],
                ),
            )
        return dims
    return []

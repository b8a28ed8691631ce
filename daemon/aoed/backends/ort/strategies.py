"""Exact strategies for ONNX Runtime's CPU provider (precision ``exact``).

Each is a real, different way to run a task that stock onnxruntime accepts, with the
same outputs up to float rounding:

- ``matmul``: MatMul(+bias) as Gemm over a pre-transposed weight; MatMul + bias +
  activation as one FusedGemm; FusedMatMul over the pre-transposed weight; Gemm as
  MatMul + Add (the form MLAS prepacks).
- ``conv``: Conv (+ BatchNormalization folded) + activation as one FusedConv; a 1x1
  Conv as a MatMul over flattened pixels.

`register(registry)` adds them; the int8 strategies live in `quant.py`.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from aoed.backends.ort._rewrite import (
    act_attrs,
    as_2d,
    attrs_of,
    conv_parts,
    copy_act,
    init,
    matmul_parts,
)
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]


def _gemm_rewrite(view: TaskView, fused: bool) -> Rewrite | None:
    parts = matmul_parts(view)
    if parts is None:
        return None
    a, w, bias, act, rank = parts
    if fused and act is None:
        return None
    k, n = w.shape
    out = view.output
    pre, a2 = as_2d(view, a, rank, k)
    nodes = [p[0] for p in pre]
    inits = [p[1] for p in pre]
    wt = init(view, "weight_t", np.ascontiguousarray(w.T))
    inits.append(wt)
    ins = [a2, wt.name]
    if bias is not None:
        b = init(view, "bias", bias.astype(w.dtype))
        inits.append(b)
        ins.append(b.name)
    y2 = view.name("y2d") if rank != 2 else None
    last = act is None or fused
    gemm_out = (y2 or out) if last else view.name("gemm")
    if fused:
        gemm = helper.make_node(
            "FusedGemm",
            ins,
            [gemm_out],
            name=view.name("FusedGemm"),
            domain=CONTRIB_DOMAIN,
            transB=1,
            **act_attrs(act, gemm=True),
        )
    else:
        gemm = helper.make_node("Gemm", ins, [gemm_out], name=view.name("Gemm"), transB=1)
    nodes.append(gemm)
    cur = gemm_out
    if rank != 2:
        info = view.info(out) if last else view.info(view.anchor.output[0])
        shape = numpy_helper.from_array(np.array(info.shape, dtype=np.int64), view.name("shape_nd"))
        inits.append(shape)
        target = out if last else view.name("gemm_nd")
        nodes.append(
            helper.make_node("Reshape", [cur, shape.name], [target], name=view.name("ReshapeNd"))
        )
        cur = target
    if not last:
        nodes.append(copy_act(view, act, cur))
    return Rewrite(tuple(nodes), tuple(inits))


def _gemm_pretransposed(view: TaskView) -> Rewrite | None:
    """MatMul(+bias) as Gemm with the weight stored transposed (transB=1)."""
    return _gemm_rewrite(view, fused=False)


def _fused_gemm(view: TaskView) -> Rewrite | None:
    """MatMul + bias + activation as one com.microsoft FusedGemm."""
    return _gemm_rewrite(view, fused=True)


def _fused_matmul(view: TaskView) -> Rewrite | None:
    """com.microsoft FusedMatMul over the pre-transposed weight, epilogue kept."""
    parts = matmul_parts(view)
    if parts is None or view.anchor.op_type != "MatMul":
        return None
    a, w, _bias_vec, _act, _rank = parts
    wt = init(view, "weight_t", np.ascontiguousarray(w.T))
    mm = view.anchor
    node = helper.make_node(
        "FusedMatMul",
        [a, wt.name],
        [mm.output[0]],
        name=view.name("FusedMatMul"),
        domain=CONTRIB_DOMAIN,
        transB=1,
    )
    return Rewrite((node, *view.nodes[1:]), (wt,))


def _gemm_as_matmul(view: TaskView) -> Rewrite | None:
    """Gemm as MatMul over a [K, N] weight plus a bias Add (the form MLAS prepacks)."""
    parts = matmul_parts(view)
    if parts is None or view.anchor.op_type != "Gemm":
        return None
    a, w, bias, act, _rank = parts
    inits = [init(view, "weight", np.ascontiguousarray(w))]
    last = view.output if act is None else view.name("pre_act")
    mm_out = last if bias is None else view.name("mm")
    nodes = [helper.make_node("MatMul", [a, inits[0].name], [mm_out], name=view.name("MatMul"))]
    if bias is not None:
        inits.append(init(view, "bias", bias.astype(w.dtype)))
        nodes.append(
            helper.make_node("Add", [mm_out, inits[1].name], [last], name=view.name("Bias"))
        )
    if act is not None:
        nodes.append(copy_act(view, act, last))
    return Rewrite(tuple(nodes), tuple(inits))


def _fused_conv(view: TaskView) -> Rewrite | None:
    """Conv (with its BatchNormalization folded) + activation as one com.microsoft FusedConv."""
    act = view.epilogue("Relu", "Sigmoid", "Tanh", "LeakyRelu")
    if act is None or view.anchor.op_type != "Conv":
        return None
    conv = view.anchor
    attrs = attrs_of(conv)
    attrs.update(act_attrs(act))
    inits: list = []
    ins = list(conv.input)
    if view.epilogue("BatchNormalization") is not None:
        parts = conv_parts(view)
        if parts is None:
            return None
        _conv, w, bias, _act = parts
        inits = [init(view, "weight", w), init(view, "bias", bias)]
        ins = [conv.input[0], inits[0].name, inits[1].name]
    node = helper.make_node(
        "FusedConv",
        ins,
        [act.output[0]],
        name=view.name("FusedConv"),
        domain=CONTRIB_DOMAIN,
        **attrs,
    )
    return Rewrite((node,), tuple(inits))


def _conv1x1_matmul(view: TaskView) -> Rewrite | None:
    """A 1x1, stride-1, unpadded, ungrouped Conv as a MatMul over flattened pixels."""
    parts = conv_parts(view)
    if parts is None:
        return None
    conv, w, bias, act = parts
    x = view.info(conv.input[0])
    if x is None or w.ndim != 4 or len(x.shape) != 4:
        return None
    attrs = attrs_of(conv)
    if (
        w.shape[2:] != (1, 1)
        or attrs.get("group", 1) != 1
        or any(s != 1 for s in attrs.get("strides", [1, 1]))
        or any(p != 0 for p in attrs.get("pads", [0, 0, 0, 0]))
        or any(d != 1 for d in attrs.get("dilations", [1, 1]))
        or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
    ):
        return None
    n, c, h, wd = x.shape
    m = w.shape[0]
    inits = [
        numpy_helper.from_array(np.array([n, c, h * wd], dtype=np.int64), view.name("shape_in")),
        numpy_helper.from_array(np.ascontiguousarray(w.reshape(m, c)), view.name("weight_2d")),
        numpy_helper.from_array(np.array([n, m, h, wd], dtype=np.int64), view.name("shape_out")),
    ]
    out = view.output
    pre_act = view.name("conv_out") if act is not None else out
    nodes = [
        helper.make_node(
            "Reshape",
            [conv.input[0], inits[0].name],
            [view.name("x3")],
            name=view.name("ReshapeIn"),
        ),
        helper.make_node(
            "MatMul", [inits[1].name, view.name("x3")], [view.name("y3")], name=view.name("MatMul")
        ),
    ]
    cur = view.name("y3")
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.reshape(m, 1), view.name("bias")))
        nodes.append(
            helper.make_node(
                "Add", [cur, inits[-1].name], [view.name("y3b")], name=view.name("Bias")
            )
        )
        cur = view.name("y3b")
    nodes.append(
        helper.make_node("Reshape", [cur, inits[2].name], [pre_act], name=view.name("ReshapeOut"))
    )
    if act is not None:
        nodes.append(copy_act(view, act, pre_act))
    return Rewrite(tuple(nodes), tuple(inits))


def register(registry: StrategyRegistry) -> None:
    """Add the exact CPU strategies to `registry`."""
    s = registry.strategy
    s("gemm_pretransposed", "matmul")(_gemm_pretransposed)
    s("fused_gemm", "matmul")(_fused_gemm)
    s("fused_matmul_transb", "matmul")(_fused_matmul)
    s("gemm_as_matmul", "matmul")(_gemm_as_matmul)
    s("fused_conv", "conv")(_fused_conv)
    s("conv1x1_as_matmul", "conv")(_conv1x1_matmul)

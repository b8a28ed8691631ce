"""Helpers the CPU strategies share: reading a task's parts and writing node chains."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from aoe.partition import ACTIVATIONS
from aoed.engine.tasks import TaskView

__all__ = [
    "Nodes",
    "act_attrs",
    "as_2d",
    "attrs_of",
    "conv_parts",
    "copy_act",
    "init",
    "int8_weight",
    "matmul_parts",
    "scalar",
]


def attrs_of(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def init(view: TaskView, name: str, value: np.ndarray) -> onnx.TensorProto:
    """An initializer named under the task's prefix."""
    return numpy_helper.from_array(np.asarray(value), view.name(name))


def act_attrs(act: onnx.NodeProto, gemm: bool = False) -> dict:
    """FusedConv (or, with `gemm`, FusedGemm) attributes reproducing activation node `act`.

    FusedConv takes LeakyRelu's alpha in `activation_params`, FusedGemm in
    `activation_alpha`.
    """
    attrs = {"activation": act.op_type}
    if act.op_type == "LeakyRelu":
        alpha = next((a.f for a in act.attribute if a.name == "alpha"), 0.01)
        if gemm:
            attrs["activation_alpha"] = alpha
        else:
            attrs["activation_params"] = [alpha]
    return attrs


def copy_act(view: TaskView, act: onnx.NodeProto, src: str) -> onnx.NodeProto:
    """Activation `act` again, reading `src` and writing `act`'s output."""
    node = helper.make_node(act.op_type, [src], [act.output[0]], name=view.name(act.op_type))
    node.attribute.extend(act.attribute)
    return node


def _row_vector(b: np.ndarray | None, n: int, out_rank: int) -> np.ndarray | None:
    """`b` as a length-n vector when adding it broadcasts one value per output column.

    A column bias ([n, 1] on an [n, n] product) or one that raises the output's rank is
    no such vector, even with n elements.
    """
    if b is None or b.size != n or b.ndim > out_rank or (b.ndim and b.shape[-1] != n):
        return None
    return b.reshape(n)


def _bias(view: TaskView, n: int) -> tuple[onnx.NodeProto | None, np.ndarray | None]:
    """The constant bias Add of a matmul task, as (node, vector of length n)."""
    add = view.epilogue("Add")
    if add is None:
        return None, None
    other = add.input[1] if add.input[0] == view.anchor.output[0] else add.input[0]
    y = view.info(view.anchor.output[0])
    return add, _row_vector(view.const(other), n, len(y.shape) if y is not None else 0)


def matmul_parts(view: TaskView):
    """(A name, W as [K, N], bias or None, activation or None, A rank) of a matmul task.

    Serves MatMul (+ constant bias Add) and plain Gemm (alpha = beta = 1, no transA,
    constant B and C) anchors alike; `None` where the task is neither.
    """
    anchor = view.anchor
    a_info = view.info(anchor.input[0])
    if a_info is None or len(a_info.shape) < 2:
        return None
    act = view.epilogue(*ACTIVATIONS)
    if anchor.op_type == "MatMul":
        w = view.const(anchor.input[1])
        if w is None or w.ndim != 2:
            return None
        add, bias = _bias(view, w.shape[1])
        if add is not None and bias is None:
            return None
        return anchor.input[0], w, bias, act, len(a_info.shape)
    if anchor.op_type == "Gemm":
        attrs = attrs_of(anchor)
        if (
            attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
            or attrs.get("transA", 0)
        ):
            return None
        w = view.const(anchor.input[1])
        if w is None or w.ndim != 2:
            return None
        w = w.T if attrs.get("transB", 0) else w
        bias = None
        if len(anchor.input) > 2 and anchor.input[2]:
            bias = _row_vector(view.const(anchor.input[2]), w.shape[1], 2)
            if bias is None:
                return None
        return anchor.input[0], w, bias, act, 2
    return None


def as_2d(view: TaskView, a: str, rank: int, k: int) -> tuple[list, str]:
    """A Reshape of `a` to [-1, k] (with its shape initializer) unless `a` is 2-D."""
    if rank == 2:
        return [], a
    shape = numpy_helper.from_array(np.array([-1, k], dtype=np.int64), view.name("shape2d"))
    node = helper.make_node(
        "Reshape", [a, shape.name], [view.name("a2d")], name=view.name("Reshape2d")
    )
    return [(node, shape)], view.name("a2d")


def conv_parts(view: TaskView):
    """(Conv node, weight, bias or None, activation or None) of a conv task, with an
    inference BatchNormalization epilogue folded into weight and bias; None where the
    weight (or a BatchNormalization statistic) is not a known constant.

    Only strategies that rewrite the Conv use these values; the default keeps the
    model's own tensors.
    """
    conv = view.anchor
    if conv.op_type != "Conv":
        return None
    w = view.const(conv.input[1])
    if w is None or w.ndim < 3:
        return None
    bias = None
    if len(conv.input) > 2 and conv.input[2]:
        bias = view.const(conv.input[2])
        if bias is None:
            return None
    bn = view.epilogue("BatchNormalization")
    if bn is not None:
        stats = [view.const(n) for n in bn.input[1:5]]
        if any(s is None for s in stats):
            return None
        scale, shift, mean, var = (np.asarray(s, dtype=np.float64).reshape(-1) for s in stats)
        eps = attrs_of(bn).get("epsilon", 1e-5)
        factor = scale / np.sqrt(var + eps)
        w = (w.astype(np.float64) * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        b0 = np.zeros(w.shape[0]) if bias is None else bias.astype(np.float64)
        bias = ((b0 - mean) * factor + shift).astype(w.dtype)
    return conv, w, bias, view.epilogue(*ACTIVATIONS)


def scalar(view: TaskView, name: str) -> float | None:
    """The value of a constant scalar, or None."""
    v = view.const(name)
    if v is None or np.size(v) != 1:
        return None
    return float(np.asarray(v).reshape(()))


class Nodes:
    """The task's nodes by the tensors they write and read."""

    def __init__(self, view: TaskView):
        self.view = view
        self.producer = {o: n for n in view.nodes for o in n.output if o}
        self.users: dict[str, list[onnx.NodeProto]] = {}
        for n in view.nodes:
            for i in n.input:
                self.users.setdefault(i, []).append(n)

    def made(self, tensor: str, *op_types: str) -> onnx.NodeProto | None:
        n = self.producer.get(tensor)
        return n if n is not None and n.op_type in op_types else None


def int8_weight(w: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of a [K, N] weight: per output column or per tensor."""
    amax = np.abs(w).max(axis=0) if per_channel else np.asarray(np.abs(w).max())
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return q, scale

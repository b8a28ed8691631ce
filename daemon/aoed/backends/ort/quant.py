"""Lossy int8 strategies for ONNX Runtime's CPU provider (precision policy ``int8``).

Each is a real alternative stock onnxruntime runs, and each carries its own quantize /
dequantize boundary inside the task, so the boundary's cost is part of what is measured:

- matmul (constant weight): dynamic int8 quantization of the activation at run time with
  the weight stored int8, as the fused contrib op (DynamicQuantizeMatMul, per tensor or
  per output channel) or as the standard-op form (DynamicQuantizeLinear + MatMulInteger).
- conv (constant weight): static int8 with activation scales from calibration ranges, as
  QDQ around the Conv (onnxruntime fuses it into QLinearConv) or as an explicit
  QLinearConv. Two adjacent quantized tasks see the same range for the tensor between
  them, so their boundaries carry identical scales and onnxruntime drops the redundant
  DequantizeLinear -> QuantizeLinear pair: they share the boundary.
- matmul_act (both inputs activations, e.g. attention's Q·Kᵀ and P·V): both sides
  quantized dynamically, MatMulInteger in int32, rescaled to float.

Under the ``int4`` policy (weight-only), a matmul task's weight is stored 4-bit in blocks
of 32 rows with a scale each, and com.microsoft MatMulNBits computes the product in float
(or, as a second candidate, with the activation quantized to int8: accuracy level 4).

Weights are quantized symmetrically (int8, zero point 0); activations asymmetrically
(uint8) over a range that always includes zero. A conv task's BatchNormalization is
folded into the weights before they are quantized. `register(registry)` adds them.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from aoed.backends.ort._rewrite import conv_parts, copy_act, init, matmul_parts
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]


def _sym_int8(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of `w`, per tensor (axis None) or along `axis`."""
    if axis is None:
        amax = np.asarray(np.abs(w).max(), dtype=np.float32)
    else:
        other = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.abs(w).max(axis=other).astype(np.float32)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def _uint8_params(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric uint8 scale and zero point covering [lo, hi] and zero."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    zp = int(np.clip(round(-lo / scale), 0, 255))
    return np.array(scale, dtype=np.float32), np.array(zp, dtype=np.uint8)


def _dynamic_matmul(view: TaskView, per_channel: bool, fused: bool) -> Rewrite | None:
    parts = matmul_parts(view)
    if parts is None:
        return None
    a, w, bias, act, _rank = parts
    wq, ws = _sym_int8(w, 1 if per_channel else None)
    inits = [
        init(view, "weight_q", wq),
        init(view, "weight_scale", ws),
        init(view, "weight_zp", np.zeros(ws.shape, dtype=np.int8)),
    ]
    out = view.output if act is None else view.name("pre_act")
    nodes = []
    if fused:
        ins = [a, inits[0].name, inits[1].name, inits[2].name]
        if bias is not None:
            inits.append(init(view, "bias", bias.astype(np.float32)))
            ins.append(inits[-1].name)
        nodes.append(
            helper.make_node(
                "DynamicQuantizeMatMul",
                ins,
                [out],
                name=view.name("DynamicQuantizeMatMul"),
                domain=CONTRIB_DOMAIN,
            )
        )
    else:
        aq, a_s, a_z = view.name("a_q"), view.name("a_scale"), view.name("a_zp")
        nodes += [
            helper.make_node(
                "DynamicQuantizeLinear", [a], [aq, a_s, a_z], name=view.name("QuantizeA")
            ),
            helper.make_node(
                "MatMulInteger",
                [aq, inits[0].name, a_z, inits[2].name],
                [view.name("acc")],
                name=view.name("MatMulInteger"),
            ),
            helper.make_node(
                "Cast",
                [view.name("acc")],
                [view.name("acc_f")],
                name=view.name("Cast"),
                to=TensorProto.FLOAT,
            ),
            helper.make_node(
                "Mul", [a_s, inits[1].name], [view.name("scale")], name=view.name("Scale")
            ),
        ]
        last = out if bias is None else view.name("scaled")
        nodes.append(
            helper.make_node(
                "Mul", [view.name("acc_f"), view.name("scale")], [last], name=view.name("Rescale")
            )
        )
        if bias is not None:
            inits.append(init(view, "bias", bias.astype(np.float32)))
            nodes.append(
                helper.make_node("Add", [last, inits[-1].name], [out], name=view.name("Bias"))
            )
    if act is not None:
        nodes.append(copy_act(view, act, out))
    return Rewrite(tuple(nodes), tuple(inits))


def _int8_dynamic(view: TaskView) -> Rewrite | None:
    """DynamicQuantizeMatMul, weight int8 per tensor."""
    return _dynamic_matmul(view, per_channel=False, fused=True)


def _int8_dynamic_pc(view: TaskView) -> Rewrite | None:
    """DynamicQuantizeMatMul, weight int8 per output channel."""
    return _dynamic_matmul(view, per_channel=True, fused=True)


def _int8_matmulinteger(view: TaskView) -> Rewrite | None:
    """DynamicQuantizeLinear + MatMulInteger + rescale, weight int8 per tensor."""
    return _dynamic_matmul(view, per_channel=False, fused=False)


# --------------------------------------------------------------------------- conv


def _conv_int8_parts(view: TaskView):
    parts = conv_parts(view)
    if parts is None:
        return None
    conv, w, bias, act = parts
    x_range = view.ranges.get(conv.input[0])
    y_range = view.ranges.get(view.output)
    if w.ndim != 4 or x_range is None or y_range is None:
        return None
    return conv, w, bias, act, x_range, y_range


def _int8_qdq(view: TaskView) -> Rewrite | None:
    """Static int8: QDQ around the Conv (per-channel weights), scales from calibration."""
    parts = _conv_int8_parts(view)
    if parts is None:
        return None
    conv, w, bias, act, x_range, y_range = parts
    xs, xz = _uint8_params(*x_range)
    ys, yz = _uint8_params(*y_range)
    wq, ws = _sym_int8(w, 0)
    inits = [
        init(view, "x_scale", xs),
        init(view, "x_zp", xz),
        init(view, "w_q", wq),
        init(view, "w_scale", ws),
        init(view, "w_zp", np.zeros(ws.shape, np.int8)),
        init(view, "y_scale", ys),
        init(view, "y_zp", yz),
    ]
    n = {t.name.rsplit("/", 1)[1]: t.name for t in inits}
    nodes = [
        helper.make_node(
            "QuantizeLinear",
            [conv.input[0], n["x_scale"], n["x_zp"]],
            [view.name("xq")],
            name=view.name("QX"),
        ),
        helper.make_node(
            "DequantizeLinear",
            [view.name("xq"), n["x_scale"], n["x_zp"]],
            [view.name("xdq")],
            name=view.name("DQX"),
        ),
        helper.make_node(
            "DequantizeLinear",
            [n["w_q"], n["w_scale"], n["w_zp"]],
            [view.name("wdq")],
            name=view.name("DQW"),
            axis=0,
        ),
    ]
    conv_ins = [view.name("xdq"), view.name("wdq")]
    if bias is not None:
        bscale = (xs * ws).astype(np.float32)
        bq = np.round(bias / bscale).astype(np.int32)
        inits += [
            init(view, "b_q", bq),
            init(view, "b_scale", bscale),
            init(view, "b_zp", np.zeros(bq.shape, np.int32)),
        ]
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [inits[-3].name, inits[-2].name, inits[-1].name],
                [view.name("bdq")],
                name=view.name("DQB"),
                axis=0,
            )
        )
        conv_ins.append(view.name("bdq"))
    conv_out = view.name("conv")
    new_conv = helper.make_node("Conv", conv_ins, [conv_out], name=view.name("Conv"))
    new_conv.attribute.extend(conv.attribute)
    nodes.append(new_conv)
    cur = conv_out
    if act is not None:
        act_node = helper.make_node(
            act.op_type, [cur], [view.name("act")], name=view.name(act.op_type)
        )
        act_node.attribute.extend(act.attribute)
        nodes.append(act_node)
        cur = view.name("act")
    nodes += [
        helper.make_node(
            "QuantizeLinear",
            [cur, n["y_scale"], n["y_zp"]],
            [view.name("yq")],
            name=view.name("QY"),
        ),
        helper.make_node(
            "DequantizeLinear",
            [view.name("yq"), n["y_scale"], n["y_zp"]],
            [view.output],
            name=view.name("DQY"),
        ),
    ]
    return Rewrite(tuple(nodes), tuple(inits))


def _int8_qlinearconv(view: TaskView) -> Rewrite | None:
    """Static int8 as an explicit QLinearConv; a Relu epilogue folds into the output range."""
    parts = _conv_int8_parts(view)
    if parts is None:
        return None
    conv, w, bias, act, x_range, y_range = parts
    if act is not None and act.op_type != "Relu":
        return None
    xs, xz = _uint8_params(*x_range)
    lo, hi = y_range
    ys, yz = _uint8_params(0.0 if act is not None else lo, hi)  # zp 0 clamps at 0: Relu
    wq, ws = _sym_int8(w, 0)
    inits = [
        init(view, "x_scale", xs),
        init(view, "x_zp", xz),
        init(view, "w_q", wq),
        init(view, "w_scale", ws),
        init(view, "w_zp", np.zeros(ws.shape, np.int8)),
        init(view, "y_scale", ys),
        init(view, "y_zp", yz),
    ]
    names = [t.name for t in inits]
    ins = [view.name("xq"), names[0], names[1], names[2], names[3], names[4], names[5], names[6]]
    if bias is not None:
        inits.append(init(view, "b_q", np.round(bias / (xs * ws)).astype(np.int32)))
        ins.append(inits[-1].name)
    qconv = helper.make_node("QLinearConv", ins, [view.name("yq")], name=view.name("QLinearConv"))
    qconv.attribute.extend(conv.attribute)
    nodes = [
        helper.make_node(
            "QuantizeLinear",
            [conv.input[0], names[0], names[1]],
            [view.name("xq")],
            name=view.name("QX"),
        ),
        qconv,
        helper.make_node(
            "DequantizeLinear",
            [view.name("yq"), names[5], names[6]],
            [view.output],
            name=view.name("DQY"),
        ),
    ]
    return Rewrite(tuple(nodes), tuple(inits))


# --------------------------------------------------------------------------- int4


#: Weights are quantized in blocks of this many rows (along K), each with its own scale.
INT4_BLOCK = 32
#: The larger block a second int8-compute form tries: a quarter of the scales to read,
#: at a coarser approximation (the accuracy gate decides whether the task can afford it).
INT4_BLOCK_LARGE = 128


def pack_int4(w: np.ndarray, block: int = INT4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] weight as MatMulNBits takes it: 4-bit values, symmetric per block of
    `block` rows (zero point 8, the kernel's default), two to a byte, low nibble first;
    returns (packed [N, blocks, block/2] uint8, scales [N * blocks] float32). K is
    padded with zeros to whole blocks."""
    k, n = w.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = w
    cols = padded.T.reshape(n, blocks, block)
    amax = np.abs(cols).max(axis=2)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = (np.clip(np.round(cols / scale[..., None]), -8, 7) + 8).astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scale.reshape(-1)


def _int4_nbits(view: TaskView, accuracy_level: int, block: int = INT4_BLOCK) -> Rewrite | None:
    parts = matmul_parts(view)
    if parts is None:
        return None
    a, w, bias, act, _rank = parts
    k, n = w.shape
    packed, scales = pack_int4(np.asarray(w, np.float32), block)
    inits = [init(view, "weight_q4", packed), init(view, "weight_scales", scales)]
    ins = [a, inits[0].name, inits[1].name]
    if bias is not None:
        inits.append(init(view, "bias", bias.astype(np.float32)))
        ins += ["", "", inits[-1].name]  # no zero points (8), no g_idx
    out = view.output if act is None else view.name("pre_act")
    nodes = [
        helper.make_node(
            "MatMulNBits",
            ins,
            [out],
            name=view.name("MatMulNBits"),
            domain=CONTRIB_DOMAIN,
            K=k,
            N=n,
            bits=4,
            block_size=block,
            accuracy_level=accuracy_level,
        )
    ]
    if act is not None:
        nodes.append(copy_act(view, act, out))
    return Rewrite(tuple(nodes), tuple(inits))


def _int4_weight_only(view: TaskView) -> Rewrite | None:
    """MatMulNBits: the weight 4-bit in blocks of 32, the product in float."""
    return _int4_nbits(view, accuracy_level=0)


def _int4_int8_compute(view: TaskView) -> Rewrite | None:
    """MatMulNBits with the activation quantized to int8 for the product (accuracy level 4)."""
    return _int4_nbits(view, accuracy_level=4)


def _int4_int8_compute_b128(view: TaskView) -> Rewrite | None:
    """As int4_int8_compute, the weight in blocks of 128 rows: fewer scales, coarser."""
    return _int4_nbits(view, accuracy_level=4, block=INT4_BLOCK_LARGE)


# --------------------------------------------------------------------------- matmul_act


def _int8_actact(view: TaskView) -> Rewrite | None:
    """Both activations quantized at run time, MatMulInteger, rescaled to float."""
    mm = view.anchor
    if mm.op_type != "MatMul" or len(view.nodes) != 1:
        return None
    a, b = mm.input[0], mm.input[1]
    n = view.name
    nodes = (
        helper.make_node(
            "DynamicQuantizeLinear", [a], [n("a_q"), n("a_s"), n("a_z")], name=n("QuantizeA")
        ),
        helper.make_node(
            "DynamicQuantizeLinear", [b], [n("b_q"), n("b_s"), n("b_z")], name=n("QuantizeB")
        ),
        helper.make_node(
            "MatMulInteger",
            [n("a_q"), n("b_q"), n("a_z"), n("b_z")],
            [n("acc")],
            name=n("MatMulInteger"),
        ),
        helper.make_node("Cast", [n("acc")], [n("acc_f")], name=n("Cast"), to=TensorProto.FLOAT),
        helper.make_node("Mul", [n("a_s"), n("b_s")], [n("scale")], name=n("Scale")),
        helper.make_node("Mul", [n("acc_f"), n("scale")], [view.output], name=n("Rescale")),
    )
    return Rewrite(nodes)


def register(registry: StrategyRegistry) -> None:
    """Add the int8 CPU strategies to `registry`."""
    s = registry.strategy
    s("int8_dynamic", "matmul", "int8")(_int8_dynamic)
    s("int8_dynamic_per_channel", "matmul", "int8")(_int8_dynamic_pc)
    s("int8_matmulinteger", "matmul", "int8")(_int8_matmulinteger)
    s("int8_qdq", "conv", "int8")(_int8_qdq)
    s("int8_qlinearconv", "conv", "int8")(_int8_qlinearconv)
    s("int8_dynamic_actact", "matmul_act", "int8")(_int8_actact)
    s("int4_weight_only", "matmul", "int4")(_int4_weight_only)
    s("int4_int8_compute", "matmul", "int4")(_int4_int8_compute)
    s("int4_int8_compute_b128", "matmul", "int4")(_int4_int8_compute_b128)

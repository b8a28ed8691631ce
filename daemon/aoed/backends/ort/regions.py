"""int8 for a whole CNN region (SGAT's ``conv_region``, precision policy ``int8``).

Per-operator int8 quantizes and dequantizes around every Conv, so every link between two
Convs, every residual Add and every pool runs in float between a DequantizeLinear and a
QuantizeLinear. Here the region is written in QDQ form once: each tensor that a Conv, an
Add or a pool reads (and the region's output) gets one QuantizeLinear/DequantizeLinear
pair with its calibrated range, weights are int8 per output channel, biases int32, and
BatchNormalization is folded into its Conv. onnxruntime's QDQ fusions then run the
region as QLinearConv, QLinearAdd and QLinear pooling from its input to its output, a
Relu becoming the range of the quantized tensor after it. A MaxPool's output shares its
input's scale (it only picks values), so no requantization sits there.

``int8_region`` quantizes every Conv. ``int8_region:f<i>.<j>`` keeps the Convs
numbered i, j (0-based, in graph order) in float: the engine measures each Conv's
sensitivity in context (how far the region's output moves when only that Conv is int8,
on the task's real input activations) and tries the region with the most sensitive
ones kept in float, so that they alone stay float; and with the shallow ones (a stem on
a one-channel image) kept in float, where int8 has too little arithmetic to be faster.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from aoed.backends.ort._rewrite import attrs_of, init
from aoed.engine.tasks import Rewrite, TaskView

__all__ = ["int8_region", "int8_region_param", "propose_float_convs", "region_convs"]

#: How many of the most sensitive Convs the variants keep in float (1, 2, ... this many).
MAX_FLOAT = 3

#: A Conv whose outputs each sum fewer products than this (input channels per group times
#: kernel area: a stem on a 1- or 3-channel image, 3x3) has too little arithmetic for
#: int8 to pay its quantized layout: one variant keeps those Convs in float.
SHALLOW = 32

_READERS = ("Conv", "Add", "MaxPool", "AveragePool", "GlobalAveragePool")


def _uint8(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    return np.array(scale, np.float32), np.array(int(np.clip(round(-lo / scale), 0, 255)), np.uint8)


def region_convs(view: TaskView) -> list[onnx.NodeProto]:
    """The region's Convs in graph order (their numbers in ``:f<i>`` names)."""
    return [n for n in view.nodes if n.op_type == "Conv"]


def _folded(
    view: TaskView, conv: onnx.NodeProto, bn: onnx.NodeProto | None
) -> tuple[np.ndarray, np.ndarray] | None:
    w = view.const(conv.input[1])
    if w is None or w.ndim != 4:
        return None
    w = np.asarray(w, np.float32)
    b = (
        view.const(conv.input[2])
        if len(conv.input) > 2 and conv.input[2]
        else np.zeros(w.shape[0], np.float32)
    )
    if b is None:
        return None
    b = np.asarray(b, np.float32)
    if bn is not None:
        scale, shift, mean, var = (np.asarray(view.const(i), np.float32) for i in bn.input[1:5])
        eps = float(attrs_of(bn).get("epsilon", 1e-5))
        k = scale / np.sqrt(var + eps)
        w = w * k.reshape(-1, 1, 1, 1)
        b = (b - mean) * k + shift
    return w, b


def int8_region(view: TaskView, keep_float: frozenset[int] = frozenset()) -> Rewrite | None:
    """The region in QDQ form (see the module doc); Convs numbered in `keep_float` stay float."""
    nodes = list(view.nodes)
    produced = {o for n in nodes for o in n.output if o}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            users.setdefault(i, []).append(n)
    # Which tensors get a QDQ pair, and with whose range.
    points: dict[str, tuple[float, float]] = {}
    for n in nodes:
        if n.op_type not in _READERS:
            continue
        for i in n.input[:1] if n.op_type != "Add" else n.input:
            if view.const(i) is not None:
                continue
            r = view.ranges.get(i)
            if r is None:
                return None
            points[i] = r
    out_range = view.ranges.get(view.output)
    if out_range is None:
        return None
    for n in nodes:  # a MaxPool picks values: its output keeps its input's scale
        if n.op_type == "MaxPool" and n.output[0] in points and n.input[0] in points:
            points[n.output[0]] = points[n.input[0]]
    inits: list[onnx.TensorProto] = []
    new: list[onnx.NodeProto] = []
    dq: dict[str, str] = {}

    def qdq(tensor: str, rng: tuple[float, float], out: str | None = None) -> str:
        k = len(dq)
        s, z = _uint8(*rng)
        si, zi = init(view, f"q{k}_scale", s), init(view, f"q{k}_zp", z)
        inits.extend((si, zi))
        q, d = view.name(f"q{k}"), out or view.name(f"dq{k}")
        new.append(
            helper.make_node(
                "QuantizeLinear", [tensor, si.name, zi.name], [q], name=view.name(f"Q{k}")
            )
        )
        new.append(
            helper.make_node(
                "DequantizeLinear", [q, si.name, zi.name], [d], name=view.name(f"DQ{k}")
            )
        )
        dq[tensor] = d
        return d

    for t, rng in points.items():  # the region's inputs first
        if t not in produced:
            qdq(t, rng)
    convs = {n.name: i for i, n in enumerate(region_convs(view))}
    if any(i >= len(convs) for i in keep_float):
        return None
    skip: set[str] = set()
    last = nodes[-1]
    for n in nodes:
        if n.name in skip:
            continue
        outs = list(n.output)
        if n.op_type == "Conv":
            nxt = users.get(n.output[0], [])
            bn = nxt[0] if len(nxt) == 1 and nxt[0].op_type == "BatchNormalization" else None
            parts = _folded(view, n, bn)
            if parts is None:
                return None
            w, b = parts
            if bn is not None:
                skip.add(bn.name)
                outs = list(bn.output)
                if bn is last:
                    last = n
            x = dq.get(n.input[0], n.input[0])
            k = convs[n.name]
            if k in keep_float:
                # It reads the float tensor, not its dequantized copy: onnxruntime would
                # quantize the weights of a Conv between a DequantizeLinear and a Quantize.
                wi, bi = init(view, f"w{k}", w), init(view, f"b{k}", b)
                inits.extend((wi, bi))
                ins = [n.input[0], wi.name, bi.name]
            else:
                amax = np.abs(w).max(axis=(1, 2, 3))
                ws = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
                wq = np.clip(np.round(w / ws.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
                xs, _ = _uint8(*points[n.input[0]])
                bs = (xs * ws).astype(np.float32)
                bq = np.round(b / bs).astype(np.int32)
                wi, wsi, wzi = (
                    init(view, f"w{k}_q", wq),
                    init(view, f"w{k}_scale", ws),
                    init(view, f"w{k}_zp", np.zeros(ws.shape, np.int8)),
                )
                bi, bsi, bzi = (
                    init(view, f"b{k}_q", bq),
                    init(view, f"b{k}_scale", bs),
                    init(view, f"b{k}_zp", np.zeros(bq.shape, np.int32)),
                )
                inits.extend((wi, wsi, wzi, bi, bsi, bzi))
                new.append(
                    helper.make_node(
                        "DequantizeLinear",
                        [wi.name, wsi.name, wzi.name],
                        [view.name(f"w{k}")],
                        name=view.name(f"DQW{k}"),
                        axis=0,
                    )
                )
                new.append(
                    helper.make_node(
                        "DequantizeLinear",
                        [bi.name, bsi.name, bzi.name],
                        [view.name(f"b{k}")],
                        name=view.name(f"DQB{k}"),
                        axis=0,
                    )
                )
                ins = [x, view.name(f"w{k}"), view.name(f"b{k}")]
            node = helper.make_node("Conv", ins, outs, name=n.name)
            node.attribute.extend(n.attribute)
        else:
            node = onnx.NodeProto()
            node.CopyFrom(n)
            for i, name in enumerate(node.input):
                node.input[i] = dq.get(name, name)
        if n is last:
            final = node.output[0]
            node.output[0] = view.name("region_out")
            new.append(node)
            qdq(node.output[0], out_range, out=final)
            continue
        new.append(node)
        for o in outs:
            if o in points:
                qdq(o, points[o])
    return Rewrite(tuple(new), tuple(inits))


def int8_region_param(view: TaskView, param: str) -> Rewrite | None:
    """``int8_region:f<i>.<j>``: the Convs numbered i, j kept in float."""
    if not param.startswith("f"):
        return None
    try:
        keep = frozenset(int(p) for p in param[1:].split(".") if p)
    except ValueError:
        return None
    return int8_region(view, keep) if keep else None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / den) if den > 0 else 1.0


def propose_float_convs(view: TaskView, evaluate, notes: list[str]) -> list[str]:
    """Measure each Conv's sensitivity in context, on the task's real inputs: the error
    of the region's output (1 - cosine against float) when that Conv alone is int8.
    Propose the region with the 1, 2, ... MAX_FLOAT most sensitive Convs in float, and
    with the shallow ones (`SHALLOW`) in float, where int8 would be slower, not less
    accurate."""
    convs = region_convs(view)
    if len(convs) < 2 or int8_region(view) is None:
        return []
    ref = np.asarray(evaluate(None))
    every = frozenset(range(len(convs)))
    errors = []
    for i in range(len(convs)):
        alone = int8_region(view, every - {i})
        errors.append(1.0 - _cosine(np.asarray(evaluate(alone)), ref) if alone is not None else 0.0)
    order = sorted(range(len(convs)), key=lambda i: -errors[i])
    notes.append(
        "int8 sensitivity per Conv (1 - cosine of the region's output, that Conv alone int8): "
        + ", ".join(f"{i}:{errors[i]:.2e}" for i in order)
    )
    out = []
    for k in range(1, min(MAX_FLOAT, len(convs) - 1) + 1):
        out.append(_name(order[:k]))
    shallow = [i for i, c in enumerate(convs) if _depth(view, c) < SHALLOW]
    if shallow and len(shallow) < len(convs) and _name(shallow) not in out:
        notes.append(
            f"Convs with fewer than {SHALLOW} products per output, tried in float: "
            + ", ".join(str(i) for i in shallow)
        )
        out.append(_name(shallow))
    return out


def _name(keep_float) -> str:
    return "int8_region:f" + ".".join(str(i) for i in sorted(keep_float))


def _depth(view: TaskView, conv: onnx.NodeProto) -> int:
    """Products summed per output of `conv`: input channels per group times kernel area."""
    w = view.const(conv.input[1])
    return int(np.prod(w.shape[1:])) if w is not None and w.ndim == 4 else SHALLOW

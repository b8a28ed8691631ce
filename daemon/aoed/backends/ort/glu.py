"""Gated FFN strategies for ONNX Runtime's CPU provider (SGAT, family ``glu``).

A ``glu`` subgraph (`aoe.subgraphs`) is act(x·Wg + bg) · (x·Wu + bu), act SiLU or
Sigmoid: two products of one input. The strategies:

- ``packed_glu`` (exact): one MatMul over the concatenated [K, 2N] weight (and one bias
  Add), Split, then the gate and the product; SiLU as one com.microsoft QuickGelu with
  alpha 1 (x·Sigmoid(1·x), the same formula in one kernel).
- ``silu_kernel`` (exact): the products as they are, SiLU as one QuickGelu.
- ``int8_packed_glu`` (int8): the shared input quantized once for both products, one
  com.microsoft DynamicQuantizeMatMul over the packed weight (int8 per column), then
  the float gate; per-operator int8 quantizes the input once per product.

A strategy returns None where the block does not fit (a bias that is not one row, a
weight that is not 2-D); the default then stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from aoed.backends.ort._rewrite import Nodes, init, int8_weight
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]


@dataclass
class _Glu:
    x: str
    gate_w: np.ndarray  # [K, N]
    gate_b: np.ndarray | None  # [N]
    up_w: np.ndarray
    up_b: np.ndarray | None
    silu: bool  # SiLU (g·Sigmoid(g)); else Sigmoid


def _product(nodes: Nodes, y: str) -> tuple[str, np.ndarray, np.ndarray | None, str] | None:
    """(x, weight, bias or None, the MatMul's name) of `MatMul(x, W) [+ b]`."""
    view = nodes.view
    bias = None
    add = nodes.made(y, "Add")
    if add is not None:
        inner = next((i for i in add.input if i in nodes.producer), None)
        const = next((i for i in add.input if i != inner), None)
        b = view.const(const) if const is not None else None
        if inner is None or b is None:
            return None
        bias, y = np.asarray(b), inner
    mm = nodes.made(y, "MatMul")
    w = view.const(mm.input[1]) if mm is not None else None
    if mm is None or w is None or w.ndim != 2:
        return None
    if bias is not None:
        if bias.size != w.shape[1] or any(d != 1 for d in bias.shape[:-1]):
            return None
        bias = bias.reshape(-1).astype(w.dtype)
    return mm.input[0], np.asarray(w), bias, mm.name


def _glu_parts(view: TaskView) -> _Glu | None:
    nodes = Nodes(view)
    out = view.nodes[-1]
    if out.op_type != "Mul" or len(out.input) != 2:
        return None
    for a, u in (out.input, reversed(out.input)):
        silu = False
        act = nodes.made(a, "Sigmoid", "Mul")
        if act is not None and act.op_type == "Mul":
            sig = next(
                (
                    nodes.made(i, "Sigmoid")
                    for i in act.input
                    if nodes.made(i, "Sigmoid") is not None
                ),
                None,
            )
            if sig is None or sorted(act.input) != sorted([sig.input[0], sig.output[0]]):
                continue
            silu, g = True, sig.input[0]
        elif act is not None:
            g = act.input[0]
        else:
            continue
        gp, up = _product(nodes, g), _product(nodes, u)
        if (
            gp is None
            or up is None
            or gp[0] != up[0]
            or gp[3] == up[3]
            or gp[1].shape != up[1].shape
        ):
            continue
        return _Glu(gp[0], gp[1], gp[2], up[1], up[2], silu)
    return None


def _packed_bias(parts: _Glu) -> np.ndarray | None:
    if parts.gate_b is None and parts.up_b is None:
        return None
    n = parts.gate_w.shape[1]
    zero = np.zeros(n, parts.gate_w.dtype)
    return np.concatenate(
        [zero if parts.gate_b is None else parts.gate_b, zero if parts.up_b is None else parts.up_b]
    )


def _gate_and_product(view: TaskView, parts: _Glu, gate: str, up: str) -> list[onnx.NodeProto]:
    act = view.name("act")
    if parts.silu:
        first = helper.make_node(
            "QuickGelu", [gate], [act], name=view.name("Silu"), domain=CONTRIB_DOMAIN, alpha=1.0
        )
    else:
        first = helper.make_node("Sigmoid", [gate], [act], name=view.name("Sigmoid"))
    return [first, helper.make_node("Mul", [act, up], [view.output], name=view.name("Gate"))]


def _split(
    view: TaskView, packed: str, n: int, inits: list
) -> tuple[list[onnx.NodeProto], str, str] | None:
    if view.opset < 13:
        return None
    sizes = init(view, "split", np.array([n, n], np.int64))
    inits.append(sizes)
    gate, up = view.name("gate"), view.name("up")
    node = helper.make_node(
        "Split", [packed, sizes.name], [gate, up], name=view.name("Split"), axis=-1
    )
    return [node], gate, up


def _packed_glu(view: TaskView) -> Rewrite | None:
    """Both products as one MatMul over the concatenated weight, then Split."""
    parts = _glu_parts(view)
    if parts is None:
        return None
    n = parts.gate_w.shape[1]
    w = init(view, "weight", np.concatenate([parts.gate_w, parts.up_w], axis=1))
    inits = [w]
    packed = view.name("packed")
    nodes = [helper.make_node("MatMul", [parts.x, w.name], [packed], name=view.name("MatMul"))]
    bias = _packed_bias(parts)
    if bias is not None:
        b = init(view, "bias", bias)
        inits.append(b)
        nodes.append(
            helper.make_node(
                "Add", [packed, b.name], [view.name("packed_b")], name=view.name("Bias")
            )
        )
        packed = view.name("packed_b")
    split = _split(view, packed, n, inits)
    if split is None:
        return None
    nodes += split[0]
    nodes += _gate_and_product(view, parts, split[1], split[2])
    return Rewrite(tuple(nodes), tuple(inits))


def _silu_kernel(view: TaskView) -> Rewrite | None:
    """The products kept, SiLU as one QuickGelu (alpha 1)."""
    parts = _glu_parts(view)
    if parts is None or not parts.silu:
        return None
    inits, outs, nodes = [], [], []
    for which, w, b in (("gate", parts.gate_w, parts.gate_b), ("up", parts.up_w, parts.up_b)):
        wi = init(view, f"{which}_weight", w)
        inits.append(wi)
        y = view.name(which)
        nodes.append(
            helper.make_node("MatMul", [parts.x, wi.name], [y], name=view.name(f"{which}_MatMul"))
        )
        if b is not None:
            bi = init(view, f"{which}_bias", b)
            inits.append(bi)
            nodes.append(
                helper.make_node("Add", [y, bi.name], [y + "_b"], name=view.name(f"{which}_Bias"))
            )
            y += "_b"
        outs.append(y)
    nodes += _gate_and_product(view, parts, outs[0], outs[1])
    return Rewrite(tuple(nodes), tuple(inits))


def _int8_packed_glu(view: TaskView) -> Rewrite | None:
    """The shared input quantized once: one DynamicQuantizeMatMul over the packed int8
    weight (per column) and bias, Split, the gate in float."""
    parts = _glu_parts(view)
    if parts is None:
        return None
    n = parts.gate_w.shape[1]
    wq, ws = int8_weight(
        np.concatenate([parts.gate_w, parts.up_w], axis=1).astype(np.float32), per_channel=True
    )
    inits = [
        init(view, "weight_q", wq),
        init(view, "weight_scale", ws),
        init(view, "weight_zp", np.zeros(ws.shape, np.int8)),
    ]
    bias = _packed_bias(parts)
    if bias is not None:
        inits.append(init(view, "bias", bias.astype(np.float32)))
    packed = view.name("packed")
    nodes = [
        helper.make_node(
            "DynamicQuantizeMatMul",
            [parts.x, *(i.name for i in inits)],
            [packed],
            name=view.name("DynamicQuantizeMatMul"),
            domain=CONTRIB_DOMAIN,
        )
    ]
    split = _split(view, packed, n, inits)
    if split is None:
        return None
    nodes += split[0]
    nodes += _gate_and_product(view, parts, split[1], split[2])
    return Rewrite(tuple(nodes), tuple(inits))


def register(registry: StrategyRegistry) -> None:
    """Add the gated FFN strategies to `registry`."""
    s = registry.strategy
    s("packed_glu", "glu")(_packed_glu)
    s("silu_kernel", "glu")(_silu_kernel)
    s("int8_packed_glu", "glu", "int8")(_int8_packed_glu)

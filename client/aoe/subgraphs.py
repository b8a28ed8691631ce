"""Subgraphs: the units SGAT tunes, recognized by structure, never by node names.

A subgraph task is a `Task` like an operator task (only its last node's output escapes,
so one rewrite serves the isolated task model and the whole model), in one of these
families:

  attention   self-attention from the Q/K/V projections to the merged heads: three
              MatMuls of one input (each with an optional constant bias Add; or one
              packed product, a Gemm between Reshapes as GPT-2 exports, Split), Reshape
              to heads, Transpose (K to [b, n, d, s], directly or in two steps), the
              Q·Kᵀ MatMul, any scalar Mul/Div (on Q or on the scores), an additive
              mask (Add) or a causal Where, Softmax over the last axis (and the NaN
              guard torch's sdpa export puts after it), P·V, Transpose back (after a
              Reshape that keeps the shape, as that export writes) and Reshape to
              [b, s, hidden]. The output projection is left out:
              it is an operator task of its own.
  layernorm   LayerNorm written out (ReduceMean, Sub, Pow or Mul, ReduceMean, Add eps,
              Sqrt, Div or Reciprocal+Mul, then an optional scale Mul and bias Add), or a
              LayerNormalization node; either with the residual Add in front of it when
              that sum feeds nothing else (post-norm blocks). A lone LayerNormalization
              is already fused and is no task.
  conv_region a CNN's convolutional trunk: a connected run of Convs (constant weights),
              inference BatchNormalizations, Relus, residual Adds and pooling, at least
              two Convs, with one output leaving it (where the head begins); int8 can
              then keep every link, residual and pool inside in int8.
  gelu        GELU written out, erf form (x·0.5·(1 + erf(x/√2)) in any order of its
              products) or tanh form (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))), with
              the bias Add and the MatMul before it when they feed nothing else (an FFN's
              first product).

`subgraph_tasks` finds them in a normalized model (`aoe.graph.normalize`); a block that
does not match is simply left to operator tuning. Signatures come from
`aoe.signature.task_signature` over the task's nodes, so subgraph entries in the bank
have their own keys and twins (the same block repeated in every layer) are tuned once.

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from aoe.signature import ModelContext

__all__ = ["SUBGRAPH_FAMILIES", "Match", "find_subgraphs"]

#: Subgraph families, in the order the tuner reports them.
SUBGRAPH_FAMILIES = ("attention", "layernorm", "gelu", "conv_region")

_STD = ("", "ai.onnx")


class Match:
    """One recognized subgraph: its family and its nodes in graph order (last = output)."""

    def __init__(self, family: str, nodes: list[onnx.NodeProto]):
        self.family = family
        self.nodes = nodes


class _Graph:
    """Producers, consumers and readable constant values of one graph."""

    def __init__(self, model: onnx.ModelProto, ctx: ModelContext):
        g = model.graph
        self.ctx = ctx
        self.order = {n.name: i for i, n in enumerate(g.node)}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in g.node:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in dict.fromkeys(node.input):  # a node reading a tensor twice is one reader
                if i:
                    self.consumers[i].append(node)
        self.outputs = {o.name for o in g.output}
        inputs = {i.name for i in g.input}
        self._stored = {t.name: t for t in g.initializer if t.name not in inputs}
        self._constant_nodes = {
            n.output[0]: a.t for n in g.node if n.op_type == "Constant" and n.domain in _STD
            for a in n.attribute if a.name == "value"
        }  # fmt: skip

    def node(self, tensor: str, *op_types: str) -> onnx.NodeProto | None:
        n = self.producer.get(tensor)
        return n if n is not None and n.domain in _STD and n.op_type in op_types else None

    def is_const(self, tensor: str) -> bool:
        return tensor in self.ctx.constants

    def value(self, tensor: str) -> np.ndarray | None:
        """A stored constant's value (an initializer or a Constant node); None otherwise."""
        t = self._stored.get(tensor) or self._constant_nodes.get(tensor)
        if t is None:
            return None
        try:
            return numpy_helper.to_array(t)
        except Exception:  # external data not loaded, an odd type: not readable here
            return None

    def scalar(self, tensor: str) -> float | None:
        v = self.value(tensor)
        if v is None or v.size != 1 or v.dtype.kind not in "fiu":
            return None
        return float(v.reshape(()))

    def is_scalar(self, tensor: str, want: float, rel: float = 1e-3) -> bool:
        got = self.scalar(tensor)
        return got is not None and math.isclose(got, want, rel_tol=rel)

    def users(self, tensor: str) -> list[onnx.NodeProto]:
        return self.consumers.get(tensor, [])

    def attr(self, node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def other(self, node: onnx.NodeProto, tensor: str) -> str | None:
        """The other input of a two-input node that reads `tensor`."""
        if len(node.input) != 2:
            return None
        a, b = node.input
        return b if a == tensor else a if b == tensor else None

    def closed(self, nodes: Sequence[onnx.NodeProto]) -> bool:
        """True when only the last node's outputs leave `nodes` (no other output is a
        graph output or read by a node outside)."""
        names = {n.name for n in nodes}
        last = nodes[-1]
        for n in nodes:
            if n is last:
                continue
            for o in n.output:
                if not o:
                    continue
                if o in self.outputs or any(u.name not in names for u in self.users(o)):
                    return False
        return bool([o for o in last.output if o]) and len([o for o in last.output if o]) == 1

    def sorted(self, nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
        uniq = {n.name: n for n in nodes}
        return sorted(uniq.values(), key=lambda n: self.order[n.name])


# --------------------------------------------------------------------------- attention


def _reduce_axes(g: _Graph, node: onnx.NodeProto) -> list[int] | None:
    axes = g.attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        v = g.value(node.input[1])
        axes = None if v is None else [int(a) for a in v.reshape(-1)]
    return None if axes is None else list(axes)


def _last_axis(g: _Graph, node: onnx.NodeProto, tensor: str) -> bool:
    axes = _reduce_axes(g, node)
    info = g.ctx.tensors.get(tensor)
    if axes is None or len(axes) != 1 or info is None:
        return False
    return axes[0] in (-1, len(info.shape) - 1)


def _scaled(g: _Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str:
    """Walk back over scalar Mul/Div nodes (a softmax scale), collecting them."""
    while True:
        n = g.node(tensor, "Mul", "Div")
        if n is None:
            return tensor
        if n.op_type == "Div" and g.scalar(n.input[1]) is not None:
            nodes.append(n)
            tensor = n.input[0]
        elif n.op_type == "Mul" and g.scalar(n.input[1]) is not None:
            nodes.append(n)
            tensor = n.input[0]
        elif n.op_type == "Mul" and g.scalar(n.input[0]) is not None:
            nodes.append(n)
            tensor = n.input[1]
        else:
            return tensor


def _projection(g: _Graph, tensor: str, perms: Sequence[Sequence[int]], nodes: list[onnx.NodeProto]) -> str | None:
    """The input x of `Transpose*(Reshape(MatMul(x, W) [+ b]))` ending in `tensor`, the
    Transposes' perms being `perms` (outermost last); a scalar Mul/Div may sit on the
    way (a scale applied to Q). The product may also be a Gemm between Reshapes, and
    one output of a Split of a packed product. Collects the nodes; None when the chain
    differs."""
    tensor = _scaled(g, tensor, nodes)
    for perm in reversed(perms):
        t = g.node(tensor, "Transpose")
        if t is None or list(g.attr(t, "perm", [])) != list(perm):
            return None
        nodes.append(t)
        tensor = _scaled(g, t.input[0], nodes)
    r = g.node(tensor, "Reshape")
    if r is None or not g.is_const(r.input[1]):
        return None
    nodes.append(r)
    tensor = _scaled(g, r.input[0], nodes)
    split = g.node(tensor, "Split")
    if split is not None:  # Q, K and V from one packed product (GPT-2's c_attn)
        nodes.append(split)
        tensor = split.input[0]
    back = g.node(tensor, "Reshape")
    gemm = g.node(back.input[0], "Gemm") if back is not None else None
    if gemm is not None:  # Reshape to 2-D, Gemm, Reshape back: a Conv1D or Linear on 3-D input
        flat = g.node(gemm.input[0], "Reshape")
        if flat is None or not g.is_const(gemm.input[1]) or not all(g.is_const(i) for i in gemm.input[2:] if i):
            return None
        nodes += [back, gemm, flat]
        return flat.input[0]
    add = g.node(tensor, "Add")
    if add is not None:
        bias = add.input[1] if g.is_const(add.input[1]) else add.input[0] if g.is_const(add.input[0]) else None
        if bias is None:
            return None
        nodes.append(add)
        tensor = g.other(add, bias) or ""
    mm = g.node(tensor, "MatMul")
    if mm is None or not g.is_const(mm.input[1]) or g.is_const(mm.input[0]):
        return None
    nodes.append(mm)
    return mm.input[0]


def _reaches_scores(g: _Graph, tensor: str, depth: int = 8) -> bool:
    """True when `tensor` is Q·Kᵀ (a MatMul of two activations) behind scalar Mul/Div,
    Add and Where nodes."""
    for _ in range(depth):
        n = g.producer.get(tensor)
        if n is None or n.domain not in _STD:
            return False
        if n.op_type == "MatMul":
            return not g.is_const(n.input[0]) and not g.is_const(n.input[1])
        if n.op_type in ("Mul", "Div") and g.scalar(n.input[1]) is not None:
            tensor = n.input[0]
        elif n.op_type == "Mul" and g.scalar(n.input[0]) is not None:
            tensor = n.input[1]
        elif n.op_type == "Where":
            tensor = n.input[1]
        elif n.op_type == "Add":
            ins = [i for i in n.input if not g.is_const(i)]
            return any(_reaches_scores(g, i, depth - 1) for i in ins)
        else:
            return False
    return False


def _nan_guard(g: _Graph, probs: str) -> list[onnx.NodeProto] | None:
    """[IsNaN, Where] of `Where(IsNaN(P), 0, P)` when that is all that reads P."""
    users = g.users(probs)
    isnan = [u for u in users if u.op_type == "IsNaN"]
    where = [u for u in users if u.op_type == "Where"]
    if len(users) != 2 or len(isnan) != 1 or len(where) != 1:
        return None
    w = where[0]
    if list(w.input) != [isnan[0].output[0], w.input[1], probs] or not g.is_scalar(w.input[1], 0.0):
        return None
    if g.users(isnan[0].output[0]) != [w]:
        return None
    return [isnan[0], w]


def _unflattened(g: _Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str | None:
    """The [b, n, s, d] tensor that `Reshape(Transpose(Reshape(t, [b·n, s, d]), [0, 2, 1]),
    [b, n, d, s])` transposes, collecting those three nodes; None when `tensor` is not that."""
    r4 = g.node(tensor, "Reshape")
    t = g.node(r4.input[0], "Transpose") if r4 is not None else None
    r3 = g.node(t.input[0], "Reshape") if t is not None and list(g.attr(t, "perm", [])) == [0, 2, 1] else None
    if r3 is None:
        return None
    src, out = g.ctx.tensors.get(r3.input[0]), g.ctx.tensors.get(tensor)
    if src is None or out is None or len(src.shape) != 4 or len(out.shape) != 4:
        return None
    b, n, s, d = src.shape
    if tuple(out.shape) != (b, n, d, s):
        return None
    nodes += [r4, t, r3]
    return r3.input[0]


def _same_shape(g: _Graph, a: str, b: str) -> bool:
    sa, sb = g.ctx.tensors.get(a), g.ctx.tensors.get(b)
    return sa is not None and sb is not None and sa.shape == sb.shape


def _attention(g: _Graph, sm: onnx.NodeProto) -> Match | None:
    info = g.ctx.tensors.get(sm.input[0])
    if info is None or len(info.shape) != 4 or g.attr(sm, "axis", -1) not in (-1, 3):
        return None
    nodes: list[onnx.NodeProto] = [sm]
    t = sm.input[0]
    qk = None
    for _ in range(8):  # scale, mask and causal Where between Q·Kᵀ and Softmax
        n = g.producer.get(t)
        if n is None or n.domain not in _STD:
            return None
        if n.op_type == "MatMul" and not g.is_const(n.input[0]) and not g.is_const(n.input[1]):
            qk = n
            break
        if n.op_type in ("Mul", "Div"):
            s = _scaled(g, t, nodes)
            if s == t:
                return None
            t = s
            continue
        if n.op_type == "Add":
            # The scores come from the side that leads back to Q·Kᵀ; the other is the mask.
            side = [i for i in n.input if _reaches_scores(g, i)]
            if len(side) != 1:
                return None
            nodes.append(n)
            t = side[0]
            continue
        if n.op_type == "Where" and g.is_const(n.input[0]) and g.is_const(n.input[2]):
            nodes.append(n)
            t = n.input[1]
            continue
        return None
    if qk is None:
        return None
    nodes.append(qk)
    probs = sm.output[0]
    guard = _nan_guard(g, probs)
    if guard is not None:  # Where(IsNaN(P), 0, P), as torch's sdpa export writes
        nodes += guard
        probs = guard[-1].output[0]
    pv = [u for u in g.users(probs) if u.op_type == "MatMul" and u.domain in _STD and u.input[0] == probs]
    if len(pv) != 1 or len(g.users(probs)) != 1:
        return None
    pv_node = pv[0]
    nodes.append(pv_node)
    q = _projection(g, qk.input[0], [(0, 2, 1, 3)], nodes)
    k = _projection(g, qk.input[1], [(0, 2, 3, 1)], nodes)
    if k is None:
        k = _projection(g, qk.input[1], [(0, 2, 1, 3), (0, 1, 3, 2)], nodes)
    if k is None:  # torch's dynamo export: Kᵀ as Reshape to 3-D, Transpose, Reshape back
        inner = _unflattened(g, _scaled(g, qk.input[1], nodes), nodes)
        k = _projection(g, inner, [(0, 2, 1, 3)], nodes) if inner is not None else None
    v = _projection(g, pv_node.input[1], [(0, 2, 1, 3)], nodes)
    xs = [q, k, v]
    if None in xs or len(set(xs)) != 1:
        return None
    ctx_out = pv_node.output[0]
    users = g.users(ctx_out)
    if len(users) == 1 and users[0].op_type == "Reshape" and _same_shape(g, ctx_out, users[0].output[0]):
        nodes.append(users[0])  # a Reshape that keeps [b, n, s, d] (torch's sdpa export)
        ctx_out = users[0].output[0]
        users = g.users(ctx_out)
    if len(users) != 1 or users[0].op_type != "Transpose" or list(g.attr(users[0], "perm", [])) != [0, 2, 1, 3]:
        return None
    tr = users[0]
    users = g.users(tr.output[0])
    if len(users) != 1 or users[0].op_type != "Reshape" or not g.is_const(users[0].input[1]):
        return None
    nodes += [tr, users[0]]
    ordered = g.sorted(nodes)
    if ordered[-1] is not users[0] or not g.closed(ordered):
        return None
    return Match("attention", ordered)


# --------------------------------------------------------------------------- layernorm


def _residual(g: _Graph, x: str, inside: Sequence[onnx.NodeProto]) -> onnx.NodeProto | None:
    """The Add producing `x` from two activations when `x` feeds only `inside`."""
    add = g.node(x, "Add")
    if add is None or x in g.outputs or any(g.is_const(i) for i in add.input):
        return None
    names = {n.name for n in inside}
    if any(u.name not in names for u in g.users(x)):
        return None
    a, b = (g.ctx.tensors.get(i) for i in add.input)
    if a is None or b is None or a.shape != b.shape:
        return None  # a broadcasting Add (a bias) is no residual
    return add


def _layernorm(g: _Graph, r1: onnx.NodeProto) -> Match | None:
    """A LayerNorm written out, anchored at its first ReduceMean."""
    x = r1.input[0]
    if not _last_axis(g, r1, x):
        return None
    sub = [u for u in g.users(r1.output[0]) if u.op_type == "Sub" and u.input == [x, r1.output[0]]]
    if len(sub) != 1 or len(g.users(r1.output[0])) != 1:
        return None
    d = sub[0].output[0]
    uses = g.users(d)
    sq = [u for u in uses if (u.op_type == "Pow" and u.input[0] == d and g.is_scalar(u.input[1], 2.0))
          or (u.op_type == "Mul" and list(u.input) == [d, d])]  # fmt: skip
    if len(sq) != 1:
        return None
    r2 = g.users(sq[0].output[0])
    if len(r2) != 1 or r2[0].op_type != "ReduceMean" or not _last_axis(g, r2[0], sq[0].output[0]):
        return None
    eps = g.users(r2[0].output[0])
    if len(eps) != 1 or eps[0].op_type != "Add" or g.scalar(g.other(eps[0], r2[0].output[0]) or "") is None:
        return None
    sqrt = g.users(eps[0].output[0])
    if len(sqrt) != 1 or sqrt[0].op_type != "Sqrt":
        return None
    nodes = [r1, sub[0], sq[0], r2[0], eps[0], sqrt[0]]
    after = g.users(sqrt[0].output[0])
    if len(after) != 1:
        return None
    if after[0].op_type == "Div" and list(after[0].input) == [d, sqrt[0].output[0]]:
        nodes.append(after[0])
    elif after[0].op_type == "Reciprocal":
        mul = g.users(after[0].output[0])
        if len(mul) != 1 or mul[0].op_type != "Mul" or g.other(mul[0], after[0].output[0]) != d:
            return None
        nodes += [after[0], mul[0]]
    else:
        return None
    out = nodes[-1].output[0]
    for op in ("Mul", "Add"):  # scale, then shift
        users = g.users(out)
        if len(users) == 1 and users[0].op_type == op and g.is_const(g.other(users[0], out) or ""):
            nodes.append(users[0])
            out = users[0].output[0]
    if set(u.name for u in g.users(d)) - {n.name for n in nodes}:
        return None
    res = _residual(g, x, nodes)
    if res is not None:
        nodes.append(res)
    ordered = g.sorted(nodes)
    return Match("layernorm", ordered) if g.closed(ordered) else None


def _skip_layernorm(g: _Graph, ln: onnx.NodeProto) -> Match | None:
    """A LayerNormalization node over the last axis with a residual Add in front."""
    if g.attr(ln, "axis", -1) not in (-1,) and g.ctx.tensors.get(ln.input[0]) is not None:
        info = g.ctx.tensors[ln.input[0]]
        if g.attr(ln, "axis", -1) != len(info.shape) - 1:
            return None
    if len(ln.input) < 2 or not all(g.is_const(i) for i in ln.input[1:] if i):
        return None
    res = _residual(g, ln.input[0], [ln])
    if res is None:
        return None
    ordered = g.sorted([res, ln])
    return Match("layernorm", ordered) if g.closed(ordered) else None


# --------------------------------------------------------------------------- gelu


def _gelu_tail(g: _Graph, x: str, inner: str, nodes: list[onnx.NodeProto]) -> bool:
    """From `inner` = 1 + f(x), the products with x and 0.5 in any order; collects them."""
    users = g.users(inner)
    if len(users) != 1 or users[0].op_type != "Mul":
        return False
    m1 = users[0]
    o = g.other(m1, inner)
    nodes.append(m1)
    if o == x:  # x·(1 + f) then ·0.5
        m2 = g.users(m1.output[0])
        if len(m2) != 1 or m2[0].op_type != "Mul" or not g.is_scalar(g.other(m2[0], m1.output[0]) or "", 0.5):
            return False
        nodes.append(m2[0])
        return True
    if o is not None and g.is_scalar(o, 0.5):  # (1 + f)·0.5 then ·x
        m2 = g.users(m1.output[0])
        if len(m2) != 1 or m2[0].op_type != "Mul" or g.other(m2[0], m1.output[0]) != x:
            return False
        nodes.append(m2[0])
        return True
    h = g.node(o or "", "Mul")  # (x·0.5)·(1 + f)
    if h is not None and x in h.input and g.is_scalar(g.other(h, x) or "", 0.5):
        nodes.append(h)
        return True
    return False


def _gelu(g: _Graph, anchor: onnx.NodeProto) -> Match | None:
    """GELU written out, anchored at its Erf or Tanh."""
    nodes: list[onnx.NodeProto] = [anchor]
    if anchor.op_type == "Erf":
        pre = g.node(anchor.input[0], "Div", "Mul")
        if pre is None:
            return None
        if pre.op_type == "Div" and g.is_scalar(pre.input[1], math.sqrt(2.0)):
            x = pre.input[0]
        elif pre.op_type == "Mul" and g.is_scalar(pre.input[1], 1 / math.sqrt(2.0)):
            x = pre.input[0]
        elif pre.op_type == "Mul" and g.is_scalar(pre.input[0], 1 / math.sqrt(2.0)):
            x = pre.input[1]
        else:
            return None
        nodes.append(pre)
    else:  # Tanh(√(2/π)·(x + 0.044715·x³))
        pre = g.node(anchor.input[0], "Mul")
        if pre is None:
            return None
        c = next((i for i in pre.input if g.is_scalar(i, math.sqrt(2 / math.pi))), None)
        inner = g.node(g.other(pre, c) or "", "Add") if c is not None else None
        if inner is None:
            return None
        cube = next((g.node(i, "Mul") for i in inner.input if g.node(i, "Mul") is not None), None)
        if cube is None:
            return None
        x = g.other(inner, cube.output[0]) or ""
        k = next((i for i in cube.input if g.is_scalar(i, 0.044715)), None)
        p = g.node(g.other(cube, k) or "", "Pow", "Mul") if k is not None else None
        if p is None or p.input[0] != x:
            return None
        if p.op_type == "Pow" and not g.is_scalar(p.input[1], 3.0):
            return None
        if p.op_type == "Mul":  # x·x·x as two Muls
            sq = g.node(p.input[1], "Mul") if p.input[0] == x else None
            if sq is None or list(sq.input) != [x, x]:
                return None
            nodes.append(sq)
        nodes += [pre, inner, cube, p]
    one = g.users(anchor.output[0])
    if len(one) != 1 or one[0].op_type != "Add" or not g.is_scalar(g.other(one[0], anchor.output[0]) or "", 1.0):
        return None
    nodes.append(one[0])
    if not _gelu_tail(g, x, one[0].output[0], nodes):
        return None
    # The FFN's first product and its bias, when they feed nothing else.
    inside = {n.name for n in nodes}
    add = g.node(x, "Add")
    if add is not None and x not in g.outputs and all(u.name in inside for u in g.users(x)):
        bias = next((i for i in add.input if g.is_const(i)), None)
        mm = g.node(g.other(add, bias) or "", "MatMul") if bias is not None else None
        if mm is not None and g.is_const(mm.input[1]) and len(g.users(mm.output[0])) == 1 and mm.output[0] not in g.outputs:
            nodes += [add, mm]
    ordered = g.sorted(nodes)
    return Match("gelu", ordered) if g.closed(ordered) else None


# --------------------------------------------------------------------------- conv regions

#: What a CNN region is made of: every one has an int8 kernel in onnxruntime (QLinearConv,
#: QLinearAdd, QLinear pooling) or folds away (BatchNormalization into its Conv, Relu
#: into the range of what follows).
_REGION_OPS = ("Conv", "BatchNormalization", "Relu", "Add", "MaxPool", "AveragePool", "GlobalAveragePool")


def _in_region(g: _Graph, node: onnx.NodeProto) -> bool:
    if node.domain not in _STD or node.op_type not in _REGION_OPS:
        return False
    if node.op_type == "Conv":
        return len(node.input) >= 2 and g.is_const(node.input[1]) and all(g.is_const(i) for i in node.input[2:] if i)
    if node.op_type == "BatchNormalization":
        return len([o for o in node.output if o]) == 1 and all(g.is_const(i) for i in node.input[1:])
    if node.op_type == "Add":  # a residual: two activations of one shape
        a, b = (g.ctx.tensors.get(i) for i in node.input)
        return not any(g.is_const(i) for i in node.input) and a is not None and b is not None and a.shape == b.shape
    if node.op_type == "MaxPool":
        return len([o for o in node.output if o]) == 1  # no indices output
    return True


def _conv_regions(model: onnx.ModelProto, g: _Graph) -> list[Match]:
    """Connected runs of region ops with at least two Convs and one output leaving."""
    members = [n for n in model.graph.node if _in_region(g, n)]
    inside = {n.name for n in members}
    parent = {n.name: n.name for n in members}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for n in members:
        for i in n.input:
            p = g.producer.get(i)
            if p is not None and p.name in inside:
                parent[find(p.name)] = find(n.name)
    groups: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in members:
        groups[find(n.name)].append(n)
    found = []
    for nodes in groups.values():
        if sum(n.op_type == "Conv" for n in nodes) < 2:
            continue
        ordered = g.sorted(nodes)
        if g.closed(ordered):
            found.append(Match("conv_region", ordered))
    return found


# --------------------------------------------------------------------------- all


def find_subgraphs(model: onnx.ModelProto, ctx: ModelContext) -> list[Match]:
    """Every subgraph of `model` in a family, in graph order of their outputs; no node
    is in two. Attention first (it is the biggest), then LayerNorm, then GELU."""
    g = _Graph(model, ctx)
    taken: set[str] = set()
    found: list[Match] = []
    finders = (
        (("Softmax",), _attention),
        (("ReduceMean",), _layernorm),
        (("LayerNormalization",), _skip_layernorm),
        (("Erf", "Tanh"), _gelu),
    )
    for op_types, finder in finders:
        for node in model.graph.node:
            if node.op_type not in op_types or node.domain not in _STD or node.name in taken:
                continue
            try:
                m = finder(g, node)
            except (KeyError, IndexError, ValueError, TypeError):
                m = None  # an odd graph: that block is left to operator tuning
            if m is None or any(n.name in taken for n in m.nodes):
                continue
            taken.update(n.name for n in m.nodes)
            found.append(m)
    for m in _conv_regions(model, g):
        if not any(n.name in taken for n in m.nodes):
            taken.update(n.name for n in m.nodes)
            found.append(m)
    found.sort(key=lambda m: g.order[m.nodes[-1].name])
    return found

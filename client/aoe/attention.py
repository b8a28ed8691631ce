"""Self-attention blocks recognized by structure (`aoe.subgraphs`, family ``attention``).

From a Softmax back to the Q/K/V projections and forward to the merged heads: three
MatMuls of one input (each with an optional constant bias Add; or one packed product, a
Gemm between Reshapes as GPT-2 exports, Split), Reshape to heads, Transpose (K to
[b, n, d, s], directly or in two steps), rotary embeddings on Q and K (LLaMA-style
models: t·cos + rotate_half(t)·sin, cos and sin constants), K and V heads repeated for
groups of query heads (grouped-query attention, transformers' repeat_kv), the Q·Kᵀ
MatMul, any scalar Mul/Div, an additive mask (with the Where that makes it from a
boolean, when it serves this block alone) or a causal Where, Softmax over the last axis
(and the NaN guard torch's sdpa export puts after it), P·V, Transpose back and Reshape
to [b, s, hidden]. The output projection is left out.

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx

from aoe._sgraph import STD, Graph, Match

__all__ = ["MASKED", "attention", "mask_fill"]


def _scaled(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str:
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


def _rotary(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str:
    """The t of `t·cos + rotate_half(t)·sin` ending in `tensor` (rotary position
    embeddings as LLaMA-style models write them: rotate_half(t) = Concat(-t[..., h:],
    t[..., :h]), cos and sin constants), collecting those nodes; `tensor` itself when
    it is not that."""
    add = g.node(tensor, "Add")
    if add is None or len(add.input) != 2:
        return tensor
    for a, b in (add.input, reversed(add.input)):
        straight, turned = g.node(a, "Mul"), g.node(b, "Mul")
        if straight is None or turned is None or len(turned.input) != 2:
            continue
        for cat_out, sin in (turned.input, reversed(turned.input)):
            cat = g.node(cat_out, "Concat")
            if cat is None or len(cat.input) != 2 or not g.is_const(sin):
                continue
            neg, low = g.node(cat.input[0], "Neg"), g.node(cat.input[1], "Slice")
            high = g.node(neg.input[0], "Slice") if neg is not None else None
            if high is None or low is None or high.input[0] != low.input[0]:
                continue
            t = low.input[0]
            cos = g.other(straight, t)
            if (
                cos is None
                or not g.is_const(cos)
                or not all(g.is_const(i) for s in (low, high) for i in s.input[1:] if i)
            ):
                continue
            nodes += [add, straight, turned, cat, neg, high, low]
            return t
    return tensor


def _widened(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str | None:
    """The t of `Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d])` ending in `tensor`, t
    being [b, kv, s, d] (K or V heads repeated for groups of query heads, as
    transformers' repeat_kv writes grouped-query attention), collecting those nodes; None
    when it is not that. The shapes are checked, not the Expand's shape input, which
    exports compute at run time."""
    e = g.node(tensor, "Expand")
    u = g.node(e.input[0], "Unsqueeze") if e is not None else None
    if u is None:
        return None
    axes = g.attr(u, "axes")
    if axes is None and len(u.input) > 1:
        v = g.value(u.input[1])
        axes = None if v is None else [int(a) for a in v.reshape(-1)]
    src, wide = g.ctx.tensors.get(u.input[0]), g.ctx.tensors.get(tensor)
    if axes is None or list(axes) not in ([2], [-3]) or src is None or wide is None:
        return None
    if (
        len(src.shape) != 4
        or len(wide.shape) != 5
        or tuple(wide.shape[:2] + wide.shape[3:]) != tuple(src.shape)
    ):
        return None
    nodes += [e, u]
    return u.input[0]


def _repeated(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str:
    """The t of repeat_kv, `Reshape(Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d]),
    [b, kv·r, s, d])`, ending in `tensor`, collecting those nodes; `tensor` itself when
    it is not that."""
    r = g.node(tensor, "Reshape")
    if r is None or not g.is_const(r.input[1]):
        return tensor
    wide, out = g.ctx.tensors.get(r.input[0]), g.ctx.tensors.get(tensor)
    found: list[onnx.NodeProto] = []
    t = _widened(g, r.input[0], found)
    if t is None or wide is None or out is None:
        return tensor
    b, kv, rep, s, d = wide.shape
    if tuple(out.shape) != (b, kv * rep, s, d):
        return tensor
    nodes += [r, *found]
    return t


def _projection(
    g: Graph, tensor: str, perms: Sequence[Sequence[int]], nodes: list[onnx.NodeProto]
) -> str | None:
    """The input x of `Transpose*(Reshape(MatMul(x, W) [+ b]))` ending in `tensor`, the
    Transposes' perms being `perms` (outermost last); a scalar Mul/Div may sit on the
    way (a scale applied to Q), and rotary embeddings on the heads (Q and K of
    LLaMA-style models). The product may also be a Gemm between Reshapes, and one
    output of a Split of a packed product. Collects the nodes; None when the chain
    differs."""
    tensor = _scaled(g, tensor, nodes)
    rotated = repeated = False
    for perm in reversed(perms):
        if not repeated:
            inner = _repeated(g, tensor, nodes)
            repeated = inner != tensor
            tensor = _scaled(g, inner, nodes)
        if not rotated:
            inner = _rotary(g, tensor, nodes)
            rotated = inner != tensor
            tensor = _scaled(g, inner, nodes)
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
        if (
            flat is None
            or not g.is_const(gemm.input[1])
            or not all(g.is_const(i) for i in gemm.input[2:] if i)
        ):
            return None
        nodes += [back, gemm, flat]
        return flat.input[0]
    add = g.node(tensor, "Add")
    if add is not None:
        bias = (
            add.input[1]
            if g.is_const(add.input[1])
            else add.input[0]
            if g.is_const(add.input[0])
            else None
        )
        if bias is None:
            return None
        nodes.append(add)
        tensor = g.other(add, bias) or ""
    mm = g.node(tensor, "MatMul")
    if mm is None or not g.is_const(mm.input[1]) or g.is_const(mm.input[0]):
        return None
    nodes.append(mm)
    return mm.input[0]


def _reaches_scores(g: Graph, tensor: str, depth: int = 8) -> bool:
    """True when `tensor` is Q·Kᵀ (a MatMul of two activations) behind scalar Mul/Div,
    Add and Where nodes."""
    for _ in range(depth):
        n = g.producer.get(tensor)
        if n is None or n.domain not in STD:
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


def _nan_guard(g: Graph, probs: str) -> list[onnx.NodeProto] | None:
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


def _unflattened(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> str | None:
    """The [b, n, s, d] tensor that `Reshape(Transpose(Reshape(t, [b·n, s, d]), [0, 2, 1]),
    [b, n, d, s])` transposes, collecting those three nodes; None when `tensor` is not that."""
    r4 = g.node(tensor, "Reshape")
    t = g.node(r4.input[0], "Transpose") if r4 is not None else None
    r3 = (
        g.node(t.input[0], "Reshape")
        if t is not None and list(g.attr(t, "perm", [])) == [0, 2, 1]
        else None
    )
    if r3 is None:
        return None
    src, out = g.ctx.tensors.get(r3.input[0]), g.ctx.tensors.get(tensor)
    if src is None or out is None or len(out.shape) != 4:
        return None
    if len(src.shape) == 5:  # grouped-query: repeat_kv's Reshape merged into this one
        b, kv, r, s, d = src.shape
        found: list[onnx.NodeProto] = []
        inner = _widened(g, r3.input[0], found)
        if inner is None or tuple(out.shape) != (b, kv * r, d, s):
            return None
        nodes += [r4, t, r3, *found]
        return inner
    if len(src.shape) != 4:
        return None
    b, n, s, d = src.shape
    if tuple(out.shape) != (b, n, d, s):
        return None
    nodes += [r4, t, r3]
    return r3.input[0]


#: An additive mask value at or below this hides its position from the softmax.
MASKED = -1e4


def mask_fill(a: float | None, b: float | None) -> float | None:
    """The fill of a Where(cond, a, b) that makes an additive mask from a boolean: one
    branch 0, the other a constant at or below MASKED (-inf too); None otherwise."""
    if a is None or b is None or (a == 0.0) == (b == 0.0):
        return None
    fill = b if a == 0.0 else a
    return None if math.isnan(fill) or fill > MASKED else fill


def _mask_where(g: Graph, mask: str, add: onnx.NodeProto) -> onnx.NodeProto | None:
    """The `Where(cond, 0, fill)` (or `Where(cond, fill, 0)`) that makes the additive
    `mask` from a boolean computed outside, fill a constant at or below MASKED (-inf
    too), when it feeds this block's Add alone: as transformers writes each layer's mask. Taken
    into the block, the boolean becomes the block's input, which a raw-mask kernel
    (QAttention's mask_index) can read."""
    w = g.node(mask, "Where")
    if w is None or mask in g.outputs or g.users(mask) != [add] or g.is_const(w.input[0]):
        return None
    if mask_fill(g.scalar(w.input[1]), g.scalar(w.input[2])) is None:
        return None
    cond = g.ctx.tensors.get(w.input[0])
    return w if cond is not None and len(cond.shape) == 4 else None


def _same_shape(g: Graph, a: str, b: str) -> bool:
    sa, sb = g.ctx.tensors.get(a), g.ctx.tensors.get(b)
    return sa is not None and sb is not None and sa.shape == sb.shape


def attention(g: Graph, sm: onnx.NodeProto) -> Match | None:
    info = g.ctx.tensors.get(sm.input[0])
    if info is None or len(info.shape) != 4 or g.attr(sm, "axis", -1) not in (-1, 3):
        return None
    nodes: list[onnx.NodeProto] = [sm]
    t = sm.input[0]
    qk = None
    for _ in range(8):  # scale, mask and causal Where between Q·Kᵀ and Softmax
        n = g.producer.get(t)
        if n is None or n.domain not in STD:
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
            mask = g.other(n, side[0])
            where = _mask_where(g, mask, n) if mask is not None else None
            if where is not None:
                nodes.append(where)
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
    pv = [
        u
        for u in g.users(probs)
        if u.op_type == "MatMul" and u.domain in STD and u.input[0] == probs
    ]
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
    if (
        len(users) == 1
        and users[0].op_type == "Reshape"
        and _same_shape(g, ctx_out, users[0].output[0])
    ):
        nodes.append(users[0])  # a Reshape that keeps [b, n, s, d] (torch's sdpa export)
        ctx_out = users[0].output[0]
        users = g.users(ctx_out)
    if (
        len(users) != 1
        or users[0].op_type != "Transpose"
        or list(g.attr(users[0], "perm", [])) != [0, 2, 1, 3]
    ):
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

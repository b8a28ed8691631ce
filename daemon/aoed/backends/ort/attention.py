"""Attention strategies for ONNX Runtime's CPU provider (SGAT, family ``attention``).

`_attention_parts` reads what a fused kernel needs from an attention subgraph
(`aoe.subgraphs`): the three projections (separate, or one packed product and a Split),
the head count, the scale, an additive mask (activation or constant) or a causal one,
rotary embeddings on Q and K (LLaMA-style: t·cos + rotate_half(t)·sin), and K and V
heads shared by groups of query heads (grouped-query attention: transformers' repeat_kv).
The strategies, with the same outputs up to float rounding (precision ``exact``):

- ``fused_attention``: the com.microsoft ``Attention`` kernel over packed Q/K/V weights
  (one product, then scaled dot product, softmax and merge in one kernel; no rotary);
- ``multihead_attention``: one packed projection, then ``MultiHeadAttention``; rotary
  embeddings as com.microsoft ``RotaryEmbedding`` on Q and K before it (where the
  model's tables are one [S, D] table whose halves repeat, what that kernel computes);
- ``group_query_attention``: one packed projection, then com.microsoft
  ``GroupQueryAttention``, which reads each K/V head for its group of query heads (a
  group of one where the block has as many K/V heads as query heads; rotary embeddings
  as ``RotaryEmbedding`` before it);
- ``packed_qkv``: only the packing (one product over the concatenated weights and a
  Split, the rest as it was).

On a grouped-query block, ``fused_attention``, ``multihead_attention`` and
``int8_qattention`` take the K and V weights with each head's columns repeated for its
group: the same outputs, for a larger K/V product.

Under the ``int8`` policy (weights int8 per column, the shared input quantized once at
run time): ``int8_qattention`` (the whole block on com.microsoft QAttention; no
rotary, and a mask from an input only where the block makes it itself from a boolean,
as transformers writes each layer's Where(keep, 0, -inf): that boolean becomes
QAttention's raw mask_index), ``int8_multihead_attention`` and
``int8_group_query_attention`` (the packed projection on one DynamicQuantizeMatMul, then
the fused float kernel) and ``int8_packed_qkv`` (that product, the rest as the model
has it).

A strategy returns None where the block's details do not fit its kernel (a mask it
cannot express, a scale applied after a mask that is not constant, a rank it does not
take); the default then stays. The scale, mask and head count are read from the task's
constants, never assumed. Where the block guards its softmax (Where(IsNaN(P), 0, P),
torch's sdpa export), the fused kernels get the same guard on their output: a query row
whose every key is masked by -inf (a left-padded position) is NaN in them as in the
softmax, and zeros in the block. Where no row can lose every key to -inf (the mask's
fill is finite, as transformers writes it, or the only mask is causal), the guard
never fires and the kernels go without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from aoe.attention import mask_fill
from aoed.backends.ort._rewrite import Nodes, attrs_of, init, int8_weight, scalar
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]

#: the fill the kernels get in place of a mask Where's -inf where `_row_guard` applies:
#: exp(FINITE_FILL - max) is 0 in float32 as exp(-inf) is, and a row of it is finite
FINITE_FILL = -1e30


class _Attention:
    """The parts of an attention subgraph a fused kernel needs."""

    x: str
    weights: list[np.ndarray]  # Wq, Wk, Wv as [hidden, h]
    biases: list[np.ndarray]  # bq, bk, bv (zeros where the model has none)
    has_bias: bool
    projections: list[_Proj]
    heads: int
    head_dim: int
    scale: float  # of Q·Kᵀ before the mask
    mask: str | None = None  # an additive mask tensor, [.., S, T] (activation or constant)
    mask_value: np.ndarray | None = None  # its value when constant (scaled as the scores are)
    causal: bool = False
    rotated: bool = False  # rotary embeddings on Q and K
    rotary: tuple[np.ndarray, np.ndarray] | None = None  # their caches, where RotaryEmbedding fits
    groups: int = 1  # query heads per K/V head (grouped-query attention)
    #: the block's own Where(keep, 0, fill) that makes `mask` from a boolean (or
    #: Where(masked, fill, 0)): (the node, the boolean, True when it marks kept
    #: positions, fill)
    mask_where: tuple[onnx.NodeProto, str, bool, float] | None = None
    guard: bool = False  # Where(IsNaN(P), 0, P) after the softmax (torch's sdpa export)


def _walk_scale(nodes: Nodes, tensor: str, factor: float) -> tuple[str, float] | None:
    """Back over scalar Mul/Div from `tensor`: (where it starts, the product of the scales)."""
    view = nodes.view
    while True:
        n = nodes.made(tensor, "Mul", "Div")
        if n is None:
            return tensor, factor
        a, b = scalar(view, n.input[0]), scalar(view, n.input[1])
        if n.op_type == "Div" and b is not None and b != 0:
            factor /= b
            tensor = n.input[0]
        elif n.op_type == "Mul" and b is not None:
            factor *= b
            tensor = n.input[0]
        elif n.op_type == "Mul" and a is not None:
            factor *= a
            tensor = n.input[1]
        else:
            return tensor, factor


@dataclass
class _Proj:
    """One of Q, K, V: its input, weight [in, out], bias, the scale applied on the way,
    the nodes that compute it (shared by all three for a packed projection) and the
    tensor they produce before the split into heads."""

    x: str
    weight: np.ndarray
    bias: np.ndarray
    scale: float
    nodes: list[onnx.NodeProto]
    out: str
    heads_shape: tuple
    rotated: bool = False  # rotary embeddings on the heads
    rotary: tuple[np.ndarray, np.ndarray] | None = None  # their (cos, sin) caches, [S, D/2]
    groups: int = 1  # heads repeated this many times on the way (repeat_kv)


def _widened(nodes: Nodes, tensor: str) -> tuple[str, int] | None:
    """(t, r) of `Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d])` ending in `tensor`, t
    being [b, kv, s, d]: K or V heads repeated for groups of query heads (repeat_kv),
    checked by the shapes; None when it is not that."""
    view = nodes.view
    e = nodes.made(tensor, "Expand")
    u = nodes.made(e.input[0], "Unsqueeze") if e is not None else None
    if u is None:
        return None
    axes = attrs_of(u).get("axes")
    if axes is None and len(u.input) > 1:
        v = view.const(u.input[1])
        axes = None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    src, wide = view.info(u.input[0]), view.info(tensor)
    if axes is None or list(axes) not in ([2], [-3]) or src is None or wide is None:
        return None
    if (
        len(src.shape) != 4
        or len(wide.shape) != 5
        or tuple(wide.shape[:2] + wide.shape[3:]) != tuple(src.shape)
    ):
        return None
    return u.input[0], int(wide.shape[2])


def _repeat(nodes: Nodes, tensor: str) -> tuple[str, int] | None:
    """(t, r) of repeat_kv, `Reshape(Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d]),
    [b, kv·r, s, d])`, ending in `tensor`; None when it is not that."""
    r = nodes.made(tensor, "Reshape")
    got = _widened(nodes, r.input[0]) if r is not None else None
    src, out = (
        (nodes.view.info(got[0]), nodes.view.info(tensor)) if got is not None else (None, None)
    )
    if got is None or src is None or out is None:
        return None
    b, kv, s, d = src.shape
    return got if tuple(out.shape) == (b, kv * got[1], s, d) else None


def _gemm_weights(view: TaskView, gemm: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
    """(weight [in, out], bias) of a plain Gemm (alpha = beta = 1, A not transposed)."""
    a = attrs_of(gemm)
    if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
        return None
    w = view.const(gemm.input[1])
    if w is None or w.ndim != 2:
        return None
    w = np.asarray(w).T if a.get("transB", 0) else np.asarray(w)
    c = (
        view.const(gemm.input[2])
        if len(gemm.input) > 2 and gemm.input[2]
        else np.zeros(w.shape[1], w.dtype)
    )
    if c is None or np.size(c) != w.shape[1]:
        return None
    return w, np.asarray(c, w.dtype).reshape(-1)


def _product(
    nodes: Nodes, tensor: str
) -> tuple[str, np.ndarray, np.ndarray, list[onnx.NodeProto]] | None:
    """(x, weight, bias, nodes) of `MatMul(x, W) [+ b]`, or of a Gemm between Reshapes
    to 2-D and back (as GPT-2's Conv1D exports)."""
    view = nodes.view
    add = nodes.made(tensor, "Add")
    if add is not None:
        inner = next((i for i in add.input if i in nodes.producer), "")
        mm = nodes.made(inner, "MatMul")
        if mm is None:
            return None
        w, b = view.const(mm.input[1]), view.const(next(i for i in add.input if i != inner))
        if w is None or b is None or w.ndim != 2 or b.size != w.shape[1]:
            return None
        return mm.input[0], np.asarray(w), np.asarray(b, w.dtype).reshape(-1), [mm, add]
    mm = nodes.made(tensor, "MatMul")
    if mm is not None:
        w = view.const(mm.input[1])
        if w is None or w.ndim != 2:
            return None
        return mm.input[0], np.asarray(w), np.zeros(w.shape[1], w.dtype), [mm]
    back = nodes.made(tensor, "Reshape")
    gemm = nodes.made(back.input[0], "Gemm") if back is not None else None
    flat = nodes.made(gemm.input[0], "Reshape") if gemm is not None else None
    if flat is None:
        return None
    wb = _gemm_weights(view, gemm)
    if wb is None:
        return None
    return flat.input[0], wb[0], wb[1], [flat, gemm, back]


def _split_sizes(view: TaskView, split: onnx.NodeProto, total: int) -> list[int] | None:
    a = attrs_of(split)
    if len(split.input) > 1 and split.input[1]:
        sizes = view.const(split.input[1])
        return None if sizes is None else [int(v) for v in np.asarray(sizes).reshape(-1)]
    if "split" in a:
        return [int(v) for v in a["split"]]
    n = len(split.output)
    return [total // n] * n if total % n == 0 else None


def _slice_of(view: TaskView, node: onnx.NodeProto, rank: int) -> tuple[int, int] | None:
    """(start, end) of a Slice along the last axis with step 1; None otherwise."""
    vals = [view.const(i) if i else None for i in node.input[1:5]]
    if (
        len(vals) < 3
        or any(v is None for v in vals[:3])
        or any(np.size(v) != 1 for v in vals if v is not None)
    ):
        return None
    start, end, axis = (int(np.asarray(v).reshape(())) for v in vals[:3])
    step = int(np.asarray(vals[3]).reshape(())) if len(vals) > 3 and vals[3] is not None else 1
    if axis not in (-1, rank - 1) or step != 1:
        return None
    return start, end


def _rotary(nodes: Nodes, tensor: str) -> tuple[str, tuple[np.ndarray, np.ndarray] | None] | None:
    """(t, (cos, sin) as [S, D/2] caches) of `t·cos + rotate_half(t)·sin` ending in
    `tensor`, rotate_half(t) = Concat(-t[..., D/2:], t[..., :D/2]) (non-interleaved, as
    LLaMA-style models write it); the caches are None where the tables are not what
    onnxruntime's RotaryEmbedding computes (one [S, D] table whose halves repeat). None
    when `tensor` is not that."""
    view = nodes.view
    add = nodes.made(tensor, "Add")
    if add is None:
        return None
    for a, b in (add.input, tuple(reversed(add.input))):
        straight, turned = nodes.made(a, "Mul"), nodes.made(b, "Mul")
        if straight is None or turned is None:
            continue
        for cat_out, sin_name in (turned.input, tuple(reversed(turned.input))):
            cat = nodes.made(cat_out, "Concat")
            neg = (
                nodes.made(cat.input[0], "Neg") if cat is not None and len(cat.input) == 2 else None
            )
            low = nodes.made(cat.input[1], "Slice") if neg is not None else None
            high = nodes.made(neg.input[0], "Slice") if neg is not None else None
            if low is None or high is None or low.input[0] != high.input[0]:
                continue
            t = low.input[0]
            info = view.info(t)
            cos_name = (
                next((i for i in straight.input if i != t), None) if t in straight.input else None
            )
            cos = view.const(cos_name) if cos_name else None
            sin = view.const(sin_name)
            if info is None or len(info.shape) != 4 or cos is None or sin is None:
                return None
            seq, d = info.shape[2], info.shape[3]
            h = d // 2
            if d % 2 or attrs_of(cat).get("axis") not in (-1, 3):
                return None
            if _slice_of(view, low, 4) != (0, h) or (_slice_of(view, high, 4) or (0, 0))[0] != h:
                return None
            if (_slice_of(view, high, 4) or (0, 0))[1] < d:
                return None
            try:
                c = np.broadcast_to(np.asarray(cos, np.float32), (1, 1, seq, d))[0, 0]
                s = np.broadcast_to(np.asarray(sin, np.float32), (1, 1, seq, d))[0, 0]
            except ValueError:
                return t, None
            if np.asarray(cos).size != seq * d or np.asarray(sin).size != seq * d:
                return t, None  # the tables differ per head or batch: not one cache
            if not (np.array_equal(c[:, :h], c[:, h:]) and np.array_equal(s[:, :h], s[:, h:])):
                return t, None
            return t, (np.ascontiguousarray(c[:, :h]), np.ascontiguousarray(s[:, :h]))
    return None


def _project(nodes: Nodes, tensor: str, perms: int) -> _Proj | None:
    """The projection ending in `tensor` (after `perms` Transposes, scalar scales and
    rotary embeddings on the heads)."""
    view = nodes.view
    tensor, scale = _walk_scale(nodes, tensor, 1.0)
    rotary, rotated, groups = None, False, 1
    for _ in range(perms):
        if groups == 1:
            rep = _repeat(nodes, tensor)
            if rep is not None:
                tensor, groups = rep
                tensor, scale = _walk_scale(nodes, tensor, scale)
        if not rotated:
            rot = _rotary(nodes, tensor)
            if rot is not None:
                (tensor, rotary), rotated = rot, True
                tensor, scale = _walk_scale(nodes, tensor, scale)
        t = nodes.made(tensor, "Transpose")
        if t is None:
            return None
        tensor, scale = _walk_scale(nodes, t.input[0], scale)
    r = nodes.made(tensor, "Reshape")
    if r is None:
        return None
    heads_shape = view.info(r.output[0])
    tensor, scale = _walk_scale(nodes, r.input[0], scale)
    if heads_shape is None or len(heads_shape.shape) != 4:
        return None
    split = nodes.made(tensor, "Split")
    if split is None:
        got = _product(nodes, tensor)
        if got is None:
            return None
        x, w, b, made = got
        return _Proj(
            x, w, b, scale, made, tensor, tuple(heads_shape.shape), rotated, rotary, groups
        )
    # A packed projection (GPT-2): one product, split along its last axis.
    total = view.info(split.input[0])
    got = _product(nodes, split.input[0])
    if (
        got is None
        or total is None
        or attrs_of(split).get("axis", 0) not in (-1, len(total.shape) - 1)
    ):
        return None
    x, w, b, made = got
    sizes = _split_sizes(view, split, w.shape[1])
    if sizes is None or sum(sizes) != w.shape[1]:
        return None
    i = list(split.output).index(tensor)
    lo = sum(sizes[:i])
    return _Proj(
        x,
        w[:, lo : lo + sizes[i]],
        b[lo : lo + sizes[i]],
        scale,
        [*made, split],
        tensor,
        tuple(heads_shape.shape),
        rotated,
        rotary,
        groups,
    )


def _attention_parts(view: TaskView) -> _Attention | None:
    nodes = Nodes(view)
    sm = next((n for n in view.nodes if n.op_type == "Softmax"), None)
    if sm is None:
        return None
    att = _Attention()
    # From Softmax back to Q·Kᵀ: scales, the mask Add, a causal Where.
    steps: list[tuple[str, object]] = []
    t = sm.input[0]
    qk = None
    while qk is None:
        n = nodes.producer.get(t)
        if n is None:
            return None
        if n.op_type == "MatMul":
            qk = n
        elif n.op_type in ("Mul", "Div"):
            s, f = _walk_scale(nodes, t, 1.0) or (t, 1.0)
            if s == t:
                return None
            steps.append(("scale", f))
            t = s
        elif n.op_type == "Add":
            side = next((i for i in n.input if i in nodes.producer and _to_scores(nodes, i)), None)
            if side is None:
                return None
            steps.append(("mask", n.input[1] if n.input[0] == side else n.input[0]))
            t = side
        elif n.op_type == "Where":
            cond, fill = view.const(n.input[0]), view.const(n.input[2])
            if cond is None or fill is None:
                return None
            steps.append(("where", (np.asarray(cond, bool), np.asarray(fill, np.float32))))
            t = n.input[1]
        else:
            return None
    probs = sm.output[0]
    guard = next(
        (n for n in view.nodes if n.op_type == "Where" and list(n.input[2:]) == [probs]), None
    )
    if guard is not None:  # Where(IsNaN(P), 0, P)
        probs = guard.output[0]
        att.guard = True
    pv = next((n for n in view.nodes if n.op_type == "MatMul" and n.input[0] == probs), None)
    if pv is None:
        return None
    q = _project(nodes, qk.input[0], 1)
    # Kᵀ in two steps, or one
    k = _project(nodes, qk.input[1], 2) or _project(nodes, qk.input[1], 1)
    if k is None:  # torch's dynamo export: Kᵀ as Reshape to 3-D, Transpose, Reshape back
        t, outer = _walk_scale(nodes, qk.input[1], 1.0)
        r4 = nodes.made(t, "Reshape")
        tr = nodes.made(r4.input[0], "Transpose") if r4 is not None else None
        r3 = nodes.made(tr.input[0], "Reshape") if tr is not None else None
        got = _widened(nodes, r3.input[0]) if r3 is not None else None
        if got is not None:  # repeat_kv's Reshape merged into the flattening one
            k = _project(nodes, got[0], 1)
            if k is not None and k.groups == 1:
                k.groups = got[1]
        else:
            k = _project(nodes, r3.input[0], 1) if r3 is not None else None
        if k is not None:
            k.scale *= outer
    v = _project(nodes, pv.input[1], 1)
    if q is None or k is None or v is None or len({q.x, k.x, v.x}) != 1:
        return None
    b, s, heads, head_dim = q.heads_shape
    if q.groups != 1 or k.groups != v.groups or k.heads_shape[:3] != v.heads_shape[:3]:
        return None
    if (
        k.heads_shape[:2] != (b, s)
        or k.heads_shape[3] != head_dim
        or k.heads_shape[2] * k.groups != heads
    ):
        return None
    att.groups = k.groups
    att.x = q.x
    att.heads, att.head_dim = int(heads), int(head_dim)
    att.projections = [q, k, v]
    if v.rotated or q.rotated != k.rotated:
        return None
    att.rotated = q.rotated
    if (
        q.rotary is not None
        and k.rotary is not None
        and all(np.array_equal(a, b) for a, b in zip(q.rotary, k.rotary, strict=True))
    ):
        att.rotary = q.rotary
    att.weights = [p.weight for p in (q, k, v)]
    att.biases = [p.bias for p in (q, k, v)]
    att.has_bias = any(np.any(p.bias != 0) for p in (q, k, v))
    xi = view.info(att.x)
    if xi is None or len(xi.shape) != 3 or att.weights[0].shape[1] != att.heads * att.head_dim:
        return None
    seq = xi.shape[1]
    # The scores' transform, from Q·Kᵀ outwards: scale, then mask (scaled by any later
    # scale), then a causal Where. Anything else does not fit the kernel.
    scale = q.scale * k.scale
    mask: np.ndarray | str | None = None
    later = 1.0
    for kind, arg in steps:  # softmax side first
        if kind == "scale":
            later *= float(arg)  # type: ignore[arg-type]
        elif kind == "mask":
            if mask is not None:
                return None
            name = str(arg)
            value = view.const(name)
            if value is None:
                if later != 1.0:
                    return None
                mask = name
                att.mask_where = _mask_where(nodes, name)
            else:
                mask = np.asarray(value, np.float32) * np.float32(later)
        elif kind == "where":
            cond, fill = arg  # type: ignore[misc]
            if mask is not None and not isinstance(mask, np.ndarray):
                return None
            bias = np.where(cond, np.float32(0), fill * np.float32(later)).astype(np.float32)
            mask = bias if mask is None else mask + bias
    att.scale = scale * later
    if isinstance(mask, np.ndarray):
        full = np.broadcast_to(mask, np.broadcast_shapes(mask.shape, (1, 1, seq, seq)))
        if full.shape[-2:] != (seq, seq) or full.ndim != 4:
            return None
        lower = np.tril(np.ones((seq, seq), bool))
        if np.all(full[..., lower] == 0) and np.all(full[..., ~lower] <= -1e4):
            att.causal = True
        elif not np.all(full == 0):
            att.mask_value = np.ascontiguousarray(full[:, :, :, :]).astype(np.float32)
    elif isinstance(mask, str):
        mi = view.info(mask)
        if mi is None or len(mi.shape) != 4 or tuple(mi.shape[-2:]) not in ((seq, seq), (1, seq)):
            return None
        att.mask = mask
    if not math.isfinite(att.scale):
        return None
    oi = view.info(view.output)
    if _flattened(view, att) and (oi is None or sum(not isinstance(d, int) for d in oi.shape) > 1):
        return None  # a reshape to it needs its dimensions
    if att.guard and _rows_stay_finite(att):
        att.guard = False  # the block's guard never fires: the kernels need none either
    return att


def _rows_stay_finite(att: _Attention) -> bool:
    """Whether every query row keeps a finite score for finite inputs, so that the
    softmax never gives NaN and a Where(IsNaN(P), 0, P) guard after it changes nothing:
    no mask but a causal one (a row keeps its own position), a constant mask with a
    finite entry in every row, or the block's own mask Where with a finite fill
    (transformers fills with the float's lowest value, not -inf)."""
    if att.mask is not None:
        return att.mask_where is not None and math.isfinite(att.mask_where[3])
    if att.mask_value is not None:
        return bool(np.isfinite(att.mask_value).any(axis=-1).all())
    return True


def _mask_where(nodes: Nodes, mask: str) -> tuple[onnx.NodeProto, str, bool, float] | None:
    """The task's Where that makes the additive `mask` from a boolean (aoe.attention
    takes it in): (node, boolean, whether True keeps, fill)."""
    w = nodes.made(mask, "Where")
    if w is None or w.input[0] in nodes.producer:
        return None
    a = scalar(nodes.view, w.input[1])
    fill = mask_fill(a, scalar(nodes.view, w.input[2]))
    if fill is None:
        return None
    return w, w.input[0], a == 0.0, fill


def _to_scores(nodes: Nodes, tensor: str) -> bool:
    for _ in range(8):
        n = nodes.producer.get(tensor)
        if n is None:
            return False
        if n.op_type == "MatMul":
            return True
        if n.op_type in ("Mul", "Div"):
            tensor = n.input[0] if n.input[0] in nodes.producer else n.input[1]
        elif n.op_type == "Where":
            tensor = n.input[1]
        elif n.op_type == "Add":
            return any(_to_scores(nodes, i) for i in n.input if i in nodes.producer)
        else:
            return False
    return False


def _per_head(att: _Attention) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The Q, K, V weights and biases with one column block per query head: on a
    grouped-query block each K/V head's columns repeated for its group (what repeat_kv
    does to the heads, done once to the weights)."""
    if att.groups == 1:
        return att.weights, att.biases
    d, g = att.head_dim, att.groups

    def wide(a: np.ndarray) -> np.ndarray:
        lead = a.shape[:-1]
        kv = a.shape[-1] // d
        return np.repeat(a.reshape(*lead, kv, 1, d), g, axis=-2).reshape(*lead, kv * g * d)

    q, k, v = att.weights
    bq, bk, bv = att.biases
    return [q, wide(k), wide(v)], [bq, wide(bk), wide(bv)]


def _bias_input(view: TaskView, att: _Attention, nodes: list, inits: list) -> str:
    """The attention_bias input: a constant [.., S, S], or the mask tensor expanded to
    [B, 1|N, S, S]; '' when there is none."""
    if att.mask_value is not None:
        t = init(view, "attention_bias", att.mask_value)
        inits.append(t)
        return t.name
    if att.mask is None:
        return ""
    if att.mask_where is not None:  # the block's own Where, kept
        copy = onnx.NodeProto()
        copy.CopyFrom(att.mask_where[0])
        if _row_guard(view, att):  # a finite fill: a fully masked row comes out finite, then zeroed
            fill = init(view, "mask_fill", np.array(FINITE_FILL, np.float32))
            inits.append(fill)
            copy.input[2 if att.mask_where[2] else 1] = fill.name
        nodes.append(copy)
    mi = view.info(att.mask)
    xi = view.info(att.x)
    assert mi is not None and xi is not None
    if mi.shape[-2] == xi.shape[1]:
        return att.mask
    shape = init(
        view,
        "attention_bias_shape",
        np.array([mi.shape[0], mi.shape[1], xi.shape[1], mi.shape[3]], np.int64),
    )
    inits.append(shape)
    out = view.name("attention_bias")
    nodes.append(
        helper.make_node("Expand", [att.mask, shape.name], [out], name=view.name("ExpandMask"))
    )
    return out


def _flattened(view: TaskView, att: _Attention) -> bool:
    """Whether the block's output is not the kernels' [B, S, hidden]: torch's dynamo
    export of GPT-2's Conv1D merges the heads straight into [B*S, hidden] for the next
    product. The kernels' output is then reshaped to it."""
    oi, xi = view.info(view.output), view.info(att.x)
    if oi is None or xi is None:
        return False
    return tuple(oi.shape) != (*tuple(xi.shape)[:2], att.heads * att.head_dim)


def _out(view: TaskView, att: _Attention) -> str:
    """Where a fused kernel writes: the task's output, or before what `_finish` adds."""
    return view.name("attention") if att.guard or _flattened(view, att) else view.output


def _row_guard(view: TaskView, att: _Attention) -> bool:
    """Whether the block's guard can be a product by the rows' keep flags: its only mask
    is its own Where with a fill of -inf, on a boolean with one head dimension. The kernels then get a finite fill instead, so
    that a fully masked row comes out finite (their average) and the product makes it
    zeros, as the guarded softmax does, for a fraction of the IsNaN and Where's cost."""
    if not att.guard or att.causal or att.mask_where is None or att.mask_where[3] != -math.inf:
        return False
    ci = view.info(att.mask_where[1])
    return ci is not None and len(ci.shape) == 4 and ci.shape[1] == 1


def _finish(view: TaskView, att: _Attention, nodes: list, inits: list) -> Rewrite:
    """The rewrite of a fused kernel; where the block guards its softmax (Where(IsNaN(P),
    0, P), torch's sdpa export), the same effect on the kernel's output. A query row whose
    keys are all masked by -inf is NaN in the kernels as in the softmax; the block makes it
    zeros, and so does this: without it, such a row (a left-padded position) would come
    out NaN. With `_row_guard`, the output times each row's keep flag (whether any key is
    kept); otherwise IsNaN and Where on the output. Last, the reshape to a flattened
    block output (`_flattened`)."""
    flat = _flattened(view, att)
    y = _out(view, att)
    guarded = view.name("guarded") if flat else view.output
    if _row_guard(view, att):
        nodes.append(
            helper.make_node(
                "Mul",
                [y, _row_keeps(view, att, nodes, inits)],
                [guarded],
                name=view.name("RowGuard"),
            )
        )
        y = guarded
    elif att.guard:
        nan, zero = view.name("nan"), init(view, "zero", np.zeros((), np.float32))
        inits.append(zero)
        nodes += [
            helper.make_node("IsNaN", [y], [nan], name=view.name("IsNaN")),
            helper.make_node("Where", [nan, zero.name, y], [guarded], name=view.name("NanGuard")),
        ]
        y = guarded
    if flat:
        oi = view.info(view.output)
        assert oi is not None
        shape = init(
            view,
            "output_shape",
            np.array([d if isinstance(d, int) else -1 for d in oi.shape], np.int64),
        )
        inits.append(shape)
        nodes.append(
            helper.make_node(
                "Reshape", [y, shape.name], [view.output], name=view.name("OutputShape")
            )
        )
    return Rewrite(tuple(nodes), tuple(inits))


def _row_keeps(view: TaskView, att: _Attention, nodes: list, inits: list) -> str:
    """[B|1, S|1, 1] float: 1 where a query row keeps any key under the block's mask
    Where, 0 where it keeps none."""
    assert att.mask_where is not None
    _node, cond, keeps, _fill = att.mask_where
    names = [view.name(n) for n in ("row_keepf", "row_any", "row_keep")]
    nodes.append(
        helper.make_node(
            "Cast", [cond], [names[0]], name=view.name("RowCast"), to=onnx.TensorProto.FLOAT
        )
    )
    if keeps:
        reduce = "ReduceMax"
    else:  # the boolean marks masked positions: a row keeps nothing where its min is 1
        reduce = "ReduceMin"
    if view.opset >= 18:
        axes = init(view, "row_axes", np.array([-1], np.int64))
        inits.append(axes)
        nodes.append(
            helper.make_node(
                reduce, [names[0], axes.name], [names[1]], name=view.name("RowAny"), keepdims=1
            )
        )
    else:
        nodes.append(
            helper.make_node(
                reduce, [names[0]], [names[1]], name=view.name("RowAny"), axes=[-1], keepdims=1
            )
        )
    if not keeps:
        one = init(view, "row_one", np.ones((), np.float32))
        inits.append(one)
        nodes.append(
            helper.make_node(
                "Sub", [one.name, names[1]], [view.name("row_some")], name=view.name("RowSome")
            )
        )
        names[1] = view.name("row_some")
    # [B, 1, S, 1] as [B, S, 1]
    shape = init(view, "row_keep_shape", np.array([0, -1, 1], np.int64))
    inits.append(shape)
    nodes.append(
        helper.make_node("Reshape", [names[1], shape.name], [names[2]], name=view.name("RowKeep"))
    )
    return names[2]


def _fused_attention(view: TaskView) -> Rewrite | None:
    """Q/K/V projections, scaled dot product, softmax and head merge as one com.microsoft
    Attention over the packed [hidden, 3h] weight (not with rotary embeddings)."""
    att = _attention_parts(view)
    if att is None or att.rotated:
        return None
    weights, biases = _per_head(att)
    w = init(view, "qkv_weight", np.concatenate(weights, axis=1))
    b = init(view, "qkv_bias", np.concatenate(biases))
    nodes: list = []
    inits = [w, b]
    bias = _bias_input(view, att, nodes, inits)
    ins = [att.x, w.name, b.name]
    if bias:
        ins += ["", "", bias]
    nodes.append(
        helper.make_node(
            "Attention",
            ins,
            [_out(view, att)],
            name=view.name("Attention"),
            domain=CONTRIB_DOMAIN,
            num_heads=att.heads,
            scale=float(att.scale),
            unidirectional=int(att.causal),
        )
    )
    return _finish(view, att, nodes, inits)


def _packed_projection(
    view: TaskView,
    att: _Attention,
    with_bias: bool,
    per_head: bool = False,
    split: bool = True,
    int8: bool = False,
) -> tuple[list, list, list[str]]:
    """One MatMul over the concatenated weights (and bias Add), split into q, k, v (the
    weights `_per_head` when `per_head`; `split` False: the packed tensor alone). `int8`:
    one com.microsoft DynamicQuantizeMatMul instead (the input quantized once, the
    weight int8 per column, the bias inside the kernel)."""
    weights, biases = _per_head(att) if per_head else (att.weights, att.biases)
    h = [w.shape[1] for w in weights]
    mm = view.name("qkv")
    if int8:
        wq, ws = int8_weight(np.concatenate(weights, axis=1).astype(np.float32), per_channel=True)
        inits = [
            init(view, "qkv_weight_q", wq),
            init(view, "qkv_weight_scale", ws),
            init(view, "qkv_weight_zp", np.zeros(ws.shape, np.int8)),
        ]
        if with_bias:
            inits.append(init(view, "qkv_bias", np.concatenate(biases).astype(np.float32)))
        nodes = [
            helper.make_node(
                "DynamicQuantizeMatMul",
                [att.x, *(i.name for i in inits)],
                [mm],
                name=view.name("QkvDynamicQuantizeMatMul"),
                domain=CONTRIB_DOMAIN,
            )
        ]
        with_bias = False
    else:
        w = init(view, "qkv_weight", np.concatenate(weights, axis=1))
        inits = [w]
        nodes = [helper.make_node("MatMul", [att.x, w.name], [mm], name=view.name("QkvMatMul"))]
    if with_bias:
        b = init(view, "qkv_bias", np.concatenate(biases))
        inits.append(b)
        nodes.append(
            helper.make_node("Add", [mm, b.name], [view.name("qkv_b")], name=view.name("QkvAdd"))
        )
        mm = view.name("qkv_b")
    if not split:
        return nodes, inits, [mm]
    sizes = init(view, "qkv_split", np.array(h, np.int64))
    outs = [view.name(p) for p in ("q", "k", "v")]
    if view.opset >= 13:
        inits.append(sizes)
        nodes.append(
            helper.make_node("Split", [mm, sizes.name], outs, name=view.name("QkvSplit"), axis=-1)
        )
    else:
        nodes.append(
            helper.make_node("Split", [mm], outs, name=view.name("QkvSplit"), axis=-1, split=h)
        )
    return nodes, inits, outs


def _packed_qkv(view: TaskView) -> Rewrite | None:
    """The three projections as one MatMul over the concatenated weights, then Split;
    the rest of the block as the model has it."""
    att = _attention_parts(view)
    if att is None:
        return None
    nodes, inits, outs = _packed_projection(view, att, with_bias=att.has_bias)
    return Rewrite((*nodes, *_after_projections(view, att, outs)), tuple(inits))


def _after_projections(
    view: TaskView, att: _Attention, outs: Sequence[str]
) -> list[onnx.NodeProto]:
    """The block's nodes past its three projections, reading `outs` (q, k, v) instead."""
    replaced = {n.name for p in att.projections for n in p.nodes}
    renames = {p.out: out for p, out in zip(att.projections, outs, strict=True)}
    kept = []
    for n in view.nodes:
        if n.name in replaced:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        for i, name in enumerate(copy.input):
            copy.input[i] = renames.get(name, name)
        kept.append(copy)
    return kept


def _rotated(
    view: TaskView,
    att: _Attention,
    outs: Sequence[str],
    nodes: list,
    inits: list,
    kv_heads: int | None = None,
) -> list[str]:
    """q and k of `outs` through com.microsoft RotaryEmbedding (non-interleaved, the
    model's own tables as caches, positions 0..S-1; k with `kv_heads` heads, by default
    as many as q); v as it is."""
    assert att.rotary is not None
    cos, sin = att.rotary
    pos = init(view, "rotary_positions", np.arange(cos.shape[0], dtype=np.int64)[None, :])
    c, s = init(view, "rotary_cos", cos), init(view, "rotary_sin", sin)
    inits += [pos, c, s]
    rotated = []
    for which, src, heads in zip(
        ("q", "k"), outs[:2], (att.heads, kv_heads or att.heads), strict=True
    ):
        out = view.name(f"{which}_rotary")
        nodes.append(
            helper.make_node(
                "RotaryEmbedding",
                [src, pos.name, c.name, s.name],
                [out],
                name=view.name(f"Rotary_{which}"),
                domain=CONTRIB_DOMAIN,
                interleaved=0,
                num_heads=heads,
            )
        )
        rotated.append(out)
    return [*rotated, outs[2]]


def _multihead_attention(view: TaskView, int8: bool = False) -> Rewrite | None:
    """One packed projection, Split, then com.microsoft MultiHeadAttention (the bias added
    inside the kernel). Rotary embeddings become com.microsoft RotaryEmbedding on Q and
    K between the two (the bias then added before the Split). `int8`: the projection
    on DynamicQuantizeMatMul (the bias inside it)."""
    att = _attention_parts(view)
    if att is None or att.rotated and att.rotary is None:
        return None
    rotary = att.rotated
    fold = rotary or int8
    nodes, inits, outs = _packed_projection(
        view, att, with_bias=fold and att.has_bias, per_head=True, int8=int8
    )
    qkv_bias = ""
    if rotary:
        outs = _rotated(view, att, outs, nodes, inits)
    elif not int8:
        b = init(view, "qkv_bias", np.concatenate(_per_head(att)[1]))
        inits.append(b)
        qkv_bias = b.name
    bias = _bias_input(view, att, nodes, inits)
    ins = [*outs, qkv_bias, "", bias] if bias else [*outs, qkv_bias] if qkv_bias else list(outs)
    nodes.append(
        helper.make_node(
            "MultiHeadAttention",
            ins,
            [_out(view, att)],
            name=view.name("MultiHeadAttention"),
            domain=CONTRIB_DOMAIN,
            num_heads=att.heads,
            scale=float(att.scale),
            unidirectional=int(att.causal),
        )
    )
    return _finish(view, att, nodes, inits)


def _group_query_attention(view: TaskView, int8: bool = False) -> Rewrite | None:
    """Attention on com.microsoft GroupQueryAttention: one packed projection (the K and V
    weights as the model has them, one block per K/V head), the packed tensor straight
    into the kernel, or split and rotated by RotaryEmbedding first where the block has
    rotary embeddings; no past, every sequence full length (seqlens_k S - 1), the mask as
    attention_bias, a causal one as `causal`. Also for blocks whose K and V have a head
    per query head (a group of one): on a 2-core AVX-512 machine, one thread, a causal
    [1, 128, 8x32] rotary block took 294 us there against 337 us on MultiHeadAttention
    (the same Split and RotaryEmbedding in front). `int8`: the projection on
    DynamicQuantizeMatMul."""
    att = _attention_parts(view)
    if att is None or att.rotated and att.rotary is None:
        return None
    xi = view.info(att.x)
    assert xi is not None
    batch, seq = int(xi.shape[0]), int(xi.shape[1])
    kv = att.heads // att.groups
    if att.rotated:
        nodes, inits, outs = _packed_projection(view, att, with_bias=att.has_bias, int8=int8)
        outs = _rotated(view, att, outs, nodes, inits, kv_heads=kv)
    else:
        nodes, inits, packed = _packed_projection(
            view, att, with_bias=att.has_bias, split=False, int8=int8
        )
        outs = [packed[0], "", ""]
    lens = init(view, "seqlens_k", np.full(batch, seq - 1, np.int32))
    total = init(view, "total_sequence_length", np.array(seq, np.int32))
    inits += [lens, total]
    bias = _bias_input(view, att, nodes, inits)
    ins = [*outs, "", "", lens.name, total.name] + (["", "", "", bias] if bias else [])
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            ins,
            [_out(view, att)],
            name=view.name("GroupQueryAttention"),
            domain=CONTRIB_DOMAIN,
            num_heads=att.heads,
            kv_num_heads=kv,
            scale=float(att.scale),
            causal=int(att.causal),
        )
    )
    return _finish(view, att, nodes, inits)


def _raw_mask(view: TaskView, att: _Attention, nodes: list, inits: list) -> str | None:
    """QAttention's mask_index from the block's own mask Where: its boolean as 1 (kept)
    and 0 (masked), [B, S, T] int32, the raw 3-D form; None when the boolean has a
    dimension per head or the block has no such Where."""
    if att.mask_where is None:
        return None
    _node, cond, keeps, _fill = att.mask_where
    ci, xi = view.info(cond), view.info(att.x)
    if ci is None or xi is None or len(ci.shape) != 4 or ci.shape[1] != 1:
        return None
    batch, seq = int(xi.shape[0]), int(xi.shape[1])
    if ci.shape[0] not in (1, batch) or ci.shape[2] not in (1, seq) or ci.shape[3] != seq:
        return None
    if not keeps:
        nodes.append(
            helper.make_node("Not", [cond], [view.name("mask_keep")], name=view.name("MaskKeep"))
        )
        cond = view.name("mask_keep")
    full = init(view, "mask_shape", np.array([batch, 1, seq, seq], np.int64))
    flat = init(view, "mask_index_shape", np.array([batch, seq, seq], np.int64))
    inits += [full, flat]
    names = [view.name(n) for n in ("mask_full", "mask_int", "mask_index")]
    nodes += [
        helper.make_node("Expand", [cond, full.name], [names[0]], name=view.name("MaskExpand")),
        helper.make_node(
            "Cast", [names[0]], [names[1]], name=view.name("MaskCast"), to=onnx.TensorProto.INT32
        ),
        helper.make_node("Reshape", [names[1], flat.name], [names[2]], name=view.name("MaskIndex")),
    ]
    return names[2]


def _int8_qattention(view: TaskView) -> Rewrite | None:
    """The whole attention block on one int8 kernel: the input quantized once
    (DynamicQuantizeLinear) and com.microsoft QAttention over the packed int8 weight
    (per column). QAttention takes no additive bias: only blocks without a mask, with a
    causal one, or with a mask the block makes itself from a boolean (transformers'
    per-layer Where), which becomes its raw 3-D mask_index, the fill as its
    mask_filter_value; and without rotary embeddings."""
    att = _attention_parts(view)
    if att is None or att.mask_value is not None or att.rotated:
        return None
    nodes: list = []
    inits: list = []
    mask_index, fill = "", None
    if att.mask is not None:
        got = _raw_mask(view, att, nodes, inits)
        if got is None:
            return None
        mask_index, fill = got, FINITE_FILL if _row_guard(view, att) else att.mask_where[3]  # type: ignore[index]
    weights, biases = _per_head(att)
    wq, ws = int8_weight(np.concatenate(weights, axis=1).astype(np.float32), per_channel=True)
    inits += [
        init(view, "qkv_weight_q", wq),
        init(view, "qkv_weight_scale", ws),
        init(view, "qkv_weight_zp", np.zeros(ws.shape, np.int8)),
        init(view, "qkv_bias", np.concatenate(biases).astype(np.float32)),
    ]
    w_q, w_s, w_zp, bias = (i.name for i in inits[-4:])
    xq, xs, xz = view.name("x_q"), view.name("x_scale"), view.name("x_zp")
    attrs = {"num_heads": att.heads, "scale": float(att.scale), "unidirectional": int(att.causal)}
    if fill is not None:
        attrs["mask_filter_value"] = float(fill)
    nodes += [
        helper.make_node(
            "DynamicQuantizeLinear", [att.x], [xq, xs, xz], name=view.name("QuantizeX")
        ),
        helper.make_node(
            "QAttention",
            [xq, w_q, bias, xs, w_s, mask_index, xz, w_zp],
            [_out(view, att)],
            name=view.name("QAttention"),
            domain=CONTRIB_DOMAIN,
            **attrs,
        ),
    ]
    return _finish(view, att, nodes, inits)


def _int8_packed_qkv(view: TaskView) -> Rewrite | None:
    """The three projections as one int8 product: the shared input quantized once
    (com.microsoft DynamicQuantizeMatMul over the packed weight, per column), then Split;
    the scaled dot product stays float."""
    att = _attention_parts(view)
    if att is None:
        return None
    nodes, inits, outs = _packed_projection(view, att, with_bias=att.has_bias, int8=True)
    return Rewrite((*nodes, *_after_projections(view, att, outs)), tuple(inits))


def _int8_multihead_attention(view: TaskView) -> Rewrite | None:
    """``multihead_attention`` with its packed projection in int8: what QAttention cannot
    take (masks from an input, rotary embeddings) on the fused float kernel."""
    return _multihead_attention(view, int8=True)


def _int8_group_query_attention(view: TaskView) -> Rewrite | None:
    """``group_query_attention`` with its packed projection in int8."""
    return _group_query_attention(view, int8=True)


def register(registry: StrategyRegistry) -> None:
    """Add the attention strategies to `registry`."""
    s = registry.strategy
    s("fused_attention", "attention")(_fused_attention)
    s("multihead_attention", "attention")(_multihead_attention)
    s("group_query_attention", "attention")(_group_query_attention)
    s("packed_qkv", "attention")(_packed_qkv)
    s("int8_qattention", "attention", "int8")(_int8_qattention)
    s("int8_packed_qkv", "attention", "int8")(_int8_packed_qkv)
    s("int8_multihead_attention", "attention", "int8")(_int8_multihead_attention)
    s("int8_group_query_attention", "attention", "int8")(_int8_group_query_attention)

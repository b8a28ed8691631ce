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

A decode step with a KV cache (GPT-2's and LLaMA's exports with past, the sample
`kv_decoder`) concatenates this step's K and V heads to the past ones along the sequence
axis, [b, kv, past, d] + [b, kv, s, d], after rotary embeddings and before repeat_kv;
that Concat's result, the present, is the model's output as well as what the scores and
P·V read. Such a block holds both Concats (`Cache`), and its presents leave it beside
the merged heads; also the nodes that compute Kᵀ's reshape targets from the present's
Shape at run time (torch's dynamo export of GPT-2 with a cache), and nothing it reads
from outside may be computed from its presents. Its rotary tables may be computed at
run time from this step's positions (LLaMA's and Qwen2's exports with a cache), where
their halves repeat by construction (`Rotary`).

`attention` is the one recognizer: the partitioner forms tasks from the block it
returns (`Match`), and a strategy reads the same `AttentionBlock` from its task's nodes
(`task_block`): the projections (input, weight, bias, packing, scale, rotary tables, K/V
heads repeated for groups), the head layout, the scale, the scores' mask steps, the
mask Where the block owns and the softmax's NaN guard. A strategy reads constant values
through the tensor names the block gives; it never walks the graph itself.

This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import onnx

from aoe._sgraph import STD, Graph, Match
from aoe.signature import TensorInfo

__all__ = [
    "MASKED",
    "AttentionBlock",
    "Cache",
    "Heads",
    "MaskWhere",
    "Product",
    "Projection",
    "Rotary",
    "ScoreStep",
    "attention",
    "attention_block",
    "mask_fill",
    "task_block",
]


@dataclass(frozen=True)
class Product:
    """`MatMul(x, weight) [+ bias]`, or `Reshape(Gemm(Reshape(x), weight, bias))` (a
    Conv1D or Linear on 3-D input, as GPT-2 exports): `gemm` is that Gemm, whose
    attributes say how to read `weight` and `bias`; `nodes` compute it."""

    x: str
    weight: str
    bias: str | None
    nodes: tuple[onnx.NodeProto, ...]
    gemm: onnx.NodeProto | None = None


@dataclass(frozen=True)
class Rotary:
    """`t·cos + rotate_half(t)·sin` on one projection's heads, rotate_half(t) being
    Concat(-t[..., high], t[..., low]) (`cat`, `high`, `low` the nodes). `cos` and `sin`
    are constants, or (a decode step's block) computed at run time as Cos and Sin of
    Concat(f, f), f the positions times the inverse frequencies: tables whose halves
    repeat, one row per position this step."""

    t: str
    cos: str
    sin: str
    cat: onnx.NodeProto
    high: onnx.NodeProto
    low: onnx.NodeProto


@dataclass(frozen=True)
class Cache:
    """A KV cache on K or V heads: `present` = Concat(`past`, this step's heads) along
    the sequence axis (`node`), [b, kv, past, d] and [b, kv, s, d]."""

    past: str
    present: str
    node: onnx.NodeProto


@dataclass(frozen=True)
class Projection:
    """One of Q, K and V: its `product` (shared by all three where `split`, one packed
    product's Split, takes it apart), `out` the tensor split into heads (the product's
    or the Split's output), `heads` the static [b, s, n, d] of the Reshape to heads
    (None where shapes do not say it), `scale` the scalar Mul/Div on the way, `rotary`
    embeddings on the heads, `groups` the times repeat_kv repeats each head, and `cache`
    the KV cache the heads are appended to (K and V of a decode step)."""

    product: Product
    split: onnx.NodeProto | None
    out: str
    heads: tuple[int, ...] | None
    scale: float
    rotary: Rotary | None
    groups: int
    cache: Cache | None = None

    @property
    def nodes(self) -> tuple[onnx.NodeProto, ...]:
        """What computes `out`: the product, and the Split of a packed one."""
        return (*self.product.nodes, *((self.split,) if self.split is not None else ()))


@dataclass(frozen=True)
class ScoreStep:
    """One transform between Q·Kᵀ and the Softmax: a scalar `scale`, an additive `mask`
    (the tensor added), or a `where` (Where(cond, scores, fill), constant cond and fill:
    a causal mask)."""

    kind: Literal["scale", "mask", "where"]
    factor: float = 1.0
    mask: str = ""
    cond: str = ""
    fill: str = ""


@dataclass(frozen=True)
class MaskWhere:
    """The block's own Where that makes its additive mask from a boolean: `cond` True
    keeps a position where `keeps` (Where(keep, 0, fill)), masks it otherwise
    (Where(masked, fill, 0))."""

    node: onnx.NodeProto
    cond: str
    keeps: bool
    fill: float


@dataclass(frozen=True)
class Heads:
    """The head layout: `heads` query heads of `head_dim`, each K/V head read by
    `groups` of them (grouped-query attention; 1: one K/V head per query head)."""

    heads: int
    head_dim: int
    groups: int

    @property
    def kv_heads(self) -> int:
        return self.heads // self.groups


@dataclass(frozen=True)
class AttentionBlock:
    """One self-attention block, as `attention` recognizes it.

    `nodes` in graph order (the last writes the merged heads); `q`, `k`, `v` the
    projections of the one input `x`; `layout` the heads where the shapes of Q, K and V
    agree on one (None otherwise); `scores` the transforms from Q·Kᵀ to the Softmax,
    softmax side first; `mask_where` the Where making the additive mask that the block
    holds; `guard` whether Where(IsNaN(P), 0, P) follows the softmax."""

    nodes: tuple[onnx.NodeProto, ...]
    x: str
    q: Projection
    k: Projection
    v: Projection
    layout: Heads | None
    scores: tuple[ScoreStep, ...]
    mask_where: MaskWhere | None
    guard: bool

    @property
    def projections(self) -> tuple[Projection, Projection, Projection]:
        return self.q, self.k, self.v

    @property
    def scale(self) -> float:
        """The scale of Q·Kᵀ in the softmax: every scalar Mul/Div on Q, K and the scores
        (the mask steps between them scale the mask, not this)."""
        later = 1.0
        for step in self.scores:
            later *= step.factor
        return self.q.scale * self.k.scale * later

    @property
    def rotated(self) -> bool:
        return self.q.rotary is not None or self.k.rotary is not None

    @property
    def caches(self) -> tuple[Cache, Cache] | None:
        """The K and V caches of a decode step's block; None without a KV cache."""
        k, v = self.k.cache, self.v.cache
        return None if k is None or v is None else (k, v)

    @property
    def presents(self) -> tuple[str, ...]:
        """What leaves the block beside its last node's output: the presents, K's first."""
        caches = self.caches
        return () if caches is None else (caches[0].present, caches[1].present)


def _times(factor: float, by: float, divide: bool) -> float:
    """`factor` times `by` (or divided by it; by 0: the division is infinite or NaN, and
    no kernel takes a scale that is not finite)."""
    if not divide:
        return factor * by
    if by == 0.0:
        return math.nan if factor == 0.0 else math.copysign(math.inf, factor)
    return factor / by


def _scaled(
    g: Graph, tensor: str, nodes: list[onnx.NodeProto], factor: float = 1.0
) -> tuple[str, float]:
    """Walk back over scalar Mul/Div nodes (a softmax scale), collecting them: (where
    they start, `factor` times their product)."""
    while True:
        n = g.node(tensor, "Mul", "Div")
        if n is None:
            return tensor, factor
        a, b = g.scalar(n.input[0]), g.scalar(n.input[1])
        if n.op_type == "Div" and b is not None:
            nodes.append(n)
            tensor, factor = n.input[0], _times(factor, b, divide=True)
        elif n.op_type == "Mul" and b is not None:
            nodes.append(n)
            tensor, factor = n.input[0], factor * b
        elif n.op_type == "Mul" and a is not None:
            nodes.append(n)
            tensor, factor = n.input[1], factor * a
        else:
            return tensor, factor


def _run_time_table(g: Graph, tensor: str, op: str) -> bool:
    """Whether `tensor` is `op` (Cos or Sin) of Concat(f, f) along the last axis, behind
    Unsqueeze and a scalar Mul (transformers' attention scaling): a rotary table whose
    halves repeat, computed at run time from the positions (LLaMA's and Qwen2's exports
    with a cache compute them from the past's length). A task's own graph cannot see
    what computes its inputs: there a table from outside is taken as the partitioner,
    which saw the whole model, took it."""
    if g.partial and tensor not in g.producer:
        return not g.is_const(tensor)
    for _ in range(4):
        n = g.node(tensor, "Unsqueeze", "Mul")
        if n is None:
            break
        if n.op_type == "Mul":
            other = n.input[1] if g.scalar(n.input[1]) is not None else n.input[0]
            if g.scalar(other) is None:
                return False
            tensor = g.other(n, other) or ""
        else:
            tensor = n.input[0]
    f = g.node(tensor, op)
    cat = g.node(f.input[0], "Concat") if f is not None else None
    return (
        cat is not None
        and len(cat.input) == 2
        and cat.input[0] == cat.input[1]
        and g.attr(cat, "axis") == -1
    )


def _rotary(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> Rotary | None:
    """`t·cos + rotate_half(t)·sin` ending in `tensor` (rotary position embeddings as
    LLaMA-style models write them: rotate_half(t) = Concat(-t[..., h:], t[..., :h]), cos
    and sin constants or `_run_time_table`s), collecting those nodes; None when it is not
    that."""
    add = g.node(tensor, "Add")
    if add is None or len(add.input) != 2:
        return None
    for a, b in (add.input, reversed(add.input)):
        straight, turned = g.node(a, "Mul"), g.node(b, "Mul")
        if straight is None or turned is None or len(turned.input) != 2:
            continue
        for cat_out, sin in (turned.input, reversed(turned.input)):
            cat = g.node(cat_out, "Concat")
            if (
                cat is None
                or len(cat.input) != 2
                or not (g.is_const(sin) or _run_time_table(g, sin, "Sin"))
            ):
                continue
            neg, low = g.node(cat.input[0], "Neg"), g.node(cat.input[1], "Slice")
            high = g.node(neg.input[0], "Slice") if neg is not None else None
            if high is None or low is None or high.input[0] != low.input[0]:
                continue
            t = low.input[0]
            cos = g.other(straight, t)
            if (
                cos is None
                or not (g.is_const(cos) or _run_time_table(g, cos, "Cos"))
                or not all(g.is_const(i) for s in (low, high) for i in s.input[1:] if i)
            ):
                continue
            nodes += [add, straight, turned, cat, neg, high, low]
            return Rotary(t, cos, sin, cat, high, low)
    return None


def _widened(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> tuple[str, int] | None:
    """(t, r) of `Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d])` ending in `tensor`, t
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
    src, wide = g.tensors.get(u.input[0]), g.tensors.get(tensor)
    if axes is None or list(axes) not in ([2], [-3]) or src is None or wide is None:
        return None
    if (
        len(src.shape) != 4
        or len(wide.shape) != 5
        or tuple(wide.shape[:2] + wide.shape[3:]) != tuple(src.shape)
    ):
        return None
    nodes += [e, u]
    return u.input[0], int(wide.shape[2])


def _repeated(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> tuple[str, int] | None:
    """(t, r) of repeat_kv, `Reshape(Expand(Unsqueeze(t, axis 2), [b, kv, r, s, d]),
    [b, kv·r, s, d])`, ending in `tensor`, collecting those nodes; None when it is not
    that."""
    r = g.node(tensor, "Reshape")
    if r is None or not g.is_const(r.input[1]):
        return None
    wide, out = g.tensors.get(r.input[0]), g.tensors.get(tensor)
    found: list[onnx.NodeProto] = []
    t = _widened(g, r.input[0], found)
    if t is None or wide is None or out is None:
        return None
    b, kv, rep, s, d = wide.shape
    if tuple(out.shape) != (b, kv * rep, s, d):
        return None
    nodes += [r, *found]
    return t


def _cached(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> Cache | None:
    """The `Concat(past, new)` along axis 2 of two [b, kv, *, d] activations ending in
    `tensor` (a KV cache), collecting it; None when it is not that."""
    cat = g.node(tensor, "Concat")
    if cat is None or len(cat.input) != 2 or g.attr(cat, "axis") not in (2, -2):
        return None
    past, new = cat.input
    pi, ni = g.tensors.get(past), g.tensors.get(new)
    if g.is_const(past) or g.is_const(new) or pi is None or ni is None:
        return None
    if len(pi.shape) != 4 or len(ni.shape) != 4:
        return None
    if tuple(pi.shape[:2]) != tuple(ni.shape[:2]) or pi.shape[3] != ni.shape[3]:
        return None
    nodes.append(cat)
    return Cache(past, tensor, cat)


def _projection(
    g: Graph, tensor: str, perms: Sequence[Sequence[int]], nodes: list[onnx.NodeProto]
) -> Projection | None:
    """The projection of `Transpose*(Reshape(MatMul(x, W) [+ b]))` ending in `tensor`,
    the Transposes' perms being `perms` (outermost last); a scalar Mul/Div may sit on the
    way (a scale applied to Q), and rotary embeddings on the heads (Q and K of
    LLaMA-style models). The product may also be a Gemm between Reshapes, and one
    output of a Split of a packed product; the heads, past rotary embeddings and before
    repeat_kv, may be appended to a KV cache. Collects the nodes; None when the chain
    differs."""
    tensor, scale = _scaled(g, tensor, nodes)
    rotary: Rotary | None = None
    cache: Cache | None = None
    groups = 0
    for perm in reversed(perms):
        if not groups:
            rep = _repeated(g, tensor, nodes)
            if rep is not None:
                tensor, groups = rep
            tensor, scale = _scaled(g, tensor, nodes, scale)
        if cache is None and rotary is None and tuple(perm) == (0, 2, 1, 3):
            cache = _cached(g, tensor, nodes)  # on the [b, kv, s, d] heads
            if cache is not None:
                tensor = cache.node.input[1]
        if rotary is None:
            rotary = _rotary(g, tensor, nodes)
            if rotary is not None:
                tensor = rotary.t
            tensor, scale = _scaled(g, tensor, nodes, scale)
        t = g.node(tensor, "Transpose")
        if t is None or list(g.attr(t, "perm", [])) != list(perm):
            return None
        nodes.append(t)
        tensor, scale = _scaled(g, t.input[0], nodes, scale)
    r = g.node(tensor, "Reshape")
    if r is None or not g.is_const(r.input[1]):
        return None
    nodes.append(r)
    info = g.tensors.get(r.output[0])
    heads = (
        tuple(info.shape)
        if info is not None and len(info.shape) == 4 and all(isinstance(d, int) for d in info.shape)
        else None
    )
    tensor, scale = _scaled(g, r.input[0], nodes, scale)
    out = tensor
    split = g.node(tensor, "Split")
    if split is not None:  # Q, K and V from one packed product (GPT-2's c_attn)
        nodes.append(split)
        tensor = split.input[0]
    product = _product(g, tensor, nodes)
    if product is None:
        return None
    return Projection(product, split, out, heads, scale, rotary, groups or 1, cache)


def _product(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> Product | None:
    """`MatMul(x, W) [+ b]` ending in `tensor`, or a Gemm between Reshapes; collects
    its nodes."""
    back = g.node(tensor, "Reshape")
    gemm = g.node(back.input[0], "Gemm") if back is not None else None
    if back is not None and gemm is not None:  # Reshape to 2-D, Gemm, Reshape back
        flat = g.node(gemm.input[0], "Reshape")
        if (
            flat is None
            or not g.is_const(gemm.input[1])
            or not all(g.is_const(i) for i in gemm.input[2:] if i)
        ):
            return None
        nodes += [back, gemm, flat]
        bias = gemm.input[2] if len(gemm.input) > 2 and gemm.input[2] else None
        return Product(flat.input[0], gemm.input[1], bias, (flat, gemm, back), gemm)
    add = g.node(tensor, "Add")
    bias = None
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
    made = (mm, add) if add is not None else (mm,)
    return Product(mm.input[0], mm.input[1], bias, made)


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


#: What computes a Reshape's target from a tensor's Shape at run time.
_SHAPE_OPS = ("Slice", "Concat", "Gather", "Unsqueeze", "Squeeze", "Cast")


def _shape_from(
    g: Graph, tensor: str, sources: Container[str], found: list[onnx.NodeProto], depth: int = 12
) -> bool:
    """Whether `tensor` is computed at run time from the Shape of one of `sources` and
    constants alone (Shape, Slice, Concat, Gather, Unsqueeze, Squeeze, Cast), collecting
    those nodes."""
    n = g.node(tensor, "Shape", *_SHAPE_OPS)
    if n is None or depth == 0:
        return False
    if n.op_type == "Shape":
        found.append(n)
        return n.input[0] in sources
    found.append(n)
    return all(g.is_const(i) or _shape_from(g, i, sources, found, depth - 1) for i in n.input if i)


def _unflattened(g: Graph, tensor: str, nodes: list[onnx.NodeProto]) -> tuple[str, int] | None:
    """(t, r): the [b, n, s, d] tensor t that `Reshape(Transpose(Reshape(t, [b·n, s, d]),
    [0, 2, 1]), [b, n, d, s])` transposes, r the times repeat_kv's Reshape merged into the
    first one repeats its heads (1: none), collecting those nodes; None when `tensor` is
    not that. Where both Reshapes' targets are computed from the Shape of what they
    reshape (the dynamo export with a dynamic past: the present's), those nodes are the
    block's too."""
    r4 = g.node(tensor, "Reshape")
    t = g.node(r4.input[0], "Transpose") if r4 is not None else None
    r3 = (
        g.node(t.input[0], "Reshape")
        if t is not None and list(g.attr(t, "perm", [])) == [0, 2, 1]
        else None
    )
    if r3 is None:
        return None
    src, out = g.tensors.get(r3.input[0]), g.tensors.get(tensor)
    if src is None or out is None or len(out.shape) != 4:
        return None
    if len(src.shape) == 5:  # grouped-query: repeat_kv's Reshape merged into this one
        b, kv, r, s, d = src.shape
        found: list[onnx.NodeProto] = []
        inner = _widened(g, r3.input[0], found)
        if inner is None or tuple(out.shape) != (b, kv * r, d, s):
            return None
        nodes += [r4, t, r3, *found, *_shapes(g, (r3, r4), {r3.input[0], inner[0]})]
        return inner
    if len(src.shape) != 4:
        return None
    b, n, s, d = src.shape
    if tuple(out.shape) != (b, n, d, s):
        return None
    nodes += [r4, t, r3, *_shapes(g, (r3, r4), {r3.input[0]})]
    return r3.input[0], 1


def _shapes(
    g: Graph, reshapes: Sequence[onnx.NodeProto], sources: Container[str]
) -> list[onnx.NodeProto]:
    """The nodes that compute `reshapes`' targets from the Shape of `sources` at run
    time; none where a target is constant or comes from elsewhere."""
    found: list[onnx.NodeProto] = []
    for r in reshapes:
        if not g.is_const(r.input[1]) and not _shape_from(g, r.input[1], sources, found):
            return []
    return found


#: An additive mask value at or below this hides its position from the softmax.
MASKED = -1e4


def mask_fill(a: float | None, b: float | None) -> float | None:
    """The fill of a Where(cond, a, b) that makes an additive mask from a boolean: one
    branch 0, the other a constant at or below MASKED (-inf too); None otherwise."""
    if a is None or b is None or (a == 0.0) == (b == 0.0):
        return None
    fill = b if a == 0.0 else a
    return None if math.isnan(fill) or fill > MASKED else fill


def _mask_where(g: Graph, mask: str, add: onnx.NodeProto) -> MaskWhere | None:
    """The `Where(cond, 0, fill)` (or `Where(cond, fill, 0)`) that makes the additive
    `mask` from a boolean computed outside, fill a constant at or below MASKED (-inf
    too), when it feeds this block's Add alone: as transformers writes each layer's mask. Taken
    into the block, the boolean becomes the block's input, which a raw-mask kernel
    (QAttention's mask_index) can read."""
    w = g.node(mask, "Where")
    if w is None or mask in g.outputs or g.users(mask) != [add] or g.is_const(w.input[0]):
        return None
    a = g.scalar(w.input[1])
    fill = mask_fill(a, g.scalar(w.input[2]))
    if fill is None:
        return None
    cond = g.tensors.get(w.input[0])
    if cond is None or len(cond.shape) != 4:
        return None
    return MaskWhere(w, w.input[0], a == 0.0, fill)


def _ready(g: Graph, nodes: Sequence[onnx.NodeProto], presents: Container[str]) -> bool:
    """Whether nothing `nodes` read from outside them is computed from `presents`, the
    tensors of theirs that others may read: a block replaced at its first node reads
    nothing that it writes itself. (The dynamo export of GPT-2 with past reshapes Kᵀ to
    targets computed from the present's Shape; those nodes are the block's own, see
    `_unflattened`, and then nothing outside reads back.)"""
    inside = {n.name for n in nodes}
    todo = [t for n in nodes for t in n.input if t]
    seen: set[str] = set()
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        made = g.producer.get(t)
        if made is None or made.name in inside:
            continue
        if any(i in presents for i in made.input):
            return False
        todo += [i for i in made.input if i]
    return True


def _same_shape(g: Graph, a: str, b: str) -> bool:
    sa, sb = g.tensors.get(a), g.tensors.get(b)
    return sa is not None and sb is not None and sa.shape == sb.shape


def attention(g: Graph, sm: onnx.NodeProto) -> Match | None:
    """The attention task whose Softmax is `sm` (see the module doc); None when the
    block around it is not one."""
    block = attention_block(g, sm)
    return None if block is None else Match("attention", list(block.nodes), block.presents)


def task_block(
    nodes: Sequence[onnx.NodeProto],
    tensors: Mapping[str, TensorInfo],
    constants: Container[str],
    value: Callable[[str], np.ndarray | None],
) -> AttentionBlock | None:
    """The block that a task's `nodes` (in graph order) are, read by the same recognizer
    as the partitioner's: `tensors` their static infos, `constants` the names of the
    constant tensors, `value` a constant's value. None unless the nodes are one block,
    all of it and nothing else."""
    g = Graph.of_task(nodes, tensors, constants, value)
    softmax = [n for n in nodes if n.op_type == "Softmax" and n.domain in STD]
    if len(softmax) != 1:
        return None
    try:
        block = attention_block(g, softmax[0])
    except (KeyError, IndexError, ValueError, TypeError):
        return None  # an odd graph, as `aoe.subgraphs` takes it
    if block is None or [n.name for n in block.nodes] != [n.name for n in nodes]:
        return None
    return block


def _layout(q: Projection, k: Projection, v: Projection) -> Heads | None:
    """The heads where Q has [b, s, n, d] and K and V the same [b, s, kv, d], repeated
    n / kv times; None otherwise."""
    if q.heads is None or k.heads is None or v.heads is None:
        return None
    b, s, heads, head_dim = q.heads
    if q.groups != 1 or k.groups != v.groups or k.heads[:3] != v.heads[:3]:
        return None
    if k.heads[:2] != (b, s) or k.heads[3] != head_dim or k.heads[2] * k.groups != heads:
        return None
    return Heads(heads, head_dim, k.groups)


def attention_block(g: Graph, sm: onnx.NodeProto) -> AttentionBlock | None:
    """The self-attention block whose Softmax is `sm`; None when it is not one."""
    info = g.tensors.get(sm.input[0])
    if info is None or len(info.shape) != 4 or g.attr(sm, "axis", -1) not in (-1, 3):
        return None
    nodes: list[onnx.NodeProto] = [sm]
    scores: list[ScoreStep] = []
    mask_where: MaskWhere | None = None
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
            s, factor = _scaled(g, t, nodes)
            if s == t:
                return None
            scores.append(ScoreStep("scale", factor=factor))
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
                nodes.append(where.node)
                mask_where = where
            scores.append(ScoreStep("mask", mask=mask or ""))
            t = side[0]
            continue
        if n.op_type == "Where" and g.is_const(n.input[0]) and g.is_const(n.input[2]):
            nodes.append(n)
            scores.append(ScoreStep("where", cond=n.input[0], fill=n.input[2]))
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
        outer, factor = _scaled(g, qk.input[1], nodes)
        inner = _unflattened(g, outer, nodes)
        k = _projection(g, inner[0], [(0, 2, 1, 3)], nodes) if inner is not None else None
        if k is not None and inner is not None:
            groups = k.groups if k.groups != 1 else inner[1]
            k = replace(k, scale=k.scale * factor, groups=groups)
    v = _projection(g, pv_node.input[1], [(0, 2, 1, 3)], nodes)
    if q is None or k is None or v is None or len({q.product.x, k.product.x, v.product.x}) != 1:
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
    caches = [c for c in (k.cache, v.cache) if c is not None]
    if q.cache is not None or len(caches) == 1:
        return None  # a cache on K alone, or on Q, is no decode step
    tables = [t for p in (q, k) if p.rotary is not None for t in (p.rotary.cos, p.rotary.sin)]
    if not caches and not all(g.is_const(t) for t in tables):
        return None  # run-time tables: a decode step's, where the positions follow the past
    if (
        ordered[-1] is not users[0]
        or not g.closed(ordered, [c.present for c in caches])
        or caches
        and not _ready(g, ordered, [c.present for c in caches])
    ):
        return None
    return AttentionBlock(
        nodes=tuple(ordered),
        x=q.product.x,
        q=q,
        k=k,
        v=v,
        layout=_layout(q, k, v),
        scores=tuple(scores),
        mask_where=mask_where,
        guard=guard is not None,
    )

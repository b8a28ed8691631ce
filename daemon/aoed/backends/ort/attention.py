"""Attention strategies for ONNX Runtime's CPU provider (SGAT, family ``attention``).

The task's block comes from the partitioner's own recognizer (`aoe.attention.task_block`:
the three projections, separate or one packed product and a Split, the heads, the scale,
the scores' mask steps, rotary embeddings on Q and K, K and V heads shared by groups of
query heads); `_parts` reads the values of the constants it names (weights, biases, rotary
tables, a constant mask, which makes a causal or an additive one). No strategy walks the
graph itself, so what is tuned is what was recognized.
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

A decode step's block with a KV cache (`AttentionBlock.caches`: K and V appended to the
past along the sequence axis, the presents leaving the block) runs on the kernels that
take the cache as it is, [B, kv, past, D] in and [B, kv, past + S, D] out:
``multihead_attention`` (past_key/past_value in, present_key/present_value out; a K/V
head per query head) and ``group_query_attention`` (the same for any group, with
seqlens_k and total_sequence_length computed in the graph from the past's and the
input's shapes, so that the past stays dynamic), their int8 forms, and the packings,
which leave the Concats as they are. A mask the block reads from outside (computed at
run time, [.., S, past + S], as transformers' exports make it from the past's length)
goes to the kernels as attention_bias as it is, and rotary tables computed at run time
(this step's rows) become RotaryEmbedding's caches, at positions 0..S-1 of them, in
front of the kernel. ``fused_attention`` and ``int8_qattention`` decline a cached block
(their kernels take the cache packed as one [2, B, N, past, D] tensor), and so do the
fused kernels where it has constant rotary tables or a constant mask (values read from
constants would hold the profiled past length).

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
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import onnx
from onnx import helper

from aoe.attention import AttentionBlock, Cache, Heads, MaskWhere, Projection, Rotary, task_block
from aoed.backends.ort._rewrite import attrs_of, init, int8_weight
from aoed.engine.registry import StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]

#: the fill the kernels get in place of a mask Where's -inf where `_row_guard` applies:
#: exp(FINITE_FILL - max) is 0 in float32 as exp(-inf) is, and a row of it is finite
FINITE_FILL = -1e30


@dataclass(frozen=True)
class _Parts:
    """What the fused kernels read of one `AttentionBlock`: the values of its constants
    (weights, biases, rotary tables, a constant mask) and what they make of its scores
    (the scale, a causal or additive mask). Built whole by `_parts`, never changed."""

    block: AttentionBlock
    layout: Heads
    weights: tuple[np.ndarray, np.ndarray, np.ndarray]  # Wq, Wk, Wv as [hidden, h]
    biases: tuple[np.ndarray, np.ndarray, np.ndarray]  # bq, bk, bv (zeros where none)
    has_bias: bool
    scale: float  # of Q·Kᵀ, as the softmax sees it
    mask: str | None  # an additive mask tensor, [.., S, T] (an activation)
    mask_value: np.ndarray | None  # a constant mask (scaled as the scores are)
    causal: bool
    rotary: tuple[np.ndarray, np.ndarray] | None  # the caches, where RotaryEmbedding fits
    #: a cached block's tables computed at run time (cos, sin: this step's positions'
    #: rows, whose halves repeat), where RotaryEmbedding fits
    run_time_rotary: tuple[str, str] | None
    guard: bool  # the block's NaN guard can fire: the kernels need one too

    @property
    def x(self) -> str:
        return self.block.x

    @property
    def heads(self) -> int:
        return self.layout.heads

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    @property
    def groups(self) -> int:
        return self.layout.groups

    @property
    def rotated(self) -> bool:
        return self.block.rotated

    @property
    def mask_where(self) -> MaskWhere | None:
        """The block's own Where that makes `mask` from a boolean."""
        return self.block.mask_where if self.mask is not None else None

    @property
    def caches(self) -> tuple[Cache, Cache] | None:
        """The block's K and V caches (a decode step); None without a KV cache."""
        return self.block.caches


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


def _weights(view: TaskView, proj: Projection) -> tuple[np.ndarray, np.ndarray] | None:
    """(weight [in, out], bias) of one projection, its columns of a packed product."""
    p = proj.product
    if p.gemm is not None:
        wb = _gemm_weights(view, p.gemm)
        if wb is None:
            return None
        w, b = wb
    else:
        w = view.const(p.weight)
        if w is None or w.ndim != 2:
            return None
        w = np.asarray(w)
        if p.bias is None:
            b = np.zeros(w.shape[1], w.dtype)
        else:
            bias = view.const(p.bias)
            if bias is None or bias.size != w.shape[1]:
                return None
            b = np.asarray(bias, w.dtype).reshape(-1)
    if proj.split is None:
        return w, b
    total = view.info(proj.split.input[0])
    if total is None or attrs_of(proj.split).get("axis", 0) not in (-1, len(total.shape) - 1):
        return None
    sizes = _split_sizes(view, proj.split, w.shape[1])
    if sizes is None or sum(sizes) != w.shape[1]:
        return None
    i = list(proj.split.output).index(proj.out)
    lo = sum(sizes[:i])
    return w[:, lo : lo + sizes[i]], b[lo : lo + sizes[i]]


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


#: `_tables` of a rotation that is not rotate_half over the last axis
_UNREAD = "unread"


def _tables(
    view: TaskView, rot: Rotary
) -> tuple[np.ndarray, np.ndarray] | None | Literal["unread"]:
    """The (cos, sin) caches, [S, D/2], of a rotation (non-interleaved, as LLaMA-style
    models write it); None where the tables are not what onnxruntime's RotaryEmbedding
    computes (one [S, D] table whose halves repeat); `_UNREAD` where the slices and the
    Concat are not rotate_half over the last axis, or the tables cannot be read."""
    info = view.info(rot.t)
    cos, sin = view.const(rot.cos), view.const(rot.sin)
    if info is None or cos is None or sin is None or not _rotates_half(view, rot):
        return _UNREAD
    seq, d = info.shape[2], info.shape[3]
    h = d // 2
    try:
        c = np.broadcast_to(np.asarray(cos, np.float32), (1, 1, seq, d))[0, 0]
        s = np.broadcast_to(np.asarray(sin, np.float32), (1, 1, seq, d))[0, 0]
    except ValueError:
        return None
    if np.asarray(cos).size != seq * d or np.asarray(sin).size != seq * d:
        return None  # the tables differ per head or batch: not one cache
    if not (np.array_equal(c[:, :h], c[:, h:]) and np.array_equal(s[:, :h], s[:, h:])):
        return None
    return np.ascontiguousarray(c[:, :h]), np.ascontiguousarray(s[:, :h])


def _rotates_half(view: TaskView, rot: Rotary) -> bool:
    """Whether the rotation's slices and Concat are rotate_half over the last axis of
    [b, n, s, d] heads."""
    info = view.info(rot.t)
    if info is None or len(info.shape) != 4:
        return False
    d = info.shape[3]
    h = d // 2
    if d % 2 or attrs_of(rot.cat).get("axis") not in (-1, 3):
        return False
    high = _slice_of(view, rot.high, 4) or (0, 0)
    return _slice_of(view, rot.low, 4) == (0, h) and high[0] == h and high[1] >= d


def _run_time_rotary(view: TaskView, block: AttentionBlock) -> tuple[str, str] | None:
    """(cos, sin) of a cached block whose Q and K rotate by the same tables computed at
    run time (`aoe.attention.Rotary`), one [S, D] table for every batch row and head;
    None otherwise."""
    q, k = block.q.rotary, block.k.rotary
    if block.caches is None or q is None or k is None or (q.cos, q.sin) != (k.cos, k.sin):
        return None
    if view.const(q.cos) is not None or view.const(q.sin) is not None:
        return None
    if not (_rotates_half(view, q) and _rotates_half(view, k)):
        return None
    heads = view.info(q.t)
    assert heads is not None  # `_rotates_half` read it
    for table in (q.cos, q.sin):
        info = view.info(table)
        if info is None or len(info.shape) < 2 or tuple(info.shape[-2:]) != heads.shape[2:]:
            return None
        if any(d != 1 for d in info.shape[:-2]):
            return None
    return q.cos, q.sin


def _block(view: TaskView) -> AttentionBlock | None:
    """The attention block the task is, by the partitioner's own recognizer."""
    return task_block(view.nodes, view.infos, view.consts, view.const)


def _parts(view: TaskView) -> _Parts | None:
    """What the fused kernels read of the task's block; None where the task is no block,
    or its details fit no kernel (a rotation not over the last axis, a mask after a
    scale that is not constant, two masks, a scale that is not finite)."""
    block = _block(view)
    if block is None or block.layout is None:
        return None
    layout = block.layout
    q, k, v = block.projections
    read = [_weights(view, p) for p in (q, k, v)]
    run_time = _run_time_rotary(view, block)
    tables = [
        _tables(view, p.rotary) if p.rotary is not None and run_time is None else None
        for p in (q, k, v)
    ]
    if any(r is None for r in read) or any(isinstance(t, str) for t in tables):
        return None
    if v.rotary is not None or (q.rotary is None) != (k.rotary is None):
        return None
    rotary = None
    tq, tk = tables[0], tables[1]
    if (
        tq is not None
        and tk is not None
        and not isinstance(tq, str)
        and not isinstance(tk, str)
        and all(np.array_equal(a, b) for a, b in zip(tq, tk, strict=True))
    ):
        rotary = tq
    weights = tuple(r[0] for r in read if r is not None)
    biases = tuple(r[1] for r in read if r is not None)
    xi = view.info(block.x)
    if xi is None or len(xi.shape) != 3 or weights[0].shape[1] != layout.heads * layout.head_dim:
        return None
    seq = xi.shape[1]
    if block.caches is not None and any(
        step.kind == "where" or step.kind == "mask" and view.const(step.mask) is not None
        for step in block.scores
    ):
        return None  # a constant mask over past + S keys holds the profiled past
    # The scores' transform, from Q·Kᵀ outwards: scale, then mask (scaled by any later
    # scale), then a causal Where. Anything else does not fit the kernel.
    mask: np.ndarray | str | None = None
    later = 1.0
    for step in block.scores:  # softmax side first
        if step.kind == "scale":
            later *= step.factor
        elif step.kind == "mask":
            if mask is not None:
                return None
            value = view.const(step.mask)
            if value is None:
                if later != 1.0:
                    return None
                mask = step.mask
            else:
                mask = np.asarray(value, np.float32) * np.float32(later)
        else:
            cond, fill = view.const(step.cond), view.const(step.fill)
            if cond is None or fill is None:
                return None
            if mask is not None and not isinstance(mask, np.ndarray):
                return None
            bias = np.where(
                np.asarray(cond, bool),
                np.float32(0),
                np.asarray(fill, np.float32) * np.float32(later),
            ).astype(np.float32)
            mask = bias if mask is None else mask + bias
    causal, mask_value, mask_input = False, None, None
    if isinstance(mask, np.ndarray):
        full = np.broadcast_to(mask, np.broadcast_shapes(mask.shape, (1, 1, seq, seq)))
        if full.shape[-2:] != (seq, seq) or full.ndim != 4:
            return None
        lower = np.tril(np.ones((seq, seq), bool))
        if np.all(full[..., lower] == 0) and np.all(full[..., ~lower] <= -1e4):
            causal = True
        elif not np.all(full == 0):
            mask_value = np.ascontiguousarray(full[:, :, :, :]).astype(np.float32)
    elif isinstance(mask, str):
        mi = view.info(mask)
        # a cached block's mask goes to the kernel as it is: [.., S, past + S]; an Expand
        # of its rows (`_bias_input`) would hold the profiled past
        keys, rows = (seq, (seq, 1)) if block.caches is None else (_keys(view, block), (seq,))
        if mi is None or len(mi.shape) != 4 or mi.shape[-1] != keys or mi.shape[-2] not in rows:
            return None
        mask_input = mask
    if not math.isfinite(block.scale):
        return None
    parts = _Parts(
        block=block,
        layout=layout,
        weights=(weights[0], weights[1], weights[2]),
        biases=(biases[0], biases[1], biases[2]),
        has_bias=any(np.any(b != 0) for b in biases),
        scale=block.scale,
        mask=mask_input,
        mask_value=mask_value,
        causal=causal,
        rotary=rotary,
        run_time_rotary=run_time,
        guard=block.guard,
    )
    oi = view.info(view.output)
    if _flattened(view, parts) and (
        oi is None or sum(not isinstance(d, int) for d in oi.shape) > 1
    ):
        return None  # a reshape to it needs its dimensions
    if parts.guard and _rows_stay_finite(parts):
        parts = replace(
            parts, guard=False
        )  # the block's guard never fires: the kernels need none either
    return parts


def _keys(view: TaskView, block: AttentionBlock) -> int | None:
    """The keys a cached block's query attends to at the profiled point: past + S."""
    assert block.caches is not None
    info = view.info(block.caches[0].present)
    return None if info is None else info.shape[2]


def _rows_stay_finite(att: _Parts) -> bool:
    """Whether every query row keeps a finite score for finite inputs, so that the
    softmax never gives NaN and a Where(IsNaN(P), 0, P) guard after it changes nothing:
    no mask but a causal one (a row keeps its own position), a constant mask with a
    finite entry in every row, or the block's own mask Where with a finite fill
    (transformers fills with the float's lowest value, not -inf)."""
    if att.mask is not None:
        return att.mask_where is not None and math.isfinite(att.mask_where.fill)
    if att.mask_value is not None:
        return bool(np.isfinite(att.mask_value).any(axis=-1).all())
    return True


def _per_head(att: _Parts) -> tuple[list[np.ndarray], list[np.ndarray]]:
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


def _bias_input(view: TaskView, att: _Parts, nodes: list, inits: list) -> str:
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
        copy.CopyFrom(att.mask_where.node)
        if _row_guard(view, att):  # a finite fill: a fully masked row comes out finite, then zeroed
            fill = init(view, "mask_fill", np.array(FINITE_FILL, np.float32))
            inits.append(fill)
            copy.input[2 if att.mask_where.keeps else 1] = fill.name
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


def _flattened(view: TaskView, att: _Parts) -> bool:
    """Whether the block's output is not the kernels' [B, S, hidden]: torch's dynamo
    export of GPT-2's Conv1D merges the heads straight into [B*S, hidden] for the next
    product. The kernels' output is then reshaped to it."""
    oi, xi = view.info(view.output), view.info(att.x)
    if oi is None or xi is None:
        return False
    return tuple(oi.shape) != (*tuple(xi.shape)[:2], att.heads * att.head_dim)


def _out(view: TaskView, att: _Parts) -> str:
    """Where a fused kernel writes: the task's output, or before what `_finish` adds."""
    return view.name("attention") if att.guard or _flattened(view, att) else view.output


def _row_guard(view: TaskView, att: _Parts) -> bool:
    """Whether the block's guard can be a product by the rows' keep flags: its only mask
    is its own Where with a fill of -inf, on a boolean with one head dimension. The kernels then get a finite fill instead, so
    that a fully masked row comes out finite (their average) and the product makes it
    zeros, as the guarded softmax does, for a fraction of the IsNaN and Where's cost."""
    if not att.guard or att.causal or att.mask_where is None or att.mask_where.fill != -math.inf:
        return False
    ci = view.info(att.mask_where.cond)
    return ci is not None and len(ci.shape) == 4 and ci.shape[1] == 1


def _finish(view: TaskView, att: _Parts, nodes: list, inits: list) -> Rewrite:
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


def _row_keeps(view: TaskView, att: _Parts, nodes: list, inits: list) -> str:
    """[B|1, S|1, 1] float: 1 where a query row keeps any key under the block's mask
    Where, 0 where it keeps none."""
    assert att.mask_where is not None
    cond, keeps = att.mask_where.cond, att.mask_where.keeps
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
    shape = init(
        view, "row_keep_shape", np.array([0, -1, 1], np.int64)
    )  # [B, 1, S, 1] as [B, S, 1]
    inits.append(shape)
    nodes.append(
        helper.make_node("Reshape", [names[1], shape.name], [names[2]], name=view.name("RowKeep"))
    )
    return names[2]


def _fused_attention(view: TaskView) -> Rewrite | None:
    """Q/K/V projections, scaled dot product, softmax and head merge as one com.microsoft
    Attention over the packed [hidden, 3h] weight (not with rotary embeddings)."""
    att = _parts(view)
    if att is None or att.rotated or att.caches is not None:
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
    att: _Parts,
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
    att = _parts(view)
    if att is None:
        return None
    nodes, inits, outs = _packed_projection(view, att, with_bias=att.has_bias)
    return Rewrite((*nodes, *_after_projections(view, att, outs)), tuple(inits))


def _after_projections(view: TaskView, att: _Parts, outs: Sequence[str]) -> list[onnx.NodeProto]:
    """The block's nodes past its three projections, reading `outs` (q, k, v) instead."""
    replaced = {n.name for p in att.block.projections for n in p.nodes}
    renames = {p.out: out for p, out in zip(att.block.projections, outs, strict=True)}
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
    att: _Parts,
    outs: Sequence[str],
    nodes: list,
    inits: list,
    kv_heads: int | None = None,
) -> list[str]:
    """q and k of `outs` through com.microsoft RotaryEmbedding (non-interleaved, the
    model's own tables as caches, positions 0..S-1; k with `kv_heads` heads, by default
    as many as q); v as it is. Tables computed at run time (a decode step's) are this
    step's rows: the caches are their first halves, taken at run time."""
    if att.run_time_rotary is not None:
        # This step's rows, as many as its new tokens, at positions 0..S-1: a position_ids
        # of shape [1] is the kernel's offset of the first (never the searched point's
        # count, and nothing to compute at run time).
        rows = init(view, "rotary_rows", np.array([-1, att.head_dim], np.int64))
        ends = [
            init(view, f"rotary_{n}", np.array([v], np.int64))
            for n, v in (("start", 0), ("half", att.head_dim // 2), ("axis", 1))
        ]
        first = init(view, "rotary_first", np.array([0], np.int64))
        inits += [rows, *ends, first]
        pos_name = first.name
        caches = []
        for which, table in zip(("cos", "sin"), att.run_time_rotary, strict=True):
            flat, half = view.name(f"rotary_{which}_rows"), view.name(f"rotary_{which}")
            nodes += [
                helper.make_node(
                    "Reshape", [table, rows.name], [flat], name=view.name(f"Rotary{which}Rows")
                ),
                helper.make_node(
                    "Slice",
                    [flat, *(e.name for e in ends)],
                    [half],
                    name=view.name(f"Rotary{which}Half"),
                ),
            ]
            caches.append(half)
        cos_name, sin_name = caches[0], caches[1]
    else:
        assert att.rotary is not None
        cos, sin = att.rotary
        pos = init(view, "rotary_positions", np.arange(cos.shape[0], dtype=np.int64)[None, :])
        c, s = init(view, "rotary_cos", cos), init(view, "rotary_sin", sin)
        inits += [pos, c, s]
        pos_name, cos_name, sin_name = pos.name, c.name, s.name
    rotated = []
    for which, src, heads in zip(
        ("q", "k"), outs[:2], (att.heads, kv_heads or att.heads), strict=True
    ):
        out = view.name(f"{which}_rotary")
        nodes.append(
            helper.make_node(
                "RotaryEmbedding",
                [src, pos_name, cos_name, sin_name],
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
    att = _parts(view)
    if att is None or att.rotated and att.rotary is None and att.run_time_rotary is None:
        return None
    if att.caches is not None and (att.rotary is not None or att.groups != 1):
        return None  # constant tables hold the profiled positions; a present per query head
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
    if att.caches is not None:
        ins = [*outs, qkv_bias, "", bias, *(c.past for c in att.caches)]
    nodes.append(
        helper.make_node(
            "MultiHeadAttention",
            ins,
            [_out(view, att), *_presents(att)],
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
    att = _parts(view)
    if att is None or att.rotated and att.rotary is None and att.run_time_rotary is None:
        return None
    if att.caches is not None and att.rotary is not None:
        return None  # constant tables hold the profiled positions
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
    if att.caches is None:
        lens_t = init(view, "seqlens_k", np.full(batch, seq - 1, np.int32))
        total_t = init(view, "total_sequence_length", np.array(seq, np.int32))
        inits += [lens_t, total_t]
        lens, total, pasts = lens_t.name, total_t.name, ["", ""]
    else:
        lens, total = _cache_lengths(view, att, nodes, inits)
        pasts = [c.past for c in att.caches]
    bias = _bias_input(view, att, nodes, inits)
    ins = [*outs, *pasts, lens, total] + (["", "", "", bias] if bias else [])
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            ins,
            [_out(view, att), *_presents(att)],
            name=view.name("GroupQueryAttention"),
            domain=CONTRIB_DOMAIN,
            num_heads=att.heads,
            kv_num_heads=kv,
            scale=float(att.scale),
            causal=int(att.causal),
        )
    )
    return _finish(view, att, nodes, inits)


def _presents(att: _Parts) -> list[str]:
    """The kernels' present_key and present_value outputs: the block's presents."""
    return [] if att.caches is None else [c.present for c in att.caches]


def _cache_lengths(view: TaskView, att: _Parts, nodes: list, inits: list) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k ([B] int32, past + S - 1 for every row) and
    total_sequence_length (int32 scalar, past + S), computed from the past's and the
    input's shapes at run time: the tuned model serves every past length, never only the
    one it was measured at."""
    assert att.caches is not None
    one = init(view, "cache_one", np.array([1], np.int32))
    scalar = init(view, "cache_scalar", np.zeros(0, np.int64))
    inits += [one, scalar]
    n = {k: view.name(k) for k in ("past_shape", "x_shape", "past_len", "seq", "batch")}
    n |= {k: view.name(k) for k in ("total64", "total", "last", "seqlens_k", "total_len")}
    node = helper.make_node
    if view.opset >= 15:  # Shape's start and end: each length one node, nothing to gather
        nodes += [
            node("Shape", [src], [n[k]], name=view.name(k), start=i, end=i + 1)
            for src, k, i in (
                (att.caches[0].past, "past_len", 2),
                (att.x, "seq", 1),
                (att.x, "batch", 0),
            )
        ]
    else:
        at = {i: init(view, f"cache_axis_{i}", np.array([i], np.int64)) for i in (0, 1, 2)}
        inits += at.values()
        nodes += [
            node("Shape", [att.caches[0].past], [n["past_shape"]], name=view.name("PastShape")),
            node("Shape", [att.x], [n["x_shape"]], name=view.name("InputShape")),
            node(
                "Gather", [n["past_shape"], at[2].name], [n["past_len"]], name=view.name("PastLen")
            ),
            node("Gather", [n["x_shape"], at[1].name], [n["seq"]], name=view.name("SeqLen")),
            node("Gather", [n["x_shape"], at[0].name], [n["batch"]], name=view.name("Batch")),
        ]
    nodes += [
        node("Add", [n["past_len"], n["seq"]], [n["total64"]], name=view.name("Total64")),
        node(
            "Cast", [n["total64"]], [n["total"]], name=view.name("Total"), to=onnx.TensorProto.INT32
        ),
        node("Sub", [n["total"], one.name], [n["last"]], name=view.name("LastKey")),
        node("Expand", [n["last"], n["batch"]], [n["seqlens_k"]], name=view.name("SeqlensK")),
        node("Reshape", [n["total"], scalar.name], [n["total_len"]], name=view.name("TotalLen")),
    ]
    return n["seqlens_k"], n["total_len"]


def _raw_mask(view: TaskView, att: _Parts, nodes: list, inits: list) -> str | None:
    """QAttention's mask_index from the block's own mask Where: its boolean as 1 (kept)
    and 0 (masked), [B, S, T] int32, the raw 3-D form; None when the boolean has a
    dimension per head or the block has no such Where."""
    if att.mask_where is None:
        return None
    cond, keeps = att.mask_where.cond, att.mask_where.keeps
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
    att = _parts(view)
    if att is None or att.mask_value is not None or att.rotated or att.caches is not None:
        return None
    nodes: list = []
    inits: list = []
    mask_index, fill = "", None
    if att.mask is not None:
        got = _raw_mask(view, att, nodes, inits)
        if got is None:
            return None
        mask_index, fill = got, FINITE_FILL if _row_guard(view, att) else att.mask_where.fill  # type: ignore[union-attr]
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
    att = _parts(view)
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

"""Subgraphs: the units SGAT tunes, recognized by structure, never by node names.

A subgraph task is a `Task` like an operator task (only its last node's output escapes,
and an attention block's KV cache or a pre-norm block's residual sum, so one rewrite
serves the isolated task model and the whole model), in one of these families:

  attention   self-attention from the Q/K/V projections to the merged heads: three
              MatMuls of one input (each with an optional constant bias Add; or one
              packed product, a Gemm between Reshapes as GPT-2 exports, Split), Reshape
              to heads, Transpose (K to [b, n, d, s], directly or in two steps), the
              Q·Kᵀ MatMul, any scalar Mul/Div (on Q or on the scores), an additive
              mask (Add) or a causal Where, Softmax over the last axis (and the NaN
              guard torch's sdpa export puts after it), P·V, Transpose back (after a
              Reshape that keeps the shape, as that export writes) and Reshape to
              [b, s, hidden]. The output projection is left out:
              it is an operator task of its own. A decode step's K and V may be
              Concat(past, new) along the sequence axis (a KV cache), the Concat's
              result, the present, leaving the block too.
  layernorm   LayerNorm written out (ReduceMean, Sub, Pow or Mul, ReduceMean, Add eps,
              Sqrt, Div or Reciprocal+Mul, then an optional scale Mul and bias Add), or a
              LayerNormalization node; either with the residual Add in front of it:
              in a post-norm block the sum feeds nothing else, in a pre-norm one it
              feeds the next residual too and leaves the task as its second output
              (a [batch, sequence, hidden] sum no other norm reads). A lone
              LayerNormalization is already fused and is no task. Also RMSNorm written
              out (LLaMA-style: Pow or Mul for x², ReduceMean, Add eps, Sqrt, Div or
              Reciprocal+Mul, an optional scale Mul), with a residual Add in front on
              the same terms.
  conv_region a CNN's convolutional trunk: a connected run of Convs (constant weights),
              inference BatchNormalizations, Relus, residual Adds and pooling, at least
              two Convs, with one output leaving it (where the head begins); int8 can
              then keep every link, residual and pool inside in int8.
  gelu        GELU written out, erf form (x·0.5·(1 + erf(x/√2)) in any order of its
              products) or tanh form (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))), with
              the bias Add and the MatMul before it when they feed nothing else (an FFN's
              first product).
  glu         a gated FFN (SwiGLU, as LLaMA-style models write it, or GLU): two
              products of one input, gate and up (MatMul with a constant weight, an
              optional constant bias Add), the gate through SiLU (g·Sigmoid(g)) or
              Sigmoid, and their product (Mul). The down projection after it is an
              operator task of its own.

`subgraph_tasks` finds them in a normalized model (`aoe.graph.normalize`); a block that
does not match is simply left to operator tuning. Signatures come from
`aoe.signature.task_signature` over the task's nodes, so subgraph entries in the bank
have their own keys and twins (the same block repeated in every layer) are tuned once.

The attention recognizer lives in `aoe.attention`, the graph view both use in
`aoe._sgraph`. This module imports neither trio nor onnxruntime.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import onnx

from aoe._sgraph import STD, Graph, Match, last_axis
from aoe.attention import attention
from aoe.signature import ModelContext

__all__ = ["SUBGRAPH_FAMILIES", "Match", "find_subgraphs"]

#: Subgraph families, in the order the tuner reports them.
SUBGRAPH_FAMILIES = ("attention", "layernorm", "gelu", "glu", "conv_region")


# --------------------------------------------------------------------------- layernorm


def _reads_as_norm(g: Graph, node: onnx.NodeProto, x: str) -> bool:
    """True when `node` starts a norm of `x`: its mean, its square, or a norm node."""
    if node.domain in STD and node.op_type in ("ReduceMean", "LayerNormalization"):
        return True
    if node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization"):
        return True
    return (node.op_type == "Pow" and node.input[0] == x and g.is_scalar(node.input[1], 2.0)) or (
        node.op_type == "Mul" and list(node.input) == [x, x]
    )


def _residual(
    g: Graph, x: str, inside: Sequence[onnx.NodeProto]
) -> tuple[onnx.NodeProto, tuple[str, ...]] | None:
    """The Add producing `x` from two activations of one shape, and what of it leaves the
    task besides the norm's output: nothing when `x` feeds only `inside` (a post-norm
    block), else `x` itself. A pre-norm block's sum also feeds the next residual (and
    perhaps the model's outputs); it is taken for a [batch, sequence, hidden] sum that no
    other norm reads (of two norms, neither owns the Add: graph order is no reason to
    give it to one), and then leaves as the task's second output, the Skip kernels'
    fourth. Leaving or not, the task's signature is the same: every strategy writes the
    sum under its own name, read or not, so one rewrite serves both."""
    add = g.node(x, "Add")
    if add is None or any(g.is_const(i) for i in add.input):
        return None
    a, b = (g.tensors.get(i) for i in add.input)
    if a is None or b is None or a.shape != b.shape:
        return None  # a broadcasting Add (a bias) is no residual
    names = {n.name for n in inside}
    others = [u for u in g.users(x) if u.name not in names]
    if not others and x not in g.outputs:
        return add, ()
    if len(a.shape) != 3 or any(_reads_as_norm(g, u, x) for u in others):
        return None
    return add, (x,)


def _with_residual(g: Graph, x: str, nodes: list[onnx.NodeProto]) -> Match | None:
    """The layernorm task of a norm's `nodes` over `x`, with the residual Add in front
    when there is one to take (`_residual`)."""
    res = _residual(g, x, nodes)
    also: tuple[str, ...] = ()
    if res is not None:
        nodes = [*nodes, res[0]]
        also = res[1]
    ordered = g.sorted(nodes)
    return Match("layernorm", ordered, also) if g.closed(ordered, also) else None


def _layernorm(g: Graph, r1: onnx.NodeProto) -> Match | None:
    """A LayerNorm written out, anchored at its first ReduceMean."""
    x = r1.input[0]
    if not last_axis(g, r1, x):
        return None
    sub = [u for u in g.users(r1.output[0]) if u.op_type == "Sub" and u.input == [x, r1.output[0]]]
    if len(sub) != 1 or len(g.users(r1.output[0])) != 1:
        return None
    d = sub[0].output[0]
    uses = g.users(d)
    sq = [
        u
        for u in uses
        if (u.op_type == "Pow" and u.input[0] == d and g.is_scalar(u.input[1], 2.0))
        or (u.op_type == "Mul" and list(u.input) == [d, d])
    ]
    if len(sq) != 1:
        return None
    r2 = g.users(sq[0].output[0])
    if len(r2) != 1 or r2[0].op_type != "ReduceMean" or not last_axis(g, r2[0], sq[0].output[0]):
        return None
    eps = g.users(r2[0].output[0])
    if (
        len(eps) != 1
        or eps[0].op_type != "Add"
        or g.scalar(g.other(eps[0], r2[0].output[0]) or "") is None
    ):
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
    return _with_residual(g, x, nodes)


def _rmsnorm(g: Graph, r: onnx.NodeProto) -> Match | None:
    """An RMSNorm written out (LLaMA-style), anchored at its ReduceMean: x², the mean
    over the last axis, + eps, Sqrt, then x / it (Div) or x · 1/it (Reciprocal and Mul),
    and an optional constant scale Mul; with the residual Add in front (`_residual`)."""
    sq = g.node(r.input[0], "Pow", "Mul")
    if sq is None:
        return None
    x = sq.input[0]
    if not (
        (sq.op_type == "Pow" and g.is_scalar(sq.input[1], 2.0))
        or (sq.op_type == "Mul" and list(sq.input) == [x, x])
    ):
        return None
    if (
        len(g.users(sq.output[0])) != 1
        or not last_axis(g, r, sq.output[0])
        or g.attr(r, "keepdims", 1) != 1
    ):
        return None
    eps = g.users(r.output[0])
    if (
        len(eps) != 1
        or eps[0].op_type != "Add"
        or g.scalar(g.other(eps[0], r.output[0]) or "") is None
    ):
        return None
    sqrt = g.users(eps[0].output[0])
    if len(sqrt) != 1 or sqrt[0].op_type != "Sqrt":
        return None
    nodes = [sq, r, eps[0], sqrt[0]]
    after = g.users(sqrt[0].output[0])
    if len(after) != 1:
        return None
    if after[0].op_type == "Div" and list(after[0].input) == [x, sqrt[0].output[0]]:
        nodes.append(after[0])
    elif after[0].op_type == "Reciprocal":
        mul = g.users(after[0].output[0])
        if len(mul) != 1 or mul[0].op_type != "Mul" or g.other(mul[0], after[0].output[0]) != x:
            return None
        nodes += [after[0], mul[0]]
    else:
        return None
    out = nodes[-1].output[0]
    users = g.users(out)
    if len(users) == 1 and users[0].op_type == "Mul" and g.is_const(g.other(users[0], out) or ""):
        nodes.append(users[0])
    return _with_residual(g, x, nodes)


def _norm(g: Graph, r: onnx.NodeProto) -> Match | None:
    """A LayerNorm or an RMSNorm written out, anchored at a ReduceMean."""
    return _layernorm(g, r) or _rmsnorm(g, r)


def _skip_layernorm(g: Graph, ln: onnx.NodeProto) -> Match | None:
    """A LayerNormalization node over the last axis with a residual Add in front."""
    if g.attr(ln, "axis", -1) not in (-1,) and g.tensors.get(ln.input[0]) is not None:
        info = g.tensors[ln.input[0]]
        if g.attr(ln, "axis", -1) != len(info.shape) - 1:
            return None
    if len(ln.input) < 2 or not all(g.is_const(i) for i in ln.input[1:] if i):
        return None
    m = _with_residual(g, ln.input[0], [ln])
    return m if m is not None and len(m.nodes) == 2 else None


# --------------------------------------------------------------------------- gelu


def _gelu_tail(g: Graph, x: str, inner: str, nodes: list[onnx.NodeProto]) -> bool:
    """From `inner` = 1 + f(x), the products with x and 0.5 in any order; collects them."""
    users = g.users(inner)
    if len(users) != 1 or users[0].op_type != "Mul":
        return False
    m1 = users[0]
    o = g.other(m1, inner)
    nodes.append(m1)
    if o == x:  # x·(1 + f) then ·0.5
        m2 = g.users(m1.output[0])
        if (
            len(m2) != 1
            or m2[0].op_type != "Mul"
            or not g.is_scalar(g.other(m2[0], m1.output[0]) or "", 0.5)
        ):
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


def _gelu(g: Graph, anchor: onnx.NodeProto) -> Match | None:
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
    if (
        len(one) != 1
        or one[0].op_type != "Add"
        or not g.is_scalar(g.other(one[0], anchor.output[0]) or "", 1.0)
    ):
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
        if (
            mm is not None
            and g.is_const(mm.input[1])
            and len(g.users(mm.output[0])) == 1
            and mm.output[0] not in g.outputs
        ):
            nodes += [add, mm]
    ordered = g.sorted(nodes)
    return Match("gelu", ordered) if g.closed(ordered) else None


# --------------------------------------------------------------------------- glu


def _product(g: Graph, y: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(input, nodes) of `y = MatMul(x, W) [+ b]` with constant W (2-D) and b."""
    nodes: list[onnx.NodeProto] = []
    add = g.node(y, "Add")
    if add is not None:
        bias = next((i for i in add.input if g.is_const(i)), None)
        if bias is None:
            return None
        y = g.other(add, bias) or ""
        nodes.append(add)
    mm = g.node(y, "MatMul")
    if mm is None or not g.is_const(mm.input[1]) or g.is_const(mm.input[0]):
        return None
    w = g.tensors.get(mm.input[1])
    if w is None or len(w.shape) != 2:
        return None
    return mm.input[0], [mm, *nodes]


def _gate(g: Graph, a: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(gate pre-activation, activation nodes) of SiLU (g·Sigmoid(g)) or Sigmoid."""
    sig = g.node(a, "Sigmoid")
    if sig is not None:
        return sig.input[0], [sig]
    mul = g.node(a, "Mul")
    if mul is None or len(mul.input) != 2:
        return None
    for x, s in (mul.input, reversed(mul.input)):
        sig = g.node(s, "Sigmoid")
        if sig is not None and sig.input[0] == x:
            return x, [sig, mul]
    return None


def _glu(g: Graph, anchor: onnx.NodeProto) -> Match | None:
    """A gated FFN ending in the Mul `anchor`: act(x·Wg + bg) · (x·Wu + bu)."""
    if len(anchor.input) != 2 or anchor.input[0] == anchor.input[1]:
        return None
    for a, u in (anchor.input, reversed(anchor.input)):
        gate = _gate(g, a)
        if gate is None:
            continue
        gp, up = _product(g, gate[0]), _product(g, u)
        if gp is None or up is None or gp[0] != up[0] or gp[1][0] is up[1][0]:
            continue  # not one input, or one product (SiLU itself is Sigmoid(g)·g)
        gw, uw = g.tensors.get(gp[1][0].input[1]), g.tensors.get(up[1][0].input[1])
        if gw is None or uw is None or gw.shape != uw.shape or gw.dtype != uw.dtype:
            continue
        ordered = g.sorted([*gp[1], *gate[1], *up[1], anchor])
        if g.closed(ordered):
            return Match("glu", ordered)
    return None


# --------------------------------------------------------------------------- conv regions

#: What a CNN region is made of: every one has an int8 kernel in onnxruntime (QLinearConv,
#: QLinearAdd, QLinear pooling) or folds away (BatchNormalization into its Conv, Relu
#: into the range of what follows).
_REGION_OPS = (
    "Conv",
    "BatchNormalization",
    "Relu",
    "Add",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
)


def _in_region(g: Graph, node: onnx.NodeProto) -> bool:
    if node.domain not in STD or node.op_type not in _REGION_OPS:
        return False
    if node.op_type == "Conv":
        return (
            len(node.input) >= 2
            and g.is_const(node.input[1])
            and all(g.is_const(i) for i in node.input[2:] if i)
        )
    if node.op_type == "BatchNormalization":
        return len([o for o in node.output if o]) == 1 and all(
            g.is_const(i) for i in node.input[1:]
        )
    if node.op_type == "Add":  # a residual: two activations of one shape
        a, b = (g.tensors.get(i) for i in node.input)
        return (
            not any(g.is_const(i) for i in node.input)
            and a is not None
            and b is not None
            and a.shape == b.shape
        )
    if node.op_type == "MaxPool":
        return len([o for o in node.output if o]) == 1  # no indices output
    return True


def _conv_regions(model: onnx.ModelProto, g: Graph) -> list[Match]:
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
    is in two. Attention first (it is the biggest), then LayerNorm, GELU, gated FFNs."""
    g = Graph(model, ctx)
    taken: set[str] = set()
    found: list[Match] = []
    finders = (
        (("Softmax",), attention),
        (("ReduceMean",), _norm),
        (("LayerNormalization",), _skip_layernorm),
        (("Erf", "Tanh"), _gelu),
        (("Mul",), _glu),
    )
    for op_types, finder in finders:
        for node in model.graph.node:
            if node.op_type not in op_types or node.domain not in STD or node.name in taken:
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

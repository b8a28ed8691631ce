"""Subgraph strategies for ONNX Runtime's CPU provider (SGAT): normalization, GELU and
CNN regions (attention: `attention.py`, gated FFNs: `glu.py`).

Each rewrites a whole subgraph (`aoe.subgraphs`) into what onnxruntime runs as fewer or
faster kernels, with the same outputs up to float rounding (precision ``exact``):

- ``layernorm``: ``LayerNormalization`` for the written-out form (opset 17 and later);
  ``SkipLayerNormalization`` for a residual Add and its LayerNorm; the residual as a
  Sum that onnxruntime's SkipLayerNorm fusion leaves apart. An RMSNorm written out
  (LLaMA) in the form onnxruntime fuses into ``SimplifiedLayerNormalization``, and with
  its residual Add as ``SkipSimplifiedLayerNormalization``. A pre-norm block's residual
  sum, which the next residual reads too, stays a task output: the Skip kernels write
  it as their fourth output, the others keep the Add writing it.
- ``gelu``: ``Gelu``, ``BiasGelu`` (the FFN's bias folded in) and ``FastGelu`` (tanh form).

Lossy: ``tanh_gelu`` (precision ``approx``: erf GELU as FastGelu's tanh form),
``int8_bias_gelu`` (the FFN's first product in int8, then BiasGelu), ``int8_gelu`` (that
product with its bias, then Gelu) and ``int8_region``
(a CNN trunk in int8, `regions.py`).

A strategy returns None where the subgraph's details do not fit its kernel; the default
then stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from aoed.backends.ort import regions
from aoed.backends.ort._rewrite import Nodes, attrs_of, init, int8_weight, scalar
from aoed.engine.registry import APPROX, Strategy, StrategyRegistry
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = ["register"]


# --------------------------------------------------------------------------- layernorm


def _normalized(nodes: Nodes) -> str | None:
    """The tensor a written-out norm divides by its deviation: Div(x, ·), or the
    Mul(x, Reciprocal(·)) after it; None where the task has neither (the matchers only
    hand over tasks that do, but a strategy must not raise on another view)."""
    norm = next((n for n in nodes.view.nodes if n.op_type in ("Div", "Reciprocal")), None)
    if norm is None:
        return None
    if norm.op_type == "Div":
        return str(norm.output[0])
    users = nodes.users.get(norm.output[0], [])
    return str(users[0].output[0]) if len(users) == 1 and users[0].op_type == "Mul" else None


def _ln_parts(view: TaskView) -> tuple[str, str | None, np.ndarray, np.ndarray, float] | None:
    """(x, residual other input or None, gamma, beta, epsilon) of a layernorm task; x is
    the residual's first input when there is one."""
    nodes = Nodes(view)
    first = view.nodes[0]
    res = first if first.op_type == "Add" and len(view.nodes) > 1 else None
    ln = next((n for n in view.nodes if n.op_type == "LayerNormalization"), None)
    hidden_info = view.info(view.output)
    if hidden_info is None:
        return None
    hidden = hidden_info.shape[-1]
    dtype = np.dtype(hidden_info.dtype)
    if ln is not None:
        gamma = view.const(ln.input[1])
        beta = (
            view.const(ln.input[2])
            if len(ln.input) > 2 and ln.input[2]
            else np.zeros(hidden, dtype)
        )
        eps = float(attrs_of(ln).get("epsilon", 1e-5))
    else:
        if not any(n.op_type == "Sub" for n in view.nodes):
            return None  # an RMSNorm: `_rms_parts`
        eps_add = next(
            (
                n
                for n in view.nodes
                if n.op_type == "Add" and any(scalar(view, i) is not None for i in n.input)
            ),
            None,
        )
        if eps_add is None:
            return None
        eps = next(scalar(view, i) for i in eps_add.input if scalar(view, i) is not None)  # type: ignore[assignment]
        out = _normalized(nodes)
        if out is None:
            return None
        gamma, beta = np.ones(hidden, dtype), np.zeros(hidden, dtype)
        for op in ("Mul", "Add"):
            users = nodes.users.get(out, [])
            if len(users) == 1 and users[0].op_type == op:
                c = view.const(next(i for i in users[0].input if i != out))
                if c is None or c.size != hidden:
                    return None
                if op == "Mul":
                    gamma = np.asarray(c, dtype).reshape(-1)
                else:
                    beta = np.asarray(c, dtype).reshape(-1)
                out = users[0].output[0]
    if gamma is None or beta is None or np.size(gamma) != hidden or np.size(beta) != hidden:
        return None
    gamma, beta = np.asarray(gamma, dtype).reshape(-1), np.asarray(beta, dtype).reshape(-1)
    if res is None:
        x = (ln or view.nodes[0]).input[0]
        return x, None, gamma, beta, eps
    return res.input[0], res.input[1], gamma, beta, eps


def _residual_sum(view: TaskView) -> str:
    """The tensor a norm task's residual Add (its first node) writes. Rewrites write it
    under that name, never their own: in a pre-norm block the next residual reads it
    too, as the task's second output."""
    return str(view.nodes[0].output[0])


def _ln_with_residual(view: TaskView, residual_op: str) -> Rewrite | None:
    if view.opset < 17:
        return None
    parts = _ln_parts(view)
    if parts is None:
        return None
    x, skip, gamma, beta, eps = parts
    g, b = init(view, "gamma", gamma), init(view, "beta", beta)
    nodes = []
    if skip is not None:
        x = _residual_sum(view)
        nodes.append(
            helper.make_node(residual_op, [*view.nodes[0].input], [x], name=view.name("Residual"))
        )
    nodes.append(
        helper.make_node(
            "LayerNormalization",
            [x, g.name, b.name],
            [view.output],
            name=view.name("LayerNorm"),
            axis=-1,
            epsilon=eps,
        )
    )
    return Rewrite(tuple(nodes), (g, b))


def _layer_normalization(view: TaskView) -> Rewrite | None:
    """The written-out LayerNorm as one LayerNormalization (opset 17 and later); a
    residual Add in front stays."""
    if any(n.op_type == "LayerNormalization" for n in view.nodes):
        return None
    return _ln_with_residual(view, "Add")


def _residual_as_sum(view: TaskView) -> Rewrite | None:
    """The residual Add as a two-input Sum, then LayerNormalization (a written-out
    LayerNorm becomes one): the same sum and the same normalization, but onnxruntime's
    SkipLayerNormFusion, which matches Add + LayerNormalization only, leaves the two
    kernels apart. On a 2-core AVX2 machine the two took about half the fused kernel's
    time (bench/bench_kernels.py); where the fused kernel is the faster, the measurement
    keeps the default."""
    parts = _ln_parts(view)
    if parts is None or parts[1] is None:
        return None
    return _ln_with_residual(view, "Sum")


def _skip_layer_normalization(view: TaskView) -> Rewrite | None:
    """A residual Add and its LayerNorm as one com.microsoft SkipLayerNormalization, the
    sum as its fourth output (input_skip_bias_sum; unread in a post-norm block)."""
    parts = _ln_parts(view)
    if parts is None or parts[1] is None:
        return None
    x, skip, gamma, beta, eps = parts
    xi, si = view.info(x), view.info(skip)
    if xi is None or si is None or xi.shape != si.shape or len(xi.shape) != 3:
        return None
    g, b = init(view, "gamma", gamma), init(view, "beta", beta)
    node = helper.make_node(
        "SkipLayerNormalization",
        [x, skip, g.name, b.name],
        [view.output, "", "", _residual_sum(view)],
        name=view.name("SkipLayerNorm"),
        domain=CONTRIB_DOMAIN,
        epsilon=eps,
    )
    return Rewrite((node,), (g, b))


def _rms_parts(view: TaskView) -> tuple[str, str | None, np.ndarray, float] | None:
    """(x, residual other input or None, scale, epsilon) of an RMSNorm task (no mean
    subtracted: x / sqrt(mean(x²) + eps) · scale); x is the residual's first input when
    there is one."""
    if any(n.op_type in ("Sub", "LayerNormalization") for n in view.nodes):
        return None
    nodes = Nodes(view)
    first = view.nodes[0]
    res = (
        first
        if first.op_type == "Add" and not any(scalar(view, i) is not None for i in first.input)
        else None
    )
    sq = next(
        (
            n
            for n in view.nodes
            if n.op_type == "Pow" or n.op_type == "Mul" and n.input[0] == n.input[1]
        ),
        None,
    )
    eps_add = next(
        (
            n
            for n in view.nodes
            if n.op_type == "Add" and any(scalar(view, i) is not None for i in n.input)
        ),
        None,
    )
    info = view.info(view.output)
    if (
        sq is None
        or eps_add is None
        or info is None
        or not any(n.op_type == "Sqrt" for n in view.nodes)
    ):
        return None
    hidden, dtype = info.shape[-1], np.dtype(info.dtype)
    eps = next(scalar(view, i) for i in eps_add.input if scalar(view, i) is not None)
    out = _normalized(nodes)
    if out is None:
        return None
    gamma = np.ones(hidden, dtype)
    users = nodes.users.get(out, [])
    if len(users) == 1 and users[0].op_type == "Mul":
        c = view.const(next(i for i in users[0].input if i != out))
        if c is None or c.size != hidden or not isinstance(hidden, int):
            return None
        gamma = np.asarray(c, dtype).reshape(-1)
    if res is None:
        return sq.input[0], None, gamma, float(eps)  # type: ignore[arg-type]
    return res.input[0], res.input[1], gamma, float(eps)  # type: ignore[arg-type]


def _simplified_layer_normalization(view: TaskView) -> Rewrite | None:
    """An RMSNorm in the one written form onnxruntime's own fusion turns into its
    SimplifiedLayerNormalization kernel when the session is made: Pow(x, 2), ReduceMean
    over the last axis, Add eps, Sqrt, Div(x, ·), Mul by the scale (ones where the
    model has none). torch's dynamo exporter writes x · Reciprocal(·) instead, which
    that fusion does not match, and the norm then runs as seven kernels. Standard ops
    only, so the tuned model stays one onnx.checker accepts (the kernel itself is in
    onnxruntime's default domain, which onnx does not know). A residual Add in front
    stays."""
    parts = _rms_parts(view)
    if parts is None:
        return None
    x, skip, gamma, eps = parts
    info = view.info(view.output)
    assert info is not None
    dtype = np.dtype(info.dtype)
    g = init(view, "gamma", gamma)
    two, e = init(view, "two", np.array(2.0, dtype)), init(view, "epsilon", np.array(eps, dtype))
    inits = [g, two, e]
    nodes = []
    if skip is not None:
        x = _residual_sum(view)
        nodes.append(
            helper.make_node("Add", [*view.nodes[0].input], [x], name=view.name("Residual"))
        )
    n = view.name
    if view.opset >= 18:
        axes = init(view, "axes", np.array([-1], np.int64))
        inits.append(axes)
        mean = helper.make_node(
            "ReduceMean", [n("square"), axes.name], [n("mean")], name=n("Mean"), keepdims=1
        )
    else:
        mean = helper.make_node(
            "ReduceMean", [n("square")], [n("mean")], name=n("Mean"), axes=[-1], keepdims=1
        )
    nodes += [
        helper.make_node("Pow", [x, two.name], [n("square")], name=n("Square")),
        mean,
        helper.make_node("Add", [n("mean"), e.name], [n("mean_eps")], name=n("Epsilon")),
        helper.make_node("Sqrt", [n("mean_eps")], [n("rms")], name=n("Rms")),
        helper.make_node("Div", [x, n("rms")], [n("normed")], name=n("Normalize")),
        helper.make_node("Mul", [n("normed"), g.name], [view.output], name=n("Scale")),
    ]
    return Rewrite(tuple(nodes), tuple(inits))


def _skip_simplified_layer_normalization(view: TaskView) -> Rewrite | None:
    """A residual Add and its RMSNorm as one com.microsoft SkipSimplifiedLayerNormalization,
    the sum as its fourth output (input_skip_bias_sum), which a pre-norm block's next
    residual reads (onnxruntime-genai's decoders are written so); in a post-norm block
    nobody reads it."""
    parts = _rms_parts(view)
    if parts is None or parts[1] is None:
        return None
    x, skip, gamma, eps = parts
    xi, si = view.info(x), view.info(skip)
    if xi is None or si is None or xi.shape != si.shape or len(xi.shape) != 3:
        return None
    g = init(view, "gamma", gamma)
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization",
        [x, skip, g.name],
        [view.output, "", "", _residual_sum(view)],
        name=view.name("SkipRMSNorm"),
        domain=CONTRIB_DOMAIN,
        epsilon=eps,
    )
    return Rewrite((node,), (g,))


# --------------------------------------------------------------------------- gelu


def _gelu_parts(
    view: TaskView,
) -> tuple[str, onnx.NodeProto | None, np.ndarray | None, bool] | None:
    """(GELU's input, the MatMul before it or None, its bias or None, tanh form)."""
    nodes = Nodes(view)
    tanh = any(n.op_type == "Tanh" for n in view.nodes)
    mm = view.nodes[0] if view.nodes[0].op_type == "MatMul" else None
    add = (
        view.nodes[1]
        if mm is not None and len(view.nodes) > 1 and view.nodes[1].op_type == "Add"
        else None
    )
    if mm is not None and add is not None:
        bias = view.const(next((i for i in add.input if i != mm.output[0]), ""))
        if bias is None:
            return None
        out = view.info(add.output[0])
        if (
            out is None
            or bias.size != out.shape[-1]
            or bias.ndim > 1
            and any(d != 1 for d in bias.shape[:-1])
        ):
            return None
        return mm.output[0], mm, np.asarray(bias).reshape(-1), tanh
    outside = [
        i for n in view.nodes for i in n.input if i not in nodes.producer and view.const(i) is None
    ]
    if len(set(outside)) != 1:
        return None
    return outside[0], None, None, tanh


def _keep_product(view: TaskView, mm: onnx.NodeProto | None) -> list:
    return [mm] if mm is not None else []


def _gelu(view: TaskView) -> Rewrite | None:
    """GELU (erf form) as one com.microsoft Gelu; the product and bias stay."""
    parts = _gelu_parts(view)
    if parts is None or parts[3]:
        return None
    x, mm, bias, _ = parts
    nodes = _keep_product(view, mm)
    inits = []
    if bias is not None:
        b = init(view, "bias", bias)
        inits.append(b)
        nodes.append(
            helper.make_node("Add", [x, b.name], [view.name("biased")], name=view.name("Bias"))
        )
        x = view.name("biased")
    nodes.append(
        helper.make_node("Gelu", [x], [view.output], name=view.name("Gelu"), domain=CONTRIB_DOMAIN)
    )
    return Rewrite(tuple(nodes), tuple(inits))


def _bias_gelu(view: TaskView) -> Rewrite | None:
    """The FFN's bias Add and GELU (erf form) as one com.microsoft BiasGelu."""
    parts = _gelu_parts(view)
    if parts is None or parts[3] or parts[2] is None:
        return None
    x, mm, bias, _ = parts
    b = init(view, "bias", bias)
    node = helper.make_node(
        "BiasGelu", [x, b.name], [view.output], name=view.name("BiasGelu"), domain=CONTRIB_DOMAIN
    )
    return Rewrite((*_keep_product(view, mm), node), (b,))


def _as_fast_gelu(view: TaskView, tanh_form: bool) -> Rewrite | None:
    parts = _gelu_parts(view)
    if parts is None or parts[3] != tanh_form:
        return None
    x, mm, bias, _ = parts
    inits: Sequence = ()
    ins = [x]
    if bias is not None:
        b = init(view, "bias", bias)
        inits, ins = (b,), [x, b.name]
    node = helper.make_node(
        "FastGelu", ins, [view.output], name=view.name("FastGelu"), domain=CONTRIB_DOMAIN
    )
    return Rewrite((*_keep_product(view, mm), node), tuple(inits))


def _fast_gelu(view: TaskView) -> Rewrite | None:
    """GELU in tanh form (and its bias) as one com.microsoft FastGelu: the same formula."""
    return _as_fast_gelu(view, tanh_form=True)


def _tanh_gelu(view: TaskView) -> Rewrite | None:
    """GELU in erf form (and its bias) as one com.microsoft FastGelu: the tanh
    approximation, within about 5e-4 of erf GELU everywhere (lossy policies only)."""
    return _as_fast_gelu(view, tanh_form=False)


# --------------------------------------------------------------------------- int8


def _int8_ffn_gelu(view: TaskView, bias_in_product: bool) -> Rewrite | None:
    parts = _gelu_parts(view)
    if parts is None or parts[1] is None or parts[2] is None:
        return None
    _x, mm, bias, tanh = parts
    w = view.const(mm.input[1])
    if w is None or w.ndim != 2:
        return None
    wq, ws = int8_weight(np.asarray(w, np.float32), per_channel=True)
    inits = [
        init(view, "weight_q", wq),
        init(view, "weight_scale", ws),
        init(view, "weight_zp", np.zeros(ws.shape, np.int8)),
        init(view, "bias", bias.astype(np.float32)),
    ]
    y = view.name("product")
    product_ins = [mm.input[0], *(i.name for i in inits[: 4 if bias_in_product else 3])]
    op = "FastGelu" if tanh else ("Gelu" if bias_in_product else "BiasGelu")
    nodes = [
        helper.make_node(
            "DynamicQuantizeMatMul",
            product_ins,
            [y],
            name=view.name("DynamicQuantizeMatMul"),
            domain=CONTRIB_DOMAIN,
        ),
        helper.make_node(
            op,
            [y] if bias_in_product else [y, inits[3].name],
            [view.output],
            name=view.name(op),
            domain=CONTRIB_DOMAIN,
        ),
    ]
    return Rewrite(tuple(nodes), tuple(inits))


def _int8_bias_gelu(view: TaskView) -> Rewrite | None:
    """The FFN's first product in int8 (DynamicQuantizeMatMul, weight per column), then
    its bias and GELU as one BiasGelu (erf form) or FastGelu (tanh form)."""
    return _int8_ffn_gelu(view, bias_in_product=False)


def _int8_gelu(view: TaskView) -> Rewrite | None:
    """The FFN's first product and its bias in int8 (the bias as DynamicQuantizeMatMul's
    own input), then GELU alone as Gelu (erf form) or FastGelu (tanh form). Measured
    here on a [1, 128, 256] x [256, 1024] product: 4% faster than the BiasGelu form,
    whose kernel adds the bias in a separate pass; which wins in context is measured."""
    return _int8_ffn_gelu(view, bias_in_product=True)


def register(registry: StrategyRegistry) -> None:
    """Add the normalization, GELU and CNN region strategies to `registry`."""
    s = registry.strategy
    # A Skip kernel first: where it ties with the norm alone on the task, it still runs
    # the residual Add inside the norm's kernel, one node fewer in the model for every
    # instance (a task's own timing cannot see a node's dispatch in the model).
    s("skip_layer_normalization", "layernorm")(_skip_layer_normalization)
    s("layer_normalization", "layernorm")(_layer_normalization)
    s("residual_as_sum", "layernorm")(_residual_as_sum)
    s("skip_simplified_layer_normalization", "layernorm")(_skip_simplified_layer_normalization)
    s("simplified_layer_normalization", "layernorm")(_simplified_layer_normalization)
    s("gelu", "gelu")(_gelu)
    s("bias_gelu", "gelu")(_bias_gelu)
    s("fast_gelu", "gelu")(_fast_gelu)
    s("tanh_gelu", "gelu", APPROX)(_tanh_gelu)
    s("int8_bias_gelu", "gelu", "int8")(_int8_bias_gelu)
    s("int8_gelu", "gelu", "int8")(_int8_gelu)
    registry.register(
        Strategy(
            "int8_region",
            "conv_region",
            "int8",
            regions.int8_region,
            (regions.int8_region.__doc__ or "").strip(),
            with_param=regions.int8_region_param,
            propose=regions.propose_float_convs,
        )
    )

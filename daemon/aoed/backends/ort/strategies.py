"""Strategy spaces for ONNX Runtime's CPU provider, registered per op family.

A strategy is a real, different way to run a task that stock onnxruntime accepts: a
graph rewrite of the task's nodes. Each strategy declares the family it serves and its
precision policy; the engine asks the registry for the strategies of a task's family and
never names one itself, so a new strategy plugs in with `register()` alone.

Third-party strategies load from the modules named in the AOED_PLUGINS environment
variable (comma separated); each such module calls `register()` at import. Compile
workers load the same plugins, so a plugin strategy compiles where the built-ins do.

Families:
- ``matmul``: MatMul with a constant 2-D weight (or Gemm with constant B), with an
  optional constant bias Add and an optional activation.
- ``conv``: Conv with a constant weight, with an optional activation.
- ``matmul_act``: MatMul of two activations (attention's Q·Kᵀ and P·V); only lossy
  strategies apply, so exact jobs leave it alone.

The int8 strategies live in `quant.py`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

from aoe.errors import OptionError
from aoed.engine.tasks import CONTRIB_DOMAIN, Rewrite, TaskView

__all__ = [
    "ACTIVATIONS",
    "DEFAULT",
    "Strategy",
    "get",
    "load_plugins",
    "register",
    "strategies_for",
]

#: Elementwise activations partition fuses into a task, with the contrib fused ops'
#: spelling of each (FusedConv and FusedGemm take `activation` plus their own parameters).
ACTIVATIONS = ("Relu", "Sigmoid", "Tanh", "LeakyRelu")
DEFAULT = "default"
_PRECISIONS = ("exact",)


@dataclass(frozen=True)
class Strategy:
    """A named rewrite for one family; `rewrite(view)` returns `None` where it does not apply."""

    name: str
    family: str
    precision: str
    rewrite: object  # Callable[[TaskView], Rewrite | None]
    doc: str = ""

    def apply(self, view: TaskView) -> Rewrite | None:
        return self.rewrite(view)  # type: ignore[operator]


_REGISTRY: dict[tuple[str, str], Strategy] = {}
_plugins_loaded = False


def register(strategy: Strategy) -> Strategy:
    """Add `strategy` to the registry (new per family); returns it."""
    key = (strategy.family, strategy.name)
    if key in _REGISTRY and _REGISTRY[key] is not strategy:
        raise ValueError(f"strategy {strategy.name!r} is already registered for {strategy.family}")
    _REGISTRY[key] = strategy
    return strategy


def load_plugins() -> None:
    """Import the modules named in AOED_PLUGINS once; a missing one is an OptionError."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name in filter(None, (s.strip() for s in os.environ.get("AOED_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise OptionError(f"AOED_PLUGINS: cannot import strategy plugin {name!r}: {exc}") from None


def get(family: str, name: str) -> Strategy:
    """The strategy `name` of `family`; KeyError when there is none."""
    load_plugins()
    try:
        return _REGISTRY[(family, name)]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r} for {family}") from None


def strategies_for(family: str, precision: str = "exact") -> Iterator[Strategy]:
    """The registered strategies of `family` allowed under `precision`, in registry order."""
    load_plugins()
    allowed = {"exact"} if precision == "exact" else {"exact", precision}
    for s in _REGISTRY.values():
        if s.family == family and s.precision in allowed:
            yield s


def _strategy(name: str, family: str, precision: str = "exact"):
    def deco(fn):
        register(Strategy(name, family, precision, fn, (fn.__doc__ or "").strip()))
        return fn

    return deco


# --------------------------------------------------------------------------- helpers


def _act_attrs(act, gemm: bool = False) -> dict:
    """FusedConv (or, with `gemm`, FusedGemm) attributes reproducing activation node `act`.

    FusedConv takes LeakyRelu's alpha in `activation_params`, FusedGemm in
    `activation_alpha`.
    """
    attrs = {"activation": act.op_type}
    if act.op_type == "LeakyRelu":
        alpha = next((a.f for a in act.attribute if a.name == "alpha"), 0.01)
        if gemm:
            attrs["activation_alpha"] = alpha
        else:
            attrs["activation_params"] = [alpha]
    return attrs


def _copy_act(view: TaskView, act, src: str):
    node = helper.make_node(act.op_type, [src], [act.output[0]], name=view.name(act.op_type))
    node.attribute.extend(act.attribute)
    return node


def _bias(view: TaskView, n: int) -> tuple[object | None, np.ndarray | None]:
    """The constant bias Add of a matmul task, as (node, vector of length n)."""
    add = view.epilogue("Add")
    if add is None:
        return None, None
    other = add.input[1] if add.input[0] == view.anchor.output[0] else add.input[0]
    y = view.info(view.anchor.output[0])
    return add, _row_vector(view.const(other), n, len(y.shape) if y is not None else 0)


def _row_vector(b: np.ndarray | None, n: int, out_rank: int) -> np.ndarray | None:
    """`b` as a length-n vector when adding it broadcasts one value per output column.

    A column bias ([n, 1] on an [n, n] product) or one that raises the output's rank is
    no such vector, even with n elements.
    """
    if b is None or b.size != n or b.ndim > out_rank or (b.ndim and b.shape[-1] != n):
        return None
    return b.reshape(n)


def _matmul_parts(view: TaskView):
    """(A name, W as [K, N], bias or None, activation or None, A rank) of a matmul task.

    Serves MatMul (+ constant bias Add) and plain Gemm (alpha = beta = 1, no transA,
    constant B and C) anchors alike; `None` where the task is neither.
    """
    anchor = view.anchor
    a_info = view.info(anchor.input[0])
    if a_info is None or len(a_info.shape) < 2:
        return None
    act = view.epilogue(*ACTIVATIONS)
    if anchor.op_type == "MatMul":
        w = view.const(anchor.input[1])
        if w is None or w.ndim != 2:
            return None
        add, bias = _bias(view, w.shape[1])
        if add is not None and bias is None:
            return None
        return anchor.input[0], w, bias, act, len(a_info.shape)
    if anchor.op_type == "Gemm":
        attrs = {a.name: helper.get_attribute_value(a) for a in anchor.attribute}
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
            return None
        w = view.const(anchor.input[1])
        if w is None or w.ndim != 2:
            return None
        w = w.T if attrs.get("transB", 0) else w
        bias = None
        if len(anchor.input) > 2 and anchor.input[2]:
            bias = _row_vector(view.const(anchor.input[2]), w.shape[1], 2)
            if bias is None:
                return None
        return anchor.input[0], w, bias, act, 2
    return None


def _as_2d(view: TaskView, a: str, rank: int, k: int) -> tuple[list, str]:
    if rank == 2:
        return [], a
    shape = numpy_helper.from_array(np.array([-1, k], dtype=np.int64), view.name("shape2d"))
    node = helper.make_node("Reshape", [a, shape.name], [view.name("a2d")], name=view.name("Reshape2d"))
    return [(node, shape)], view.name("a2d")


def _gemm_rewrite(view: TaskView, fused: bool) -> Rewrite | None:
    parts = _matmul_parts(view)
    if parts is None:
        return None
    a, w, bias, act, rank = parts
    if fused and act is None:
        return None
    k, n = w.shape
    out = view.output
    pre, a2 = _as_2d(view, a, rank, k)
    nodes = [p[0] for p in pre]
    inits = [p[1] for p in pre]
    wt = numpy_helper.from_array(np.ascontiguousarray(w.T), view.name("weight_t"))
    inits.append(wt)
    ins = [a2, wt.name]
    if bias is not None:
        b = numpy_helper.from_array(bias.astype(w.dtype), view.name("bias"))
        inits.append(b)
        ins.append(b.name)
    y2 = view.name("y2d") if rank != 2 else None
    last = act is None or fused
    gemm_out = (y2 or out) if last else view.name("gemm")
    if fused:
        gemm = helper.make_node(
            "FusedGemm", ins, [gemm_out], name=view.name("FusedGemm"), domain=CONTRIB_DOMAIN,
            transB=1, **_act_attrs(act, gemm=True),
        )
    else:
        gemm = helper.make_node("Gemm", ins, [gemm_out], name=view.name("Gemm"), transB=1)
    nodes.append(gemm)
    cur = gemm_out
    if rank != 2:
        info = view.info(out) if last else view.info(view.anchor.output[0])
        shape = numpy_helper.from_array(np.array(info.shape, dtype=np.int64), view.name("shape_nd"))
        inits.append(shape)
        target = out if last else view.name("gemm_nd")
        nodes.append(helper.make_node("Reshape", [cur, shape.name], [target], name=view.name("ReshapeNd")))
        cur = target
    if not last:
        nodes.append(_copy_act(view, act, cur))
    return Rewrite(tuple(nodes), tuple(inits))


# --------------------------------------------------------------------------- matmul


def _unchanged(view: TaskView) -> Rewrite:
    """The task as the model has it."""
    return Rewrite(tuple(view.nodes))


# Every family's first strategy is the task unchanged: the incumbent to beat.
for _family in ("matmul", "conv", "matmul_act"):
    register(Strategy(DEFAULT, _family, "exact", _unchanged, "the task as the model has it"))


@_strategy("gemm_pretransposed", "matmul")
def _gemm_pretransposed(view: TaskView) -> Rewrite | None:
    """MatMul(+bias) as Gemm with the weight stored transposed (transB=1)."""
    return _gemm_rewrite(view, fused=False)


@_strategy("fused_gemm", "matmul")
def _fused_gemm(view: TaskView) -> Rewrite | None:
    """MatMul + bias + activation as one com.microsoft FusedGemm."""
    return _gemm_rewrite(view, fused=True)


@_strategy("fused_matmul_transb", "matmul")
def _fused_matmul(view: TaskView) -> Rewrite | None:
    """com.microsoft FusedMatMul over the pre-transposed weight, epilogue kept."""
    parts = _matmul_parts(view)
    if parts is None:
        return None
    a, w, _bias_vec, _act, _rank = parts
    if view.anchor.op_type != "MatMul":
        return None
    wt = numpy_helper.from_array(np.ascontiguousarray(w.T), view.name("weight_t"))
    mm = view.anchor
    node = helper.make_node(
        "FusedMatMul", [a, wt.name], [mm.output[0]], name=view.name("FusedMatMul"),
        domain=CONTRIB_DOMAIN, transB=1,
    )
    return Rewrite((node, *view.nodes[1:]), (wt,))


@_strategy("gemm_as_matmul", "matmul")
def _gemm_as_matmul(view: TaskView) -> Rewrite | None:
    """Gemm as MatMul over a [K, N] weight plus a bias Add (the form MLAS prepacks)."""
    parts = _matmul_parts(view)
    if parts is None or view.anchor.op_type != "Gemm":
        return None
    a, w, bias, act, _rank = parts
    inits = [numpy_helper.from_array(np.ascontiguousarray(w), view.name("weight"))]
    last = view.output if act is None else view.name("pre_act")
    mm_out = last if bias is None else view.name("mm")
    nodes = [helper.make_node("MatMul", [a, inits[0].name], [mm_out], name=view.name("MatMul"))]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(w.dtype), view.name("bias")))
        nodes.append(helper.make_node("Add", [mm_out, inits[1].name], [last], name=view.name("Bias")))
    if act is not None:
        nodes.append(_copy_act(view, act, last))
    return Rewrite(tuple(nodes), tuple(inits))


# --------------------------------------------------------------------------- conv


def _conv_attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@_strategy("fused_conv", "conv")
def _fused_conv(view: TaskView) -> Rewrite | None:
    """Conv + activation as one com.microsoft FusedConv."""
    act = view.epilogue(*ACTIVATIONS)
    if act is None:
        return None
    conv = view.anchor
    attrs = _conv_attrs(conv)
    attrs.update(_act_attrs(act))
    node = helper.make_node(
        "FusedConv", list(conv.input), [act.output[0]], name=view.name("FusedConv"),
        domain=CONTRIB_DOMAIN, **attrs,
    )
    return Rewrite((node,))


@_strategy("conv1x1_as_matmul", "conv")
def _conv1x1_matmul(view: TaskView) -> Rewrite | None:
    """A 1x1, stride-1, unpadded, ungrouped Conv as a MatMul over flattened pixels."""
    conv = view.anchor
    w = view.const(conv.input[1])
    x = view.info(conv.input[0])
    y = view.info(conv.output[0])
    if w is None or x is None or y is None or w.ndim != 4 or len(x.shape) != 4:
        return None
    attrs = _conv_attrs(conv)
    if (
        w.shape[2:] != (1, 1)
        or attrs.get("group", 1) != 1
        or any(s != 1 for s in attrs.get("strides", [1, 1]))
        or any(p != 0 for p in attrs.get("pads", [0, 0, 0, 0]))
        or any(d != 1 for d in attrs.get("dilations", [1, 1]))
        or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
    ):
        return None
    n, c, h, wd = x.shape
    m = w.shape[0]
    inits = [
        numpy_helper.from_array(np.array([n, c, h * wd], dtype=np.int64), view.name("shape_in")),
        numpy_helper.from_array(np.ascontiguousarray(w.reshape(m, c)), view.name("weight_2d")),
        numpy_helper.from_array(np.array([n, m, h, wd], dtype=np.int64), view.name("shape_out")),
    ]
    act = view.epilogue(*ACTIVATIONS)
    out = act.output[0] if act is not None else conv.output[0]
    pre_act = view.name("conv_out") if act is not None else out
    nodes = [
        helper.make_node("Reshape", [conv.input[0], inits[0].name], [view.name("x3")], name=view.name("ReshapeIn")),
        helper.make_node("MatMul", [inits[1].name, view.name("x3")], [view.name("y3")], name=view.name("MatMul")),
    ]
    cur = view.name("y3")
    if len(conv.input) > 2 and conv.input[2]:
        b = view.const(conv.input[2])
        if b is None:
            return None
        inits.append(numpy_helper.from_array(b.reshape(m, 1), view.name("bias")))
        nodes.append(helper.make_node("Add", [cur, inits[-1].name], [view.name("y3b")], name=view.name("Bias")))
        cur = view.name("y3b")
    nodes.append(helper.make_node("Reshape", [cur, inits[2].name], [pre_act], name=view.name("ReshapeOut")))
    if act is not None:
        nodes.append(_copy_act(view, act, pre_act))
    return Rewrite(tuple(nodes), tuple(inits))


# Registered last: the int8 strategies build on the helpers above.
from aoed.backends.ort import quant as _quant  # noqa: E402,F401

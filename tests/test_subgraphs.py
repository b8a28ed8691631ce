"""SGAT's subgraphs: recognized by structure in the forms exporters write, rewritten into
fused kernels that compute the same outputs, tuned as jobs and applied from the bank.

The blocks are built here in the shapes torch.onnx and Hugging Face exports use (scale
on Q or on the scores, Kᵀ in one Transpose or two, additive padding masks from an
input, causal masks as an Add or a Where, LayerNorm and GELU written out in their
variants); every node then gets a random name, so nothing can match by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from aoe.attention import task_block
from aoe.bank import open_bank
from aoe.bankrecord import Measured
from aoe.errors import OptionError
from aoe.graph import normalize
from aoe.partition import partition
from aoe.signature import ModelContext
from aoe.spec import parse_job_type
from aoe.subgraphs import find_subgraphs
from aoed import samples
from aoed.backends.ort.catalog import build_registry
from aoed.backends.ort.runner import accuracy
from aoed.engine.assemble import task_rewrites
from aoed.engine.policy import POLICIES
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.tasks import Constants, TaskView, apply_rewrites, task_model

from .bank_util import make_bank, rec
from .conftest import run_aoe
from .graphs import B, D, G, H, N, S, anonymize, glu_block, linear

REGISTRY = build_registry()


def attention(
    g: G,
    x: str,
    *,
    scale_on: str = "scores_div",
    k_two: bool = False,
    mask: str | None = None,
    bias: bool = True,
    kv: str | None = None,
    sdpa: bool = False,
    packed: bool = False,
    k_flat: bool = False,
    rotary: str | None = None,
    kv_heads: int = N,
    flat_out: bool = False,
    additive: str | None = None,
    fill: float = -np.inf,
) -> str:
    """Self-attention as exporters write it; `kv` (another tensor) makes it cross-attention.
    `rotary` puts LLaMA's rotary embeddings on Q and K ("llama": tables that repeat their
    halves, as transformers builds them; "odd": tables that do not). `kv_heads` < N makes
    it grouped-query attention: K and V with fewer heads, repeated as transformers'
    repeat_kv does (Unsqueeze, Expand, Reshape; with the dynamo export's Kᵀ, that Reshape
    merged into the flattening one). `flat_out` merges the heads straight into [B*S, H],
    as torch's dynamo export of GPT-2 does for the Conv1D after it. `additive` is a mask
    made outside, added to the scores."""
    split, merge = (
        g.t(np.array([B, S, N, D], np.int64)),
        g.t(np.array([B * S, H] if flat_out else [B, S, H], np.int64)),
    )
    kv_split = g.t(np.array([B, S, kv_heads, D], np.int64))
    k_two = k_two or (kv_heads != N and not k_flat)

    parts: list[str] = []
    if packed:  # GPT-2's Conv1D: Reshape to 2-D, one Gemm for Q, K and V, Reshape back, Split
        flat = g.n("Reshape", x, g.t(np.array([B * S, H], np.int64)))
        qkv = g.n("Gemm", flat, g.w(H, 3 * H), g.w(3 * H, std=0.05))
        qkv = g.n("Reshape", qkv, g.t(np.array([B, S, 3 * H], np.int64)))
        sp = helper.make_node(
            "Split",
            [qkv, g.t(np.array([H, H, H], np.int64))],
            [f"{qkv}_{i}" for i in range(3)],
            name=f"Split_{qkv}",
            axis=2,
        )
        g.nodes.append(sp)
        parts = list(sp.output)

    def heads(src: str, perm, n: int = N) -> str:
        y = g.n(
            "Reshape",
            parts.pop(0) if parts else linear(g, src, H, n * D, bias),
            split if n == N else kv_split,
        )
        return g.n("Transpose", y, perm=perm)

    def wide(t: str) -> str:  # [B, kv, S, D] -> [B, kv, N/kv, S, D]
        t = g.n("Unsqueeze", t, g.t(np.array([2], np.int64)))
        return g.n("Expand", t, g.t(np.array([B, kv_heads, N // kv_heads, S, D], np.int64)))

    def repeat(t: str) -> str:
        return (
            t if kv_heads == N else g.n("Reshape", wide(t), g.t(np.array([B, N, S, D], np.int64)))
        )

    if rotary:
        freqs = np.outer(np.arange(S), 1.0 / 10000 ** (np.arange(0, D, 2) / D))
        if rotary == "llama":
            freqs = np.concatenate([freqs, freqs], axis=-1)
        else:
            freqs = np.concatenate([freqs, freqs + 0.5], axis=-1)
        cos, sin = (
            g.t(np.cos(freqs)[None, None].astype(np.float32)),
            g.t(np.sin(freqs)[None, None].astype(np.float32)),
        )
        half, big, last = (g.t(np.array([v], np.int64)) for v in (D // 2, 2**31 - 1, -1))
        zero = g.t(np.array([0], np.int64))

        def rotate(t: str) -> str:
            turned = g.n(
                "Concat",
                g.n("Neg", g.n("Slice", t, half, big, last)),
                g.n("Slice", t, zero, half, last),
                axis=-1,
            )
            return g.n("Add", g.n("Mul", t, cos), g.n("Mul", turned, sin))

        q = rotate(heads(x, [0, 2, 1, 3]))
        k = g.n(
            "Transpose", repeat(rotate(heads(kv or x, [0, 2, 1, 3], kv_heads))), perm=[0, 1, 3, 2]
        )
        k_two = False
    else:
        q = heads(x, [0, 2, 1, 3])
    if scale_on == "q":
        q = g.n("Mul", q, g.f(1 / math.sqrt(D)))
    if rotary:
        pass
    elif k_two:
        k = g.n("Transpose", repeat(heads(kv or x, [0, 2, 1, 3], kv_heads)), perm=[0, 1, 3, 2])
    elif k_flat:  # torch's dynamo export: Kᵀ through 3-D
        k = heads(kv or x, [0, 2, 1, 3], kv_heads)
        k = g.n("Reshape", k if kv_heads == N else wide(k), g.t(np.array([B * N, S, D], np.int64)))
        k = g.n(
            "Reshape", g.n("Transpose", k, perm=[0, 2, 1]), g.t(np.array([B, N, D, S], np.int64))
        )
    else:
        k = heads(kv or x, [0, 2, 3, 1])
    v = repeat(heads(kv or x, [0, 2, 1, 3], kv_heads))
    if scale_on == "q_and_k":  # torch's sdpa export: D^-1/4 on Q and on Kᵀ
        q, k = g.n("Mul", q, g.f(D**-0.25)), g.n("Mul", k, g.f(D**-0.25))
    s = g.n("MatMul", q, k)
    if scale_on == "scores_div":
        s = g.n("Div", s, g.f(math.sqrt(D)))
    elif scale_on == "scores_mul":
        s = g.n("Mul", s, g.f(1 / math.sqrt(D)))

    if mask == "causal_add":
        s = g.n("Add", s, g.t(np.triu(np.full((S, S), -1e4, np.float32), 1)[None, None]))
    elif mask == "causal_where":
        s = g.n("Where", g.t(np.tril(np.ones((S, S), bool))[None, None]), s, g.f(-np.inf))
    elif mask == "padding":
        m = g.input("attention_mask", [B, S], TensorProto.INT64)
        m = g.n("Unsqueeze", m, g.t(np.array([1, 2], np.int64)))
        m = g.n("Cast", m, to=TensorProto.FLOAT)
        m = g.n("Mul", g.n("Sub", g.f(1.0), m), g.f(-10000.0))
        s = g.n("Add", s, m)
    elif mask == "causal_padding_where":
        # transformers: one boolean, each layer's Where(keep, 0, -inf)
        m = g.input("attention_mask", [B, S], TensorProto.INT64)
        keep = g.n(
            "Unsqueeze", g.n("Cast", m, to=TensorProto.BOOL), g.t(np.array([1, 2], np.int64))
        )
        keep = g.n("And", keep, g.t(np.tril(np.ones((S, S), bool))[None, None]))
        s = g.n("Add", s, g.n("Where", keep, g.f(0.0), g.f(fill)))
    if additive is not None:
        s = g.n("Add", s, additive)
    p = g.n("Softmax", s, axis=-1)
    if sdpa:  # torch's sdpa export: a NaN guard after the softmax, a Reshape keeping P·V's shape
        p = g.n("Where", g.n("IsNaN", p), g.f(0.0), p)
        c = g.n(
            "Transpose",
            g.n("Reshape", g.n("MatMul", p, v), g.t(np.array([B, N, S, D], np.int64))),
            perm=[0, 2, 1, 3],
        )
        return g.n("Reshape", c, merge)
    c = g.n("Transpose", g.n("MatMul", p, v), perm=[0, 2, 1, 3])
    return g.n("Reshape", c, merge)


def layernorm(g: G, x: str, *, square: str = "Pow", divide: str = "Div") -> str:
    mean = g.n("ReduceMean", x, axes=[-1])
    d = g.n("Sub", x, mean)
    sq = g.n("Pow", d, g.f(2.0)) if square == "Pow" else g.n("Mul", d, d)
    var = g.n("ReduceMean", sq, axes=[-1])
    std = g.n("Sqrt", g.n("Add", var, g.f(1e-5)))
    y = g.n("Div", d, std) if divide == "Div" else g.n("Mul", d, g.n("Reciprocal", std))
    y = g.n("Mul", y, g.t(g.rng.uniform(0.9, 1.1, H).astype(np.float32)))
    return g.n("Add", y, g.w(H, std=0.02))


def gelu(g: G, x: str, form: str = "erf") -> str:
    if form == "tanh":
        inner = g.n("Add", x, g.n("Mul", g.n("Pow", x, g.f(3.0)), g.f(0.044715)))
        t = g.n("Tanh", g.n("Mul", inner, g.f(math.sqrt(2 / math.pi))))
        return g.n("Mul", g.n("Mul", x, g.f(0.5)), g.n("Add", t, g.f(1.0)))
    e = g.n("Add", g.n("Erf", g.n("Div", x, g.f(math.sqrt(2.0)))), g.f(1.0))
    if form == "erf":  # x·(1+erf)·0.5
        return g.n("Mul", g.n("Mul", x, e), g.f(0.5))
    if form == "erf_half_first":  # (x·0.5)·(1+erf)
        return g.n("Mul", g.n("Mul", x, g.f(0.5)), e)
    return g.n("Mul", g.n("Mul", e, g.f(0.5)), x)  # ((1+erf)·0.5)·x


def block(**kw) -> onnx.ModelProto:
    """attention -> out projection -> residual -> LayerNorm -> FFN (GELU) -> residual -> LayerNorm."""
    ln_kw = {k: kw.pop(k) for k in ("square", "divide") if k in kw}
    form = kw.pop("form", "erf")
    g = G(seed=1)
    x = g.input("x", [B, S, H])
    if kw.get("flat_out"):  # GPT-2's Conv1D on the merged [B*S, H]: a Gemm, then back to 3-D
        a = g.n("Gemm", attention(g, x, **kw), g.w(H, H), g.w(H, std=0.05))
        a = g.n("Reshape", a, g.t(np.array([B, S, H], np.int64)))
    else:
        a = linear(g, attention(g, x, **kw), H, H)
    h = layernorm(g, g.n("Add", a, x), **ln_kw)
    f = linear(g, gelu(g, linear(g, h, H, 2 * H), form), 2 * H, H)
    return g.model(layernorm(g, g.n("Add", f, h), **ln_kw))


def _families(model: onnx.ModelProto) -> list[str]:
    norm = normalize(model, None, strict=False).model
    return [m.family for m in find_subgraphs(norm, ModelContext(norm))]


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT64:
            m = np.ones(dims, np.int64)
            m[..., -3:] = 0  # three padding positions
            feeds[i.name] = m
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


VARIANTS = {
    "scores_div": {},
    "scores_mul": {"scale_on": "scores_mul"},
    "scale_on_q": {"scale_on": "q"},
    "k_two_transposes": {"k_two": True},
    "no_bias": {"bias": False},
    "sdpa_export": {"sdpa": True, "scale_on": "q_and_k", "mask": "padding"},
    "gpt2_packed_gemm": {"packed": True, "mask": "causal_where"},
    "dynamo_export": {"k_flat": True, "sdpa": True, "mask": "padding"},
    "llama_rotary": {"rotary": "llama", "scale_on": "q_and_k", "mask": "causal_add", "bias": False},
    "rotary_padding": {"rotary": "llama", "mask": "padding"},
    "llama_gqa": {
        "rotary": "llama",
        "scale_on": "q_and_k",
        "mask": "causal_add",
        "bias": False,
        "kv_heads": 2,
    },
    "gqa_dynamo_padding": {"k_flat": True, "sdpa": True, "mask": "padding", "kv_heads": 2},
    "multi_query_causal": {"kv_heads": 1, "mask": "causal_where"},
    "gpt2_sdpa_causal_padding": {
        "packed": True,
        "sdpa": True,
        "scale_on": "q_and_k",
        "mask": "causal_padding_where",
    },
    "gpt2_dynamo_flat_out": {
        "packed": True,
        "sdpa": True,
        "scale_on": "q_and_k",
        "mask": "causal_padding_where",
        "flat_out": True,
    },
    "causal_add": {"mask": "causal_add"},
    "causal_where": {"mask": "causal_where"},
    "padding_mask": {"mask": "padding"},
    "ln_mul_reciprocal": {"square": "Mul", "divide": "Reciprocal"},
    "gelu_half_first": {"form": "erf_half_first"},
    "gelu_half_then_x": {"form": "erf_other"},
    "gelu_tanh": {"form": "tanh"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_are_found_by_structure(variant: str) -> None:
    model = anonymize(block(**VARIANTS[variant]))
    assert _families(model) == ["attention", "layernorm", "gelu", "layernorm"]


def test_what_is_not_self_attention_or_a_full_pattern_is_left_to_opat() -> None:
    g = G()
    x, mem = g.input("x", [B, S, H]), g.input("memory", [B, S, H])
    model = g.model(attention(g, x, kv=mem))  # cross-attention: K and V from another input
    assert _families(model) == []
    g = G()
    x = g.input("x", [B, S, H])
    y = g.n("Softmax", g.n("MatMul", x, g.w(H, H)), axis=-1)  # a softmax over a product of a weight
    assert _families(g.model(y)) == []
    g = G()
    x = g.input("x", [B, S, H])
    e = g.n("Add", g.n("Erf", g.n("Div", x, g.f(2.0))), g.f(1.0))  # erf(x/2): not GELU
    assert _families(g.model(g.n("Mul", g.n("Mul", x, e), g.f(0.5)))) == []


def test_an_intermediate_read_outside_keeps_the_block_out() -> None:
    """Only the last node's output may leave a task: a LayerNorm whose centred values
    are read elsewhere is no LayerNorm task. What follows the centring is an RMSNorm of
    the centred values (the same function), and that is one, without the mean."""
    g = G()
    x = g.input("x", [B, S, H])
    mean = g.n("ReduceMean", x, axes=[-1])
    d = g.n("Sub", x, mean)
    std = g.n("Sqrt", g.n("Add", g.n("ReduceMean", g.n("Pow", d, g.f(2.0)), axes=[-1]), g.f(1e-5)))
    y = g.n("Div", d, std)
    model = g.model(g.n("Add", y, d))
    norm = normalize(model, None, strict=False).model
    [m] = find_subgraphs(norm, ModelContext(norm))
    assert m.family == "layernorm" and [n.op_type for n in m.nodes] == [
        "Pow",
        "ReduceMean",
        "Add",
        "Sqrt",
        "Div",
    ]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_strategy_that_applies_keeps_the_outputs(variant: str, tmp_path: Path) -> None:
    model = anonymize(block(**VARIANTS[variant]))
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    feeds = _feeds(prep.model)
    ref = _run(prep.model, feeds)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    applied: dict[str, list[str]] = {}
    gelu_out: dict[str, np.ndarray] = {}
    for task in partition(prep.model, prep.ctx, "sgat"):
        for strategy in REGISTRY.strategies_for(task.family, "int8"):
            if strategy.name == "default":
                continue
            try:
                rewrites = task_rewrites(
                    prep.model, prep.ctx, consts, task, strategy.name, REGISTRY
                )
            except Exception:
                continue  # does not apply to this form
            y = _run(apply_rewrites(prep.model, rewrites), feeds)
            if strategy.name in ("int8_bias_gelu", "int8_gelu"):
                gelu_out[strategy.name] = y
            if strategy.precision == "exact":
                assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), (
                    task.family,
                    strategy.name,
                )
            elif strategy.precision == "approx":  # a float approximation: close, and not equal
                err = np.abs(y - ref).max()
                assert 0 < err <= 1e-3 * np.abs(ref).max(), (task.family, strategy.name, err)
            else:
                cos = float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref))
                assert cos > 0.99, (task.family, strategy.name, cos)
            applied.setdefault(task.family, []).append(strategy.name)
    # The fused kernels take every form built here (QAttention: not a padding mask;
    # rotary embeddings: MultiHeadAttention after RotaryEmbedding, not Attention).
    rotary = "rotary" in VARIANTS[variant]
    assert {
        "multihead_attention",
        "packed_qkv",
        "int8_packed_qkv",
        "int8_multihead_attention",
    } <= set(applied["attention"])
    assert ("fused_attention" in applied["attention"]) != rotary
    assert ("int8_qattention" in applied["attention"]) == (
        VARIANTS[variant].get("mask") != "padding" and not rotary
    )
    # GroupQueryAttention takes every block, a group of one head where K/V are not shared
    assert {"group_query_attention", "int8_group_query_attention"} <= set(applied["attention"])
    assert "skip_layer_normalization" in applied["layernorm"]
    assert "layer_normalization" in applied["layernorm"]  # the written-out form (opset 17)
    assert "residual_as_sum" in applied["layernorm"]
    tanh = variant == "gelu_tanh"
    assert ("fast_gelu" in applied["gelu"]) == tanh and ("bias_gelu" in applied["gelu"]) != tanh
    assert {"int8_bias_gelu", "int8_gelu"} <= set(applied["gelu"])
    # the same int8 product: only where its bias is added differs
    a, b = gelu_out["int8_bias_gelu"], gelu_out["int8_gelu"]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert ("tanh_gelu" in applied["gelu"]) != tanh  # erf GELU approximated by FastGelu


def test_approximations_are_offered_under_lossy_policies_only() -> None:
    names = {
        p: {s.name for s in REGISTRY.strategies_for("gelu", p)} for p in ("exact", "int8", "int4")
    }
    assert "tanh_gelu" not in names["exact"] and "fast_gelu" in names["exact"]
    assert "tanh_gelu" in names["int8"] and "tanh_gelu" in names["int4"]
    # int4's budget admits int8's forms, a finer grid (registry.FINER); exact never does
    assert "int8_bias_gelu" in names["int4"] and "int8_gelu" in names["int4"]
    assert "int8_gelu" not in names["exact"]


def _shared_mask_model(fill: float, zero: float = 0.0) -> onnx.ModelProto:
    """Two attention layers adding one mask made once, Where(keep, zero, fill), as torch's
    dynamo export writes transformers' mask."""
    g = G(seed=2)
    x = g.input("x", [B, S, H])
    m = g.input("attention_mask", [B, S], TensorProto.INT64)
    keep = g.n("Unsqueeze", g.n("Cast", m, to=TensorProto.BOOL), g.t(np.array([1, 2], np.int64)))
    keep = g.n("And", keep, g.t(np.tril(np.ones((S, S), bool))[None, None]))
    mask = g.n("Where", keep, g.f(zero), g.f(fill))
    h = x
    for _ in range(2):
        h = g.n(
            "Add", linear(g, attention(g, h, sdpa=True, scale_on="q_and_k", additive=mask), H, H), h
        )
    return g.model(h)


def test_a_mask_shared_by_layers_gets_a_where_per_layer_and_qattention(tmp_path: Path) -> None:
    """torch's dynamo export makes transformers' mask once for every layer; normalization
    gives each layer its own copy of the Where, so that each attention block holds it and
    QAttention reads the boolean. The copies change no output."""
    model = _shared_mask_model(-np.inf)
    norm = normalize(model).model
    wheres = [
        n
        for n in norm.graph.node
        if n.op_type == "Where"
        and n.input[1] != n.input[2]
        and not any(p.op_type == "IsNaN" and p.output[0] == n.input[0] for p in norm.graph.node)
    ]
    assert len(wheres) == 2 and len({w.output[0] for w in wheres}) == 2
    assert len({w.input[0] for w in wheres}) == 1  # one boolean
    assert _families(model) == ["attention", "attention"]
    feeds = _feeds(model)
    ref = _run(model, feeds)
    assert np.array_equal(_run(norm, feeds), ref)
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    rewrites = {
        k: r
        for task in partition(prep.model, prep.ctx, "sgat")
        for k, r in task_rewrites(
            prep.model, prep.ctx, consts, task, "int8_qattention", REGISTRY
        ).items()
    }
    tuned = apply_rewrites(prep.model, rewrites)
    assert [n.op_type for n in tuned.graph.node].count("QAttention") == 2
    y = _run(tuned, feeds)
    assert np.isfinite(y).all()
    assert float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref)) > 0.99


def test_a_shared_where_that_is_no_mask_stays_shared() -> None:
    for model in (_shared_mask_model(-1.0), _shared_mask_model(0.0, zero=1.0)):
        norm = normalize(model).model
        assert sum(n.op_type == "Where" for n in norm.graph.node) == sum(
            n.op_type == "Where" for n in model.graph.node
        )


def test_residual_as_sum_keeps_onnxruntime_from_fusing_skip_layer_normalization(
    tmp_path: Path,
) -> None:
    """onnxruntime turns Add + LayerNorm into SkipLayerNormalization from its extended
    level on; the Sum form keeps the two kernels, with the same outputs."""
    src = tmp_path / "m.onnx"
    onnx.save(block(), src)
    prep = prepare(src, tmp_path)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    tasks = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "layernorm"]
    rewrites = {}
    for t in tasks:
        rewrites.update(task_rewrites(prep.model, prep.ctx, consts, t, "residual_as_sum", REGISTRY))
    tuned = apply_rewrites(prep.model, rewrites)

    def optimized(model: onnx.ModelProto, name: str) -> list[str]:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]

    before = optimized(prep.model, "input")
    fused = before.count("SkipLayerNormalization")
    assert tasks and fused == 2, before  # the fusion is there, for both LayerNorms of the block
    ops = optimized(tuned, "tuned")
    assert "SkipLayerNormalization" not in ops and ops.count("LayerNormalization") == fused, ops
    feeds = _feeds(prep.model)
    y, ref = _run(tuned, feeds), _run(prep.model, feeds)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()  # exact: float rounding only


def _attention_node(
    variant: str, strategy: str, tmp_path: Path
) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    tmp_path.mkdir(parents=True)
    src = tmp_path / "m.onnx"
    onnx.save(block(**VARIANTS[variant]), src)
    prep = prepare(src, tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    tuned = apply_rewrites(
        prep.model, task_rewrites(prep.model, prep.ctx, consts, task, strategy, REGISTRY)
    )
    op = {"fused_attention": "Attention", "multihead_attention": "MultiHeadAttention"}[strategy]
    [node] = [n for n in tuned.graph.node if n.op_type == op]
    return tuned, node


def test_masks_and_scales_are_read_not_assumed(tmp_path: Path) -> None:
    def attrs(node):
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    for variant in ("causal_add", "causal_where"):
        _, node = _attention_node(variant, "fused_attention", tmp_path / variant)
        assert attrs(node)["unidirectional"] == 1 and len(node.input) == 3, variant
    tuned, node = _attention_node("padding_mask", "fused_attention", tmp_path / "pad")
    assert node.input[5] and any(
        n.op_type == "Expand" and n.output[0] == node.input[5] for n in tuned.graph.node
    )
    for variant in ("scores_div", "scale_on_q"):
        _, node = _attention_node(variant, "multihead_attention", tmp_path / f"s_{variant}")
        assert math.isclose(attrs(node)["scale"], 1 / math.sqrt(D), rel_tol=1e-6)
        assert attrs(node)["num_heads"] == N


def test_rotary_embeddings_run_on_rotary_embedding_only_where_the_tables_fit(
    tmp_path: Path,
) -> None:
    tuned, node = _attention_node("llama_rotary", "multihead_attention", tmp_path / "llama")
    rot = [n for n in tuned.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rot) == 2 and {n.output[0] for n in rot} == set(node.input[:2])
    assert not any(n.op_type in ("Neg", "Concat", "Slice") for n in tuned.graph.node)
    # Tables whose halves differ are not what RotaryEmbedding computes: no fused kernel,
    # the packing alone still applies (the rotation kept as the model has it).
    odd = dict(VARIANTS["llama_rotary"], rotary="odd")
    src = tmp_path / "odd.onnx"
    onnx.save(block(**odd), src)
    prep = prepare(src, tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    with pytest.raises(Exception, match="does not apply"):
        task_rewrites(prep.model, prep.ctx, consts, task, "multihead_attention", REGISTRY)
    feeds = _feeds(prep.model)
    packed = apply_rewrites(
        prep.model, task_rewrites(prep.model, prep.ctx, consts, task, "packed_qkv", REGISTRY)
    )
    ref = _run(prep.model, feeds)
    assert np.abs(_run(packed, feeds) - ref).max() <= 1e-4 * np.abs(ref).max()


def _repeat_kv(model: onnx.ModelProto) -> int:
    """How many Expands of an Unsqueeze (repeat_kv's) the model has."""
    unsqueezed = {n.output[0] for n in model.graph.node if n.op_type == "Unsqueeze"}
    return sum(n.op_type == "Expand" and n.input[0] in unsqueezed for n in model.graph.node)


def test_grouped_query_attention_reads_each_kv_head_for_its_group(tmp_path: Path) -> None:
    """transformers' repeat_kv (Unsqueeze, Expand, Reshape) is matched and gone from the
    fused forms: GroupQueryAttention over K/V with the model's own head count, or
    MultiHeadAttention over weights widened to one block per query head."""
    for variant in ("llama_gqa", "gqa_dynamo_padding", "multi_query_causal"):
        kv = VARIANTS[variant]["kv_heads"]
        src = tmp_path / f"{variant}.onnx"
        onnx.save(block(**VARIANTS[variant]), src)
        prep = prepare(src, tmp_path / variant)
        [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
        consts = Constants(prep.model.graph, list(prep.model.opset_import))
        feeds = _feeds(prep.model)
        ref = _run(prep.model, feeds)
        for strategy, op in (
            ("group_query_attention", "GroupQueryAttention"),
            ("multihead_attention", "MultiHeadAttention"),
        ):
            tuned = apply_rewrites(
                prep.model, task_rewrites(prep.model, prep.ctx, consts, task, strategy, REGISTRY)
            )
            [node] = [n for n in tuned.graph.node if n.op_type == op]
            got = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert got["num_heads"] == N and got.get("kv_num_heads", N) == (
                kv if op == "GroupQueryAttention" else N
            )
            assert got.get("causal", got.get("unidirectional")) == int(
                VARIANTS[variant]["mask"] != "padding"
            )
            assert _repeat_kv(prep.model) == 2 and _repeat_kv(tuned) == 0  # K and V
            y = _run(tuned, feeds)
            assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), (variant, strategy)


def test_a_layers_own_mask_where_becomes_a_raw_mask_and_left_padding_stays_finite(
    tmp_path: Path,
) -> None:
    """transformers makes one boolean (causal and padding) and each layer's Where(keep, 0,
    -inf): the matcher takes that Where into the block, so QAttention reads the boolean
    as its raw mask_index. Left padding leaves the first query rows with every key masked:
    the block's softmax is NaN there and its guard makes zeros; every fused form must give
    the same zeros, not NaN (which P·V would spread to every row of the next layer). The
    kernels get a finite fill and their output is zeroed on those rows by a product."""
    variant = "gpt2_sdpa_causal_padding"
    src = tmp_path / "m.onnx"
    onnx.save(block(**VARIANTS[variant]), src)
    prep = prepare(src, tmp_path / "w")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    [keep] = [n.output[0] for n in prep.model.graph.node if n.op_type == "And"]
    assert keep in task.inputs  # the boolean, not the -inf bias made from it
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    feeds = _feeds(prep.model)
    feeds["attention_mask"] = np.ones((B, S), np.int64)
    feeds["attention_mask"][:, :3] = 0  # left padding: query rows 0-2 see no key
    ref = _run(prep.model, feeds)
    assert np.isfinite(ref).all()
    tried = []
    for strategy in REGISTRY.strategies_for("attention", "int8"):
        if strategy.name == "default":
            continue
        try:
            tuned = apply_rewrites(
                prep.model,
                task_rewrites(prep.model, prep.ctx, consts, task, strategy.name, REGISTRY),
            )
        except Exception:
            continue
        y = _run(tuned, feeds)
        assert np.isfinite(y).all(), strategy.name
        if strategy.precision == "exact":
            assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), strategy.name
        else:
            cos = float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref))
            assert cos > 0.99, (strategy.name, cos)
        if strategy.name == "int8_qattention":
            [node] = [n for n in tuned.graph.node if n.op_type == "QAttention"]
            assert node.input[5], "QAttention without its mask_index"
            got = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert np.isfinite(got["mask_filter_value"]) and got["mask_filter_value"] <= -1e4
            assert got["unidirectional"] == 0
        # the guard is a product by each row's keep flag, not IsNaN and Where on the output
        ops = {n.op_type for n in tuned.graph.node}
        if ops & {"Attention", "MultiHeadAttention", "QAttention"}:
            assert "IsNaN" not in ops and "Mul" in ops, strategy.name
        tried.append(strategy.name)
    assert {
        "fused_attention",
        "multihead_attention",
        "int8_qattention",
        "int8_multihead_attention",
    } <= set(tried)


def test_a_guard_that_never_fires_is_left_out(tmp_path: Path) -> None:
    """transformers fills its mask with the float's lowest value, not -inf: a left-padded
    row then keeps finite scores, its softmax is a finite average and the block's NaN
    guard never fires. The fused kernels give the same rows without any guard."""
    kw = {**VARIANTS["gpt2_sdpa_causal_padding"], "fill": float(np.finfo(np.float32).min)}
    src = tmp_path / "m.onnx"
    onnx.save(block(**kw), src)
    prep = prepare(src, tmp_path / "w")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    feeds = _feeds(prep.model)
    feeds["attention_mask"] = np.ones((B, S), np.int64)
    feeds["attention_mask"][:, :3] = 0
    ref = _run(prep.model, feeds)
    assert np.isfinite(ref).all()
    fused = []
    for name in (
        "fused_attention",
        "multihead_attention",
        "group_query_attention",
        "int8_qattention",
    ):
        tuned = apply_rewrites(
            prep.model, task_rewrites(prep.model, prep.ctx, consts, task, name, REGISTRY)
        )
        ops = [n.op_type for n in tuned.graph.node]
        assert "IsNaN" not in ops and not any(
            n.name.endswith("RowGuard") for n in tuned.graph.node
        ), (name, ops)
        y = _run(tuned, feeds)
        if name == "int8_qattention":
            assert float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref)) > 0.99
        else:
            assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), name
        fused.append(name)
    assert len(fused) == 4


def test_shapes_computed_at_run_time_are_inferred_and_make_tasks(tmp_path: Path) -> None:
    """torch.onnx writes shapes as Shape -> Gather -> Unsqueeze -> Concat -> Equal/Where
    (here feeding an Expand of a bias); onnx's inference leaves what follows without a shape, and every
    task behind it without a signature. Normalization evaluates those computations on a
    scratch copy, so the tasks are found; the model keeps its nodes."""
    g = G()
    x = g.input("x", [B, S, H])
    shape = g.n("Shape", x)
    dims = [
        g.n(
            "Unsqueeze",
            g.n("Gather", shape, g.t(np.array(i, np.int64)), axis=0),
            g.t(np.array([0], np.int64)),
        )
        for i in range(3)
    ]
    target = g.n("Concat", *dims, axis=0)
    # torch's expand(-1, ...) spelling: -1 entries replaced by 1 through Equal and Where
    target = g.n(
        "Where",
        g.n("Equal", target, g.t(np.array(-1, np.int64))),
        g.t(np.ones(3, np.int64)),
        target,
    )
    bias = g.n("Expand", g.w(1, 1, H), target)
    y = g.n("Add", x, bias)
    y = g.n("Relu", linear(g, y, H, H))
    model = g.model(g.n("Relu", linear(g, y, H, H)))
    norm = normalize(model, None).model
    assert [n.op_type for n in norm.graph.node] == [n.op_type for n in model.graph.node]
    tasks = partition(norm, ModelContext(norm))
    assert sum(t.instances for t in tasks) == 2 and all(t.family == "matmul" for t in tasks)
    off = onnx.shape_inference.infer_shapes(model, data_prop=True)
    known = {
        vi.name
        for vi in off.graph.value_info
        if vi.type.tensor_type.HasField("shape")
        and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
    }
    assert y not in known, "this test needs a model onnx's own inference leaves unshaped"


def test_twins_are_one_task_and_partition_modes_split_the_nodes(
    models: Path, tmp_path: Path
) -> None:
    prep = prepare(models / "bert.onnx", tmp_path)
    sgat = partition(prep.model, prep.ctx, "sgat")
    opat = partition(prep.model, prep.ctx, "opat")
    both = partition(prep.model, prep.ctx, "sgat+opat")
    att = [t for t in sgat if t.family == "attention"]
    assert len(att) == 1 and att[0].instances == 4  # four layers, one signature
    in_sgat = {n for t in sgat for u in (t, *t.twins) for n in u.node_names}
    for t in both:
        if t.family not in ("attention", "layernorm", "gelu"):
            assert not in_sgat & {n for u in (t, *t.twins) for n in u.node_names}, t.id
    assert [t.signature.digest for t in both[: len(sgat)]] == [t.signature.digest for t in sgat]
    assert len(both) > len(sgat) and {t.signature.digest for t in opat} > {
        t.signature.digest for t in both[len(sgat) :]
    }


def test_model_tasks_find_subgraph_tasks_by_their_first_node(models: Path, tmp_path: Path) -> None:
    from aoe.partition import ModelTasks

    model = onnx.load(str(models / "bert.onnx"))
    prep = prepare(models / "bert.onnx", tmp_path)
    att = next(t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention")
    by_name = {n.name: n for n in model.graph.node}
    anchors = [by_name[u.node_names[0]] for u in (att, *att.twins)]
    sgat = ModelTasks(model, job_type="sgat")
    assert {sgat.signature(n).digest for n in anchors} == {att.signature.digest}
    opat = ModelTasks(model)  # the same first node anchors an operator task there
    assert all(
        opat.signature(n) is not None and opat.signature(n).digest != att.signature.digest
        for n in anchors
    )


GLU_VARIANTS = {
    "silu": {},
    "silu_bias": {"bias": True},
    "silu_sigmoid_first": {"silu_order": "sigmoid_first", "up_first": True},
    "sigmoid_glu": {"act": "sigmoid", "bias": True},
}


@pytest.mark.parametrize("variant", list(GLU_VARIANTS))
def test_gated_ffns_are_found_and_their_strategies_keep_the_outputs(
    variant: str, tmp_path: Path
) -> None:
    model = anonymize(glu_block(**GLU_VARIANTS[variant]))
    assert _families(model) == ["glu"]
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat")]
    applied = {
        name: [n.op_type for n in tuned.graph.node]
        for name, tuned in _every_strategy(prep, task, "glu").items()
    }
    silu = GLU_VARIANTS[variant].get("act", "silu") == "silu"
    assert set(applied) == {"packed_glu", "int8_packed_glu"} | ({"silu_kernel"} if silu else set())
    # packed: the gate and up products are one product over the input, then the down one
    assert applied["packed_glu"].count("MatMul") == 2 and "Split" in applied["packed_glu"]
    assert applied["int8_packed_glu"].count("DynamicQuantizeMatMul") == 1
    assert ("QuickGelu" in applied["packed_glu"]) == silu and "Sigmoid" not in applied.get(
        "silu_kernel", []
    )


def rmsnorm(
    g: G, x: str, *, square: str = "Pow", divide: str = "Reciprocal", scale: bool = True
) -> str:
    """LLaMA's RMSNorm written out: x / sqrt(mean(x²) + eps) · w (torch's dynamo export:
    Pow and x · Reciprocal; the TorchScript one: Div)."""
    sq = g.n("Pow", x, g.f(2.0)) if square == "Pow" else g.n("Mul", x, x)
    if g.opset >= 18:  # the axes as an input, as the dynamo exporter writes opset 18
        mean = g.n("ReduceMean", sq, g.t(np.array([-1], np.int64)), keepdims=1)
    else:
        mean = g.n("ReduceMean", sq, axes=[-1])
    rms = g.n("Sqrt", g.n("Add", mean, g.f(1e-6)))
    y = g.n("Div", x, rms) if divide == "Div" else g.n("Mul", x, g.n("Reciprocal", rms))
    return g.n("Mul", g.t(g.rng.uniform(0.9, 1.1, H).astype(np.float32)), y) if scale else y


RMS_VARIANTS = {
    "dynamo_reciprocal": {},
    "torchscript_div": {"divide": "Div"},
    "square_as_mul": {"square": "Mul"},
    "no_scale": {"scale": False},
    "opset_18": {"opset": 18},
}


def _every_strategy(prep, task, family: str) -> dict[str, onnx.ModelProto]:
    """The prepared model with `task` (and its twins) on each strategy of `family` that
    applies under int8, by name: each passes onnx's checker, an exact one within 1e-4 of
    the model's outputs, a lossy one at cosine above 0.99."""
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    feeds = _feeds(prep.model)
    ref = _run(prep.model, feeds)
    applied = {}
    for strategy in REGISTRY.strategies_for(family, "int8"):
        if strategy.name == "default":
            continue
        try:
            rewrites = task_rewrites(prep.model, prep.ctx, consts, task, strategy.name, REGISTRY)
        except Exception:
            continue  # does not apply to this form
        tuned = apply_rewrites(prep.model, rewrites)
        onnx.checker.check_model(tuned)
        y = _run(tuned, feeds)
        if strategy.precision == "exact":
            assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), strategy.name
        else:
            cos = float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref))
            assert 0.99 < cos < 1.0, (strategy.name, cos)
        applied[strategy.name] = tuned
    return applied


@pytest.mark.parametrize("post_norm", [False, True])
@pytest.mark.parametrize("variant", list(RMS_VARIANTS))
def test_rmsnorm_is_found_and_runs_on_onnxruntimes_kernel(
    variant: str, post_norm: bool, tmp_path: Path
) -> None:
    """Pre-norm (LLaMA: the residual sum also feeds the next residual, and leaves the task
    as its second output) and post-norm; the residual Add joins the task in both.
    simplified_layer_normalization
    writes the form onnxruntime fuses into SimplifiedLayerNormalization, in standard ops;
    the LayerNorm strategies, which subtract the mean, do not take it."""
    kw = dict(RMS_VARIANTS[variant])
    g = G(seed=7, opset=kw.pop("opset", 17))
    x = g.input("x", [B, S, H])
    h = g.n("Add", linear(g, x, H, H), x)
    n = rmsnorm(g, h, **kw)
    if post_norm:
        model = g.model(n)
    else:
        model = g.model(g.n("Add", linear(g, n, H, H), h))
    model = anonymize(model)
    assert _families(model) == ["layernorm"]
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "layernorm"]
    assert task.op_type.startswith("Add+"), task.op_type
    assert len(task.outputs) == (1 if post_norm else 2), task.outputs
    applied = _every_strategy(prep, task, "layernorm")
    assert set(applied) == {"simplified_layer_normalization", "skip_simplified_layer_normalization"}
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(
        applied["simplified_layer_normalization"].SerializeToString(),
        so,
        providers=["CPUExecutionProvider"],
    )
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"} & set(ops), ops
    assert {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"} & set(ops), ops


def test_what_is_no_rmsnorm_is_left_to_opat() -> None:
    g = G()
    x = g.input("x", [B, S, H])
    sq = g.n("Pow", x, g.f(3.0))  # not a square
    assert (
        _families(
            g.model(
                g.n(
                    "Mul",
                    x,
                    g.n(
                        "Reciprocal",
                        g.n("Sqrt", g.n("Add", g.n("ReduceMean", sq, axes=[-1]), g.f(1e-6))),
                    ),
                )
            )
        )
        == []
    )
    g = G()
    x = g.input("x", [B, S, H])
    sq = g.n("Pow", x, g.f(2.0))
    rms = g.n("Sqrt", g.n("Add", g.n("ReduceMean", sq, axes=[1]), g.f(1e-6)))  # not the last axis
    assert _families(g.model(g.n("Div", x, rms))) == []
    g = G()
    x, other = g.input("x", [B, S, H]), g.input("other", [B, S, H])
    rms = g.n("Sqrt", g.n("Add", g.n("ReduceMean", g.n("Pow", x, g.f(2.0)), axes=[-1]), g.f(1e-6)))
    assert _families(g.model(g.n("Div", other, rms))) == []  # another tensor divided


def _layernorm_node(g: G, x: str) -> str:
    return g.n(
        "LayerNormalization",
        x,
        g.t(g.rng.uniform(0.9, 1.1, H).astype(np.float32)),
        g.w(H, std=0.02),
        axis=-1,
        epsilon=1e-5,
    )


#: norm -> (its builder, the strategies that take its residual task, the Skip kernel)
PRENORMS = {
    "rmsnorm": (
        rmsnorm,
        {"simplified_layer_normalization", "skip_simplified_layer_normalization"},
        "SkipSimplifiedLayerNormalization",
    ),
    "layernorm": (
        layernorm,
        {"layer_normalization", "skip_layer_normalization", "residual_as_sum"},
        "SkipLayerNormalization",
    ),
    "layernorm_node": (
        _layernorm_node,
        {"skip_layer_normalization", "residual_as_sum"},
        "SkipLayerNormalization",
    ),
}


def _prenorm_stack(norm: str, sublayers: int = 4) -> onnx.ModelProto:
    """A pre-norm decoder's residual stream (LLaMA's or GPT-2's, two layers of attention
    and MLP, each a product here): h = h + f(norm(h)) per sublayer, then the final norm.
    Every residual sum but the last feeds its norm and the next residual; the first norm
    reads the input itself."""
    make = PRENORMS[norm][0]
    g = G(seed=11)
    h = g.input("x", [B, S, H])
    for _ in range(sublayers):
        h = g.n("Add", h, linear(g, make(g, h), H, H, bias=False))
    return g.model(make(g, h))


@pytest.mark.parametrize("norm", list(PRENORMS))
def test_a_prenorm_residual_joins_its_norm_and_its_sum_leaves_the_task(
    norm: str, tmp_path: Path
) -> None:
    """Each norm after a residual Add takes it, the sum (which the next residual reads
    too) a second output of its task, so the Skip kernel writes it as its fourth output
    and no Add is left for it; the last sum feeds its norm alone. Every norm strategy
    that takes such a task keeps the model's output."""
    _, strategies, skip_op = PRENORMS[norm]
    src = tmp_path / "m.onnx"
    onnx.save(anonymize(_prenorm_stack(norm)), src)
    prep = prepare(src, tmp_path)
    tasks = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "layernorm"]
    every = [i for t in tasks for i in (t, *t.twins)]
    by_name = {n.name: n for n in prep.model.graph.node}
    with_add = [t for t in every if by_name[t.node_names[0]].op_type == "Add"]
    # (a lone LayerNormalization, the first, is no task)
    assert len(every) == (4 if norm == "layernorm_node" else 5) and len(with_add) == 4
    sums = [by_name[t.node_names[0]].output[0] for t in with_add]
    # the three sums the next residual reads leave their tasks; the last one does not
    assert [t.outputs[1:] for t in with_add] == [(s,) for s in sums[:3]] + [()]
    # one signature, sum leaving or not: the same rewrite serves both
    [rep] = [t for t in tasks if t in with_add]
    assert rep.instances == 4
    applied = _every_strategy(prep, rep, "layernorm")
    assert set(applied) == strategies
    skip = (
        "skip_simplified_layer_normalization" if norm == "rmsnorm" else "skip_layer_normalization"
    )
    tuned = applied[skip]
    assert [list(n.output) for n in tuned.graph.node if n.op_type == skip_op] == [
        [mine.output[0], "", "", s]
        for t, s in zip(with_add, sums, strict=True)
        for mine in [by_name[t.node_names[-1]]]
    ]
    assert not [n for n in tuned.graph.node if n.op_type == "Add" and n.output[0] in sums]
    # The task alone, as the tuner compiles and gates it: the norm and the sum come out,
    # within the exact policy's bounds.
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    alone = task_model(prep.model, rep, consts, prep.ctx.tensors)
    assert [o.name for o in alone.graph.output] == list(rep.outputs) == [rep.outputs[0], sums[0]]
    view = TaskView(
        list(alone.graph.node),
        Constants(alone.graph, list(alone.opset_import)),
        ModelContext(alone).tensors,
        17,
        "aoe/t",
    )
    rw = REGISTRY.get("layernorm", skip).apply(view)
    assert rw is not None
    fused = apply_rewrites(alone, {tuple(n.name for n in view.nodes): rw})
    feeds = _feeds(alone)
    want, got = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )
        for m in (alone, fused)
    )
    assert np.array_equal(want[1], got[1])  # the sum: one float Add either way
    assert POLICIES["exact"].task_ok(accuracy(want, got)), accuracy(want, got)


def test_an_add_two_norms_read_or_an_add_of_a_constant_stays_out() -> None:
    """Which of two norms would own their shared residual is no choice to make: neither
    takes it. An Add of a constant is no residual."""
    g = G(seed=12)
    x = g.input("x", [B, S, H])
    h = g.n("Add", x, linear(g, x, H, H, bias=False))
    both = g.n("Add", linear(g, rmsnorm(g, h), H, H, bias=False), rmsnorm(g, h))
    model = g.model(g.n("Add", both, h))
    norm = normalize(model, None, strict=False).model
    found = find_subgraphs(norm, ModelContext(norm))
    assert [m.family for m in found] == ["layernorm", "layernorm"]
    assert all("Add" not in [n.op_type for n in m.nodes[:1]] for m in found)
    assert all(len(m.outputs) == 1 for m in found)
    g = G(seed=12)
    x = g.input("x", [B, S, H])
    h = g.n("Add", x, g.w(B, S, H))
    model = g.model(g.n("Add", linear(g, rmsnorm(g, h), H, H, bias=False), h))
    norm = normalize(model, None, strict=False).model
    [m] = find_subgraphs(norm, ModelContext(norm))
    assert m.nodes[0].op_type == "Pow" and len(m.outputs) == 1


@pytest.mark.parametrize("drop", ["Reciprocal", "Mul_after_reciprocal"])
def test_a_norm_view_without_its_division_is_declined_not_raised(drop: str, tmp_path: Path) -> None:
    """The norm strategies find the division by the deviation themselves; handed a view
    that lacks it (or the Mul after a Reciprocal), each declines (None) instead of
    raising out of the candidate, which would fail it with a bare StopIteration or
    KeyError."""
    g = G(seed=3)
    x = g.input("x", [B, S, H])
    model = g.model(rmsnorm(g, x))
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "layernorm"]
    by_name = {n.name: n for n in prep.model.graph.node}
    nodes = [by_name[n] for n in task.node_names]
    recip = next(n for n in nodes if n.op_type == "Reciprocal")
    if drop == "Reciprocal":
        kept = [n for n in nodes if n is not recip]
    else:
        kept = [n for n in nodes if recip.output[0] not in n.input]
    assert len(kept) == len(nodes) - 1
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    view = TaskView(nodes=kept, consts=consts, infos=prep.ctx.tensors, opset=17, prefix="aoe/t")
    whole = TaskView(nodes=nodes, consts=consts, infos=prep.ctx.tensors, opset=17, prefix="aoe/t")
    tried = 0
    for strategy in REGISTRY.strategies_for("layernorm", "int8"):
        if strategy.name == "default":
            continue
        assert strategy.apply(view) is None, strategy.name
        tried += strategy.apply(whole) is not None
    assert tried >= 1  # the whole view is taken, so declining above is the missing division's doing


def test_what_is_not_a_gated_ffn_is_left_to_opat() -> None:
    g = G()
    x, other = g.input("x", [B, S, H]), g.input("other", [B, S, H])
    gate, up = linear(g, x, H, H, False), linear(g, other, H, H, False)  # two inputs: not siblings
    assert _families(g.model(g.n("Mul", g.n("Mul", gate, g.n("Sigmoid", gate)), up))) == []
    g = G()
    x = g.input("x", [B, S, H])
    gate, up = linear(g, x, H, H, False), linear(g, x, H, H, False)
    # not SiLU of one tensor
    assert _families(g.model(g.n("Mul", g.n("Mul", gate, g.n("Sigmoid", up)), up))) == []
    g = G()
    x = g.input("x", [B, S, H])
    gate, up = linear(g, x, H, H, False), linear(g, x, H, H, False)
    h = g.n("Mul", g.n("Sigmoid", gate), up)
    assert _families(g.model(g.n("Add", h, gate))) == []  # the gate read outside the block


def test_job_type_spellings() -> None:
    assert [
        parse_job_type(s) for s in ("opat", "2", "SGAT", "1", "sgat+opat", "1+2", "opat,sgat")
    ] == ["opat", "opat", "sgat", "sgat", "sgat+opat", "sgat+opat", "sgat+opat"]
    assert [parse_job_type(s) for s in ("gdat", "4")] == ["gdat", "gdat"]  # AOE_MODE=4
    with pytest.raises(OptionError, match="expected opat"):
        parse_job_type("77")


def test_sgat_plus_opat_tunes_every_operator_task_a_subgraph_without_a_choice_covers(
    models: Path, tmp_path: Path
) -> None:
    """A CNN's trunk is a subgraph with strategies at int8 only: at exact it must not take
    the convolutions from OPAT, or the default job type would tune less than OPAT alone."""
    from aoed.engine.assemble import tunable_tasks

    registry = build_registry()
    prep = prepare(models / "cnn.onnx", tmp_path / "prep")

    def ids(precision: str, job_type: str) -> list[str]:
        return [t.id for t in tunable_tasks(prep.model, prep.ctx, registry, precision, job_type)]

    opat = ids("exact", "opat")
    assert sum(i.startswith("t") for i in opat) >= 4  # the convolutions and the head
    assert ids("exact", "sgat+opat") == opat
    both = tunable_tasks(prep.model, prep.ctx, registry, "int8", "sgat+opat")
    assert [t.family for t in both][0] == "conv_region" and len(both) < len(ids("int8", "opat"))


def test_a_job_that_names_no_type_runs_sgat_plus_opat(tmp_path: Path) -> None:
    """Each edge where a job's options are made gives sgat+opat when no job type is named,
    and AOE's numbers keep AOE's meaning. (The CLI and gRPC defaults also run end to end
    below: test_sgat_plus_opat_reports_both_sections, test_daemon_runs_a_sgat_plus_opat_job.)"""
    from aoe.cli import _aoe_spelling, build_parser
    from aoe.spec import JobSpec
    from aoe.specargs import from_args
    from aoe.v1 import tuning_pb2
    from aoe.wire import spec_from_pb
    from aoed.watch import folder_spec

    assert from_args(build_parser().parse_args(["tune", "m.onnx"])).job_type == "sgat+opat"
    aoe_args = ["--framework", "5", "--model", "m.onnx"]
    assert from_args(_aoe_spelling(aoe_args)).job_type == "sgat+opat"
    assert parse_job_type(_aoe_spelling([*aoe_args, "--job_type", "2"]).job_type) == "opat"
    assert parse_job_type(_aoe_spelling([*aoe_args, "--job_type", "1"]).job_type) == "sgat"
    assert spec_from_pb(tuning_pb2.JobOptions()).job_type == "sgat+opat"
    assert spec_from_pb(tuning_pb2.JobOptions(job_type=tuning_pb2.JOB_TYPE_OPAT)).job_type == "opat"
    assert JobSpec.from_dict({}).job_type == "sgat+opat"
    assert folder_spec(tmp_path).job_type == "sgat+opat"  # a drop folder without aoed.toml
    (tmp_path / "aoed.toml").write_text('job_type = "2"\n')
    assert folder_spec(tmp_path).job_type == "opat"
    assert JobSpec().job_type == "sgat+opat"


# --------------------------------------------------------------------------- jobs

FAST = ("--budget", "3", "--parallel", "1", "--no-progress", "--local")


@pytest.mark.slow
@pytest.mark.long
def test_sgat_job_writes_aoe_result_and_bank_then_resumes_from_it(
    models: Path, tmp_path: Path
) -> None:
    bank, out = tmp_path / "bank", tmp_path / "out"
    # AOE's own spelling: --job_type 1 is SGAT.
    r = run_aoe(
        "--framework",
        "5",
        "--model",
        str(models / "transformer.onnx"),
        "--job_type",
        "1",
        "--bank",
        str(bank),
        "--output",
        str(out),
        "--progress_bar",
        "off",
    )
    assert r.returncode == 0, r.stderr
    [result] = out.glob("aoe_result_sgat_*.json")
    doc = json.loads(result.read_text())
    assert "OPAT" not in doc and doc["SGAT"]["sgat_tuning_result"] == "tuning successful"
    assert {t["family"] for t in doc["tasks"]} == {"attention", "layernorm", "gelu"}
    summary = doc["SGAT"]["repo_summary"]
    assert summary["total_num"] == len(doc["tasks"])  # one decision per task (aoe.outcome)
    added = {s["task_id"] for s in doc["SGAT"]["repo_modified_subgraphs"]["add_repo_subgraphs"]}
    assert added == {t["task_id"] for t in doc["tasks"] if t["update_mode"] == "add"}
    measured = [t for t in doc["tasks"] if t["update_mode"] not in ("skipped", "failed")]
    assert measured, doc["tasks"]
    with open_bank(bank, use_env=False) as b:
        stored = [r for _, r in b.records() if not r.HasField("trial")]
    assert len(stored) >= len(measured)  # an entry or a "default stays" record per decided task
    # Run again with --reload (AOE's resume): every decided subgraph comes from the bank.
    r = run_aoe(
        "tune",
        str(models / "transformer.onnx"),
        "--job-type",
        "sgat",
        "--reload",
        "--bank",
        str(bank),
        "--output",
        str(tmp_path / "again"),
        *FAST,
        env={"REPEAT_TUNE": "True"},
    )
    assert r.returncode == 0, r.stderr
    [again] = (tmp_path / "again").glob("aoe_result_sgat_*.json")
    doc2 = json.loads(again.read_text())
    decided = {t["task_id"] for t in measured}
    assert all(
        t["update_mode"] in ("hit", "reserved") for t in doc2["tasks"] if t["task_id"] in decided
    ), doc2["tasks"]
    assert doc2["resources"]["trials"] < doc["resources"]["trials"]


@pytest.mark.slow
@pytest.mark.long
def test_sgat_plus_opat_reports_both_sections(models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # No job type named: sgat+opat is the default.
    r = run_aoe(
        "tune",
        str(models / "transformer.onnx"),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(out),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    [result] = out.glob("aoe_result_sgat_opat_*.json")
    doc = json.loads(result.read_text())
    families = {t["task_id"]: t["family"] for t in doc["tasks"]}
    assert {"attention", "gelu"} <= set(families.values()) and "matmul" in families.values()
    sg = doc["SGAT"]["repo_summary"]["total_num"]
    op = doc["OPAT"]["repo_summary"]["total_num"]
    assert sg == sum(f in ("attention", "layernorm", "gelu") for f in families.values())
    assert op == len(families) - sg
    tuned = onnx.load(doc["tuned_model"])
    onnx.checker.check_model(tuned)


def test_compile_applies_subgraph_entries_over_operator_ones(models: Path, tmp_path: Path) -> None:
    src = models / "transformer.onnx"
    prep = prepare(src, tmp_path / "prep")
    [att] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    q_proj = next(
        t
        for t in partition(prep.model, prep.ctx, "opat")
        if set(t.node_names) <= set(att.node_names)
    )
    m, b = Measured(8.0, 0.01, 30, 7.5), Measured(10.0, 0.01, 30, 9.5)
    bank = tmp_path / "bank"
    make_bank(
        bank,
        [
            rec(
                sig=att.signature,
                strategy="fused_attention",
                family="attention",
                winner=m,
                baseline=b,
            ),
            rec(
                sig=q_proj.signature,
                strategy="gemm_pretransposed",
                family="matmul",
                winner=m,
                baseline=b,
            ),
        ],
    )
    out = tmp_path / "compiled.onnx"
    r = run_aoe("compile", str(src), "-o", str(out), "--bank", str(bank), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    status = {t["task_id"]: (t["status"], t["strategy"]) for t in report["tasks"]}
    assert status[att.id] == ("hit", "fused_attention")
    # Tasks formed as an sgat+opat job forms them (the bank names no job type): the Q
    # projection is in the subgraph, no operator task; its entry's signature is also the
    # output projection's, a task outside the subgraph, which it applies to.
    assert q_proj.id not in status
    assert status["t001_attn_out_MatMul"] == ("hit", "gemm_pretransposed")
    compiled = onnx.load(str(out))
    assert [n.op_type for n in compiled.graph.node].count("Attention") == 1
    assert any(n.name.startswith("aoe/t001_attn_out_MatMul/") for n in compiled.graph.node)
    feeds = make_inputs(prep.inputs)
    assert np.abs(_run(compiled, feeds) - _run(onnx.load(str(src)), feeds)).max() < 1e-4


@pytest.mark.slow
def test_daemon_runs_a_sgat_plus_opat_job(models: Path, tmp_path: Path) -> None:
    from aoe.v1 import tuning_pb2

    from .daemon_util import DaemonProcess, upload

    d = DaemonProcess(tmp_path / "d")
    d.start()
    try:
        model_id = upload(d.tuning(), models / "transformer.onnx")
        opts = tuning_pb2.JobOptions(budget_s=3)  # no job type: the daemon's default, sgat+opat
        job_id = (
            d.tuning()
            .SubmitJob(tuning_pb2.SubmitJobRequest(model_id=model_id, options=opts))
            .job_id
        )
        job = d.wait_job(job_id)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
        assert job.options.job_type == tuning_pb2.JOB_TYPE_SGAT_OPAT
        report = json.loads(
            b"".join(
                c.chunk
                for c in d.tuning().DownloadResult(
                    tuning_pb2.DownloadResultRequest(
                        job_id=job_id, artifact=tuning_pb2.RESULT_ARTIFACT_RESULT_JSON
                    )
                )
            )
        )
        assert Path(job.result.result_json_path).name.startswith("aoe_result_sgat_opat_")
        assert {"SGAT", "OPAT"} <= set(report) and "attention" in {
            t["family"] for t in report["tasks"]
        }
        assert len(job.result.tasks) == len(report["tasks"])
    finally:
        d.close()


# --------------------------------------------------------------------------- CNN regions


def _region(models: Path, tmp_path: Path, name: str = "cnn"):
    from aoed.backends.ort.probe import activation_ranges
    from aoed.engine.tasks import TaskView

    prep = prepare(models / f"{name}.onnx", tmp_path)
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "conv_region"]
    rng = np.random.default_rng(0)
    samples = [
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in prep.inputs.items()}
        for _ in range(8)
    ]
    ranges = activation_ranges(prep.model, prep.ctx.tensors, samples)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    by = {n.name: n for n in prep.model.graph.node}
    view = TaskView(
        [by[n] for n in task.node_names], consts, prep.ctx.tensors, 13, f"aoe/{task.id}", ranges
    )
    return prep, task, view, samples[0]


def _optimized_ops(model: onnx.ModelProto, tmp_path: Path) -> dict[str, int]:
    from collections import Counter

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


def test_conv_regions_cover_the_trunk(models: Path) -> None:
    def region(name: str):
        model = onnx.load(str(models / f"{name}.onnx"))
        norm = normalize(model, None, strict=False).model
        [m] = [m for m in find_subgraphs(norm, ModelContext(norm)) if m.family == "conv_region"]
        left = {n.op_type for n in norm.graph.node} - {n.op_type for n in m.nodes}
        return [n.op_type for n in m.nodes], left

    ops, left = region("cnn")
    assert ops.count("Conv") == 6 and ops.count("Add") == 2 and ops[-1] == "GlobalAveragePool"
    assert left == {"Flatten", "Gemm"}  # the head is left to operator tuning
    ops, _ = region("resnet")
    assert ops.count("Conv") == 20 and ops.count("Add") == 8 and "MaxPool" in ops


def test_int8_region_runs_in_int8_from_input_to_output(models: Path, tmp_path: Path) -> None:
    from aoed.backends.ort.regions import int8_region

    prep, task, view, feeds = _region(models, tmp_path)
    ref = _run(prep.model, feeds)
    tuned = apply_rewrites(prep.model, {task.node_names: int8_region(view)})
    ops = _optimized_ops(tuned, tmp_path)
    # Every Conv, residual Add and the pool became onnxruntime's int8 kernels; one
    # quantize in, one dequantize out, nothing float in between.
    assert (
        ops["QLinearConv"] == 6 and ops["QLinearAdd"] == 2 and ops["QLinearGlobalAveragePool"] == 1
    )
    assert (
        ops["QuantizeLinear"] == 1
        and ops["DequantizeLinear"] == 1
        and not ops["Conv"]
        and not ops["FusedConv"]
    )
    y = _run(tuned, feeds)
    assert float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref)) > 0.999
    # Kept in float by name: those two Convs run in float, the rest stays int8.
    kept = REGISTRY.get("conv_region", "int8_region:f0.3")
    tuned = apply_rewrites(prep.model, {task.node_names: kept.apply(view)})
    ops = _optimized_ops(tuned, tmp_path)
    assert ops["QLinearConv"] == 4 and ops["Conv"] + ops["FusedConv"] == 2
    assert REGISTRY.get("conv_region", "int8_region:f99").apply(view) is None
    with pytest.raises(KeyError):
        REGISTRY.get("conv_region", "int8_dynamic:f1")


def test_sensitivity_is_measured_and_keeps_the_layer_that_hurts_in_float(
    models: Path, tmp_path: Path
) -> None:
    from aoed.backends.ort.regions import propose_float_convs, region_convs

    prep, task, view, feeds = _region(models, tmp_path)
    convs = region_convs(view)
    # Conv 2's input calibrated over a range 200 times too wide: its int8 grid is coarse,
    # so quantizing that Conv alone moves the output most.
    lo, hi = view.ranges[convs[2].input[0]]
    view.ranges = {**view.ranges, convs[2].input[0]: (lo * 200, hi * 200)}
    by = {n.name: n for n in prep.model.graph.node}
    task_model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [by[n] for n in task.node_names],
            "t",
            [
                onnx.helper.make_tensor_value_info(
                    i.name, TensorProto.FLOAT, list(prep.inputs[i.name].shape)
                )
                for i in prep.model.graph.input
            ],
            [
                onnx.helper.make_tensor_value_info(
                    task.outputs[0],
                    TensorProto.FLOAT,
                    list(prep.ctx.tensors[task.outputs[0]].shape),
                )
            ],
            initializer=[t for t in prep.model.graph.initializer if t.name in set(task.inputs)],
        ),
        opset_imports=list(prep.model.opset_import),
    )
    task_model.ir_version = prep.model.ir_version

    def evaluate(rewrite):
        m = (
            task_model
            if rewrite is None
            else apply_rewrites(task_model, {task.node_names: rewrite})
        )
        return _run(m, feeds)

    notes: list[str] = []
    names = propose_float_convs(view, evaluate, notes)
    # the three most sensitive first, then the shallow stem (3 channels x 3x3 = 27 products)
    assert names[0] == "int8_region:f2" and len(names) == 4
    assert all(
        n.startswith("int8_region:f") and "2" in n[len("int8_region:f") :].split(".")
        for n in names[:3]
    )
    assert names[3] == "int8_region:f0" and convs[0].input[0] == prep.model.graph.input[0].name
    assert notes and notes[0].split(": ")[1].startswith("2:")


@pytest.mark.slow
def test_sgat_int8_tunes_a_cnn_region_with_measured_variants(models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_aoe(
        "tune",
        str(models / "cnn.onnx"),
        "--job-type",
        "sgat",
        "--precision",
        "int8",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(out),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    [result] = out.glob("aoe_result_sgat_*.json")
    doc = json.loads(result.read_text())
    [region] = [t for t in doc["tasks"] if t["family"] == "conv_region"]
    tried = {c["strategy"] for c in region["candidates"]}
    assert {"default", "int8_region"} <= tried and any(
        s.startswith("int8_region:f") for s in tried
    ), tried
    assert any("int8 sensitivity per Conv" in n for n in doc["notes"])


def _block_and_view(model: onnx.ModelProto, tmp_path: Path):
    """The attention task of `model` (its first), the block the recognizer returns for
    its nodes, and the view a strategy gets."""
    tmp_path.mkdir(parents=True)
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    prep = prepare(src, tmp_path)
    task = next(t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention")
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    by = {n.name: n for n in prep.model.graph.node}
    view = TaskView([by[n] for n in task.node_names], consts, prep.ctx.tensors, 17, "aoe/t")
    block = task_block(view.nodes, view.infos, view.consts, view.const)
    return block, view


def test_the_fused_kernels_take_the_recognized_block(tmp_path: Path) -> None:
    """One recognizer: the block it returns for a task's nodes (all of them) is what the
    fused kernels are written from, on the sample transformer and on grouped-query
    attention; a view it rejects (a node short) gets no fused kernel."""

    def attrs(node: onnx.NodeProto) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    cases = [
        (samples.build("transformer"), "fused_attention", "Attention"),
        (block(**VARIANTS["multi_query_causal"]), "group_query_attention", "GroupQueryAttention"),
        (block(**VARIANTS["gqa_dynamo_padding"]), "group_query_attention", "GroupQueryAttention"),
    ]
    for i, (model, name, op) in enumerate(cases):
        got, view = _block_and_view(model, tmp_path / str(i))
        assert got is not None and [n.name for n in got.nodes] == [n.name for n in view.nodes]
        assert got.layout is not None
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.guard = True  # type: ignore[misc]
        rw = REGISTRY.get("attention", name).apply(view)
        assert rw is not None, name
        [node] = [n for n in rw.nodes if n.op_type == op]
        a = attrs(node)
        assert a["num_heads"] == got.layout.heads
        assert math.isclose(a["scale"], got.scale, rel_tol=1e-6)
        if op == "GroupQueryAttention":
            assert a["kv_num_heads"] == got.layout.kv_heads < got.layout.heads
        # a view the recognizer rejects: every attention strategy declines it
        short = TaskView(view.nodes[:-1], view.consts, view.infos, 17, "aoe/t")
        assert task_block(short.nodes, short.infos, short.consts, short.const) is None
        for s in REGISTRY.strategies_for("attention", "int8"):
            if s.name != "default":
                assert s.apply(short) is None, s.name

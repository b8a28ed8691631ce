"""Attention with a KV cache as SGAT's subgraph: a decode step's block (K and V appended to
the past along the sequence axis, the Concat's result the present the model outputs) is
one task whose outputs include the presents, rewritten onto MultiHeadAttention and
GroupQueryAttention with their own past/present, and the tuned model runs at every past
length, not only the profiled ones.

The decoder is the repository's sample (aoed.samples.kv_decoder, GPT-style, a K/V head
per query head); a grouped-query block (fewer K/V heads, repeated after the cache as
transformers' repeat_kv does) is built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from aoe.attention import task_block
from aoe.bankrecord import Measured
from aoe.partition import partition
from aoed.backends.ort.catalog import build_registry
from aoed.engine.assemble import task_rewrites
from aoed.engine.prep import Prepared, prepare
from aoed.engine.shapeprofile import restore_io
from aoed.engine.tasks import Constants, TaskView, apply_rewrites

from .bank_util import make_bank, rec
from .conftest import run_aoe
from .graphs import B, D, G, H, N, linear

pytest.importorskip("torch", reason="the gdat extra (torch) is not installed")

from aoed import samples  # noqa: E402

REGISTRY = build_registry()
#: past lengths the tuned models run at: none is a point of the derived profile
PASTS = (0, 16, 256, 1024)
#: the sample's position table: pasts up to 1038 run; the profile spreads 65, 260, 1040
POSITIONS = 1040
#: the kernels that take a block's KV cache as it is, and what runs on them
CACHED = {
    "multihead_attention": "MultiHeadAttention",
    "group_query_attention": "GroupQueryAttention",
    "int8_multihead_attention": "MultiHeadAttention",
    "int8_group_query_attention": "GroupQueryAttention",
}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Prepared]:
    """The sample decoder (2 layers, hidden 128, 4 heads) and its prepared copy."""
    work = tmp_path_factory.mktemp("decoder")
    src = samples.save(samples.kv_decoder(max_positions=POSITIONS), work / "dec.onnx")
    return src, prepare(src, work / "prep")


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    data = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, past: int) -> dict[str, np.ndarray]:
    """This step's input and a random past of `past` positions for every cache input."""
    rng = np.random.default_rng(past)
    feeds: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        if i.type == "tensor(int64)":
            feeds[i.name] = np.full([1, 1], 7, np.int64)
        else:
            shape = [past if isinstance(d, str) else d for d in i.shape]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _worst(want: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    """(largest error relative to each output's largest value, lowest cosine) over the
    outputs: logits and presents."""
    err, cos = 0.0, 1.0
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape
        scale = float(np.abs(a).max()) or 1.0
        err = max(err, float(np.abs(a - b).max()) / scale)
        a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
        if a.size and np.linalg.norm(a) and np.linalg.norm(b):
            cos = min(cos, float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)))
    return err, cos


def _rewritten(prep: Prepared, name: str) -> dict[str, onnx.ModelProto | None]:
    """The prepared model with every attention task (and twin) on strategy `name`, its
    inputs and outputs as the input model declares them (None: the strategy declines)."""
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    out: dict[str, onnx.ModelProto | None] = {}
    for task in partition(prep.model, prep.ctx, "sgat"):
        if task.family != "attention":
            continue
        try:
            rw = task_rewrites(prep.model, prep.ctx, consts, task, name, REGISTRY)
        except Exception:
            out[task.id] = None
            continue
        m = apply_rewrites(prep.model, rw)
        onnx.checker.check_model(m)  # sorted: what the block reads is made before it
        assert prep.profile is not None
        restore_io(m, prep.profile)
        out[task.id] = m
    return out


def test_a_decode_steps_blocks_are_tasks_with_their_presents(
    decoder: tuple[Path, Prepared],
) -> None:
    """Each layer's block is one attention task (the second a twin of the first): its
    outputs are the merged heads and the layer's presents, its inputs the pasts, and the
    block a strategy reads from the task's nodes holds both caches."""
    _, prep = decoder
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    assert len(task.twins) == 1
    for i, t in enumerate((task, *task.twins)):
        assert t.outputs[1:] == (f"present_key_{i}", f"present_value_{i}"), t.outputs
        assert {f"past_key_{i}", f"past_value_{i}"} <= set(t.inputs)
    by = {n.name: n for n in prep.model.graph.node}
    view = TaskView(
        [by[n] for n in task.node_names],
        Constants(prep.model.graph, list(prep.model.opset_import)),
        prep.ctx.tensors,
        17,
        "aoe/t",
    )
    block = task_block(view.nodes, view.infos, view.consts, view.const)
    assert block is not None and block.caches is not None
    assert [c.past for c in block.caches] == ["past_key_0", "past_value_0"]
    assert block.presents == ("present_key_0", "present_value_0")
    assert block.layout is not None and block.layout.groups == 1


def test_the_cached_kernels_give_the_input_models_logits_and_presents_at_every_past(
    decoder: tuple[Path, Prepared],
) -> None:
    """MultiHeadAttention and GroupQueryAttention (and their int8 forms) take the block's
    past and write its presents; the packings keep its Concats. Every rewrite gives the
    input model's logits and presents at past 0 and at lengths the profile never had
    (the past stays dynamic: nothing computed from the profiled length is baked in). The
    kernels that take the cache packed decline the block."""
    src, prep = decoder
    assert prep.profile is not None
    profiled = {p["past_key_0"][2] for p in prep.profile.checked}
    assert not profiled & set(PASTS), profiled
    reference = _session(src)
    wants = {p: (f := _feeds(reference, p), reference.run(None, f)) for p in PASTS}
    applied = set()
    for s in REGISTRY.strategies_for("attention", "int8"):
        if s.name == "default":
            continue
        models = list(_rewritten(prep, s.name).values())
        if models == [None]:
            continue
        [model] = models
        assert model is not None
        applied.add(s.name)
        if s.name in CACHED:
            kernel = next(n for n in model.graph.node if n.op_type == CACHED[s.name])
            assert list(kernel.output)[1:] == ["present_key_0", "present_value_0"]
            assert not any(n.op_type == "Concat" for n in model.graph.node if "aoe/" in n.name)
        session = _session(model)
        for past, (feeds, want) in wants.items():
            err, cos = _worst(want, session.run(None, feeds))
            if s.precision == "exact":
                assert err <= 1e-4, (s.name, past, err)
            else:
                assert cos >= 0.999, (s.name, past, cos)
    assert applied == {*CACHED, "packed_qkv", "int8_packed_qkv"}


def _decoder(
    kv: int = N,
    dynamo: bool = False,
    rotary: bool = False,
    steps: int | None = 1,
    opaque: bool = False,
    opset: int = 17,
) -> onnx.ModelProto:
    """One decode step of an attention block as exporters write it with past: x [B,
    `steps`, H] (more than one: a prompt's continuation), `kv` K/V heads appended to past_key/past_value [B, kv, past, D], the presents
    repeated for N / kv query heads each (Unsqueeze, Expand, Reshape, as LLaMA's
    repeat_kv), then the output projection; y and the presents out. `dynamo`: as torch's
    dynamo export writes transformers' GPT-2 with a cache: Kᵀ through 3-D with targets
    computed from the present's Shape, and a causal mask [1, 1, steps, past + steps] made
    at run time from the past's length (Range, LessOrEqual, Where(keep, 0, -inf)). `rotary`: rotary
    embeddings on Q and K before the cache, as LLaMA's and Qwen2's exports compute them:
    the tables at run time from this step's position (the past's length) and constant
    inverse frequencies. `opaque`: the dynamo form's first Kᵀ target passes an Identity,
    which no shape computation the recognizer takes into a block has. `steps` None: as
    many new positions as x has (`seq`, dynamic; not with `dynamo`)."""
    g = G(seed=7, opset=opset)
    x = g.input("x", [B, "seq" if steps is None else steps, H])
    span = -1 if steps is None else steps
    pasts = [g.input(f"past_{w}", [B, kv, "past", D]) for w in ("key", "value")]

    def heads(n: int) -> str:
        y = g.n("Reshape", linear(g, x, H, n * D), g.t(np.array([B, span, n, D], np.int64)))
        return g.n("Transpose", y, perm=[0, 2, 1, 3])

    def repeat(t: str) -> str:
        if kv == N:
            return t
        wide = g.n(
            "Expand",
            g.n("Unsqueeze", t, g.t(np.array([2], np.int64))),
            g.t(np.array([1, 1, N // kv, 1, 1], np.int64)),
        )
        return g.n("Reshape", wide, g.t(np.array([B, N, -1, D], np.int64)))

    def dims(shape: str, *axes: int) -> str:
        return g.n(
            "Concat",
            *(g.n("Slice", shape, g.t(np.array([a])), g.t(np.array([a + 1]))) for a in axes),
            axis=0,
        )

    def rotate(t: str) -> str:
        if not rotary:
            return t
        half, big, last = (g.t(np.array([v], np.int64)) for v in (D // 2, 2**31 - 1, -1))
        turned = g.n(
            "Concat",
            g.n("Neg", g.n("Slice", t, half, big, last)),
            g.n("Slice", t, g.t(np.array([0], np.int64)), half, last),
            axis=-1,
        )
        return g.n("Add", g.n("Mul", t, cos), g.n("Mul", turned, sin))

    q, new_k = heads(N), heads(kv)
    length = g.n("Squeeze", dims(g.n("Shape", pasts[0]), 2), g.t(np.array([0])))
    if steps is None:
        count = g.n("Squeeze", dims(g.n("Shape", x), 1), g.t(np.array([0])))
        new = g.n("Range", g.t(np.array(0)), count, g.t(np.array(1)))
    else:
        new = g.t(np.arange(steps))
    positions = g.n("Add", new, length)  # this step's
    if rotary:  # made after the projections, as the exports order them
        inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
        position = g.n("Cast", positions, to=TensorProto.FLOAT)
        freqs = g.n("Mul", g.n("Unsqueeze", position, g.t(np.array([1]))), g.t(inv[None]))
        emb = g.n("Concat", freqs, freqs, axis=-1)  # [steps, D]: this step's rows
        cos, sin = (g.n("Unsqueeze", g.n(op, emb), g.t(np.array([0, 1]))) for op in ("Cos", "Sin"))
    q = rotate(q)
    presents = [g.n("Concat", pasts[0], rotate(new_k), axis=2)]
    presents.append(g.n("Concat", pasts[1], heads(kv), axis=2))
    k, v = (repeat(p) for p in presents)
    if dynamo:
        shape = g.n("Shape", k)
        flat = g.n("Concat", g.t(np.array([-1])), dims(shape, 2, 3), axis=0)
        if opaque:
            flat = g.n("Identity", flat)
        kt = g.n("Transpose", g.n("Reshape", k, flat), perm=[0, 2, 1])
        kt = g.n("Reshape", kt, dims(shape, 0, 1, 3, 2))
    else:
        kt = g.n("Transpose", k, perm=[0, 1, 3, 2])
    s = g.n("Div", g.n("MatMul", q, kt), g.f(np.sqrt(D)))
    if dynamo:
        total = g.n("Add", length, g.t(np.array(steps)))
        keys = g.n("Range", g.t(np.array(0)), total, g.t(np.array(1)))
        keep = g.n(
            "LessOrEqual",
            g.n("Unsqueeze", keys, g.t(np.array([0]))),
            g.n("Unsqueeze", positions, g.t(np.array([1]))),
        )
        keep = g.n("Unsqueeze", keep, g.t(np.array([0, 1])))
        s = g.n("Add", s, g.n("Where", keep, g.f(0.0), g.f(-np.inf)))
    c = g.n("Transpose", g.n("MatMul", g.n("Softmax", s, axis=-1), v), perm=[0, 2, 1, 3])
    model = g.model(
        linear(g, g.n("Reshape", c, g.t(np.array([B, span, H], np.int64))), H, H),
        shape=(B, "seq" if steps is None else steps, H),
    )
    model.graph.output.extend(
        helper.make_tensor_value_info(p, TensorProto.FLOAT, [B, kv, "total", D]) for p in presents
    )
    return model


@pytest.mark.parametrize("opset", [17, 14])
def test_grouped_kv_heads_with_a_cache_run_on_group_query_attention(
    opset: int, tmp_path: Path
) -> None:
    """K/V heads shared by groups of query heads, repeated after the cache: the block is
    a task with its presents, GroupQueryAttention takes the cache with kv_num_heads
    K/V heads (seqlens_k and the total length computed from shapes: Shape's start and
    end from opset 15, Gather before), MultiHeadAttention (a present per query head)
    declines, and the outputs stay the block's at every past."""
    src = tmp_path / "gqa.onnx"
    onnx.save(_decoder(kv=2, opset=opset), src)
    prep = prepare(src, tmp_path / "prep")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    presents = [o.name for o in prep.model.graph.output][1:]
    assert list(task.outputs[1:]) == presents
    assert _rewritten(prep, "multihead_attention") == {task.id: None}
    [model] = _rewritten(prep, "group_query_attention").values()
    assert model is not None
    [gqa] = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
    assert (attrs["num_heads"], attrs["kv_num_heads"]) == (N, 2)
    assert list(gqa.input[3:5]) == ["past_key", "past_value"] and list(gqa.output[1:]) == presents
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and "aoe/" in n.name]
    assert len(gathers) == (3 if opset < 15 else 0), [n.name for n in gathers]
    reference, session = _session(src), _session(model)
    for past in (0, 5, 300):
        feeds = _feeds(reference, past)
        err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
        assert err <= 1e-4, (past, err)


@pytest.mark.parametrize("steps", [1, 3])
def test_the_dynamo_exports_run_time_shapes_and_mask_stay_with_the_cached_block(
    steps: int, tmp_path: Path
) -> None:
    """torch's dynamo export of transformers' GPT-2 with a cache: Kᵀ reshaped to targets
    computed from the present's Shape, and a causal mask over past + S keys computed
    from the past's length (whose static shape normalization works out through the
    Range). The shape nodes are the block's own, the mask goes to the kernels as
    attention_bias as it is, and the outputs stay the block's at every past, for one
    new position and for a prompt's continuation (3)."""
    src = tmp_path / "dynamo.onnx"
    onnx.save(_decoder(dynamo=True, steps=steps), src)
    prep = prepare(src, tmp_path / "prep")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    by = {n.name: n for n in prep.model.graph.node}
    ops = [by[n].op_type for n in task.node_names]
    assert ops.count("Shape") == 1 and ops.count("Where") == 1, ops
    assert list(task.outputs[1:]) == [o.name for o in prep.model.graph.output][1:]
    reference = _session(src)
    for name in ("multihead_attention", "group_query_attention"):
        [model] = _rewritten(prep, name).values()
        assert model is not None, name
        session = _session(model)
        for past in (0, 5, 300):
            feeds = _feeds(reference, past)
            err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
            assert err <= 1e-4, (name, past, err)


def test_a_block_that_would_read_what_its_own_presents_make_is_no_task(tmp_path: Path) -> None:
    """A Kᵀ target computed from the present by a node the block cannot take in (here an
    Identity) is an input made from the block's own output: its rewrite, at the block's
    first node, would read what it has not yet written. Such a block is no task; the
    model's other subgraphs still are."""
    src = tmp_path / "opaque.onnx"
    onnx.save(_decoder(dynamo=True, opaque=True), src)
    prep = prepare(src, tmp_path / "prep")
    assert [t.family for t in partition(prep.model, prep.ctx, "sgat")] == []
    assert {t.family for t in partition(prep.model, prep.ctx, "opat")} == {"matmul", "matmul_act"}


def test_rotary_tables_of_as_many_rows_as_new_tokens_hold_at_a_prompt_and_at_a_step(
    tmp_path: Path,
) -> None:
    """A step whose new tokens are dynamic, rotated by run-time tables, prepared at one
    count: its kernels read the count of this step's rows at run time (never the
    prepared one), so a prompt of 5 over a past and one token over it give the block's
    outputs."""
    src = tmp_path / "rotary_seq.onnx"
    onnx.save(_decoder(kv=2, rotary=True, steps=None), src)
    prep = prepare(src, tmp_path / "prep")
    reference = _session(src)
    [model] = _rewritten(prep, "group_query_attention").values()
    assert model is not None
    session = _session(model)
    rng = np.random.default_rng(0)
    for steps, past in ((5, 0), (5, 40), (1, 41), (3, 300)):
        feeds = {"x": rng.standard_normal((B, steps, H)).astype(np.float32)}
        for name in ("past_key", "past_value"):
            feeds[name] = rng.standard_normal((B, 2, past, D)).astype(np.float32)
        err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
        assert err <= 1e-4, (steps, past, err)


@pytest.mark.parametrize("kv", [N, 2])
def test_rotary_tables_computed_from_the_past_run_on_rotary_embedding_before_the_kernels(
    kv: int, tmp_path: Path
) -> None:
    """LLaMA's and Qwen2's exports with a cache rotate Q and K by tables computed at run
    time from this step's position: the block is recognized with them, its kernels get
    RotaryEmbedding over this step's rows (MultiHeadAttention with a K/V head per query
    head, GroupQueryAttention for either), and the outputs stay the block's at every
    past, where positions differ at each."""
    src = tmp_path / "rotary.onnx"
    onnx.save(_decoder(kv=kv, rotary=True), src)
    prep = prepare(src, tmp_path / "prep")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    assert list(task.outputs[1:]) == [o.name for o in prep.model.graph.output][1:]
    reference = _session(src)
    names = ["group_query_attention", *(["multihead_attention"] if kv == N else [])]
    for name in names:
        [model] = _rewritten(prep, name).values()
        assert model is not None, name
        assert [n.op_type for n in model.graph.node].count("RotaryEmbedding") == 2
        session = _session(model)
        for past in (0, 5, 300):
            feeds = _feeds(reference, past)
            err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
            assert err <= 1e-4, (name, past, err)


def test_a_bank_entry_on_a_cached_kernel_compiles_into_a_model_for_every_past(
    decoder: tuple[Path, Prepared], tmp_path: Path
) -> None:
    """`aoe compile` applies a bank's GroupQueryAttention entry to both layers of the
    decoder as the user has it (past dynamic), and the compiled model decodes at past
    lengths the tuner never saw with the input's logits and presents."""
    src, prep = decoder
    [att] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    bank = make_bank(
        tmp_path / "bank",
        [
            rec(
                sig=att.signature,
                strategy="group_query_attention",
                family="attention",
                winner=Measured(8.0, 0.01, 30, 7.5),
                baseline=Measured(10.0, 0.01, 30, 9.5),
            )
        ],
    )
    out = tmp_path / "compiled.onnx"
    r = run_aoe("compile", str(src), "-o", str(out), "--bank", str(bank), "--json")
    assert r.returncode == 0, r.stderr
    status = {t["task_id"]: (t["status"], t["strategy"]) for t in json.loads(r.stdout)["tasks"]}
    assert status[att.id] == ("hit", "group_query_attention")
    compiled = onnx.load(str(out))
    assert [n.op_type for n in compiled.graph.node].count("GroupQueryAttention") == 2
    reference, session = _session(src), _session(out)
    for past in PASTS:
        feeds = _feeds(reference, past)
        err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
        assert err <= 1e-4, (past, err)


@pytest.mark.slow
def test_an_sgat_job_on_a_decoder_measures_the_cached_kernels(
    decoder: tuple[Path, Prepared], tmp_path: Path
) -> None:
    """A short SGAT job on the decoder tunes its attention blocks as one task of two
    instances, measures the cached kernels within the exact gate, and ships a model
    that runs at past lengths it never measured with the input's outputs."""
    src, _ = decoder
    r = run_aoe(
        "tune",
        str(src),
        "--job-type",
        "sgat",
        "--budget",
        "3",
        "--parallel",
        "1",
        "--no-progress",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    [path] = (tmp_path / "out").glob("aoe_result_*.json")
    doc = json.loads(path.read_text())
    [att] = [t for t in doc["tasks"] if t["family"] == "attention"]
    assert att["instances"] == 2 and "Concat+Concat" in att["op_type"], att
    measured = {c["strategy"]: c for c in att["candidates"]}
    assert {"multihead_attention", "group_query_attention"} <= set(measured), measured
    for name in ("multihead_attention", "group_query_attention"):
        assert measured[name]["ok"] and measured[name]["cosine"] >= 0.9999, measured[name]
    import aoe

    reference, session = _session(src), aoe.session(doc["tuned_model"])
    for past in PASTS:
        feeds = _feeds(reference, past)
        err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
        assert err <= 1e-4, (past, err)


def _transformers_step(kind: str, path: Path) -> int:
    """One decode step of a one-layer transformers model with a cache (GPT-2, or Qwen2
    with 2 K/V heads for 4 query heads and rotary embeddings), exported by torch's dynamo
    exporter with the past dynamic, to `path`: input_ids [1, 1], past_key/past_value in,
    logits and present_key/present_value out. Returns the K/V heads."""
    import warnings

    import torch
    import transformers
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    model: torch.nn.Module
    if kind == "gpt2":
        gpt2 = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=1, n_head=4)
        model, kv = transformers.GPT2LMHeadModel(gpt2), 4
    else:
        qwen2 = transformers.Qwen2Config(
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        )
        model, kv = transformers.Qwen2ForCausalLM(qwen2), 2

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model.eval()

        def forward(self, input_ids, past_key, past_value):
            cache = DynamicCache()
            cache.update(past_key, past_value, 0)
            out = self.inner(input_ids=input_ids, past_key_values=cache, use_cache=True)
            layer = out.past_key_values.layers[0]
            return out.logits, layer.keys, layer.values

    past = torch.randn(1, kv, 8, 16)
    length = torch.export.Dim("past", max=500)
    with warnings.catch_warnings():  # the exporter's and transformers' own deprecations
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            Step(),
            (torch.tensor([[3]]), past, past.clone()),
            dynamo=True,
            dynamic_shapes=(None, {2: length}, {2: length}),
            input_names=["input_ids", "past_key", "past_value"],
            output_names=["logits", "present_key", "present_value"],
            verbose=False,
        )
        program.save(str(path))
    return kv


@pytest.mark.long
@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_transformers_decode_steps_run_on_the_cached_kernels(kind: str, tmp_path: Path) -> None:
    """What the synthetic blocks above stand for, from transformers' own models as torch
    exports them with a cache: GPT-2 (packed Gemm, Kᵀ through 3-D, a run-time mask) and
    Qwen2 (grouped K/V heads, rotary tables from the past's length). The block is a task
    with its presents, and the cached kernels give the logits and presents at past 0 and
    at lengths the profile never had."""
    pytest.importorskip("transformers")
    src = tmp_path / f"{kind}.onnx"
    kv = _transformers_step(kind, src)
    prep = prepare(src, tmp_path / "prep")
    [task] = [t for t in partition(prep.model, prep.ctx, "sgat") if t.family == "attention"]
    assert task.outputs[1:] == ("present_key", "present_value")
    reference = _session(src)
    names = ["group_query_attention", *(["multihead_attention"] if kv == N else [])]
    for name in names:
        [model] = _rewritten(prep, name).values()
        assert model is not None, name
        session = _session(model)
        for past in (0, 16, 300):
            feeds = _feeds(reference, past)
            err, _ = _worst(reference.run(None, feeds), session.run(None, feeds))
            assert err <= 1e-4, (name, past, err)

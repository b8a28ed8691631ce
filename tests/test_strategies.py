"""Tests for partitioning, task surgery and the ORT strategy registry.

Every strategy that applies to a task of a sample model must leave the whole model's
outputs unchanged (precision "exact"); every task also runs alone as its own model.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from aoe.errors import OptionError
from aoe.partition import Task, partition
from aoed import samples
from aoed.backends.ort.catalog import build_registry
from aoed.engine.prep import Prepared, make_inputs, prepare
from aoed.engine.registry import DEFAULT, Strategy, StrategyRegistry
from aoed.engine.tasks import Constants, Rewrite, TaskView, apply_rewrites, task_model

REGISTRY = build_registry()

# Every sample, plus the cnn with its node names erased (prep must name the nodes).
NAMES = [*sorted(samples.SAMPLES), "cnn_unnamed"]

# Each of these must apply to at least one task of the samples.
EXPECTED = {"gemm_pretransposed", "fused_gemm", "gemm_as_matmul", "fused_conv", "conv1x1_as_matmul"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Prepared]:
    d = tmp_path_factory.mktemp("strategies")
    out = {}
    for name in NAMES:
        src = d / f"{name}.onnx"
        model = samples.build(name.removesuffix("_unnamed"))
        if name.endswith("_unnamed"):
            for node in model.graph.node:
                node.name = ""
        samples.save(model, src)
        out[name] = prepare(src, d / f"work_{name}")
    return out


def _all_tasks(tasks: list[Task]) -> list[Task]:
    return [t for rep in tasks for t in (rep, *rep.twins)]


def _view(prep: Prepared, task: Task, consts: Constants) -> TaskView:
    by_name = {n.name: n for n in prep.model.graph.node}
    return TaskView(
        nodes=[by_name[n] for n in task.node_names],
        consts=consts,
        infos=prep.ctx.tensors,
        opset=prep.ctx.opset(""),
        prefix=f"aoe/{task.id}",
    )


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_exact(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, what
        scale = float(np.abs(w).max())
        assert scale > 0, what
        assert float(np.abs(g - w).max()) <= 1e-4 * scale, what


def _exact(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    try:
        _assert_exact(got, want, "")
    except AssertionError:
        return False
    return True


def _consts(prep: Prepared) -> Constants:
    return Constants(prep.model.graph, list(prep.model.opset_import))


def _applied(prep: Prepared) -> list[tuple[Task, Strategy, Rewrite]]:
    consts = _consts(prep)
    found = []
    for task in _all_tasks(partition(prep.model, prep.ctx)):
        view = _view(prep, task, consts)
        for strat in REGISTRY.strategies_for(task.family):
            rw = strat.apply(view)
            if rw is not None:
                found.append((task, strat, rw))
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_applicable_strategy_keeps_the_outputs(
    prepared: dict[str, Prepared], name: str
) -> None:
    """Each strategy is applied to every task it fits at once, one model (one session) per
    strategy: a ResNet's 21 default rewrites are one run, not 21. When a model's outputs
    change, each of its rewrites is run alone to name the task that changed them."""
    prep = prepared[name]
    feeds = make_inputs(prep.inputs, seed=1)
    ref = _run(prep.model, feeds)
    applied = _applied(prep)
    assert applied, f"{name}: no task took any strategy"
    by_strategy: dict[str, list[tuple[Task, Rewrite]]] = {}
    for task, strat, rw in applied:
        by_strategy.setdefault(strat.name, []).append((task, rw))
    for strategy, rewrites in by_strategy.items():
        rewritten = apply_rewrites(prep.model, {task.node_names: rw for task, rw in rewrites})
        onnx.checker.check_model(rewritten)
        if strategy != DEFAULT:  # every other strategy replaces the anchor
            left = {n.name for n in rewritten.graph.node}
            for task, _rw in rewrites:
                assert task.node_names[0] not in left, f"{name}: {strategy} on {task.id}"
        if _exact(_run(rewritten, feeds), ref):
            continue
        for task, rw in rewrites:
            alone = apply_rewrites(prep.model, {task.node_names: rw})
            _assert_exact(_run(alone, feeds), ref, f"{name}: {strategy} on {task.id}")
        raise AssertionError(
            f"{name}: {strategy} changed the outputs on {len(rewrites)} tasks together, on none alone"
        )


def test_expected_strategies_each_apply_somewhere(prepared: dict[str, Prepared]) -> None:
    seen = {strat.name for prep in prepared.values() for _task, strat, _rw in _applied(prep)}
    missing = EXPECTED - seen
    assert not missing, f"never applied: {sorted(missing)}"
    assert DEFAULT in seen


def test_all_rewrites_together_keep_the_outputs(prepared: dict[str, Prepared]) -> None:
    for name, prep in prepared.items():
        feeds = make_inputs(prep.inputs, seed=2)
        ref = _run(prep.model, feeds)
        # The last applicable strategy of every task at once (twins included).
        rewrites = {task.node_names: rw for task, _strat, rw in _applied(prep)}
        rewritten = apply_rewrites(prep.model, rewrites)
        onnx.checker.check_model(rewritten)
        _assert_exact(_run(rewritten, feeds), ref, name)
        # Weights (and nodes that computed them) no node reads any more are gone.
        used = {i for n in rewritten.graph.node for i in n.input}
        assert all(t.name in used for t in rewritten.graph.initializer), name
        outputs = {o.name for o in rewritten.graph.output}
        assert all(
            any(o in used or o in outputs for o in n.output) for n in rewritten.graph.node
        ), name


def test_untouched_weights_and_nodes_stay_as_the_input_had_them(
    prepared: dict[str, Prepared],
) -> None:
    prep = prepared["legacy_cnn"]
    consts = _consts(prep)
    by_task = {t.node_names[0]: t for t in _all_tasks(partition(prep.model, prep.ctx))}
    conv1 = by_task["conv1"]  # its weight is computed: Reshape(Constant) * scale
    weight = next(n for n in prep.model.graph.node if n.name == "conv1").input[1]
    assert weight in consts and not consts.stored(weight)
    rw = REGISTRY.get("conv", "fused_conv").apply(_view(prep, conv1, consts))
    assert rw is not None
    rewritten = apply_rewrites(prep.model, {conv1.node_names: rw})
    # The nodes that only computed conv1's weight went with it...
    names = {n.name for n in rewritten.graph.node}
    assert not {"conv1/weight/Reshape", "conv1/weight/Mul", "conv1/weight/Constant"} & names
    # ...and everything the rewrite did not touch is byte for byte what it was.
    before = {t.name: t.SerializeToString() for t in prep.model.graph.initializer}
    after = {t.name: t.SerializeToString() for t in rewritten.graph.initializer}
    for name, data in after.items():
        if not name.startswith("aoe/"):
            assert before[name] == data, name
    kept = [n for n in prep.model.graph.node if n.name not in conv1.node_names and n.name in names]
    assert kept and all(n in rewritten.graph.node for n in kept)
    feeds = make_inputs(prep.inputs)
    _assert_exact(_run(rewritten, feeds), _run(prep.model, feeds), "legacy_cnn fused_conv")


@pytest.mark.parametrize("name", NAMES)
def test_task_models_check_and_run(prepared: dict[str, Prepared], name: str) -> None:
    prep = prepared[name]
    consts = _consts(prep)
    tasks = _all_tasks(partition(prep.model, prep.ctx))
    assert tasks
    for task in tasks:
        tm = task_model(prep.model, task, consts, prep.ctx.tensors)
        onnx.checker.check_model(tm, full_check=True)
        inits = {t.name for t in tm.graph.initializer}
        assert [i.name for i in tm.graph.input] == [n for n in task.inputs if n not in consts]
        assert {n for n in task.inputs if n in consts} == inits
        infos = {i.name: prep.ctx.tensors[i.name] for i in tm.graph.input}
        outs = _run(tm, make_inputs(infos))
        assert [o.shape for o in outs] == [prep.ctx.tensors[o].shape for o in task.outputs]
        assert all(np.all(np.isfinite(o)) for o in outs)


def test_task_model_matches_the_whole_model(prepared: dict[str, Prepared]) -> None:
    # The mlp's first task reads the graph input, so both models see the same data.
    prep = prepared["mlp"]
    consts = _consts(prep)
    task = partition(prep.model, prep.ctx)[0]
    assert task.inputs[0] == "input"
    feeds = make_inputs(prep.inputs)
    (got,) = _run(task_model(prep.model, task, consts, prep.ctx.tensors), feeds)
    w = consts[task.inputs[1]]
    b = consts[task.inputs[2]] if len(task.inputs) > 2 else 0
    want = np.maximum(feeds["input"] @ w + b, 0)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


def _hand_built(kind: str) -> onnx.ModelProto:
    """Small models whose matmul tasks take shapes the samples do not have."""
    rng = np.random.default_rng(5)

    def const(name: str, shape: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    x_shape, y_shape = [4, 4], [4, 4]
    if kind == "matmul_column_bias":  # [4, 1] adds one value per row, not per column
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Add", ["h", "b"], ["y"], name="add"),
        ]
        inits = [const("w", [4, 4]), const("b", [4, 1])]
    elif kind == "gemm_column_bias":
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm")]
        inits = [const("w", [4, 4]), const("b", [4, 1])]
    elif kind == "matmul_rank_raising_bias":  # [1, 1, 4] makes the result 3-D
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Add", ["b", "h"], ["y"], name="add"),
        ]
        inits = [const("w", [4, 4]), const("b", [1, 1, 4])]
        y_shape = [1, 4, 4]
    elif kind == "conv_gemm_leaky":  # LeakyRelu(0.3) after a 1x1 Conv and after a Gemm
        nodes = [
            helper.make_node("Conv", ["x", "cw", "cb"], ["c"], name="conv", kernel_shape=[1, 1]),
            helper.make_node("LeakyRelu", ["c"], ["ca"], name="conv_act", alpha=0.3),
            helper.make_node("Flatten", ["ca"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "gw", "gb"], ["g"], name="gemm", transB=1),
            helper.make_node("LeakyRelu", ["g"], ["y"], name="gemm_act", alpha=0.3),
        ]
        inits = [const("cw", [6, 3, 1, 1]), const("cb", [6])]
        inits += [const("gw", [5, 96]), const("gb", [5])]
        x_shape, y_shape = [1, 3, 4, 4], [1, 5]
    else:  # "matmul_3d": a 3-D MatMul + Relu, then MatMul + row bias + LeakyRelu
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu1"),
            helper.make_node("MatMul", ["r", "w2"], ["h2"], name="mm2"),
            helper.make_node("Add", ["b2", "h2"], ["h3"], name="add2"),
            helper.make_node("LeakyRelu", ["h3"], ["y"], name="act2", alpha=0.2),
        ]
        inits = [const("w", [16, 32]), const("w2", [32, 8]), const("b2", [1, 8])]
        x_shape, y_shape = [2, 5, 16], [2, 5, 8]
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "kind",
    [
        "matmul_column_bias",
        "gemm_column_bias",
        "matmul_rank_raising_bias",
        "matmul_3d",
        "conv_gemm_leaky",
    ],
)
def test_strategies_keep_outputs_of_unusual_matmuls(tmp_path: Path, kind: str) -> None:
    src = tmp_path / f"{kind}.onnx"
    onnx.save(_hand_built(kind), str(src))
    prep = prepare(src, tmp_path / "work")
    feeds = make_inputs(prep.inputs)
    ref = _run(prep.model, feeds)
    applied = _applied(prep)
    for task, strat, rw in applied:
        rewritten = apply_rewrites(prep.model, {task.node_names: rw})
        onnx.checker.check_model(rewritten)
        _assert_exact(_run(rewritten, feeds), ref, f"{kind}: {strat.name} on {task.id}")
    names = {strat.name for _t, strat, _rw in applied}
    if kind == "matmul_3d":
        assert {"gemm_pretransposed", "fused_gemm", "fused_matmul_transb"} <= names
    elif kind == "conv_gemm_leaky":
        assert {"fused_conv", "conv1x1_as_matmul", "fused_gemm", "gemm_as_matmul"} <= names
    else:  # a bias that is not one value per output column fits no rewrite
        assert names == {DEFAULT}


def test_rewrites_keep_weights_that_only_subgraphs_read(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)

    def const(name: str, shape: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    def branch(op: str, out: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["y", "k"], [out], name=f"branch_{op}")],
            f"branch_{op}",
            [],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 4])],
        )

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node(
            "If",
            ["cond"],
            ["z"],
            name="if",
            then_branch=branch("Add", "t"),
            else_branch=branch("Sub", "e"),
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "if_model",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])],
        initializer=[const("w", [8, 4]), const("k", [2, 4])],  # k: read only by the branches
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "if_model.onnx"))
    prep = prepare(tmp_path / "if_model.onnx", tmp_path / "work")
    applied = [a for a in _applied(prep) if a[1].name != DEFAULT]
    assert applied
    for cond in (True, False):
        feeds = {**make_inputs(prep.inputs), "cond": np.array(cond)}
        ref = _run(prep.model, feeds)
        for task, strat, rw in applied:
            rewritten = apply_rewrites(prep.model, {task.node_names: rw})
            assert "k" in {t.name for t in rewritten.graph.initializer}
            onnx.checker.check_model(rewritten, full_check=True)
            _assert_exact(_run(rewritten, feeds), ref, f"{strat.name} on {task.id}")


# --------------------------------------------------------------------------- partition


def test_cnn_blocks_are_twins(prepared: dict[str, Prepared]) -> None:
    prep = prepared["cnn"]
    tasks = partition(prep.model, prep.ctx)
    with_twins = [t for t in tasks if t.twins]
    assert with_twins
    for rep in with_twins:
        for twin in rep.twins:
            assert twin.signature.digest == rep.signature.digest
            assert twin.family == rep.family
            assert twin.node_names != rep.node_names
    # Representatives have distinct signatures.
    digests = [t.signature.digest for t in tasks]
    assert len(digests) == len(set(digests))
    pairs = {(t.node_names[0], w.node_names[0]) for t in tasks for w in t.twins}
    assert ("block1/conv1", "block2/conv1") in pairs


@pytest.mark.parametrize("name", NAMES)
def test_each_node_is_in_at_most_one_task(prepared: dict[str, Prepared], name: str) -> None:
    prep = prepared[name]
    tasks = _all_tasks(partition(prep.model, prep.ctx))
    counts = Counter(n for t in tasks for n in t.node_names)
    assert counts and max(counts.values()) == 1
    ids = [t.id for t in tasks]
    assert len(ids) == len(set(ids))
    graph_nodes = {n.name for n in prep.model.graph.node}
    assert set(counts) <= graph_nodes
    for t in tasks:
        assert t.family in ("matmul", "conv", "matmul_act")
        ops = {n.name: n.op_type for n in prep.model.graph.node}
        assert t.signature.op_type == "+".join(ops[n] for n in t.node_names)


def test_conv_tasks_take_their_batch_norm_along(prepared: dict[str, Prepared]) -> None:
    tasks = _all_tasks(partition(prepared["cnn"].model, prepared["cnn"].ctx))
    ops = {t.node_names[0]: t.signature.op_type for t in tasks}
    assert ops["stem/conv"] == "Conv+BatchNormalization+Relu"
    assert ops["block1/conv2"] == "Conv+BatchNormalization"  # a residual Add follows: not fused
    assert ops["head/fc"] == "Gemm"


# --------------------------------------------------------------------------- registry


def _noop(view: TaskView) -> Rewrite:
    return Rewrite(tuple(view.nodes))


def test_plugin_module_registers_into_the_registry_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = "aoed_test_plugin_strategy"
    (tmp_path / f"{module}.py").write_text(
        "from aoed.engine.registry import Strategy\n"
        "from aoed.engine.tasks import Rewrite\n"
        "def register(registry):\n"
        "    registry.register(Strategy('plugin_identity', 'conv', 'exact', lambda v: Rewrite(tuple(v.nodes))))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry = build_registry([f" {module} ", ""])
        assert module in sys.modules
        assert "plugin_identity" in [s.name for s in registry.strategies_for("conv")]
        assert "plugin_identity" not in [s.name for s in registry.strategies_for("matmul")]
        assert registry.get("conv", "plugin_identity").family == "conv"
        # Registries are values: the one built without the plugin does not have it.
        assert "plugin_identity" not in [s.name for s in REGISTRY.strategies_for("conv")]
    finally:
        sys.modules.pop(module, None)


def test_duplicate_registration_is_refused() -> None:
    registry = build_registry()
    with pytest.raises(ValueError, match="fused_gemm"):
        registry.register(Strategy("fused_gemm", "matmul", "exact", _noop))
    # The same object again is not a duplicate; a new name in the family is fine.
    existing = registry.get("matmul", "fused_gemm")
    assert registry.register(existing) is existing
    fresh = registry.register(Strategy("noop_for_test", "matmul", "exact", _noop))
    assert fresh in list(registry.strategies_for("matmul"))
    with pytest.raises(KeyError, match="nope"):
        registry.get("matmul", "nope")


@pytest.mark.parametrize(
    "module,needle", [("aoed_no_such_plugin_module_xyz", "cannot import"), ("json", "no register")]
)
def test_broken_plugin_is_an_option_error(module: str, needle: str) -> None:
    with pytest.raises(OptionError, match=needle) as err:
        StrategyRegistry(["matmul"]).load_plugins([module])
    assert module in str(err.value)


def test_registry_families_start_with_the_default() -> None:
    for family in ("matmul", "conv"):
        names = [s.name for s in REGISTRY.strategies_for(family)]
        assert names[0] == DEFAULT
        assert all(s.precision == "exact" for s in REGISTRY.strategies_for(family))
    matmul = {s.name for s in REGISTRY.strategies_for("matmul")}
    assert matmul >= {"gemm_pretransposed", "fused_gemm", "gemm_as_matmul"}
    assert {s.name for s in REGISTRY.strategies_for("conv")} >= {"fused_conv", "conv1x1_as_matmul"}
    assert not REGISTRY.has_choice("matmul_act", "exact") and REGISTRY.has_choice(
        "matmul_act", "int8"
    )

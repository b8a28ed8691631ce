"""The light client: what a compiler imports to look tasks up, and that it finds, in the
model a user actually has, the tasks the tuner tuned."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aoe.bank import CUSTOM, ModelTasks, open_bank
from aoe.partition import partition
from aoed import samples
from aoed.engine.prep import prepare

from .bank_util import make_bank, rec

HEAVY = ("trio", "onnxruntime", "aoed", "grpc")


def test_lookups_import_neither_trio_nor_onnxruntime_nor_the_daemon(tmp_path: Path) -> None:
    model = samples.save(samples.cnn(), tmp_path / "cnn.onnx")
    bank = make_bank(tmp_path / "bank", [rec()])
    code = textwrap.dedent(f"""
        import sys, onnx
        from aoe.signature import ModelContext, bank_key, device_fingerprint, task_signature
        from aoe.partition import ModelTasks, partition
        from aoe.bank import open_bank
        m = onnx.load({str(model)!r})
        tasks = ModelTasks(m)
        assert len(tasks) > 0
        ctx = ModelContext(tasks.model)
        assert partition(tasks.model, ctx)
        node = next(n for n in m.graph.node if n.op_type == "Conv")
        sig = tasks.signature(node)
        assert sig is not None and sig.digest == task_signature([n for n in tasks.model.graph.node
                                                                 if n.name in tasks.tasks[0].node_names], ctx).digest
        with open_bank({str(bank)!r}, use_env=False) as bank:
            bank.lookup(bank_key(sig.digest, device_fingerprint().digest, "exact"))
            bank.lookup_node(node, tasks)
        print(sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _exported_mlp() -> onnx.ModelProto:
    """An MLP as real exporters write them: unnamed nodes, a dynamic batch, opset 11, and
    weights that nodes compute (a transposed initializer, an Identity, an fp16 Cast)."""
    rng = np.random.default_rng(11)

    def init(name: str, shape: list[int], dtype=np.float32) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(dtype), name)

    nodes = [
        helper.make_node("Transpose", ["w1_t"], ["w1"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Identity", ["w2_shared"], ["w2"]),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"]),
        helper.make_node("Add", ["b2", "h2"], ["a2"]),
        helper.make_node("Tanh", ["a2"], ["r2"]),
        helper.make_node("Cast", ["w3_half"], ["w3"], to=TensorProto.FLOAT),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "exported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        [
            init("w1_t", [128, 64]),
            init("b1", [128]),
            init("w2_shared", [128, 32]),
            init("b2", [32]),
            init("w3_half", [32, 10], np.float16),
            init("b3", [10]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    return model


def _unnamed(model: onnx.ModelProto) -> onnx.ModelProto:
    for node in model.graph.node:
        node.name = ""
    return model


CASES = {
    "exported_mlp": (_exported_mlp, {"x": (4, 64)}),
    "legacy_mlp": (samples.legacy_mlp, {}),  # opset 9, initializers listed as inputs
    "legacy_cnn": (samples.legacy_cnn, {}),  # a conv weight computed by nodes
    "cnn_unnamed": (lambda: _unnamed(samples.cnn()), {}),  # Conv + BatchNormalization + Relu
    "transformer": (samples.transformer, {}),
    "mlp_dynamic": (lambda: samples.mlp(dynamic_batch=True), {"input": (2, 256)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_model_a_user_has_finds_the_tasks_the_tuner_tuned(tmp_path: Path, name: str) -> None:
    build, shapes = CASES[name]
    src = samples.save(build(), tmp_path / f"{name}.onnx")
    prep = prepare(src, tmp_path / "prep", shapes)  # what the tuner tunes
    tuned = [t for rep in partition(prep.model, prep.ctx) for t in (rep, *rep.twins)]
    assert tuned, "the tuner found no task"
    records = [rec(sig=t.signature, strategy=f"s_{t.signature.digest[:8]}") for t in tuned]
    bank = make_bank(tmp_path / "bank", records)

    original = onnx.load(str(src))  # what a compiler holds: not normalized, maybe unnamed
    index = ModelTasks(original, shapes)
    assert {t.signature.digest for t in index.tasks} == {t.signature.digest for t in tuned}
    by_output = {n.output[0]: n for n in original.graph.node if n.output}
    prep_nodes = {n.name: n for n in prep.model.graph.node}
    with open_bank(bank, use_env=False) as reader:
        for t in tuned:
            node = by_output[prep_nodes[t.node_names[0]].output[0]]
            entry, layer = reader.lookup_node(node, index)
            assert entry is not None and layer == CUSTOM, (name, t.id)
            assert entry.signature.digest == t.signature.digest


def test_without_its_shapes_a_dynamic_model_finds_nothing_and_says_nothing_wrong(
    tmp_path: Path,
) -> None:
    index = ModelTasks(samples.mlp(dynamic_batch=True))
    assert len(index) == 0  # no static shapes, no signatures: no false matches either
    assert len(ModelTasks(samples.mlp(dynamic_batch=True), {"input": (1, 256)})) == 3

"""The int4 policy: weight-only 4-bit products (MatMulNBits) under the same gates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from aoe.errors import OptionError
from aoe.partition import partition
from aoed.backends.ort.catalog import build_registry
from aoed.backends.ort.quant import INT4_BLOCK, pack_int4
from aoed.engine.assemble import task_rewrites
from aoed.engine.policy import policy
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.tasks import Constants, apply_rewrites


def _nbits_model(packed, scales, k: int, n: int, level: int, block: int = INT4_BLOCK):
    node = helper.make_node(
        "MatMulNBits",
        ["x", "B", "S"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        accuracy_level=level,
    )
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])],
        initializer=[numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")],
    )
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


@pytest.mark.parametrize(
    ("k", "block"), [(64, INT4_BLOCK), (70, INT4_BLOCK), (256, 128), (200, 128)]
)  # whole blocks, and K padded to them; both block sizes searched
def test_packing_is_what_the_kernel_reads(k: int, block: int) -> None:
    rng = np.random.default_rng(k)
    n = 48
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    packed, scales = pack_int4(w, block)
    blocks = -(-k // block)
    assert packed.shape == (n, blocks, block // 2) and scales.shape == (n * blocks,)
    # Unpack by hand: the dequantized weight is within half a step of the original.
    lo, hi = packed & 0x0F, packed >> 4
    q = np.stack([lo, hi], axis=-1).reshape(n, blocks, block).astype(np.float32) - 8
    deq = (q * scales.reshape(n, blocks, 1)).reshape(n, -1)[:, :k].T
    step = np.repeat(scales.reshape(n, blocks), block, axis=1)[:, :k].T
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-7)
    x = rng.standard_normal((4, k)).astype(np.float32)
    sess = ort.InferenceSession(
        _nbits_model(packed, scales, k, n, 0, block).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ deq, rtol=1e-4, atol=1e-5)


def test_int4_strategies_apply_to_matmul_tasks_within_the_policy(
    models: Path, tmp_path: Path
) -> None:
    registry = build_registry()
    assert [s.name for s in registry.strategies_for("matmul", "int4") if s.precision == "int4"] == [
        "int4_weight_only",
        "int4_int8_compute",
        "int4_int8_compute_b128",
    ]
    assert not any(s.precision == "int4" for s in registry.strategies_for("matmul", "int8"))
    # int4's budget admits the finer 8-bit grid too; the gate keeps what passes
    int8 = {s.name for s in registry.strategies_for("matmul", "int8") if s.precision == "int8"}
    assert int8 and int8 <= {s.name for s in registry.strategies_for("matmul", "int4")}
    prep = prepare(models / "mlp.onnx", tmp_path)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    feeds = make_inputs(prep.inputs)
    ref = ort.InferenceSession(
        prep.model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, feeds)[0]
    task = partition(prep.model, prep.ctx)[0]
    cos = {}
    for name in ("int4_weight_only", "int4_int8_compute", "int4_int8_compute_b128"):
        tuned = apply_rewrites(
            prep.model, task_rewrites(prep.model, prep.ctx, consts, task, name, registry)
        )
        assert [n.op_type for n in tuned.graph.node].count("MatMulNBits") == task.instances
        y = ort.InferenceSession(tuned.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )[0]
        cos[name] = float((y * ref).sum() / np.linalg.norm(y) / np.linalg.norm(ref))
    assert policy("int4").e2e_min_cosine <= cos["int4_weight_only"] < 1.0, cos
    assert policy("int4").e2e_min_cosine <= cos["int4_int8_compute"] < 1.0, cos
    # blocks of 128 are coarser: the gate decides whether a task affords them
    assert 0.9 < cos["int4_int8_compute_b128"] < cos["int4_int8_compute"], cos


def test_int4_policy_budget() -> None:
    p = policy("int4")
    assert p.lossy and p.e2e_min_cosine == 0.99 and p.task_min_cosine >= p.e2e_min_cosine
    assert policy("int4", min_cosine=0.999).task_min_cosine == 0.999
    with pytest.raises(OptionError, match="int3"):
        policy("int3")

"""Precision policy int8: strategies, calibration, the accuracy gate, decisions by measurement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lmdb
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import aoe
from aoe.errors import OptionError
from aoe.partition import partition
from aoed import samples
from aoed.backends.ort.catalog import build_registry
from aoed.backends.ort.probe import activation_ranges
from aoed.engine.calibration import HELD_BACK, integer_ranges, load_samples
from aoed.engine.decisions import MIN_ROUNDS
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.tasks import Constants, TaskView, apply_rewrites

from .conftest import run_aoe

REGISTRY = build_registry()

FAST = ("--budget", "2", "--parallel", "1", "--no-progress", "--job-type", "opat")


def _cosine(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    x = np.concatenate([o.ravel() for o in a]).astype(np.float64)
    y = np.concatenate([o.ravel() for o in b]).astype(np.float64)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def _run(model: onnx.ModelProto | Path, feeds: dict) -> list[np.ndarray]:
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "legacy_cnn"])
def test_every_int8_rewrite_runs_and_stays_close(tmp_path: Path, name: str):
    src = samples.save(samples.build(name), tmp_path / f"{name}.onnx")
    prep = prepare(src, tmp_path / "prep")
    calib = [make_inputs(prep.inputs, seed=s) for s in range(4)]
    ranges = activation_ranges(prep.model, prep.ctx.tensors, calib)
    feeds = make_inputs(prep.inputs, seed=99)
    ref = _run(src, feeds)
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    by = {n.name: n for n in prep.model.graph.node}
    applied = set()
    for task in partition(prep.model, prep.ctx):
        view = TaskView(
            [by[n] for n in task.node_names], consts, prep.ctx.tensors, 13, task.id, ranges
        )
        for strat in REGISTRY.strategies_for(task.family, "int8"):
            if strat.precision != "int8":
                continue
            rw = strat.apply(view)
            if rw is None:
                continue
            model = apply_rewrites(prep.model, {task.node_names: rw})
            onnx.checker.check_model(model)
            ops = {n.op_type for n in model.graph.node}
            assert ops & {"DynamicQuantizeMatMul", "MatMulInteger", "QuantizeLinear", "QLinearConv"}
            assert _cosine(_run(model, feeds), ref) >= 0.999, (task.id, strat.name)
            applied.add(strat.name)
    expected = {
        "mlp": {"int8_dynamic", "int8_dynamic_per_channel", "int8_matmulinteger"},
        "cnn": {"int8_qdq", "int8_qlinearconv", "int8_dynamic"},
        "transformer": {"int8_dynamic", "int8_dynamic_actact"},
        "legacy_cnn": {"int8_qdq"},
    }[name]
    assert expected <= applied


def test_static_conv_strategies_need_calibration(tmp_path: Path):
    src = samples.save(samples.cnn(), tmp_path / "cnn.onnx")
    prep = prepare(src, tmp_path / "prep")
    task = next(t for t in partition(prep.model, prep.ctx) if t.family == "conv")
    by = {n.name: n for n in prep.model.graph.node}
    consts = Constants(prep.model.graph, list(prep.model.opset_import))
    view = TaskView([by[n] for n in task.node_names], consts, prep.ctx.tensors, 13, "t")
    assert REGISTRY.get("conv", "int8_qdq").apply(view) is None  # no ranges, no static int8


def test_exact_jobs_see_no_lossy_strategy():
    for family in ("matmul", "conv", "matmul_act"):
        assert all(s.precision == "exact" for s in REGISTRY.strategies_for(family, "exact"))
    assert [s.name for s in REGISTRY.strategies_for("matmul_act", "exact")] == ["default"]


def test_calibration_from_files_and_synthetic(tmp_path: Path):
    src = samples.save(samples.mlp(), tmp_path / "mlp.onnx")
    prep = prepare(src, tmp_path / "prep")
    synth = load_samples(prep.inputs, None)
    assert synth.source.startswith("synthetic") and len(synth.held_back) == HELD_BACK
    assert not any(
        np.array_equal(a["input"], b["input"]) for a in synth.calibrate for b in synth.held_back
    )
    d = tmp_path / "calib"
    d.mkdir()
    for i in range(5):
        np.savez(d / f"s{i}.npz", input=np.full((256,), i, dtype=np.float32))  # batch axis added
    user = load_samples(prep.inputs, d)
    assert user.source.startswith("user (5 samples")
    assert len(user.calibrate) == 3 and user.held_back[0]["input"].shape == (1, 256)
    bad = tmp_path / "bad"
    bad.mkdir()
    np.savez(bad / "x.npz", other=np.zeros((1, 256), np.float32))
    with pytest.raises(OptionError, match="input"):
        load_samples(prep.inputs, bad)
    np.savez(bad / "x.npz", input=np.zeros((3, 3), np.float32))
    with pytest.raises(OptionError, match="shape"):
        load_samples(prep.inputs, bad)


def test_token_ids_are_drawn_from_the_embedding_range():
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.zeros((1000, 8), np.float32), "emb")
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["y"], name="g")],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8])],
        [table],
    )
    model = helper.make_model(g)
    from aoe.signature import TensorInfo

    assert integer_ranges(model, {"ids": TensorInfo("int64", (1, 16))}) == {"ids": 1000}


def _result(out: Path) -> dict:
    (path,) = out.glob("aoe_result_opat_*.json")
    return json.loads(path.read_text())


def _bank_keys(bank: Path) -> list[bytes]:
    env = lmdb.open(str(bank), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            return [k for k, _ in txn.cursor(db=env.open_db(b"entries", txn=txn, create=False))]
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "cnn",
        pytest.param("mlp", marks=pytest.mark.long),
        pytest.param("transformer", marks=pytest.mark.long),
    ],
)
def test_int8_job_stays_within_budget(models: Path, tmp_path: Path, name: str):
    r = run_aoe(
        "tune",
        str(models / f"{name}.onnx"),
        "--precision",
        "int8",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    assert doc["basic"]["precision"] == "int8"
    assert doc["calibration"].startswith("synthetic")
    conf = doc["confirmation"]
    if conf["shipped"] != "input":  # what ships met the budget on the 32 held-back samples
        acc = doc["accuracy"]
        assert acc["samples"] == 32 and acc["cosine"] >= 0.999 and acc["max_rel_error"] <= 0.25
        assert acc["cosine_p5"] >= acc["cosine"]
        assert conf["verdict"] == "faster" and conf["improvement_ci95"][0] > 0
    else:  # the input ships: its outputs are the reference
        assert doc["accuracy"]["cosine"] == 1.0
        assert onnx.load(doc["tuned_model"]).graph == onnx.load(str(models / f"{name}.onnx")).graph
    assert doc["OPAT"]["model_performance_improvement"] == pytest.approx(
        conf["improvement"], abs=1e-4
    )
    # Independently: the tuned model on inputs the job never saw.
    prep = prepare(models / f"{name}.onnx", tmp_path / "check")
    feeds = make_inputs(prep.inputs, seed=12345)
    tuned = aoe.session(doc["tuned_model"]).run(None, feeds)
    assert _cosine(tuned, _run(models / f"{name}.onnx", feeds)) >= 0.999
    for task in doc["tasks"]:
        cands = {c["strategy"]: c for c in task["candidates"] if c.get("ok")}
        if task["strategy"].startswith("int8"):  # the task gate, on its outputs or on the model's
            assert (
                max(cands[task["strategy"]]["cosine"], task["accuracy"].get("model_cosine", 0.0))
                >= 0.9995
            )
    assert all(k.endswith(b"/int8") for k in _bank_keys(tmp_path / "bank"))


@pytest.mark.slow
def test_int8_leaves_a_collapsing_task_in_fp32_and_says_so(models: Path, tmp_path: Path):
    r = run_aoe(
        "tune",
        str(models / "outlier_mlp.onnx"),
        "--precision",
        "int8",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    fc2 = next(t for t in doc["tasks"] if t["op_name"].startswith("fc2"))
    assert not fc2["strategy"].startswith("int8")
    assert any("outside the accuracy budget" in why for why in fc2["rejected"])
    bad = [c for c in fc2["candidates"] if c["strategy"].startswith("int8") and c.get("ok")]
    assert bad and all(c["cosine"] < 0.999 for c in bad)
    assert doc["accuracy"]["cosine"] >= 0.999
    assert "outside the accuracy budget" in r.stdout


#: Int8 forms of this MLP are slower by construction: with 4 features and 4 outputs per
#: row, the products are trivial and quantizing the 2048 rows' activations (and
#: dequantizing the results) is most of the work. Measured on a 2-core machine: lower
#: quartiles of 20-22 us against the exact forms' 11-12 us, far outside what noise makes
#: of a paired ratio; a model whose int8 forms are a few percent slower (16x16, one row)
#: let a noisy round pick one under load.
SLOW_INT8 = {"batch": 2048, "features": 4, "hidden": 4, "classes": 4, "layers": 2}


@pytest.mark.slow
def test_int8_slower_than_exact_stays_exact(tmp_path: Path):
    tiny = samples.save(samples.mlp(**SLOW_INT8), tmp_path / "tiny.onnx")
    r = run_aoe(
        "tune",
        str(tiny),
        "--precision",
        "int8",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    for task in doc["tasks"]:
        assert not task["strategy"].startswith("int8"), task
        cands = {c["strategy"]: c for c in task["candidates"]}
        int8 = [name for name in cands if name.startswith("int8")]
        assert int8
        # Every int8 candidate lost for a reason its own figures bear out.
        for name in int8:
            (why,) = [w for w in task["rejected"] if w.startswith(f"{name}:")]
            c = cands[name]
            if "outside the accuracy budget" in why:
                assert (
                    c["cosine"] < doc["accuracy_budget"]["task_min_cosine"]
                    or c["max_rel_error"] > doc["accuracy_budget"]["task_max_rel_error"]
                ), (why, c)
            elif "dropped after" in why:  # raced out: the quartiles it quotes are its own
                m = re.search(
                    r"lower quartile ([\d.]+) us above (\w+)'s upper quartile ([\d.]+) us", why
                )
                assert m and float(m[1]) == pytest.approx(c["q25_us"], abs=0.06), (why, c)
                assert float(m[1]) > float(m[3]) * 1.05 - 0.1
            elif "rounds measured both" in why:  # a busy machine left too few paired rounds
                assert why.endswith(
                    f"not clearly faster than {task['strategy']}: fewer than {MIN_ROUNDS} rounds"
                    " measured both"
                ), why
            else:  # measured against what the task kept: its best exact form
                assert f"not clearly faster than {task['strategy']} " in why, why
                assert (
                    f"{c['median_us']:.1f} us vs {cands[task['strategy']]['median_us']:.1f} us"
                    in why
                ), why


@pytest.mark.slow
def test_int8_options_are_checked(models: Path, tmp_path: Path):
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--precision",
        "int8",
        "--min-cosine",
        "1.5",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "--min-cosine" in r.stderr
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--precision",
        "int8",
        "--calibration",
        str(tmp_path / "none"),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "--calibration" in r.stderr

"""`aoe tune` end to end: the real command, real workers, real LMDB, real onnxruntime."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import aoe
from aoe.bank import open_bank
from aoe.fingerprint import device_fingerprint
from aoe.keys import bank_key
from aoed.bankcompile import compile_model
from aoed.engine.assemble import model_signature
from aoed.engine.prep import make_inputs, prepare

from .conftest import run_aoe

pytestmark = pytest.mark.slow

#: OPAT alone: these jobs are about operator tasks (and stay as fast as they were); the
#: default job type has tests of its own (test_subgraphs.py).
OPAT = ("--job-type", "opat")
FAST = ("--budget", "2", "--parallel", "1", "--no-progress", *OPAT)
#: A budget every task of the small samples gets a slice of.
ENOUGH = ("--budget", "8", "--parallel", "1", "--no-progress", *OPAT)


def _result(out: Path) -> dict:
    files = sorted(out.glob("aoe_result_opat_*_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _summary_adds_up(doc: dict) -> dict:
    s = doc["OPAT"]["repo_summary"]
    assert (
        s["repo_hit_num"] + s["repo_add_num"] + s["repo_unsatisfied_num"] + s["repo_not_tuned_num"]
        == s["total_num"]
    )
    assert s["repo_reserved_num"] + s["repo_update_num"] <= s["repo_hit_num"]
    assert s["total_num"] == len(doc["tasks"])  # one decision per task (aoe.outcome)
    return s


def _no_task_model(path: Path, kind: str) -> Path:
    """A model no operator task of which the tuner can change, saved at `path`: `relu` (one
    Relu: nothing any option can speed up) or `lstm` (one LSTM with constant weights,
    which onnxruntime prepacks once per session)."""
    from onnx import TensorProto, helper, numpy_helper

    if kind == "relu":
        nodes, inits = [helper.make_node("Relu", ["x"], ["y"], name="relu")], []
        x, y = [1, 1024], [1, 1024]
    else:
        steps, batch, size, hidden = 16, 4, 128, 256
        rng = np.random.default_rng(0)
        inits = [
            numpy_helper.from_array(
                (rng.standard_normal((1, 4 * hidden, n)) * 0.05).astype(np.float32), name
            )
            for name, n in (("W", size), ("R", hidden))
        ]
        nodes = [helper.make_node("LSTM", ["x", "W", "R"], ["y"], name="lstm", hidden_size=hidden)]
        x, y = [steps, batch, size], [steps, 1, batch, hidden]
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _bank_entries(bank: Path) -> int:
    env = lmdb.open(str(bank), readonly=True, lock=False, max_dbs=8)
    try:
        db = env.open_db(b"entries", create=False)
        with env.begin() as txn:
            return txn.stat(db)["entries"]
    finally:
        env.close()


def _outputs(path: Path, feeds: dict, tuned: bool) -> list[np.ndarray]:
    sess = (
        aoe.session(path)
        if tuned
        else ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    )
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _assert_exact(src: Path, tuned: Path, tmp: Path) -> None:
    feeds = make_inputs(prepare(src, tmp / "check").inputs, seed=7)
    for ref, out in zip(_outputs(src, feeds, False), _outputs(tuned, feeds, True), strict=True):
        assert out.shape == ref.shape
        assert np.max(np.abs(out - ref)) <= 1e-3 * np.max(np.abs(ref))


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "relu"])
def test_exact_never_slower_nor_less_accurate(models: Path, tmp_path: Path, name: str):
    """Whatever ships, its figures are the confirming A/B's. `relu` is a model nothing can
    speed up, so the input ships: the checks of that outcome run every time."""
    src = (
        _no_task_model(tmp_path / "relu.onnx", "relu")
        if name == "relu"
        else models / f"{name}.onnx"
    )
    out = tmp_path / "out"
    r = run_aoe("tune", str(src), "--bank", str(tmp_path / "bank"), "--output", str(out), *FAST)
    assert r.returncode == 0, r.stderr
    assert "Aoe process finished" in r.stdout
    doc = _result(out)
    opat, conf = doc["OPAT"], doc["confirmation"]
    assert opat["opat_tuning_result"] == "tuning successful"
    # The figures reported are the confirming A/B's, and what ships follows its interval.
    assert opat["model_baseline_performance(ms)"] == pytest.approx(conf["baseline_ms"], abs=1e-6)
    assert opat["model_result_performance(ms)"] == pytest.approx(conf["result_ms"], abs=1e-6)
    assert opat["model_performance_improvement"] == pytest.approx(conf["improvement"], abs=1e-4)
    assert conf["rounds"] >= 15 and conf["device_s"] > 0
    lo, hi = conf["improvement_ci95"]
    assert lo <= conf["improvement"] <= hi
    if name == "relu":
        # No task to change: the input ships, or (on a machine busy enough that fewer
        # threads win, beyond the noise) the input's own graph with session options.
        assert not doc["tasks"], doc["tasks"]
        assert conf["shipped"] == "input" or doc["session_options"], conf
        assert onnx.load(doc["tuned_model"]).graph == onnx.load(str(src)).graph
    if conf["shipped"] == "input":
        assert onnx.load(doc["tuned_model"]).graph == onnx.load(str(src)).graph
        assert conf["verdict"] != "faster"
    else:
        assert conf["verdict"] == "faster" and lo > 0
    assert doc["budget"]["spent_s"] <= doc["budget"]["budget_s"] + 1.5  # a request may end past it
    assert doc["accuracy"]["max_rel_error"] <= 1e-3 and doc["accuracy"]["cosine"] >= 0.9999
    tuned = Path(doc["tuned_model"])
    ts = re.fullmatch(rf"{name}_(\d{{14}})_tune\.onnx", tuned.name).group(1)
    assert (
        tuned
        == out
        / "aoe_workspace"
        / f"{name}_{ts}"
        / "tunespace"
        / "result"
        / f"{name}_{ts}_tune.onnx"
    )
    _assert_exact(src, tuned, tmp_path)
    assert aoe.session_options_of(tuned) == doc["session_options"]
    info = doc["device_info"]
    assert (info["device"], info["provider"], info["accelerator"]) == (
        "cpu",
        "CPUExecutionProvider",
        {},
    )
    assert (
        info["versions"]["onnxruntime"] == ort.__version__
        and "CPUExecutionProvider" in info["providers"]
    )
    for task in doc["tasks"]:
        if task["strategy"] != "default":
            assert task["accuracy"]["max_rel_error"] <= 1e-4, task
    s = _summary_adds_up(doc)
    assert s["repo_hit_num"] == 0
    # The model-level record (session options, kept or dropped) may be an entry too; the
    # tally counts the tasks' decisions only (aoe.outcome).
    prep = prepare(src, tmp_path / "prep")
    here = device_fingerprint("CPUExecutionProvider").digest
    with open_bank(tmp_path / "bank", use_env=False) as reader:
        key = bank_key(model_signature(prep.model).digest, here, "exact")
        model_entry = reader.lookup(key)[0] is not None
    assert _bank_entries(tmp_path / "bank") == s["repo_add_num"] + model_entry


@pytest.fixture(scope="module")
def mlp_banked(models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The MLP tuned with a budget every task gets a slice of: (its bank, its result).
    Tests that go on from this bank copy it first."""
    folder = tmp_path_factory.mktemp("mlp_banked")
    first = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(folder / "bank"),
        "--output",
        str(folder / "o1"),
        *ENOUGH,
    )
    assert first.returncode == 0, first.stderr
    return folder / "bank", _result(folder / "o1")


def test_bank_answers_the_second_run_and_repeat_tune_retunes(
    models: Path, tmp_path: Path, mlp_banked: tuple[Path, dict]
):
    bank = tmp_path / "bank"
    shutil.copytree(mlp_banked[0], bank)
    args = ("tune", str(models / "mlp.onnx"), "--bank", str(bank), *ENOUGH)
    d1 = mlp_banked[1]
    assert d1["resources"]["trials"] > 0

    second = run_aoe(*args, "--output", str(tmp_path / "o2"))
    assert second.returncode == 0, second.stderr
    d2 = _result(tmp_path / "o2")
    s2 = _summary_adds_up(d2)
    assert s2["repo_hit_num"] == s2["total_num"]
    assert d2["resources"]["trials"] == 0  # no per-task measurement, only the end-to-end check
    assert all(t["update_mode"] == "hit" for t in d2["tasks"])
    chosen1 = {t["op_name"]: t["strategy"] for t in d1["tasks"]}
    chosen2 = {t["op_name"]: t["strategy"] for t in d2["tasks"]}
    assert chosen1 == chosen2
    # The bank answered the confirmation too: same figures, said to be the first job's, and
    # the same model ships.
    c1, c2 = d1["confirmation"], d2["confirmation"]
    assert c2["from_bank"] == d1["basic"]["job_id"] and c2["baseline_ms"] == pytest.approx(
        c1["baseline_ms"]
    )
    # options alone are re-checked
    assert (d2["budget"]["confirm_s"] > 0) == bool(d1["session_options"])
    _banked_options_rechecked(c1, d1["session_options"], d2)
    g1 = onnx.load(d1["tuned_model"]).graph
    g2 = onnx.load(d2["tuned_model"]).graph
    assert g1.SerializeToString(deterministic=True) == g2.SerializeToString(deterministic=True)

    third = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        *ENOUGH,
        "--output",
        str(tmp_path / "o3"),
        env={"TUNE_BANK_PATH": str(bank), "REPEAT_TUNE": "True"},
    )
    assert third.returncode == 0, third.stderr
    d3 = _result(tmp_path / "o3")
    s3 = _summary_adds_up(d3)
    assert d3["resources"]["trials"] > 0
    modes = {t["update_mode"] for t in d3["tasks"]}
    assert modes <= {"reserved", "update", "add", "unsatisfied"}
    assert (
        s3["repo_reserved_num"]
        + s3["repo_update_num"]
        + s3["repo_add_num"]
        + s3["repo_unsatisfied_num"]
        == s3["total_num"]
    )


def _banked_options_rechecked(c1: dict, options: dict, d2: dict) -> list[str]:
    """Check a bank-answered run (result `d2`) against the confirmation `c1` and session
    options the bank held; returns the notes that say the options were dropped."""
    c2 = d2["confirmation"]
    dropped = [n for n in d2["notes"] if "from the bank dropped: re-checked here" in n]
    if dropped:
        # options that won on a quieter machine are re-measured, and dropped if they lose here
        assert options and d2["session_options"] == {}, dropped
    else:
        assert options == d2["session_options"]
    if dropped and c1["shipped"] == "options only":  # then the input ships, and says so
        assert c2["shipped"] == "input" and c2["verdict"] in ("no significant change", "slower"), c2
        assert c2["improvement"] == 0.0 and c2["proposal"]["improvement"] == pytest.approx(
            c1["improvement"]
        ), c2
    else:
        assert c2["shipped"] == c1["shipped"] and c2["improvement"] == pytest.approx(
            c1["improvement"]
        )
    return dropped


#: Session options slower by construction on a model with prepacked weights: onnxruntime
#: packs the LSTM's weights again on every run (about 2.3x the default session's time
#: on `_no_task_model(..., "lstm")`, measured here).
SLOWER_OPTIONS = {"config": {"session.disable_prepacking": "1"}}


def _store_session_record(bank: Path, model: Path, options: dict, confirmed: dict) -> None:
    """Replace the model-level record of `model` in `bank` with an entry saying `options`
    won, confirmed as `confirmed` (what a job on a quieter machine could have stored)."""
    from aoe.bankrecord import BankRecord, Measured, encode
    from aoe.fingerprint import device_fingerprint
    from aoe.keys import bank_key, canonical_json
    from aoe.recordcheck import SESSION_FAMILY
    from aoed.bank.store import BankStore
    from aoed.engine.assemble import model_signature

    signature = model_signature(prepare(model, bank.parent / "prep").model)
    device = device_fingerprint()
    key = bank_key(signature.digest, device.digest, "exact")
    store = BankStore(bank)
    try:
        assert store.get(key) is not None or store.get_default(key) is not None, (
            "the job stored no model record here"
        )
        record = BankRecord(
            key,
            signature,
            device,
            canonical_json(options),
            SESSION_FAMILY,
            "exact",
            Measured(800.0, 0.01, 21, 790.0),
            Measured(1000.0, 0.01, 21, 990.0),
            params={"confirmed": json.dumps(confirmed, sort_keys=True)},
            job_id=confirmed["job"],
            model=model.name,
        )
        store.commit(entries=[(key, encode(record))])
    finally:
        store.close()


def test_banked_options_that_lose_here_are_dropped_and_the_input_ships(tmp_path: Path):
    """The bank says session options won and shipped alone; here they are slower by
    construction, so the bank-answered run drops them and ships the input, saying so."""
    from aoed.engine.bankrules import choices_digest

    src = _no_task_model(tmp_path / "lstm.onnx", "lstm")
    bank = tmp_path / "bank"
    first = run_aoe("tune", str(src), "--bank", str(bank), "--output", str(tmp_path / "o1"), *FAST)
    assert first.returncode == 0, first.stderr
    assert _result(tmp_path / "o1")["tasks"] == []  # the model-level record is all the bank answers
    c1 = {
        "verdict": "faster",
        "shipped": "options only",
        "baseline_ms": 1.0,
        "result_ms": 0.8,
        "improvement": 0.25,
        "improvement_ci95": [0.1, 0.4],
        "rounds": 21,
        "device_s": 1.0,
        "options_kept": True,
        "job": "job-elsewhere",
        "choices": choices_digest([], {}, SLOWER_OPTIONS),
    }
    _store_session_record(bank, src, SLOWER_OPTIONS, c1)

    second = run_aoe("tune", str(src), "--bank", str(bank), "--output", str(tmp_path / "o2"), *FAST)
    assert second.returncode == 0, second.stderr
    d2 = _result(tmp_path / "o2")
    assert d2["confirmation"]["from_bank"] == "job-elsewhere", d2["confirmation"]
    assert _banked_options_rechecked(c1, SLOWER_OPTIONS, d2), d2["notes"]
    assert onnx.load(d2["tuned_model"]).graph == onnx.load(str(src)).graph
    assert aoe.session_options_of(d2["tuned_model"]) == {}


def test_a_confirmation_answers_only_the_job_type_it_was_made_for(
    models: Path, tmp_path: Path, mlp_banked: tuple[Path, dict]
):
    """The MLP has no subgraphs: an sgat+opat run forms the OPAT run's tasks, and the
    bank answers every one. The confirmation stored with the model was made for an OPAT
    job's tasks, so this run confirms its own, and the bank then names its job type,
    which `aoe compile` forms the tasks of."""
    bank = tmp_path / "bank"
    shutil.copytree(mlp_banked[0], bank)
    src = models / "mlp.onnx"
    r = run_aoe(
        "tune",
        str(src),
        "--bank",
        str(bank),
        "--output",
        str(tmp_path / "o2"),
        *("--budget", "8", "--parallel", "1", "--no-progress", "--job-type", "sgat+opat"),
    )
    assert r.returncode == 0, r.stderr
    [result] = (tmp_path / "o2").glob("aoe_result_sgat_opat_*.json")
    d2 = json.loads(result.read_text())
    assert sorted(t["task_id"] for t in d2["tasks"]) == sorted(
        t["task_id"] for t in mlp_banked[1]["tasks"]
    )
    assert all(t["update_mode"] == "hit" for t in d2["tasks"])
    assert d2["confirmation"]["from_bank"] == "", d2["confirmation"]
    with open_bank(bank, use_env=False) as reader:
        asm = compile_model(src, tmp_path / "c.onnx", reader, check_options=False)
    assert asm.job_type == "sgat+opat" and not any("job type" in n for n in asm.notes)


def test_crashing_candidate_is_recorded_and_job_succeeds(models: Path, tmp_path: Path):
    (tmp_path / "aoed_abort_plugin.py").write_text(
        textwrap.dedent(
            """
            import os
            from aoed.engine.registry import Strategy

            def register(registry):
                registry.register(Strategy("abort_worker", "matmul", "exact", lambda view: os.abort()))
            """
        )
    )
    import sys

    env = {
        "AOED_PLUGINS": "aoed_abort_plugin",
        "PYTHONPATH": ":".join([str(tmp_path), *filter(None, sys.path)]),
    }
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *FAST,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    failed = [c for t in doc["tasks"] for c in t["candidates"] if c["strategy"] == "abort_worker"]
    assert failed and all(not c["ok"] and "crashed" in c["error"] for c in failed)
    assert doc["resources"]["failed_candidates"] >= len(failed)
    assert all(t["strategy"] != "abort_worker" for t in doc["tasks"])


@pytest.mark.long
def test_aoe_spelling_runs_the_same_job_on_an_old_export(models: Path, tmp_path: Path):
    r = run_aoe(
        "--framework",
        "5",
        "--model",
        str(models / "legacy_mlp.onnx"),
        "--job_type",
        "2",
        "--output",
        str(tmp_path / "o"),
        "--progress_bar",
        "off",
        env={"TUNE_BANK_PATH": str(tmp_path / "bank"), "TE_PARALLEL_COMPILER": "1"},
    )
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    assert any("initializers listed as graph inputs" in n for n in doc["notes"])
    assert any("opset 9 converted" in n for n in doc["notes"])
    assert len(doc["tasks"]) == 3
    _assert_exact(models / "legacy_mlp.onnx", Path(doc["tuned_model"]), tmp_path)


def _run_at(model: Path, shape: tuple[int, ...], name: str = "input_ids") -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(sum(shape)).integers(0, 256, size=shape).astype(np.int64)
    return sess.run(None, {name: ids})[0]


@pytest.mark.long
def test_a_dynamic_model_tunes_with_no_flags_and_keeps_its_axes(models: Path, tmp_path: Path):
    """The encoder's batch and seq are dynamic and nothing names a shape: the job derives a
    profile (seq up to its 64-row position table), searches at its middle point, and
    ships a model with the input's own axes that runs, and agrees with the input, at
    shapes outside the profile. The assembled model, whatever ships, was checked at
    every point (no choice that bakes the searched shape survives: test_shapes.py)."""
    out = tmp_path / "o"
    r = run_aoe(
        "tune",
        str(models / "encoder.onnx"),
        *("--bank", str(tmp_path / "bank"), "--output", str(out), "--keep-workspace"),
        *("--budget", "2", "--parallel", "1", "--no-progress", "--job-type", "sgat+opat"),
    )
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("aoe_result_sgat_opat_*_*.json")
    doc = json.loads(path.read_text())
    prof = doc["shape_profile"]
    assert prof["inputs"] == {"input_ids": ["batch", "seq"]}
    assert prof["points"] == [{"input_ids": [1, 4]}, {"input_ids": [4, 16]}, {"input_ids": [4, 64]}]
    assert "position table's 64" in prof["axes"]["seq"]
    assert any(n.startswith("shape profile: 3 points") for n in doc["notes"])
    tuned = Path(doc["tuned_model"])
    model = onnx.load(str(tuned))
    for vi in (*model.graph.input, *model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        assert [d.dim_param for d in dims[:2]] == ["batch", "seq"], vi.name
    assert not model.graph.value_info  # no shape of the searched point left inside
    assembled = Path(doc["workspace"]) / "tunespace" / "work" / "assembled.onnx"
    for candidate in (tuned, assembled):
        for shape in [(1, 1), (3, 7), (2, 50), (1, 64)]:
            ref, got = _run_at(models / "encoder.onnx", shape), _run_at(candidate, shape)
            assert got.shape == ref.shape == (*shape, 64)
            assert np.max(np.abs(got - ref)) <= 1e-3 * np.max(np.abs(ref)), (candidate, shape)
    conf = doc["confirmation"]
    assert conf["shipped"] == "input" or "points" in conf
    if "points" in conf:
        # the proposal won at the searched point: it was measured at every other one
        assert [p["shapes"] for p in conf["points"]] == [
            prof["points"][1],
            prof["points"][0],
            prof["points"][2],
        ]
        assert conf["points"][0]["searched"]
        assert all(
            p["verdict"] in ("faster", "no significant change", "slower") for p in conf["points"]
        )
        assert any(n.startswith("at each point of the shape profile") for n in doc["notes"])
    if conf["shipped"] != "input":
        checked = prof["tuned_at_points"]
        assert [c["shapes"] for c in checked] == prof["points"]
        assert all("error" not in c and c["accuracy"]["cosine"] >= 0.9999 for c in checked)
    # aoe compile rebuilds it from the bank with the same profile: the same axes, checked
    compiled = tmp_path / "compiled.onnx"
    r = run_aoe(
        "compile",
        str(models / "encoder.onnx"),
        "-o",
        str(compiled),
        "--bank",
        str(tmp_path / "bank"),
    )
    assert r.returncode == 0, r.stderr
    dims = onnx.load(str(compiled)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "seq"]
    for shape in [(1, 1), (3, 7), (2, 50)]:
        ref, got = _run_at(models / "encoder.onnx", shape), _run_at(compiled, shape)
        assert np.max(np.abs(got - ref)) <= 1e-3 * np.max(np.abs(ref)), shape


def test_a_fixed_shape_is_one_point_and_the_axes_stay(models: Path, tmp_path: Path):
    """Today's --input-shape: the job measures at that shape alone, checks the derived
    points too, and the tuned model keeps the input's dynamic batch."""
    fixed = tmp_path / "fixed"
    r = run_aoe(
        "tune",
        str(models / "mlp_dynamic.onnx"),
        *("--input-shape", "input:4,256", "--bank", str(tmp_path / "bank"), "--output", str(fixed)),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    doc = _result(fixed)
    assert doc["shape_profile"]["points"] == [{"input": [4, 256]}]
    assert doc["shape_profile"]["checked_only"] == [{"input": [1, 256]}]
    dim = onnx.load(doc["tuned_model"]).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param == "batch"


@pytest.mark.parametrize(
    ("args", "env", "code", "needle"),
    [
        (["--precision", "fp3"], {}, 2, "--precision fp3"),
        (["--parallel", "0"], {}, 2, "--parallel"),
        ([], {"TE_PARALLEL_COMPILER": "99"}, 2, "TE_PARALLEL_COMPILER"),
        ([], {"REPEAT_TUNE": "maybe"}, 2, "REPEAT_TUNE"),
        (["--job-type", "gdat"], {}, 2, "--job-type gdat"),
        (["--reload", "--repeat-tune"], {}, 2, "--reload"),
        (["--input-shape", "nosuch:1,2"], {}, 2, "nosuch"),
    ],
)
def test_bad_options_fail_cleanly(models: Path, tmp_path: Path, args, env, code, needle):
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *args,
        env=env,
    )
    assert r.returncode == code, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bank").exists()


@pytest.mark.parametrize("content", [b"", b"garbage that is not protobuf \x00\xff", None])
def test_bad_models_fail_cleanly(tmp_path: Path, content: bytes | None):
    model = tmp_path / "bad.onnx"
    if content is not None:
        model.write_bytes(content)
    r = run_aoe(
        "tune", str(model), "--bank", str(tmp_path / "bank"), "--output", str(tmp_path / "o")
    )
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "bad.onnx" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bank").exists()


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        (
            "max_nodes = 4",
            "5 nodes or more, over the limit of 4 nodes per model ([engine] max_nodes)",
        ),
        (
            "max_model_mb = 1",
            "the model file is 2.0 MiB, over the limit of 1.0 MiB ([engine] max_model_mb)",
        ),
        (
            "max_tensor_mb = 1",
            "(2 MiB of float32), over the limit of 1 MiB per tensor ([engine] max_tensor_mb)",
        ),
    ],
)
def test_a_model_over_a_configured_limit_fails_naming_the_setting(
    tmp_path: Path, setting: str, needle: str
):
    from aoed import samples

    # 5 nodes, 2 MiB
    model = samples.save(samples.mlp(features=1024, hidden=512, layers=2), tmp_path / "m.onnx")
    config = tmp_path / "aoed.toml"
    config.write_text(f"[engine]\n{setting}\n")
    r = run_aoe(
        "--config",
        str(config),
        "tune",
        str(model),
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "o"),
        *FAST,
    )
    assert r.returncode == 3, (r.stdout, r.stderr)  # a ModelError
    assert (
        needle in r.stderr and f"error: {model.name}: " in r.stderr and "Traceback" not in r.stderr
    ), r.stderr
    assert not (tmp_path / "bank").exists()


def test_framework_other_than_onnx_is_refused(models: Path, tmp_path: Path):
    r = run_aoe("--framework", "1", "--model", str(models / "mlp.onnx"), "--output", str(tmp_path))
    assert r.returncode == 2 and "only ONNX (5) models and TensorFlow SavedModels (3)" in r.stderr


def test_read_only_layer_answers_under_an_empty_custom_bank(
    models: Path, tmp_path: Path, mlp_banked: tuple[Path, dict]
):
    team = tmp_path / "team"
    shutil.copytree(mlp_banked[0], team)
    team_data = (team / "data.mdb").read_bytes()
    mine = tmp_path / "mine"
    second = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--bank",
        str(mine),
        "--bank-layer",
        str(team),
        "--output",
        str(tmp_path / "o2"),
        *FAST,
    )
    assert second.returncode == 0, second.stderr
    doc = _result(tmp_path / "o2")
    assert doc["resources"]["trials"] == 0
    assert all(t["update_mode"] == "hit" and str(team) in t["bank_layer"] for t in doc["tasks"])
    assert (team / "data.mdb").read_bytes() == team_data  # a read-only layer is never written


@pytest.mark.long
def test_a_machine_busy_on_every_core_never_fails_the_job(models: Path, tmp_path: Path):
    """Other processes spinning on every core slow measurements down; the job still ends
    with its outputs (what is too slow costs a candidate or a stage, not the job)."""
    import os
    import subprocess
    import sys

    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        r = run_aoe(
            "tune",
            str(models / "cnn.onnx"),
            "--precision",
            "int8",
            "--bank",
            str(tmp_path / "bank"),
            "--output",
            str(tmp_path / "o"),
            "--budget",
            "3",
            "--no-progress",
            *OPAT,
            timeout=600,
        )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.returncode == 0, r.stderr
    doc = _result(tmp_path / "o")
    assert Path(doc["tuned_model"]).is_file() and doc["confirmation"]["rounds"] > 0
    assert "Aoe process finished" in r.stdout

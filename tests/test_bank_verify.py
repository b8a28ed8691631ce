"""`aoe bank verify`: bank entries re-measured on this device from their signatures and
the description of the inputs they were decided on (engine/taskinputs.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from aoe.bank import open_bank
from aoe.bankrecord import BankRecord, decode
from aoe.keys import canonical_json
from aoe.partition import partition
from aoed.backends.ort.catalog import build_registry
from aoed.backends.ort.probe import activation_ranges, capture
from aoed.engine.assemble import model_signature, tunable_tasks
from aoed.engine.bankverify import RebuildError, Verdict, judge_speed, rebuild_task
from aoed.engine.messages import Measurement
from aoed.engine.prep import make_inputs, prepare
from aoed.engine.registry import DEFAULT
from aoed.engine.taskinputs import Drawn, TaskInputs, describe
from aoed.engine.tasks import Constants, TaskView

from .bank_util import foreign, make_bank, rec
from .conftest import run_aoe
from .graphs import anonymize, glu_block

REGISTRY = build_registry()
#: The operator and subgraph families the tuner writes entries of on a CPU, each found
#: in the sample models (session options, the model-level family, have their own test).
FAMILIES = {"matmul", "matmul_act", "conv", "attention", "layernorm", "gelu", "glu", "conv_region"}


def _well_formed(reason: str) -> bool:
    """One line, every bracket closed: a reason people can read."""
    return (
        bool(reason)
        and "\n" not in reason
        and all(reason.count(o) == reason.count(c) for o, c in ("()", "[]", "{}"))
    )


@pytest.fixture(scope="module")
def every_family(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(family, lossy) -> an entry of a strategy of that family (exact, and lossy where
    the family has one) on a task of a sample model it applies to, its inputs described
    as the tuner describes them (taskinputs.describe over the task's activations)."""
    work = tmp_path_factory.mktemp("families")
    onnx.save(anonymize(glu_block(bias=True)), work / "glu.onnx")  # no sample model has one
    found: dict[tuple[str, bool], BankRecord] = {}
    for src in [models / f"{n}.onnx" for n in ("mlp", "cnn", "transformer", "bert", "gpt")] + [
        work / "glu.onnx"
    ]:
        prep = prepare(src, work / src.stem)
        consts = Constants(prep.model.graph, list(prep.model.opset_import))
        feeds = make_inputs(
            {
                i.name: prep.ctx.tensors[i.name]
                for i in prep.model.graph.input
                if i.name not in consts
            }
        )
        ranges = activation_ranges(prep.model, prep.ctx.tensors, [feeds])
        by_name = {n.name: n for n in prep.model.graph.node}
        for job_type in ("opat", "sgat"):
            for precision in ("exact", "int8", "int4"):
                for t in tunable_tasks(prep.model, prep.ctx, REGISTRY, precision, job_type):
                    view = TaskView(
                        [by_name[n] for n in t.node_names],
                        consts,
                        prep.ctx.tensors,
                        prep.ctx.opset(""),
                        f"aoe/{t.id}",
                        ranges,
                    )
                    for s in REGISTRY.strategies_for(t.family, precision):
                        kind = (t.family, s.precision != "exact")
                        if kind in found or s.name == DEFAULT or s.apply(view) is None:
                            continue
                        variable = [n for n in t.inputs if n not in consts]
                        values = capture(prep.model, prep.ctx.tensors, variable, feeds)
                        small = {n: consts[n] for n in t.inputs if n in consts}
                        found[kind] = rec(
                            sig=t.signature,
                            strategy=s.name,
                            family=t.family,
                            precision=precision if s.precision != "exact" else "exact",
                            params=describe(t.inputs, values, small).params(),
                        )
    return found


def test_every_family_the_tuner_writes_is_rebuilt_and_measured(
    every_family: dict, tmp_path: Path
) -> None:
    """Every family's entries, described as the tuner writes them, are rebuilt and
    measured: none is skipped, none crashes, and none is called inaccurate on inputs
    unlike the task's. Entries that keep no description (older banks) get a verdict
    each too, a skip saying why in one well-formed line."""
    assert {family for family, _ in every_family} == FAMILIES
    described = list(every_family.values())
    bare = [
        dataclasses.replace(e, params={})
        for e in described
        if e.family in ("attention", "conv_region")
    ]
    bank = make_bank(tmp_path / "bank", described)
    old = make_bank(tmp_path / "old", bare)
    r = run_aoe("bank", "verify", "--bank", str(bank), "--sample", "0", "--budget", "0.2", "--json")
    doc = json.loads(r.stdout)
    got = {v["key"]: v for v in doc["verdicts"]}
    assert len(got) == len(described), r.stderr
    for e in described:
        v = got[e.key.decode()]
        what = (e.family, e.strategy, v["verdict"], v["detail"])
        assert v["verdict"] in ("confirmed", "regressed", "inconclusive", "inaccurate"), what
        assert v["winner"]["median_us"] > 0 and v["baseline"]["median_us"] > 0, what
        assert _well_formed(v["detail"]) and "N(0, 1)" not in v["detail"], what
    # The exit status follows the verdicts: 1 only for one that condemns.
    bad = {"regressed", "inaccurate", "error"} & {v["verdict"] for v in got.values()}
    assert r.returncode == (1 if bad else 0), r.stderr

    r = run_aoe("bank", "verify", "--bank", str(old), "--sample", "0", "--budget", "0.2", "--json")
    old_got = {v["key"]: v for v in json.loads(r.stdout)["verdicts"]}
    assert r.returncode in (0, 1) and len(old_got) == len(bare), r.stderr
    for e in bare:
        v = old_got[e.key.decode()]
        what = (e.family, e.strategy, v["verdict"], v["detail"])
        assert v["verdict"] != "error" and _well_formed(v["detail"]), what
        if e.family == "attention":  # its Reshape targets are made up: it cannot fit
            assert v["verdict"] == "skipped" and "re-tune its model" in v["detail"], what
        else:  # a region's BatchNormalization variances: made up, but positive (no NaN)
            assert v["verdict"] != "skipped" and "not like the task's" in v["detail"], what


def test_a_description_round_trips_and_malformed_ones_are_named() -> None:
    d = describe(
        ["x", "k", "w"],
        {"x": np.array([[0.0, 2.0], [4.0, 6.0]], np.float32)},
        {"k": np.array([1.4142135], np.float32), "w": np.ones((8, 8), np.float32)},
    )
    assert d.params().keys() == {"in.0", "in.1"}  # the 64-value weight is not kept
    back = TaskInputs.from_params(d.params(), 3)
    assert back == d and back is not None
    rng = np.random.default_rng(0)
    assert back.draw(1, np.dtype(np.float32), [1], rng).tolist() == [np.float32(1.4142135)]
    x = back.draw(0, np.dtype(np.float32), [1000], rng)
    assert 0.0 <= x.min() and x.max() <= 6.0 and abs(float(x.mean()) - 3.0) < 0.5
    assert TaskInputs.from_params({"threads": "4"}, 3) is None  # an entry from before
    for params, needle in (
        ({"in.7": '{"value": [1]}'}, "in.7: the task has 3 inputs"),
        ({"in.0": "[1"}, "in.0: not JSON"),
        ({"in.0": '{"draw": [0, -1, 0, 1]}'}, "std >= 0"),
        ({"in.0": '{"value": [NaN]}'}, "finite"),
        ({"in.0": '{"run": "x"}'}, "expected"),
    ):
        with pytest.raises(ValueError, match=needle):
            TaskInputs.from_params(params, 3)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_every_task_rebuilds_to_its_own_signature(models: Path, tmp_path: Path, name: str) -> None:
    prep = prepare(models / f"{name}.onnx", tmp_path / "prep")
    tasks = partition(prep.model, prep.ctx)
    assert tasks
    for t in tasks:
        model, consts = rebuild_task(t.signature.canonical_json, t.signature.digest)
        assert [n.op_type for n in model.graph.node] == t.signature.op_type.split("+")
        assert set(consts) == {i.name for i in model.graph.initializer}
    with pytest.raises(RebuildError, match="differs"):
        rebuild_task(tasks[0].signature.canonical_json, "0" * 64)
    doc = json.loads(tasks[0].signature.canonical_json)
    doc["nodes"][0]["attrs"]["value"] = {"tensor": "ab" * 16}
    with pytest.raises(RebuildError, match="hash"):
        rebuild_task(canonical_json(doc), "0" * 64)


def test_verify_measures_local_entries_and_skips_the_rest(models: Path, tmp_path: Path) -> None:
    prep = prepare(models / "mlp.onnx", tmp_path / "prep")
    fused = next(
        t
        for t in tunable_tasks(prep.model, prep.ctx, build_registry(), "exact")
        if t.op_type == "MatMul+Add+Relu"
    )
    local = rec(sig=fused.signature, strategy="fused_gemm", family="matmul")
    records = [
        local,
        rec(sig=fused.signature, dev=foreign(), strategy="fused_gemm", family="matmul"),
        rec(sig=model_signature(prep.model), strategy="{}", family="session"),
        rec(sig=fused.signature, precision="int8", strategy="no_such_strategy", family="matmul"),
    ]
    bank = make_bank(tmp_path / "bank", records)
    r = run_aoe("bank", "verify", "--bank", str(bank), "--sample", "0", "--budget", "0.5", "--json")
    assert r.returncode == 1, r.stderr  # one entry could not be measured
    doc = json.loads(r.stdout)
    assert doc["sampled"] == doc["of"] == 4
    by_key = {v["key"]: v for v in doc["verdicts"]}
    measured = by_key[local.key.decode()]
    assert measured["verdict"] in ("confirmed", "regressed", "inconclusive"), measured
    assert measured["winner"]["median_us"] > 0 and measured["baseline"]["median_us"] > 0
    assert measured["winner"]["max_rel_error"] <= 1e-4
    verdicts = sorted(
        (v["verdict"], v["detail"].split(" ")[0]) for v in doc["verdicts"] if v is not measured
    )
    assert verdicts == [("error", "unknown"), ("skipped", "measured"), ("skipped", "model-wide")]
    with open_bank(bank, use_env=False) as reader:
        [st] = reader.stats()
    assert st.history == 2  # the default and the strategy, measured once each
    r = run_aoe("bank", "verify", "--bank", str(bank), "--op-type", "Conv", "--no-record")
    assert r.returncode == 0 and "verified 0 of 4" in r.stdout


def test_verify_rechecks_session_options_on_the_model_given(models: Path, tmp_path: Path) -> None:
    src = models / "mlp.onnx"
    prep = prepare(src, tmp_path / "prep")
    options = {"intra_op_num_threads": 1}
    session = rec(
        sig=model_signature(prep.model),
        strategy=canonical_json(options),
        family="session",
        params={},
    )
    bank = make_bank(tmp_path / "bank", [session])
    r = run_aoe(
        "bank",
        "verify",
        "--bank",
        str(bank),
        "--sample",
        "0",
        "--budget",
        "1",
        "--json",
        "--model",
        str(src),
    )
    assert r.returncode in (0, 1), r.stderr
    (v,) = json.loads(r.stdout)["verdicts"]
    assert v["verdict"] in ("confirmed", "regressed", "inconclusive"), v
    assert (
        str(options) in v["detail"]
        and v["winner"]["median_us"] > 0
        and v["baseline"]["median_us"] > 0
    )
    assert (r.returncode == 0) == (v["verdict"] != "regressed")
    # Without the model there is nothing to measure the options on: said, not guessed.
    r = run_aoe("bank", "verify", "--bank", str(bank), "--sample", "0", "--json", "--no-record")
    (v,) = json.loads(r.stdout)["verdicts"]
    assert v["verdict"] == "skipped" and "--model" in v["detail"]


def _rounds(rounds: list[float]) -> Measurement:
    return Measurement(True, median_us=float(np.median(rounds)), rounds_us=tuple(rounds))


async def test_regressed_needs_the_whole_interval_on_the_slow_side(tmp_path: Path) -> None:
    """The tuner's rule on paired rounds: a slower median alone condemns nothing. (A
    one-core device, which the cores probe cannot judge, so nothing is probed.)"""
    one_core = SimpleNamespace(device=SimpleNamespace(cores=1))
    base = _rounds([100.0, 102.0, 98.0, 101.0, 99.0, 100.0, 103.0, 97.0, 100.0])
    cases = {
        "confirmed": [80.0, 81.0, 79.0, 80.5, 79.5, 80.0, 82.0, 78.0, 80.0],
        "regressed": [130.0, 131.0, 129.0, 130.5, 129.5, 130.0, 132.0, 128.0, 130.0],
        # 4% slower at the median, but as many rounds faster: the interval spans 1.
        "inconclusive": [60.0, 150.0, 61.0, 149.0, 104.0, 150.0, 62.0, 148.0, 104.0],
    }
    for want, rounds in cases.items():
        v = Verdict("k", "MatMul", "s", "skipped")
        await judge_speed(one_core, v, _rounds(rounds), base, ("s", "default"), None, tmp_path)
        assert v.verdict == want, (want, v.detail)
        assert "90% interval [" in v.detail and _well_formed(v.detail)


@pytest.fixture(scope="module")
def tuned_bank(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bank an int8 tune of the CNN wrote (its region is int8: 1.6-1.8x faster here)."""
    work = tmp_path_factory.mktemp("tuned")
    r = run_aoe(
        "tune",
        str(models / "cnn.onnx"),
        "--local",
        "--job-type",
        "sgat",
        "--precision",
        "int8",
        "--budget",
        "3",
        "--bank",
        str(work / "bank"),
        "--output",
        str(work / "cnn_tuned.onnx"),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    return work / "bank"


def test_the_tuner_describes_its_entries_and_verify_draws_alike(tuned_bank: Path) -> None:
    with open_bank(tuned_bank, use_env=False) as reader:
        entries = [decode(e.SerializeToString()) for _, e in reader.entries()]
    assert entries, "the tune wrote no entry"
    for e in entries:
        d = TaskInputs.from_params(e.params, len(json.loads(e.signature.canonical_json)["inputs"]))
        assert d is not None and isinstance(d.inputs[0], Drawn), e.params
    r = run_aoe(
        "bank", "verify", "--bank", str(tuned_bank), "--sample", "0", "--budget", "0.2", "--json"
    )
    for v in json.loads(r.stdout)["verdicts"]:
        assert v["verdict"] not in ("skipped", "error") and "N(0, 1)" not in v["detail"], v

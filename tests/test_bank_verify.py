"""`aoe bank verify`: bank entries re-measured on this device from their signatures alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aoe.bank import open_bank
from aoe.signature import canonical_json
from aoe.partition import partition
from aoed.backends.ort.catalog import build_registry
from aoed.engine.assemble import model_signature, tunable_tasks
from aoed.engine.bankverify import RebuildError, rebuild_task
from aoed.engine.prep import prepare

from .conftest import run_aoe
from .test_bank_reader import foreign, make_bank, rec


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
    assert measured["verdict"] in ("confirmed", "regressed"), measured
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
    assert v["verdict"] in ("confirmed", "regressed"), v
    assert (
        str(options) in v["detail"]
        and v["winner"]["median_us"] > 0
        and v["baseline"]["median_us"] > 0
    )
    assert (r.returncode == 0) == (v["verdict"] == "confirmed")
    # Without the model there is nothing to measure the options on: said, not guessed.
    r = run_aoe("bank", "verify", "--bank", str(bank), "--sample", "0", "--json", "--no-record")
    (v,) = json.loads(r.stdout)["verdicts"]
    assert v["verdict"] == "skipped" and "--model" in v["detail"]

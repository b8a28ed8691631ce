"""`aoe compile`: the tuned model from the bank alone, without measuring anything."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import aoe
from aoe.bank import CUSTOM, open_bank
from aoe.bankrecord import Measured
from aoe.errors import OptionError
from aoe.keys import bank_key, canonical_json
from aoe.sessionopts import METADATA_KEY
from aoed.backends.ort.catalog import build_registry
from aoed.bankcompile import compile_model
from aoed.embedded import apply_bank
from aoed.engine.assemble import Assembly, model_signature, tunable_tasks
from aoed.engine.bankrules import choices_digest
from aoed.engine.prep import Prepared, make_inputs, prepare

from .bank_util import foreign, make_bank, rec
from .conftest import run_aoe

FAST = ("--budget", "2", "--parallel", "1", "--no-progress", "--job-type", "opat")


def _tasks(prep: Prepared):
    return tunable_tasks(prep.model, prep.ctx, build_registry(), "exact")


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


@pytest.mark.slow
def test_compile_reproduces_the_tuning_run(models: Path, tmp_path: Path) -> None:
    bank, out = tmp_path / "bank", tmp_path / "out"
    r = run_aoe("tune", str(models / "mlp.onnx"), "--bank", str(bank), "--output", str(out), *FAST)
    assert r.returncode == 0, r.stderr
    [result] = out.glob("aoe_result_opat_*.json")
    doc = json.loads(result.read_text())
    tuned = onnx.load(doc["tuned_model"])

    compiled_path = tmp_path / "compiled.onnx"
    r = run_aoe(
        "compile", str(models / "mlp.onnx"), "-o", str(compiled_path), "--bank", str(bank), "--json"
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    compiled = onnx.load(str(compiled_path))

    # Every task the run decided, and the session options, came from the bank; a task the
    # budget left untuned has nothing there.
    untuned = {t["task_id"] for t in doc["tasks"] if t["update_mode"] in ("skipped", "failed")}
    assert report["misses"] == len(untuned) and report["hits"] == len(doc["tasks"]) + 1 - len(
        untuned
    )
    assert {t["status"] for t in report["tasks"] if t["task_id"] not in untuned} <= {
        "hit",
        "default",
        "reverted",
    }
    assert all(t["layer"] == CUSTOM for t in report["tasks"] if t["task_id"] not in untuned)
    # Whatever the run shipped, compiling from the bank gives it again: the chosen
    # strategies, or the input model when its confirming A/B found no gain.
    assert compiled.graph == tuned.graph, doc["confirmation"]
    assert _meta(compiled) == {**_meta(tuned), "aoe.version": _meta(compiled)["aoe.version"]}
    assert report["session_options"] == doc["session_options"]
    assert aoe.session_options_of(compiled_path) == report["session_options"]
    shipped_input = doc["confirmation"]["shipped"] == "input"
    assert any("no faster than the input" in n for n in report["notes"]) == shipped_input


def test_compile_applies_bank_strategies_and_skips_what_it_must(
    models: Path, tmp_path: Path
) -> None:
    src = models / "mlp.onnx"
    prep = prepare(src, tmp_path / "prep")
    tasks = _tasks(prep)
    assert len(tasks) >= 3
    first, second, third = tasks[:3]
    m = Measured(8.0, 0.01, 30, 7.5)
    b = Measured(10.0, 0.01, 30, 9.5)
    session_sig = model_signature(prep.model)
    options = {"intra_op_num_threads": 1}
    records = [
        rec(sig=first.signature, strategy="fused_gemm", family=first.family, winner=m, baseline=b),
        rec(sig=second.signature, strategy="no_such_strategy", family=second.family),
        rec(sig=third.signature, dev=foreign(), strategy="fused_gemm", family=third.family),
        rec(sig=session_sig, strategy=canonical_json(options), family="session", params={}),
    ]
    bank = make_bank(tmp_path / "bank", records)
    out = tmp_path / "compiled.onnx"
    with open_bank(bank, use_env=False) as reader:
        asm = compile_model(src, out, reader)
    by_id = {t.task_id: t for t in asm.tasks}
    assert (by_id[first.id].status, by_id[first.id].strategy, by_id[first.id].layer) == (
        "hit",
        "fused_gemm",
        CUSTOM,
    )
    assert (by_id[first.id].before_us, by_id[first.id].after_us) == (10.0, 8.0)
    assert by_id[second.id].status == "ignored" and "no_such_strategy" in by_id[second.id].reason
    assert by_id[third.id].status == "miss" and "other device" in by_id[third.id].reason
    assert asm.session.status == "hit" and asm.session_options == options
    assert asm.hits == 2 and asm.misses == len(tasks) - 1

    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    assert "FusedGemm" in ops and any(
        n.name.startswith(f"aoe/{first.id}/") for n in model.graph.node
    )
    assert not any(
        n.name.startswith((f"aoe/{second.id}/", f"aoe/{third.id}/")) for n in model.graph.node
    )
    assert _meta(model)[METADATA_KEY] == canonical_json(options)
    assert _meta(model)["aoe.precision"] == "exact"
    # The compiled model computes what the source model computes.
    feeds = make_inputs(prep.inputs, seed=3)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = aoe.session(out).run(None, feeds)
    for x, y in zip(ref, got, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_compile_rechecks_banked_session_options_unless_told_not_to(
    models: Path, tmp_path: Path
) -> None:
    src = models / "mlp.onnx"
    prep = prepare(src, tmp_path / "prep")
    options = {"intra_op_num_threads": 1, "config": {"session.intra_op.allow_spinning": "0"}}
    bank = make_bank(
        tmp_path / "bank",
        [
            rec(
                sig=model_signature(prep.model),
                strategy=canonical_json(options),
                family="session",
                params={},
            )
        ],
    )
    r = run_aoe("compile", str(src), "-o", str(tmp_path / "a.onnx"), "--bank", str(bank), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (note,) = [n for n in report["notes"] if "re-checked here" in n]
    kept = "(faster)" in note
    assert (report["session_options"] == options) == kept and (report["session_options"] == {}) == (
        not kept
    )
    assert aoe.session_options_of(tmp_path / "a.onnx") == report["session_options"]
    r = run_aoe(
        "compile",
        str(src),
        "-o",
        str(tmp_path / "b.onnx"),
        "--bank",
        str(bank),
        "--json",
        "--no-check",
    )
    report = json.loads(r.stdout)
    assert report["session_options"] == options and not [
        n for n in report["notes"] if "re-checked" in n
    ]


def test_compile_against_an_empty_bank_changes_nothing(models: Path, tmp_path: Path) -> None:
    src = models / "cnn.onnx"
    bank = make_bank(tmp_path / "bank")
    out = tmp_path / "compiled.onnx"
    with open_bank(bank, use_env=False) as reader:
        asm = apply_bank(src, out, reader)
    assert asm.hits == 0 and asm.misses == len(asm.tasks) + 1
    assert all("no entry for signature" in t.reason for t in asm.tasks)
    prep = prepare(src, tmp_path / "prep")
    assert onnx.load(str(out)).graph == prep.model.graph


@pytest.mark.slow
def test_a_reversal_in_context_is_remembered(models: Path, tmp_path: Path) -> None:
    """A model-level record naming a task as reverted in context keeps both `aoe compile`
    and a bank-hit `aoe tune` from applying that task's (otherwise valid) entry."""
    src = models / "mlp.onnx"
    prep = prepare(src, tmp_path / "prep")
    first, second, *rest = _tasks(prep)
    records = [
        rec(sig=first.signature, strategy="fused_gemm", family=first.family),
        rec(sig=second.signature, strategy="gemm_pretransposed", family=second.family),
        rec(
            sig=model_signature(prep.model),
            strategy=canonical_json({}),
            family="session",
            params={"reverted": first.signature.digest},
        ),
    ]
    here_digest = records[0].device.digest
    known = [
        (bank_key(t.signature.digest, here_digest, "exact"), {"default_us": 1.0}) for t in rest
    ]
    bank = make_bank(tmp_path / "bank", records, defaults=known)
    out = tmp_path / "compiled.onnx"
    with open_bank(bank, use_env=False) as reader:
        asm = compile_model(src, out, reader)
    by_id = {t.task_id: t for t in asm.tasks}
    assert by_id[first.id].status == "reverted" and by_id[first.id].strategy == "default"
    assert by_id[second.id].status == "hit"
    names = [n.name for n in onnx.load(str(out)).graph.node]
    assert not any(n.startswith(f"aoe/{first.id}/") for n in names)
    assert any(n.startswith(f"aoe/{second.id}/") for n in names)

    r = run_aoe("tune", str(src), "--bank", str(bank), "--output", str(tmp_path / "o"), *FAST)
    assert r.returncode == 0, r.stderr
    [result] = (tmp_path / "o").glob("aoe_result_opat_*.json")
    doc = json.loads(result.read_text())
    tasks = {t["task_id"]: t for t in doc["tasks"]}
    assert doc["resources"]["trials"] == 0
    assert tasks[first.id]["applied"] is False and "reverted in context" in tasks[first.id]["error"]
    tuned_names = [n.name for n in onnx.load(doc["tuned_model"]).graph.node]
    assert not any(n.startswith(f"aoe/{first.id}/") for n in tuned_names)


def test_compile_forms_the_tasks_of_the_job_type_the_bank_names(
    models: Path, tmp_path: Path
) -> None:
    """An sgat+opat run's attention entry and its output projection's int8 entry both
    apply: the projection lies outside the attention subgraph, though under OPAT alone
    it would be the Q projection's twin. With no job type named, compile forms the
    default job type's tasks and says so; a job type given forms that type's."""
    src = models / "transformer.onnx"
    prep = prepare(src, tmp_path / "prep")
    registry = build_registry()
    tasks = {t.id: t for t in tunable_tasks(prep.model, prep.ctx, registry, "int8", "sgat+opat")}
    attention, out_proj = (
        tasks["s001_attention_attn_context_Reshape"],
        tasks["t001_attn_out_MatMul"],
    )
    entries = [
        rec(
            sig=attention.signature,
            precision="int8",
            strategy="fused_attention",
            family="attention",
        ),
        rec(sig=out_proj.signature, precision="int8", strategy="int8_dynamic", family="matmul"),
    ]
    confirmed = {"shipped": "tuned", "choices": "", "job": "job-1", "job_type": "sgat+opat"}
    model_rec = rec(
        sig=model_signature(prep.model),
        precision="int8",
        strategy=canonical_json({}),
        family="session",
        params={"confirmed": json.dumps(confirmed)},
    )

    def compiled(bank: Path, name: str, job_type: str | None = None) -> tuple[Assembly, list]:
        with open_bank(bank, use_env=False) as reader:
            asm = compile_model(src, tmp_path / name, reader, precision="int8", job_type=job_type)
        return asm, list(onnx.load(str(tmp_path / name)).graph.node)

    asm, nodes = compiled(make_bank(tmp_path / "named", [*entries, model_rec]), "named.onnx")
    assert asm.job_type == "sgat+opat"
    assert [t.task_id for t in asm.tasks] == list(tasks)
    by_id = {t.task_id: t for t in asm.tasks}
    assert (by_id[attention.id].status, by_id[attention.id].strategy) == ("hit", "fused_attention")
    assert (by_id[out_proj.id].status, by_id[out_proj.id].strategy) == ("hit", "int8_dynamic")
    assert asm.hits == 3 and asm.misses == len(tasks) - 2
    quantized = [n.name for n in nodes if n.op_type == "DynamicQuantizeMatMul"]
    assert quantized and all(n.startswith(f"aoe/{out_proj.id}/") for n in quantized)
    assert any(n.name.startswith(f"aoe/{attention.id}/") for n in nodes)

    asm, nodes = compiled(make_bank(tmp_path / "unnamed", entries), "unnamed.onnx")
    assert asm.job_type == "sgat+opat" and any(
        "does not say which job type" in n for n in asm.notes
    )
    assert [n.name for n in nodes if n.op_type == "DynamicQuantizeMatMul"] == quantized

    # Under OPAT alone the same signature is the Q projection's task, its K, V and output
    # projections its twins: the entry applies to all four.
    asm, nodes = compiled(tmp_path / "unnamed", "opat.onnx", job_type="opat")
    (q,) = [t for t in asm.tasks if t.task_id == "t001_attn_q_MatMul"]
    assert (q.status, q.instances) == ("hit", 4)
    assert len([n for n in nodes if n.op_type == "DynamicQuantizeMatMul"]) == 4 * len(quantized)
    with pytest.raises(OptionError, match="job type 'gdat'"):
        compiled(tmp_path / "unnamed", "gdat.onnx", job_type="gdat")
    # The command line names the job type the same way, AOE's numbers included.
    r = run_aoe(
        "compile", str(src), "-o", str(tmp_path / "cli.onnx"), "--bank", str(tmp_path / "unnamed"),
        "--precision", "int8", "--job-type", "2", "--no-check", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (q,) = [t for t in doc["tasks"] if t["task_id"] == "t001_attn_q_MatMul"]
    assert doc["job_type"] == "opat" and (q["status"], q["instances"]) == ("hit", 4)

    # A run whose confirming A/B shipped its session options alone shipped none of these
    # choices: neither does compile.
    chosen = {attention.id: "fused_attention", out_proj.id: "int8_dynamic"}
    options = {"intra_op_num_threads": 1}
    alone = {
        **confirmed,
        "shipped": "options only",
        "options_kept": True,
        "choices": choices_digest(list(tasks.values()), chosen, options),
    }
    options_rec = dataclasses.replace(
        model_rec, strategy=canonical_json(options), params={"confirmed": json.dumps(alone)}
    )
    asm, nodes = compiled(make_bank(tmp_path / "alone", [*entries, options_rec]), "alone.onnx")
    assert asm.choices == {} and asm.session_options == options
    assert not any(n.name.startswith("aoe/") for n in nodes)
    assert any("session options alone" in n for n in asm.notes)


# ----------------------------------------------------- compile rebuilds what each job shipped


@dataclass(frozen=True)
class _Tuned:
    bank: Path
    result: dict
    tuned: onnx.ModelProto


@pytest.fixture(scope="module")
def tuned_transformer(
    tmp_path_factory: pytest.TempPathFactory, models: Path
) -> Callable[[str, str], _Tuned]:
    """`aoe tune` of the transformer sample (attention, layernorms, a Gelu FFN: subgraph
    tasks, and an output projection that is the Q projection's twin under OPAT alone),
    once per (job type, precision), each into a fresh bank."""
    done: dict[tuple[str, str], _Tuned] = {}

    def tune(job_type: str, precision: str) -> _Tuned:
        if (job_type, precision) not in done:
            root = tmp_path_factory.mktemp(f"{job_type.replace('+', '_')}-{precision}")
            bank, out = root / "bank", root / "out"
            r = run_aoe(
                "tune",
                str(models / "transformer.onnx"),
                "--bank",
                str(bank),
                "--output",
                str(out),
                "--budget",
                "3",
                "--parallel",
                "1",
                "--no-progress",
                "--job-type",
                job_type,
                "--precision",
                precision,
            )
            assert r.returncode == 0, r.stderr
            [result] = out.glob("aoe_result_*.json")
            doc = json.loads(result.read_text())
            done[job_type, precision] = _Tuned(bank, doc, onnx.load(doc["tuned_model"]))
        return done[job_type, precision]

    return tune


def _graph_facts(model: onnx.ModelProto) -> tuple[Counter, dict]:
    """The op types (a multiset, domains included) and the initializers (name -> dtype,
    dims) of `model`: what two builds of one tuned model must agree on."""
    ops = Counter(f"{n.domain}:{n.op_type}" for n in model.graph.node)
    inits = {t.name: (t.data_type, tuple(t.dims)) for t in model.graph.initializer}
    return ops, inits


_ROUND_TRIPS = [
    pytest.param("sgat+opat", "int8", id="sgat+opat-int8"),
    pytest.param("sgat+opat", "exact", id="sgat+opat-exact"),
    pytest.param("opat", "int8", id="opat-int8"),
    pytest.param("sgat", "fp16", id="sgat-fp16"),
    pytest.param("sgat+opat", "fp16", id="sgat+opat-fp16", marks=pytest.mark.long),
    pytest.param("opat", "exact", id="opat-exact", marks=pytest.mark.long),
    pytest.param("opat", "fp16", id="opat-fp16", marks=pytest.mark.long),
    pytest.param("sgat", "int8", id="sgat-int8", marks=pytest.mark.long),
    pytest.param("sgat", "exact", id="sgat-exact", marks=pytest.mark.long),
]


@pytest.mark.slow
@pytest.mark.parametrize(("job_type", "precision"), _ROUND_TRIPS)
def test_compile_rebuilds_what_each_job_shipped(
    tuned_transformer: Callable[[str, str], _Tuned],
    models: Path,
    tmp_path: Path,
    job_type: str,
    precision: str,
) -> None:
    """Compiling from the bank a job just wrote forms that job's tasks (no more, no
    others), answers each task the job decided, and rebuilds the model it shipped: the
    same op types, the same initializers, the same graph."""
    run = tuned_transformer(job_type, precision)
    out = tmp_path / "compiled.onnx"
    with open_bank(run.bank, use_env=False) as reader:
        asm: Assembly = compile_model(
            models / "transformer.onnx", out, reader, precision=precision, check_options=False
        )
    doc = run.result
    assert asm.job_type == job_type
    # The job's tasks, by id, each answered as the job decided it; the budget's leftovers
    # (skipped, failed) are the only misses, and the model-level record is a hit.
    assert sorted(t.task_id for t in asm.tasks) == sorted(t["task_id"] for t in doc["tasks"])
    untuned = {t["task_id"] for t in doc["tasks"] if t["update_mode"] in ("skipped", "failed")}
    by_id = {t.task_id: t for t in asm.tasks}
    for t in doc["tasks"]:
        got = by_id[t["task_id"]]
        if t["task_id"] in untuned:
            assert got.status == "miss", (t, got)
        else:
            assert got.status in ("hit", "default", "reverted"), (t, got)
            assert got.strategy == (t["strategy"] if got.status == "hit" else "default"), (t, got)
    assert asm.session.status in ("hit", "default")
    assert (asm.hits, asm.misses) == (len(doc["tasks"]) + 1 - len(untuned), len(untuned))
    # What shipped, built again: op types and initializers (names, types, shapes), then the
    # whole graph (initializer values included).
    compiled = onnx.load(str(out))
    assert _graph_facts(compiled) == _graph_facts(run.tuned), doc["confirmation"]
    assert compiled.graph == run.tuned.graph, doc["confirmation"]
    assert _meta(compiled) == {**_meta(run.tuned), "aoe.version": _meta(compiled)["aoe.version"]}

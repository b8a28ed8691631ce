"""JobSpec and JobOutcome: one shape each, converted once per edge, both ways.

Every edge's pair gives back what it was given (hypothesis draws the specs and outcomes),
and a spec is checked once, where it is built: every refusal names the field, as the edge
that built it spells it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoe import sizes
from aoe.errors import OptionError
from aoe.figures import Comparison, Figures
from aoe.outcome import (
    BudgetReport,
    GdatDetails,
    JobOutcome,
    OnnxDetails,
    StageTime,
    TaskOutcome,
)
from aoe.shapes import ShapeProfile
from aoe.spec import (
    FOLDER_KEYS,
    MAX_BUDGET_S,
    JobSpec,
    JobType,
    Precision,
    Runtime,
    Stage,
    check_model_kind,
)
from aoe.specargs import add_arguments, from_args, to_argv
from aoe.v1 import tuning_pb2
from aoe.wire import outcome_from_pb, outcome_to_pb, spec_from_pb, spec_to_pb

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
#: names the command line can carry: NAME:D1,D2 and KEY=VALUE items, stripped, ';'-joinable
ARG_NAMES = st.text("abcxyz_0123:./-", min_size=1, max_size=10).filter(lambda s: s == s.strip())
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)


#: The fields of a GDAT spec (the rest are ONNX jobs' and stay unset).
GDAT_KEYS = (
    "job_type",
    "repeat_tune",
    "budget_s",
    "priority",
    "labels",
    "world_size",
    "backend",
    "gradient_precision",
    "entry",
)


def profiles(names: st.SearchStrategy[str] = NAMES) -> st.SearchStrategy[ShapeProfile]:
    """Shape profiles: ranges (lo~hi among sizes), or -1 dimensions with gears to fill them."""
    size = st.integers(1, 1 << 40)
    span = st.tuples(st.integers(1, 1000), st.integers(1001, 1 << 40)).map(
        lambda t: f"{t[0]}~{t[1]}"
    )
    ranged = st.dictionaries(
        names,
        st.lists(size | span, min_size=1, max_size=4).filter(
            lambda ds: any(isinstance(d, str) for d in ds)
        ),
        min_size=1,
        max_size=2,
    ).map(lambda d: ShapeProfile({k: ",".join(map(str, v)) for k, v in d.items()}))
    geared = st.dictionaries(
        names,
        st.lists(st.just(-1) | size | span, min_size=1, max_size=3).filter(lambda ds: -1 in ds),
        min_size=1,
        max_size=2,
    ).flatmap(
        lambda d: (
            st.lists(
                st.lists(st.integers(1, 4096), min_size=n, max_size=n),
                min_size=1,
                max_size=4,
            ).map(
                lambda gears, d=d: ShapeProfile(
                    {k: ",".join(map(str, v)) for k, v in d.items()},
                    ";".join(",".join(map(str, g)) for g in gears),
                )
            )
            if (n := sum(v.count(-1) for v in d.values()))
            else st.nothing()
        )
    )
    return st.just(ShapeProfile()) | ranged | geared


def specs(
    names: st.SearchStrategy[str] = NAMES, keys: tuple[str, ...] | None = None
) -> st.SearchStrategy[JobSpec]:
    """ONNX jobs' specs and GDAT jobs' (`keys`: the fields drawn, of those a job type has)."""
    return _specs(names, keys, gdat=False) | _specs(names, keys, gdat=True)


def _specs(
    names: st.SearchStrategy[str], keys: tuple[str, ...] | None, gdat: bool
) -> st.SearchStrategy[JobSpec]:
    fields = {
        "precision": st.sampled_from(list(Precision)),
        "job_type": st.just(JobType.GDAT)
        if gdat
        else st.sampled_from([t for t in JobType if t != JobType.GDAT]),
        "input_shapes": st.dictionaries(
            names, st.lists(st.integers(1, 1 << 40), min_size=1, max_size=4), max_size=3
        ),
        "repeat_tune": st.booleans(),
        "device": st.sampled_from([None, "cpu", "cuda:0", "cann:3", "tensorrt:1"]),
        "budget_s": st.none() | st.floats(1e-3, MAX_BUDGET_S),
        "min_cosine": st.none() | st.floats(1e-6, 1.0),
        "max_rel_error": st.none() | st.floats(1e-9, 1e9),
        "calibration_dir": st.none()
        | st.builds(Path, st.sampled_from(["/srv/calib", "/a b/c", "/ü/x"])),
        "priority": st.integers(-10, 10),
        "labels": st.dictionaries(names.filter(lambda s: "=" not in s), names, max_size=3),
        "keep_initializer_inputs": st.booleans(),
        "runtime": st.sampled_from(list(Runtime)),
        "world_size": st.none() | st.integers(1, 64),
        "backend": st.none() | st.sampled_from(["gloo", "nccl", "hccl"]),
        "gradient_precision": st.none() | st.sampled_from(["exact", "fp16", "bf16", "lowrank"]),
        "entry": st.none() | st.sampled_from(["build", "make_model"]),
        "shape_profile": profiles(names),
    }
    # aoed.toml spells the profile in input_shapes and dynamic_dims
    keys = [
        "shape_profile" if k == "dynamic_dims" else k
        for k in keys or tuple(fields)
        if (k in GDAT_KEYS if gdat else k not in GDAT_KEYS[5:])
    ]
    return (
        st.fixed_dictionaries({k: fields[k] for k in keys})
        .filter(
            lambda d: (
                not set(d.get("input_shapes", {})) & set(d.get("shape_profile", {}).dims)
                if "shape_profile" in d
                else True
            )
        )
        .map(lambda d: JobSpec(**d))
    )


# --------------------------------------------------------------------------- round trips


@given(specs())
def test_a_spec_survives_the_job_store(spec: JobSpec) -> None:
    assert JobSpec.from_dict(spec.to_dict()) == spec


@given(specs(keys=FOLDER_KEYS))
def test_a_spec_survives_an_aoed_toml(spec: JobSpec) -> None:
    assert JobSpec.from_toml(tomllib.loads(spec.to_toml())) == spec


@given(specs())
def test_a_spec_survives_the_api(spec: JobSpec) -> None:
    assert spec_from_pb(spec_to_pb(spec)) == spec
    assert (
        spec_from_pb(tuning_pb2.JobOptions.FromString(spec_to_pb(spec).SerializeToString())) == spec
    )


@settings(max_examples=60)
@given(specs(names=ARG_NAMES))
def test_a_spec_survives_the_command_line(spec: JobSpec) -> None:
    # --entry FILE.py:FUNCTION: the file is the model, which to_argv leaves out
    spec = spec.replace(entry=None)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert from_args(p.parse_args(to_argv(spec))) == spec


def test_the_edges_take_what_users_type() -> None:
    """The same job, as each edge spells it."""
    want = JobSpec(
        precision="int8", job_type="opat", input_shapes={"x": [1, 3]}, budget_s=2.5, priority=3
    )
    toml = 'precision = "int8"\njob_type = "2"\nbudget_s = 2.5\npriority = 3\n[input_shapes]\nx = [1, 3]\n'
    assert JobSpec.from_toml(tomllib.loads(toml)) == want
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = [
        "--precision",
        "INT8",
        "--job-type",
        "2",
        "--input-shape",
        "x:1,3",
        "--budget",
        "2.5",
        "--priority",
        "3",
    ]
    assert from_args(p.parse_args(argv)) == want
    opts = tuning_pb2.JobOptions(
        precision=2,
        job_type=tuning_pb2.JOB_TYPE_OPAT,
        budget_s=2.5,
        priority=3,
        input_shapes=[tuning_pb2.InputShape(name="x", dims=[1, 3])],
    )
    assert spec_from_pb(opts) == want
    # Unset in the API's terms: 0 and "".
    assert spec_from_pb(tuning_pb2.JobOptions()) == JobSpec()


def outcomes() -> st.SearchStrategy[JobOutcome]:
    text = st.text(max_size=12)
    accuracy = st.just({}) | st.fixed_dictionaries(
        {"max_abs_error": FINITE, "max_rel_error": FINITE, "cosine": FINITE}
    )
    task = st.builds(
        TaskOutcome,
        text,
        text,
        text,
        family=text,
        instances=st.integers(1, 1000),
        share=FINITE,
        strategy=st.sampled_from(["default", "int8_dynamic", "gemm_transposed"]),
        before_us=FINITE,
        after_us=FINITE,
        update_mode=st.sampled_from(
            ["add", "update", "reserved", "hit", "unsatisfied", "failed", "skipped", ""]
        ),
        bank_layer=text,
        accuracy=accuracy,
        error=text,
        rejected=st.lists(text, max_size=2).map(tuple),
        applied=st.booleans(),
        attempt=st.integers(0, 5),
    )
    shipped = st.builds(
        lambda b, r, ci, n: Figures.shipping("tuned", b, r, ci, n),
        st.floats(0.01, 100.0),
        st.floats(0.2, 0.99),
        st.tuples(st.floats(0.1, 0.2), st.floats(0.99, 1.5)),
        st.integers(1, 40),
    )
    kept = st.builds(
        lambda b, n, c: Figures.unchanged("no significant change", b, n, c),
        st.floats(0.01, 100.0),
        st.integers(0, 40),
        st.none()
        | st.builds(
            Comparison, st.just("tuned"), st.just("input"), FINITE, st.tuples(FINITE, FINITE)
        ),
    )
    stage = st.builds(
        StageTime, FINITE, FINITE, FINITE, st.booleans(), st.none() | FINITE, st.none() | FINITE
    )
    budget = st.builds(
        BudgetReport,
        FINITE,
        st.booleans(),
        FINITE,
        FINITE,
        FINITE,
        FINITE,
        FINITE,
        FINITE,
        st.none() | FINITE,
        FINITE,
        FINITE,
        st.dictionaries(st.sampled_from(list(Stage)), stage),
    )
    bank_keys = (
        "repo_add_num",
        "repo_hit_num",
        "repo_reserved_num",
        "repo_unsatisfied_num",
        "repo_update_num",
        "total_num",
        "repo_not_tuned_num",
    )
    gdat = st.builds(
        GdatDetails,
        gradient_precision=st.sampled_from(["exact", "fp16", "lowrank"]),
        backend=st.sampled_from(["gloo", "nccl"]),
        world_size=st.integers(1, 64),
        baseline_tail_ms=FINITE,
        result_tail_ms=FINITE,
        ddp_config=st.fixed_dictionaries({"label": text, "ddp_kwargs": st.just({})}),
        ddp_config_file=text,
        update_mode=st.sampled_from(["add", "hit", "unsatisfied"]),
        gates=st.lists(
            st.fixed_dictionaries({"config": text, "passed": st.booleans()}), max_size=2
        ),
    )
    # A job type and the details it has: GDAT's own, none for the ONNX job types.
    kind = st.tuples(st.just(JobType.GDAT), gdat) | st.tuples(
        st.sampled_from([t for t in JobType if t != JobType.GDAT]), st.just(OnnxDetails())
    )
    return st.builds(
        lambda *args, kind, **kw: JobOutcome(*args, job_type=kind[0], details=kind[1], **kw),
        text,
        text,
        text,
        text,
        st.sampled_from(list(Precision)),
        device=text,
        tuning_time_s=FINITE,
        figures=shipped | kept,
        kind=kind,
        tasks=st.lists(task, max_size=3).map(tuple),
        bank=st.fixed_dictionaries({k: st.integers(0, 1000) for k in bank_keys}),
        resources=st.dictionaries(
            st.sampled_from(["trials", "device_s", "duty_cycle", "failed_candidates"]),
            st.integers(0, 1 << 40).map(float),
        ),
        budget=budget,
        session_options=st.dictionaries(
            st.sampled_from(["intra_op_num_threads", "execution_mode"]), st.integers(0, 8)
        ),
        accuracy=st.dictionaries(st.sampled_from(["cosine", "max_rel_error", "samples"]), FINITE),
        accuracy_budget=st.dictionaries(st.sampled_from(["min_cosine", "max_rel_error"]), FINITE),
        calibration=text,
        verified=st.sampled_from(["tuned", "options only", "reverted to input"]),
        runtime=st.sampled_from(["onnxruntime", "openvino"]),
        runtime_options=st.dictionaries(
            st.sampled_from(["INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT"]),
            st.sampled_from(["bf16", "f32", "LATENCY"]),
        ),
        notes=st.lists(text, max_size=2).map(tuple),
    )


@given(outcomes())
def test_an_outcome_survives_the_job_store(o: JobOutcome) -> None:
    assert JobOutcome.from_dict(o.to_dict()) == o


@given(outcomes())
def test_an_outcome_survives_the_api(o: JobOutcome) -> None:
    back = outcome_from_pb(
        tuning_pb2.JobResult.FromString(outcome_to_pb(o).SerializeToString()), o.job_id
    )
    assert back == o


def test_what_the_job_store_keeps_has_the_stored_layout() -> None:
    """The library writes the store's JSON: the keys, their order and their JSON types
    are those older daemons wrote and read (round trips alone would not notice a key
    renamed both ways)."""
    spec = JobSpec(input_shapes={"x": [1, 3]}, calibration_dir="/c", labels={"k": "v"})
    assert json.loads(json.dumps(spec.to_dict())) == {
        "precision": "exact",
        "job_type": "sgat+opat",
        "input_shapes": {"x": [1, 3]},
        "repeat_tune": False,
        "device": None,
        "budget_s": None,
        "min_cosine": None,
        "max_rel_error": None,
        "calibration_dir": "/c",
        "priority": 0,
        "labels": {"k": "v"},
        "keep_initializer_inputs": False,
        "runtime": "auto",
        "world_size": None,
        "backend": None,
        "gradient_precision": None,
        "entry": None,
    }
    budget = BudgetReport(
        10.0,
        stages={
            Stage.PREPARE: StageTime(0.0, 1.5),
            Stage.SEARCH: StageTime(4.0, 4.0, 0.5, True, 4.0),
        },
    )
    o = JobOutcome(
        "j", "/m.onnx", "/t.onnx", "/r.json", "exact", "opat", "cpu", 3.0,
        Figures.unchanged("no significant change", 2.0, 8),
        tasks=(TaskOutcome("t0", "fc", "MatMul", update_mode="hit", rejected=("why",)),),
        budget=budget,
        notes=("n",),
    )  # fmt: skip
    d = json.loads(json.dumps(o.to_dict()))
    assert list(d) == [
        "job_id", "model", "tuned_model", "result_json", "precision", "job_type", "device",
        "tuning_time_s", "figures", "tasks", "bank", "resources", "budget", "session_options",
        "accuracy", "accuracy_budget", "calibration", "verified", "runtime", "runtime_options",
        "notes", "workspace", "details",
    ]  # fmt: skip
    assert d["tasks"] == [
        {
            "task_id": "t0", "op_name": "fc", "op_type": "MatMul", "family": "", "instances": 1,
            "share": 0.0, "strategy": "default", "before_us": 0.0, "after_us": 0.0,
            "update_mode": "hit", "bank_layer": "", "accuracy": {}, "error": "",
            "rejected": ["why"], "applied": True, "attempt": 0,
        }
    ]  # fmt: skip
    assert list(d["budget"])[-2:] == ["outside_s", "stages"] and d["budget"]["outside_s"] == 1.5
    assert d["budget"]["stages"] == {
        "prepare": {"given_s": 0.0, "spent_s": 1.5, "over_s": 0.0, "counted": False},
        "search": {"given_s": 4.0, "spent_s": 4.0, "over_s": 0.5, "counted": True, "device_s": 4.0},
    }
    assert (d["precision"], d["job_type"], d["notes"], d["details"]) == ("exact", "opat", ["n"], {})
    assert JobOutcome.from_dict(d) == o


def test_an_outcome_stored_by_an_older_daemon_still_reads() -> None:
    old = {
        "verdict": "faster",
        "shipped": "tuned",
        "baseline_ms": 2.0,
        "improvement": 0.25,
        "improvement_ci95": [0.2, 0.3],
        "tuned_model": "/o/t.onnx",
        "result_json": "/o/r.json",
        "repo": {"repo_add_num": 1, "total_num": 2},
        "tasks": [
            {
                "task_id": "t0",
                "op_type": "MatMul",
                "op_name": "fc",
                "strategy": "int8_dynamic",
                "before_us": 2.0,
                "after_us": 1.0,
                "update_mode": "add",
                "bank_layer": "",
                "error": "",
            }
        ],
    }
    o = JobOutcome.from_dict(old)
    assert (o.figures.result_ms, o.bank["repo_add_num"], o.tasks[0].improvement) == (1.6, 1, 1.0)


# --------------------------------------------------------------------------- checked once


#: (fields, the field the refusal names, words it says)
BAD = [
    ({"precision": "fp3"}, "precision", "not supported"),
    ({"job_type": "3"}, "job_type", "expected opat"),
    ({"budget_s": math.inf}, "budget_s", "finite"),
    ({"budget_s": math.nan}, "budget_s", "finite"),
    ({"budget_s": 0.0}, "budget_s", "positive"),
    ({"budget_s": MAX_BUDGET_S * 2}, "budget_s", "a week"),
    ({"budget_s": True}, "budget_s", "expected a number"),
    ({"min_cosine": 1.5}, "min_cosine", "(0, 1]"),
    ({"min_cosine": math.nan}, "min_cosine", "finite"),
    ({"max_rel_error": -1.0}, "max_rel_error", "positive"),
    ({"max_rel_error": math.inf}, "max_rel_error", "finite"),
    ({"priority": 11}, "priority", "between -10 and 10"),
    ({"priority": 1.5}, "priority", "whole number"),
    ({"repeat_tune": "yes"}, "repeat_tune", "true or false"),
    ({"device": "gpu:0"}, "device", "unknown kind"),
    ({"device": "cuda:x"}, "device", "KIND:INDEX"),
    ({"device": "c" * (sizes.MAX_NAME_BYTES + 1)}, "device", "over the limit"),
    ({"input_shapes": {"x": [0]}}, "input shape x", "positive whole numbers"),
    ({"input_shapes": {"x": [True]}}, "input shape x", "positive whole numbers"),
    ({"input_shapes": [1]}, "input_shapes", "table"),
    ({"input_shapes": {"x": [1] * (sizes.MAX_DIMS + 1)}}, "input shape", "over the limit"),
    ({"input_shapes": {"x": [1, sizes.MAX_DIM + 1]}}, "input shape", "over the limit"),
    (
        {"input_shapes": {str(i): [1] for i in range(sizes.MAX_INPUT_SHAPES + 1)}},
        "input_shapes",
        "over the limit",
    ),
    (
        {"labels": {str(i): "" for i in range(sizes.MAX_LABELS + 1)}},
        "labels",
        "over the limit of 64",
    ),
    (
        {"labels": {"k": "v" * (sizes.MAX_LABEL_VALUE_BYTES + 1)}},
        "labels['k']: the value",
        "over the limit",
    ),
    ({"calibration_dir": "/" + "c" * sizes.MAX_PATH_BYTES}, "calibration_dir", "over the limit"),
]


@pytest.mark.parametrize(("fields", "field", "words"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_a_spec_no_job_can_run_with_is_refused_naming_the_field(
    fields: dict, field: str, words: str
) -> None:
    with pytest.raises(OptionError) as info:
        JobSpec(**fields)
    assert str(info.value).startswith(field) and words in str(info.value), info.value


def test_the_command_line_names_its_flags_and_a_drop_folder_its_keys() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, flag in (
        (["--budget", "inf"], "--budget inf"),
        (["--priority", "12"], "--priority 12"),
        (["--min-cosine", "2"], "--min-cosine 2.0"),
        (["--input-shape", "x:1,a"], "--input-shape"),
        (["--label", "novalue"], "--label"),
    ):
        with pytest.raises(OptionError) as info:
            from_args(p.parse_args(argv))
        assert str(info.value).startswith(flag), info.value
    with pytest.raises(OptionError, match=r"'device': unknown key"):
        JobSpec.from_toml({"device": "cpu"})  # not a drop folder's to choose


def test_the_shapes_import_nothing_heavy() -> None:
    """The CLI and the gRPC client build specs and read outcomes without onnx, trio,
    grpc or numpy."""
    code = (
        "import sys, aoe.spec, aoe.specargs, aoe.outcome; aoe.spec.JobSpec(device='cuda:1'); "
        "print(sorted(m for m in ('onnx', 'trio', 'grpc', 'numpy', 'onnxruntime') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_gdat_spec_takes_gdat_options_only() -> None:
    """GDAT's options belong to GDAT jobs and ONNX jobs' to theirs: each refusal names the
    flag as typed."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    spec = from_args(
        p.parse_args(
            [
                "--job-type",
                "4",
                "--world-size",
                "3",
                "--backend",
                "GLOO",
                "--gradient-precision",
                "fp16",
                "--entry",
                "train.py:build",
            ]
        )
    )
    assert (spec.job_type, spec.world_size, spec.backend, spec.gradient_precision, spec.entry) == (
        JobType.GDAT,
        3,
        "gloo",
        "fp16",
        "build",
    )
    assert spec_from_pb(spec_to_pb(spec)) == spec and JobSpec.from_dict(spec.to_dict()) == spec
    for argv, words in [
        (["--world-size", "2"], "--world-size applies to job_type gdat"),
        (["--job-type", "gdat", "--precision", "int8"], "--precision applies to ONNX jobs"),
        (["--job-type", "gdat", "--input-shape", "x:1"], "--input-shape applies to ONNX jobs"),
        (
            ["--job-type", "gdat", "--backend", "mpi"],
            "--backend mpi: expected one of gloo, nccl, hccl",
        ),
        (["--job-type", "gdat", "--world-size", "0"], "--world-size 0: must be a whole number"),
        (
            ["--job-type", "gdat", "--entry", "train.py"],
            "--entry train.py: expected FILE.py:FUNCTION",
        ),
    ]:
        with pytest.raises(OptionError, match=words.replace("(", r"\(")):
            from_args(p.parse_args(argv))


@pytest.mark.parametrize(
    ("model", "job_type", "entry", "daemon", "words"),
    [
        ("m.onnx", "gdat", None, False, "m.onnx: --job-type gdat tunes a torch.export program"),
        ("m.onnx", "gdat", None, True, "m.onnx: job_type gdat tunes a torch.export program"),
        ("m.py", "gdat", None, False, "or, with --entry FILE.py:FUNCTION, your own training code"),
        ("m.pt2", "gdat", "build", False, "--entry m.pt2:build: expected a .py file"),
        ("m.py", "gdat", "build", True, "entry build: the daemon runs no user code"),
    ],
)
def test_the_model_kind_rule_is_said_as_each_edge_spells_it(
    model: str, job_type: str, entry: str | None, daemon: bool, words: str
) -> None:
    """One rule, stated once (aoe.spec.check_model_kind), for the CLI, the daemon's
    admission and a GDAT run: GDAT tunes a .pt2 or, embedded, a .py with an entry; the
    others an .onnx, or a .pt2 for inference (exported to ONNX)."""
    with pytest.raises(OptionError, match=re.escape(words)):
        check_model_kind(model, JobType(job_type), entry, daemon=daemon)
    check_model_kind("m.pt2", JobType.GDAT)
    check_model_kind("m.py", JobType.GDAT, "build")
    check_model_kind("m.onnx", JobType.OPAT, daemon=daemon)
    check_model_kind("m.pt2", JobType.SGAT_OPAT, daemon=daemon)

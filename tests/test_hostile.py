"""The hostile corpus (tests/hostile.py) through `aoe tune` and through one real daemon.

The contract: every kind ends in a clear, categorized error: the exit code (or the job's
error_kind) of the class the kind declares, one line that names the problem, no
traceback, nothing written to the bank; a legitimately tunable kind may succeed. After
all of them the daemon still serves and tunes a normal model. External data that points
outside the model's folder is refused without the file outside ever being opened, which
is watched with inotify rather than assumed. Last, graph preparation is fuzzed: a mutated
model either prepares or raises an AoedError, never anything else.

Cost: every `aoe tune` starts an engine (a measurement runner and a compile worker, each
importing onnxruntime: about 4 s on 2 cores), so make test runs a few kinds through the
command line, one for each edge a failure crosses, and all of them through the daemon,
which keeps its engine; AOED_HOSTILE=all runs every kind through `aoe tune` (3-4 min).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aoe import errors
from aoe.bank import open_bank
from aoe.errors import AoedError, BankError
from aoe.v1 import tuning_pb2, tuning_pb2_grpc
from aoed import samples
from aoed.engine.prep import prepare

from .conftest import run_aoe
from .daemon_util import DaemonProcess, upload
from .helpers import wait_for
from .hostile import KINDS, Case, Kind, sentinel
from .inotify import Inotify

pytestmark = pytest.mark.slow

#: Run through `aoe tune` by make test, besides the escaping kinds (in the inotify test):
#: a size limit (once a numpy traceback), the node limit, bytes that are no text in the
#: one line, onnxruntime failing in the worker, and the bad places of the command line,
#: which fail before an engine starts (1.5 s each).
CLI_KINDS = (
    "dims_2_pow_40",
    "million_nodes",
    "non_utf8_names",
    "fails_at_run_time",
    "output_unwritable",
    "output_is_file",
    "bank_is_file",
)
ESCAPES = [k for k in KINDS.values() if k.escapes]
MODELS = [k for k in KINDS.values() if not k.cli_only]
FAILING = [k for k in MODELS if k.error is not None]
TUNABLE = [k for k in MODELS if k.error is None]
#: The one class a legitimately tunable kind may fail with: its message must then name the
#: problem (the kind's pattern). An internal or device error on such a model is a bug.
TUNABLE_MAY_FAIL_AS = errors.ModelError


def _cli_kinds() -> list[Kind]:
    every = os.environ.get("AOED_HOSTILE") == "all"
    return [k for k in KINDS.values() if not k.escapes and (every or k.name in CLI_KINDS)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def daemon_proc(tmp_path_factory: pytest.TempPathFactory):
    """The daemon every kind goes to (started by `daemon`); its models folder is the
    only one it may read by path, and holds the corpus."""
    d = DaemonProcess(tmp_path_factory.mktemp("hostile") / "d", parallel=1)
    # The whole corpus is submitted at once, from one client.
    d.config.write_text(
        d.config.read_text().replace(
            "[daemon]\n", "[daemon]\nmax_jobs_per_client = 200\nmax_queued_jobs = 200\n"
        )
    )
    yield d
    d.close()


@pytest.fixture(scope="module")
def corpus(daemon_proc: DaemonProcess) -> dict[str, Case]:
    """Every kind built once, each in its own folder under the daemon's models folder;
    the escaping kinds' sentinels lie outside it."""
    return {k.name: k.build(daemon_proc.models / k.name) for k in KINDS.values()}


@pytest.fixture(scope="module")
def daemon(daemon_proc: DaemonProcess) -> DaemonProcess:
    daemon_proc.start()
    return daemon_proc


def _records(bank: Path) -> list[str]:
    """Keys of every record in the bank at `bank`; none when it was never created."""
    if not bank.is_dir() or not any(bank.iterdir()):
        return []
    try:
        reader = open_bank(bank, use_env=False)
    except BankError as exc:  # a folder with a lock file and no store: nothing was written
        if "no bank" in str(exc):
            return []
        raise
    try:
        return [
            f"{rec.WhichOneof('record')}:{getattr(rec, rec.WhichOneof('record')).key}"
            for _, rec in reader.records(history=True)
        ]
    finally:
        reader.close()


def _tune(case: Case, tmp: Path):
    return run_aoe(
        "tune",
        str(case.model),
        "--budget",
        "1",
        "--no-progress",
        "--parallel",
        "1",
        "--bank",
        str(tmp / "bank"),
        "--output",
        str(tmp / "out"),
        *case.args,
        timeout=180,
    )


def _check_cli(kind: Kind, proc, bank: Path) -> None:
    lines = proc.stderr.splitlines()
    if kind.error is None and proc.returncode == 0:
        return
    assert "Traceback" not in proc.stderr, f"{kind.name}: a traceback:\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("aoe: error: "), (
        f"{kind.name}: not one error line:\n{proc.stderr}"
    )
    if kind.error is None:  # tunable, and it failed: as the model's problem, named
        assert proc.returncode == TUNABLE_MAY_FAIL_AS.exit_code, (kind.name, proc.stderr)
        assert re.search(kind.says, lines[0], re.IGNORECASE), (
            f"{kind.name}: the message does not match {kind.says!r}"
        )
        return
    assert proc.returncode == kind.error.exit_code, (
        f"{kind.name}: exit {proc.returncode}, not {kind.error.__name__}"
        f" ({kind.error.exit_code}): {proc.stderr}"
    )
    assert re.search(kind.says, lines[0], re.IGNORECASE), (
        f"{kind.name}: the message does not match {kind.says!r}: {lines[0]}"
    )
    assert _records(bank) == [], f"{kind.name}: a failed run wrote to the bank"


# --------------------------------------------------------------------------- (a) aoe tune


@pytest.mark.parametrize("kind", _cli_kinds(), ids=lambda k: k.name)
def test_aoe_tune_ends_in_one_categorized_line(
    kind: Kind, corpus: dict[str, Case], tmp_path: Path
) -> None:
    _check_cli(kind, _tune(corpus[kind.name], tmp_path), tmp_path / "bank")


# --------------------------------------------------------------------------- (b) the daemon


@dataclass
class Outcome:
    state: str  # SUCCEEDED, FAILED, ... or REFUSED (SubmitJob answered with an error)
    kind: str  # the job's error_kind, or the gRPC status of a refused submission
    message: str


@dataclass
class DaemonRun:
    outcomes: dict[str, Outcome]
    bank_after_failures: list[str]
    events: list[tuple[Path, int]]  # opens/reads of the escaping kinds' sentinels


def _submit(d: DaemonProcess, model: Path, by_path: bool) -> str:
    """Submit `model` with a 1 s budget: by its path (inside the allowed folder), or
    uploaded (a single file: what a remote client sends)."""
    opts = tuning_pb2.JobOptions(budget_s=1.0)
    if by_path:
        req = tuning_pb2.SubmitJobRequest(model_path=str(model), options=opts)
    else:
        req = tuning_pb2.SubmitJobRequest(model_id=upload(d.tuning(), model), options=opts)
    return d.tuning().SubmitJob(req, timeout=60).job_id


@pytest.fixture(scope="module")
def daemon_run(daemon: DaemonProcess, corpus: dict[str, Case]) -> DaemonRun:
    """Every model kind submitted to the one daemon, the failing ones first (the bank is
    read once they are all final), then the tunable ones; the escaping kinds' sentinels
    are watched throughout."""
    watch = Inotify()
    for k in ESCAPES:
        watch.watch(sentinel(daemon.models / k.name))
    outcomes: dict[str, Outcome] = {}
    bank_after: list[str] = []
    try:
        for group in (FAILING, TUNABLE):
            jobs = {}
            for k in group:
                try:
                    jobs[k.name] = _submit(daemon, corpus[k.name].model, k.by_path)
                except grpc.RpcError as exc:
                    outcomes[k.name] = Outcome("REFUSED", exc.code().name, exc.details() or "")
            for name, job_id in jobs.items():
                job = daemon.wait_job(job_id, timeout=180)
                outcomes[name] = Outcome(
                    tuning_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
                    job.error_kind,
                    job.error,
                )
            if group is FAILING:
                bank_after = _records(daemon.bank)
        return DaemonRun(outcomes, bank_after, watch.events())
    finally:
        watch.close()


@pytest.mark.parametrize("kind", FAILING, ids=lambda k: k.name)
def test_daemon_job_fails_with_the_kinds_class(kind: Kind, daemon_run: DaemonRun) -> None:
    got = daemon_run.outcomes[kind.name]
    assert kind.error is not None
    if got.state == "REFUSED":
        # a path the daemon will not read, or a file over a limit: refused at once
        assert got.kind == kind.error.grpc_status, (kind.name, got)
    else:
        assert (got.state, got.kind) == ("FAILED", kind.error.__name__), (kind.name, got)
    assert "\n" not in got.message and re.search(kind.says, got.message, re.IGNORECASE), (
        kind.name,
        got.message,
    )


@pytest.mark.parametrize("kind", TUNABLE, ids=lambda k: k.name)
def test_daemon_tunable_kind_succeeds_or_names_its_error(kind: Kind, daemon_run: DaemonRun) -> None:
    got = daemon_run.outcomes[kind.name]
    if got.state == "SUCCEEDED":
        return
    # A model the corpus calls tunable may fail only as the model's problem, named.
    assert (got.state, got.kind) == ("FAILED", TUNABLE_MAY_FAIL_AS.__name__), (kind.name, got)
    assert "\n" not in got.message and re.search(kind.says, got.message, re.IGNORECASE), (
        kind.name,
        got.message,
    )


def test_daemon_still_serves_after_the_corpus(daemon: DaemonProcess, daemon_run: DaemonRun) -> None:
    assert daemon_run.bank_after_failures == [], "failed jobs wrote to the bank"
    assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died"
    with grpc.insecure_channel(daemon.target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    path = daemon.models / "mlp.onnx"
    samples.save(samples.build("mlp"), path)
    job = daemon.wait_job(_submit(daemon, path, by_path=False), timeout=300)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    assert job.result.tasks, "the normal model was tuned"


# --------------------------------------------------------------------------- (b2) options

INF, NAN = float("inf"), float("nan")

#: Options no job can run with: (id, JobOptions fields, the field the refusal names).
BAD_OPTIONS = [
    ("budget_inf", {"budget_s": INF}, "budget_s"),
    ("budget_nan", {"budget_s": NAN}, "budget_s"),
    ("budget_overflows", {"budget_s": 1e308}, "budget_s"),
    (
        "min_cosine_nan",
        {"accuracy_budget": tuning_pb2.AccuracyBudget(min_cosine=NAN)},
        "min_cosine",
    ),
    (
        "max_rel_error_inf",
        {"accuracy_budget": tuning_pb2.AccuracyBudget(max_rel_error=INF)},
        "max_rel_error",
    ),
    (
        "max_rel_error_nan",
        {"accuracy_budget": tuning_pb2.AccuracyBudget(max_rel_error=NAN)},
        "max_rel_error",
    ),
    ("precision_99", {"precision": 99}, "precision"),
    ("job_type_77", {"job_type": 77}, "job_type"),
]


@pytest.fixture(scope="module")
def small_model(daemon: DaemonProcess) -> Path:
    path = daemon.models / "options" / "mlp.onnx"
    path.parent.mkdir(exist_ok=True)
    samples.save(samples.build("mlp"), path)
    return path


@pytest.mark.parametrize(
    ("fields", "field"), [c[1:] for c in BAD_OPTIONS], ids=[c[0] for c in BAD_OPTIONS]
)
def test_an_option_no_job_can_run_with_is_invalid_argument_naming_it(
    daemon: DaemonProcess, small_model: Path, fields: dict, field: str
) -> None:
    before = {
        j.job_id for j in daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=30).jobs
    }
    req = tuning_pb2.SubmitJobRequest(
        model_path=str(small_model), options=tuning_pb2.JobOptions(**fields)
    )
    with pytest.raises(grpc.RpcError) as info:
        daemon.tuning().SubmitJob(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details(), info.value.details()
    after = {
        j.job_id for j in daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=30).jobs
    }
    assert after == before, "a refused submission left a job behind"


def test_list_jobs_with_an_unknown_state_is_invalid_argument(
    daemon: DaemonProcess, small_model: Path
) -> None:
    # A job in the store, so that "everything" would not be an empty answer.
    daemon.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_path=str(small_model), options=tuning_pb2.JobOptions(budget_s=1.0)
        ),
        timeout=60,
    )
    with pytest.raises(grpc.RpcError) as info:
        daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest(states=[99]), timeout=30)
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "states 99" in info.value.details()
    )
    known = daemon.tuning().ListJobs(
        tuning_pb2.ListJobsRequest(
            states=[
                tuning_pb2.JOB_STATE_QUEUED,
                tuning_pb2.JOB_STATE_SUCCEEDED,
                tuning_pb2.JOB_STATE_PREPARING,
                tuning_pb2.JOB_STATE_TUNING,
                tuning_pb2.JOB_STATE_VERIFYING,
            ]
        ),
        timeout=30,
    )
    assert known.jobs, "known states still filter as before"


def test_a_non_finite_budget_in_an_inbox_aoed_toml_sends_the_model_to_failed_naming_it(
    daemon: DaemonProcess,
) -> None:
    folder = daemon.inbox
    failed = folder.parent / "failed"
    (folder / "aoed.toml").write_text("budget_s = inf\n")  # TOML has inf and nan literals
    try:
        samples.save(samples.build("mlp"), folder / "toml_inf.onnx")
        report = failed / "toml_inf.onnx.error.txt"
        wait_for(report.exists, 120, "the model in failed/", poll=0.2, detail=daemon.log_tail)
        text = report.read_text()
        assert "aoed.toml" in text and "budget_s" in text and "finite" in text, text
        assert (failed / "toml_inf.onnx").exists()
    finally:
        (folder / "aoed.toml").unlink(missing_ok=True)


# --------------------------------------------------------------------------- (c) nothing outside is read


def test_external_data_outside_is_never_opened(
    daemon_run: DaemonRun, corpus: dict[str, Case], tmp_path: Path
) -> None:
    assert daemon_run.events == [], (
        f"the daemon opened files outside the model's folder: {daemon_run.events}"
    )
    watch = Inotify()
    try:
        for k in ESCAPES:
            watch.watch(sentinel(corpus[k.name].model.parent))
        for k in ESCAPES:
            _check_cli(k, _tune(corpus[k.name], tmp_path / k.name), tmp_path / k.name / "bank")
        assert watch.events() == [], "aoe tune opened a file outside the model's folder"
        # The watch itself works, through the hard link too (it sees the inode).
        (corpus["external_hardlink"].model.parent / "weights.bin").read_bytes()
        seen = watch.events()
        assert any(m & Inotify.IN_OPEN for _, m in seen) and any(
            m & Inotify.IN_ACCESS for _, m in seen
        ), seen
    finally:
        watch.close()


# --------------------------------------------------------------------------- (d) fuzzing preparation


def _base() -> onnx.ModelProto:
    return samples.mlp(features=8, hidden=8, classes=4, layers=2)


BASE = _base().SerializeToString()


def _prepared_or_ours(data: bytes) -> None:
    """The property: `prepare` (what the compile worker runs) returns a prepared model or
    raises an AoedError; anything else is a bug at an edge that did not translate it."""
    with tempfile.TemporaryDirectory(prefix="aoe-fuzz-") as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(data)
        try:
            prepare(path, tmp)
        except AoedError:
            pass


#: (operation, where, byte value, how many) edits of the base model's bytes.
_byte_edits = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "delete", "insert", "truncate"]),
        st.integers(0, len(BASE) - 1),
        st.integers(0, 255),
        st.integers(1, 16),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_byte_edits)
def test_fuzz_prepare_mutated_bytes(edits) -> None:
    data = bytearray(BASE)
    for op, at, value, n in edits:
        at = min(at, max(len(data) - 1, 0))
        if op == "flip" and data:
            data[at] ^= 1 << (value % 8)
        elif op == "set" and data:
            data[at] = value
        elif op == "delete":
            del data[at : at + n]
        elif op == "insert":
            data[at:at] = bytes([value]) * n
        elif op == "truncate":
            del data[at:]
    _prepared_or_ours(bytes(data))


_ints = st.one_of(
    st.integers(-3, 8), st.sampled_from([0, 1 << 31, 1 << 40, (1 << 63) - 1, -(1 << 63)])
)
_names = st.one_of(
    st.sampled_from(["input", "logits", "fc1.weight", "", "x"]), st.text(max_size=12)
)
_ops = st.sampled_from(
    ["MatMul", "Add", "Relu", "Gemm", "Conv", "Reshape", "If", "Loop", "Frob", "", "Constant"]
)


@st.composite
def _field_edits(draw) -> bytes:
    m = _base()
    g = m.graph
    for _ in range(draw(st.integers(1, 5))):
        what = draw(
            st.sampled_from(
                [
                    "ir",
                    "opset",
                    "dim",
                    "elem",
                    "op",
                    "io",
                    "drop",
                    "dup",
                    "init",
                    "attr",
                    "outputs",
                    "domain",
                    "external",
                ]
            )
        )
        node = g.node[draw(st.integers(0, len(g.node) - 1))] if g.node else None
        if what == "ir":
            m.ir_version = draw(st.integers(-2, 1 << 40))
        elif what == "opset":
            m.opset_import[0].version = draw(st.integers(-1, 40))
        elif what == "dim" and g.input and g.input[0].type.tensor_type.shape.dim:
            dims = g.input[0].type.tensor_type.shape.dim
            d = dims[draw(st.integers(0, len(dims) - 1))]
            if draw(st.booleans()):
                d.dim_value = draw(_ints)
            else:
                d.dim_param = draw(_names)
        elif what == "elem" and g.input:
            g.input[0].type.tensor_type.elem_type = draw(st.integers(0, 30))
        elif what == "op" and node is not None:
            node.op_type = draw(_ops)
        elif what == "io" and node is not None:
            names = node.input if draw(st.booleans()) or not node.output else node.output
            if names:
                names[draw(st.integers(0, len(names) - 1))] = draw(_names)
        elif what == "drop" and node is not None:
            g.node.remove(node)
        elif what == "dup" and node is not None:
            g.node.insert(draw(st.integers(0, len(g.node))), node)
        elif what == "init" and g.initializer:
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            choice = draw(st.sampled_from(["dims", "type", "raw"]))
            if choice == "dims":
                t.dims[draw(st.integers(0, len(t.dims) - 1))] = draw(_ints) if t.dims else 1
            elif choice == "type":
                t.data_type = draw(st.integers(0, 30))
            else:
                t.raw_data = t.raw_data[: draw(st.integers(0, len(t.raw_data)))]
        elif what == "attr" and node is not None:
            value = draw(
                st.one_of(
                    _ints,
                    st.floats(allow_nan=True),
                    st.binary(max_size=8),
                    st.lists(st.integers(-3, 8), min_size=1, max_size=4),
                )
            )
            node.attribute.append(onnx.helper.make_attribute(draw(_names) or "axis", value))
        elif what == "outputs":
            del g.output[draw(st.integers(0, len(g.output))) :]
        elif what == "external" and g.initializer:
            # resolved in a fresh temp folder: nothing there to read
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            for key in draw(
                st.lists(st.sampled_from(["location", "offset", "length", "checksum"]), max_size=4)
            ):
                entry = t.external_data.add()
                entry.key = key
                entry.value = draw(
                    st.one_of(
                        st.text(max_size=12),
                        st.integers(-5, 1 << 40).map(str),
                        st.sampled_from(["..", "/", ".", "../../etc/hostname", "/etc/hostname"]),
                    )
                )
        elif what == "domain" and node is not None:
            node.domain = draw(
                st.sampled_from(["", "ai.onnx", "com.microsoft", "com.example.nope"])
            )
    return m.SerializeToString()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_field_edits())
def test_fuzz_prepare_mutated_fields(data: bytes) -> None:
    _prepared_or_ours(data)


def _damaged(how: str) -> onnx.ModelProto:
    m = _base()
    inits = {t.name: t for t in m.graph.initializer}
    if how == "dims_grown":  # the fuzzer's find: a bias of 8 declared as [1]
        inits["fc1.bias"].dims[:] = [1]
    elif how == "raw_cut":
        inits["fc1.weight"].raw_data = inits["fc1.weight"].raw_data[:-4]
    elif how == "typed_short":
        t = inits["fc1.bias"]
        values = onnx.numpy_helper.to_array(t).tolist()
        t.ClearField("raw_data")
        t.float_data.extend(values[:-1])
    elif how == "segment":
        inits["fc1.bias"].segment.begin, inits["fc1.bias"].segment.end = 0, 4
    else:  # a Constant node's tensor
        value = onnx.helper.make_tensor("c", onnx.TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
        del value.float_data[-1]
        m.graph.node.append(
            onnx.helper.make_node("Constant", [], ["unused"], name="const", value=value)
        )
    return m


@pytest.mark.parametrize(
    "how", ["dims_grown", "raw_cut", "typed_short", "segment", "constant_node"]
)
def test_a_constant_whose_data_does_not_fit_its_shape_is_a_model_error(
    how: str, tmp_path: Path
) -> None:
    """onnx's checker passes these, and numpy_helper.to_array then raised a bare
    ValueError wherever a constant was read; `prepare` names the tensor instead."""
    (tmp_path / "m.onnx").write_bytes(_damaged(how).SerializeToString())
    with pytest.raises(errors.ModelError) as exc:
        prepare(tmp_path / "m.onnx", tmp_path)
    name = {"raw_cut": "fc1.weight", "constant_node": "of node 'const'"}.get(how, "fc1.bias")
    assert name in str(exc.value) and ("segments" in str(exc.value)) == (how == "segment"), (
        exc.value
    )
    assert how == "segment" or "but stores" in str(exc.value), exc.value


def test_fuzz_base_model_prepares(tmp_path: Path) -> None:
    """The fuzzers start from a model that prepares: their mutations are what fails."""
    (tmp_path / "m.onnx").write_bytes(BASE)
    prep = prepare(tmp_path / "m.onnx", tmp_path)
    assert prep.outputs == ["logits"] and np.dtype(prep.inputs["input"].dtype) == np.float32


@pytest.mark.long
def test_large_labels_page_listjobs_by_bytes_and_an_over_limit_label_is_refused(
    tmp_path: Path,
) -> None:
    """A few jobs with megabytes of labels made every ListJobs answer larger than a gRPC
    message may be ("Sent message larger than max"), for every client, until the jobs
    expired 30 days later. Labels have limits now, and ListJobs pages by bytes: jobs
    whose labels sum to more than 8 MiB (each job under the limits) are all listed,
    across pages, by a plain grpc client (4 MiB per answer by default), aoe.Client and
    `aoe jobs`."""
    import aoe
    from aoe import sizes

    d = DaemonProcess(tmp_path / "d", max_running_jobs=1)
    d.config.write_text(
        d.config.read_text().replace(
            "[daemon]\n", "[daemon]\nmax_queued_jobs = 1000\nmax_jobs_per_client = 1000\n"
        )
    )
    model = samples.save(samples.mlp(), d.models / "mlp.onnx")

    def submit(labels: dict[str, str], budget: float) -> str:
        return (
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_path=str(model),
                    options=tuning_pb2.JobOptions(budget_s=budget, labels=labels),
                ),
                timeout=30,
            )
            .job_id
        )

    biggest = {
        f"{i:03d}".ljust(sizes.MAX_LABEL_KEY_BYTES, "k"): "v" * sizes.MAX_LABEL_VALUE_BYTES
        for i in range(sizes.MAX_LABELS)
    }
    per_job = sum(len(k) + len(v) for k, v in biggest.items())
    try:
        d.start()
        # A budget of its own each: the same model and options would join one job.
        ids = {submit(biggest, 60 + i / 100) for i in range((8 << 20) // per_job + 2)}
        assert len(ids) * per_job > 8 << 20

        with grpc.insecure_channel(d.target) as plain:  # grpcio's defaults: 4 MiB per answer
            stub = tuning_pb2_grpc.TuningServiceStub(plain)
            request, seen, pages = tuning_pb2.ListJobsRequest(page_size=1000), [], 0
            while True:
                reply = stub.ListJobs(request, timeout=30)
                seen += [j.job_id for j in reply.jobs]
                pages += 1
                assert reply.ByteSize() < 4 << 20
                if not reply.next_page_token:
                    break
                request.page_token = reply.next_page_token
        assert sorted(seen) == sorted(ids) and pages > 1
        with aoe.Client(d.target) as client:
            assert {j.job_id for j in client.jobs()} == ids
        cli = run_aoe("jobs", "--socket", str(d.socket))
        assert cli.returncode == 0 and all(i in cli.stdout for i in ids), cli.stderr

        over = [
            ({**biggest, "one-more": "x"}, "labels: 65 labels, over the limit of 64"),
            (
                {"k": "v" * (sizes.MAX_LABEL_VALUE_BYTES + 1)},
                "labels['k']: the value: 1025 bytes, over the limit of 1024 bytes",
            ),
        ]
        for labels, message in over:
            with pytest.raises(grpc.RpcError) as err:
                submit(labels, 1.0)
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and message in err.value.details()
            ), err.value
    finally:
        d.close()

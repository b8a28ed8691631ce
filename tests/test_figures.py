"""One rule for a job's figures, on every surface (aoe.figures).

Each surface is fed the same confirming A/B, built so that the old figures contradicted
themselves: the medians of each side and the median of the paired round ratios differ in
sign. Every surface must then show a result, an improvement and a verdict that agree in
sign and size, and, when the input ships, "no change shipped (within noise: ...)" with
no percentage that reads as a gain.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from aoe import figures
from aoe.figures import Comparison, Figures
from aoe.outcome import (
    GDAT_WORDS,
    GdatDetails,
    JobOutcome,
    OnnxDetails,
    TaskOutcome,
    details_from_dict,
    summary_lines,
)
from aoe.spec import JobSpec
from aoe.v1 import tuning_pb2
from aoe.wire import outcome_from_pb, outcome_to_pb
from aoed.api.tuning import event_pb
from aoed.engine import stats
from aoed.engine.confirm import ROUNDS, Proposal, judge
from aoed.engine.messages import Measurement
from aoed.engine.outputs import ResultDetails, result_json
from aoed.jobs.states import JobState
from aoed.jobs.store import EventRow, JobRow

# 21 interleaved rounds, in microseconds. The tuned model beats the input in 16 rounds
# (ratios 0.95 and 0.967) and takes twice as long in 5 busy ones, so the median of its own
# rounds (200 us) is twice the input's (100 us) while the median paired ratio says 3.4%
# faster, with the whole 95% interval (ranks 6..16) below 1.
INPUT = [100.0] * 6 + [300.0] * 10 + [100.0] * 5
TUNED = [95.0] * 6 + [290.0] * 10 + [200.0] * 5
# A second session of the input that times like the tuned model, give or take 2%: the
# tuned model is then no faster than the noise floor of these rounds.
NOISY_COPY = [t * (1.02 if i % 2 else 0.98) for i, t in enumerate(TUNED)]


def _m(rounds: list[float]) -> Measurement:
    return Measurement(
        ok=True, median_us=stats.median(rounds), repeats=len(rounds), rounds_us=tuple(rounds)
    )


def _proposal(tmp_path: Path) -> Proposal:
    return Proposal("tuned", tmp_path / "proposal.onnx", {}, None, tmp_path / "input_copy.onnx")


@dataclass(frozen=True)
class Case:
    """A job's outcome, and the confirming A/B's document its figures come from."""

    outcome: JobOutcome
    confirmation: dict


def _case(conf) -> Case:
    outcome = JobOutcome(
        job_id="job-1",
        model="/m/model.onnx",
        tuned_model="/o/model_tune.onnx",
        result_json="/o/result.json",
        precision="exact",
        job_type="opat",
        device="cpu",
        tuning_time_s=3.0,
        figures=conf.figures,
        bank={
            "repo_add_num": 0,
            "repo_hit_num": 0,
            "repo_reserved_num": 0,
            "repo_unsatisfied_num": 0,
            "repo_update_num": 0,
            "total_num": 0,
        },
        verified="tuned",
        workspace="/o/ws",
    )
    return Case(outcome, conf.to_json())


@pytest.fixture
def shipped(tmp_path: Path) -> Case:
    conf, ship = judge(
        {"input": _m(INPUT), "input_copy": _m(INPUT), "proposal": _m(TUNED)}, _proposal(tmp_path)
    )
    assert ship == tmp_path / "proposal.onnx", "the case is one where the tuned model ships"
    return _case(conf)


@pytest.fixture
def within_noise(tmp_path: Path) -> Case:
    conf, ship = judge(
        {"input": _m(INPUT), "input_copy": _m(NOISY_COPY), "proposal": _m(TUNED)},
        _proposal(tmp_path),
    )
    assert ship == tmp_path / "input_copy.onnx", "the case is one where the input ships"
    return _case(conf)


_MS = r"(\d+\.\d+) ms"
_PCT = r"([+-]?\d+\.\d)%"


def _check_shipped(text: str, digits: int = 4) -> None:
    """`text` shows baseline, result and improvement that agree in sign and size."""
    base = float(re.search(r"baseline:?\s+" + _MS, text).group(1))
    result = float(re.search(r"result:?\s+" + _MS, text).group(1))
    imp = float(re.search(r"improvement " + _PCT, text).group(1)) / 100
    assert imp > 0 and result < base, text
    assert result == pytest.approx(base / (1 + imp), abs=2 * 10**-digits + base * 0.001), text
    lo, hi = (float(x) / 100 for x in re.search(_PCT + " to " + _PCT, text).groups())
    assert 0 < lo <= imp <= hi, text
    assert "faster: the tuned model ships" in text, text


def _check_unchanged(text: str) -> None:
    """`text` says nothing shipped, within noise, and shows no percentage that reads as
    a gain: every positive one is the top of an interval that reaches down to zero."""
    assert (
        "no change shipped (within noise: the tuned model against a second session of the input"
        in text
    ), text
    base = re.search(r"baseline:?\s+" + _MS, text)
    result = re.search(r"result:?\s+" + _MS, text)
    if base and result:
        assert float(base.group(1)) == float(result.group(1)), text
    rest = text
    for m in re.finditer(_PCT + " to " + _PCT, text):
        lo, hi = float(m.group(1)), float(m.group(2))
        assert lo <= 0 <= hi, f"a deciding interval that is not within noise: {m.group(0)}"
        rest = rest.replace(m.group(0), "")
    assert not re.search(r"\+\d+\.\d%", rest), f"a percentage that reads as a gain: {text}"


def test_the_rule_makes_result_improvement_and_interval_one_measurement() -> None:
    f = Figures.shipping("tuned", 0.6, 0.9, (0.8, 0.99), ROUNDS)
    assert f.improvement == pytest.approx(1 / 0.9 - 1) and f.result_ms == pytest.approx(0.6 * 0.9)
    assert f.ci95[0] <= f.improvement <= f.ci95[1]
    assert Figures.from_dict(f.to_dict()) == f
    # Stored before the rule: an input that shipped with its second session's noise as
    # its improvement reads as no change.
    old = {
        "verdict": "no significant change",
        "shipped": "input",
        "baseline_ms": 0.5999,
        "result_ms": 0.6071,
        "improvement": 0.181,
        "improvement_ci95": [0.001, 0.666],
        "rounds": 21,
        "from_bank": "",
    }
    g = Figures.from_dict(old)
    assert (g.improvement, g.ci95, g.result_ms) == (0.0, (0.0, 0.0), 0.5999)
    with pytest.raises(ValueError):
        Figures("no significant change", "input", 0.6, 0.05, (0.0, 0.1))


def test_the_confirming_a_b_reports_the_paired_figures_not_the_medians(shipped: Case) -> None:
    conf = shipped.confirmation
    assert stats.median(TUNED) > stats.median(INPUT), "the case: the medians say slower"
    assert conf["shipped"] == "tuned" and conf["verdict"] == "faster"
    assert conf["improvement"] == pytest.approx(
        1 / stats.median([t / i for t, i in zip(TUNED, INPUT, strict=True)]) - 1
    )
    assert conf["result_ms"] < conf["baseline_ms"] and conf["improvement"] > 0
    assert conf["result_ms"] == pytest.approx(conf["baseline_ms"] / (1 + conf["improvement"]))
    assert conf["improvement_ci95"][0] > 0, (
        "the interval shown is the one that decided: wholly above zero"
    )


def test_when_the_noise_floor_decides_its_interval_is_the_one_shown(within_noise: Case) -> None:
    conf = within_noise.confirmation
    assert conf["shipped"] == "input" and conf["verdict"] == "no significant change"
    assert conf["improvement"] == 0.0 and conf["result_ms"] == conf["baseline_ms"]
    d = Comparison.from_dict(conf["decided_by"])
    assert d.against == "second session" and d.ci95[0] <= 0 <= d.ci95[1]
    assert conf["proposal"]["improvement"] > 0, (
        "against the input alone it looked faster: kept as the proposal's"
    )


@pytest.mark.parametrize("case", ["shipped", "within_noise"])
def test_the_result_json_sections_agree_with_the_confirmation(
    case: str, request: pytest.FixtureRequest
) -> None:
    c: Case = request.getfixturevalue(case)
    doc = result_json(c.outcome, ResultDetails(confirmation=c.confirmation))
    opat, conf = doc["OPAT"], doc["confirmation"]
    base, res, imp = (
        opat[k]
        for k in (
            "model_baseline_performance(ms)",
            "model_result_performance(ms)",
            "model_performance_improvement",
        )
    )
    assert base == pytest.approx(conf["baseline_ms"], abs=1e-6) and res == pytest.approx(
        conf["result_ms"], abs=1e-6
    )
    assert imp == pytest.approx(conf["improvement"], abs=1e-4)
    if case == "shipped":
        assert (
            res < base
            and imp > 0
            and opat["model_performance_summary"] == "faster: the tuned model ships"
        )
    else:
        assert res == base and imp == 0
        _check_unchanged(opat["model_performance_summary"])


@pytest.mark.parametrize("case", ["shipped", "within_noise"])
def test_the_embedded_cli_summary_agrees(
    case: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "\n".join(summary_lines(request.getfixturevalue(case).outcome))
    (_check_shipped if case == "shipped" else _check_unchanged)(text)


@pytest.mark.parametrize("case", ["shipped", "within_noise"])
def test_the_daemon_s_job_status_list_and_events_agree(
    case: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    from aoe import jobscli

    outcome = request.getfixturevalue(case).outcome
    job = tuning_pb2.Job(
        job_id="job-1",
        state=tuning_pb2.JOB_STATE_SUCCEEDED,
        model_name="model.onnx",
        result=outcome_to_pb(outcome),
    )
    jobscli.print_result(job)  # aoe status, aoe watch, aoe submit --watch, aoe tune on the daemon
    text = capsys.readouterr().out
    event = jobscli._line(event_pb(EventRow("job-1", 7, 0.0, "result", {}, outcome)))
    cell = jobscli._progress(job)  # aoe jobs, PROGRESS
    if case == "shipped":
        _check_shipped(text)
        assert re.search(r"-> " + _MS, event) and "faster: the tuned model ships" in event, event
        ev_base, ev_res = (float(x) for x in re.findall(_MS, event)[:2])
        assert ev_res < ev_base, event
        assert cell.startswith("+") and "tuned" in cell, cell
    else:
        _check_unchanged(text)
        _check_unchanged(event)
        assert cell == "no change shipped", cell


@pytest.mark.parametrize("case", ["shipped", "within_noise"])
def test_the_drop_folder_report_agrees(case: str, request: pytest.FixtureRequest) -> None:
    from aoed.watch.report import report_text

    row = JobRow(
        id="job-1",
        state=JobState.SUCCEEDED,
        model_path="/m/model.onnx",
        model_name="model.onnx",
        model_sha256="",
        dedup_key="",
        spec=JobSpec(),
        output_dir="/o",
        outcome=request.getfixturevalue(case).outcome,
    )
    text = report_text("model.onnx", row, ["model_tuned.onnx"], [])
    if case == "shipped":
        _check_shipped(text, digits=3)
    else:
        _check_unchanged(text)


def test_chosen_tasks_the_bank_keeps_but_the_model_does_not_ship_are_counted_as_such(
    within_noise: Case, capsys: pytest.CaptureFixture[str]
) -> None:
    from aoe import jobscli

    tasks = [
        TaskOutcome(
            f"t{i}",
            f"fc{i}/MatMul",
            "MatMul",
            "matmul",
            strategy="int8_dynamic",
            before_us=20.0,
            after_us=12.0,
            update_mode="add",
            applied=False,
            error="not applied: the confirming A/B shipped input",
        )
        for i in range(2)
    ]
    r = within_noise.outcome
    r = dataclasses.replace(r, tasks=tasks, bank={**r.bank, "repo_add_num": 2, "total_num": 2})
    print("\n".join(summary_lines(r)))
    print("Aoe process finished")
    jobscli.print_result(
        tuning_pb2.Job(
            job_id="job-1", state=tuning_pb2.JOB_STATE_SUCCEEDED, result=outcome_to_pb(r)
        )
    )
    for text in capsys.readouterr().out.split("Aoe process finished"):
        assert (
            "0 changed (2 chosen by the search, not in what shipped: the input model, unchanged)"
            in text
        ), text
        assert (
            "add 2," in text and "2 of them are kept in the bank but not in what shipped" in text
        ), text
        assert "+66.7%" not in text, (
            "a task's own gain is not listed as a change when it did not ship"
        )


def _printed_agrees_with_json(stdout: str, doc: dict) -> None:
    """The printed baseline, result and verdict lines are the result JSON's figures."""
    opat, conf = doc["OPAT"], doc["confirmation"]
    f = Figures.from_dict(conf)
    lines = {
        ln.split()[0]: ln.split(None, 1)[1]
        for ln in stdout.splitlines()
        if ln.startswith("  ") and ln.split()
    }
    assert lines["baseline"].startswith(f"{opat['model_baseline_performance(ms)']:.4f} ms"), (
        lines,
        opat,
    )
    assert lines["result"] == figures.result_text(f), (lines, conf)
    assert lines["result"].startswith(f"{opat['model_result_performance(ms)']:.4f} ms"), (
        lines,
        opat,
    )
    assert lines["verdict"] == opat["model_performance_summary"] == figures.verdict_text(f), (
        lines,
        opat,
    )
    if f.changed:
        assert (
            f"improvement {figures.pct(opat['model_performance_improvement'])}:" in lines["result"]
        )
        assert opat["model_result_performance(ms)"] < opat["model_baseline_performance(ms)"]
    else:
        assert opat["model_performance_improvement"] == 0
        assert opat["model_result_performance(ms)"] == opat["model_baseline_performance(ms)"]
        assert lines["verdict"].startswith("no change shipped ("), lines


@pytest.mark.slow
def test_an_embedded_run_prints_what_its_result_json_says(models: Path, tmp_path: Path) -> None:
    from tests.conftest import run_aoe

    out = tmp_path / "out"
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--local",
        "--budget",
        "2",
        "--output",
        str(out),
        "--bank",
        str(tmp_path / "bank"),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    # (sgat+opat: both sections)
    (doc,) = [json.loads(p.read_text()) for p in out.glob("aoe_result_*.json")]
    _printed_agrees_with_json(r.stdout, doc)


@pytest.mark.slow
def test_a_daemon_run_prints_what_its_result_json_says(models: Path, tmp_path: Path) -> None:
    from tests.conftest import run_aoe
    from tests.daemon_util import DaemonProcess

    d = DaemonProcess(tmp_path / "d")
    d.start()
    try:
        out = tmp_path / "out"
        r = run_aoe(
            "tune",
            str(models / "mlp.onnx"),
            "--socket",
            str(d.socket),
            "--budget",
            "2",
            "--output",
            str(out),
            "--no-progress",
        )
        assert r.returncode == 0, r.stderr
        assert "tuning on the daemon" in r.stderr
        (doc,) = [json.loads(p.read_text()) for p in out.glob("aoe_result_*.json")]
        _printed_agrees_with_json(r.stdout, doc)
        job_id = doc["basic"]["job_id"]
        listed = run_aoe("jobs", "--socket", str(d.socket))
        (row,) = [ln for ln in listed.stdout.splitlines() if ln.startswith(job_id)]
        f = Figures.from_dict(doc["confirmation"])
        assert row.rstrip().endswith(figures.short_text(f)), row
    finally:
        d.close()


def test_a_gdat_job_s_details_and_words_cross_every_edge(within_noise: Case) -> None:
    """A GDAT job's details are typed on every side of every edge (the job store's dict,
    the API's message), written without their tag, and its figures are said in its own
    words: DDP's defaults where an ONNX job says the input."""
    details = GdatDetails(
        gradient_precision="fp16",
        world_size=2,
        baseline_tail_ms=0.25,
        ddp_config={"label": "static", "ddp_kwargs": {"static_graph": True}},
        gates=[{"config": "static,hook=fp16", "passed": True, "why": "within 1e-3"}],
    )
    o = dataclasses.replace(
        within_noise.outcome, job_type="gdat", details=details, device="gloo world of 2"
    )
    stored = o.to_dict()
    assert "kind" not in stored["details"] and stored["details"]["world_size"] == 2
    assert JobOutcome.from_dict(json.loads(json.dumps(stored))).details == details
    sent = outcome_to_pb(o)
    assert sent.WhichOneof("details") == "gdat" and sent.gdat.world_size == 2
    assert sent.gdat.ddp_config["ddp_kwargs"]["static_graph"] is True
    assert outcome_from_pb(sent).details == details
    # A daemon from before the typed details sent the JSON alone: still read.
    older = tuning_pb2.JobResult()
    older.CopyFrom(sent)
    older.ClearField("gdat")
    assert older.WhichOneof("details") is None and older.details_json
    assert outcome_from_pb(older).details == details
    # An ONNX job has no details: none are written, an empty ONNX one is sent.
    assert within_noise.outcome.to_dict()["details"] == {}
    assert outcome_to_pb(within_noise.outcome).details_json == ""
    assert outcome_to_pb(within_noise.outcome).WhichOneof("details") == "onnx"
    assert outcome_from_pb(outcome_to_pb(within_noise.outcome)).details == OnnxDetails()
    with pytest.raises(ValueError, match="world_size"):
        details_from_dict("gdat", {"world_size": "two"})
    with pytest.raises(ValueError, match="details"):
        dataclasses.replace(within_noise.outcome, details=details)  # an opat job's

    f = o.figures
    said = figures.verdict_text(f, GDAT_WORDS)
    assert said.startswith(
        "no change shipped (within noise: the tuned configuration against a second instance "
        "of DDP's defaults in the same rounds, 95% interval "
    ), said
    assert figures.result_text(f, words=GDAT_WORDS).endswith("(DDP's defaults, unchanged)")
    assert figures.shipped_text(f, GDAT_WORDS) == "DDP's defaults, unchanged"
    lines = summary_lines(o)
    assert f"  verdict      {said}" in lines and "the input" not in "\n".join(lines), lines
    assert "  ddp          static: {'static_graph': True}" in lines, lines
    unproposed = Figures.unchanged("no significant change", 1.0, 5)
    assert figures.verdict_text(unproposed, GDAT_WORDS) == (
        "no change shipped (nothing was proposed: no configuration beat DDP's defaults in the "
        "search)"
    )

"""One count of tasks and one bank tally (aoe.outcome), the same on every surface of one
real job: the CLI's summary, the result JSON, the progress events, the daemon's metrics;
the budget's given seconds within the budget; `aoe bank stats` through the daemon as
locally; and a progress bar whose job row keeps moving through the confirming A/B."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from aoe.outcome import BudgetReport, JobOutcome, summary_lines
from aoe.spec import JobSpec, Stage
from aoe.v1 import tuning_pb2
from aoe.wire import outcome_from_pb
from aoed import samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess, upload
from tests.metrics_util import Samples, metrics_address, sample_value, scrape

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Seen:
    """One daemon job as each surface gave it."""

    job: tuning_pb2.Job
    events: list[tuning_pb2.JobEvent]
    report: dict
    #: the engine's lookup series moved by the job: (hit, miss)
    lookups: tuple[float, float]

    @property
    def summary(self) -> list[str]:
        return summary_lines(outcome_from_pb(self.job.result, self.job.job_id), where=" on d")


def _engine_lookups(s: Samples) -> tuple[float, float]:
    return tuple(  # type: ignore[return-value]
        sample_value(s, "aoed_bank_lookups_total", source="engine", result=r)
        for r in ("hit", "miss")
    )


def _run(d: DaemonProcess, path: Path, url: str) -> Seen:
    before = _engine_lookups(scrape(url))
    reply = d.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_id=upload(d.tuning(), path), options=tuning_pb2.JobOptions(budget_s=2.0)
        ),
        timeout=30,
    )
    events = [
        m.event
        for m in d.tuning().WatchJob(
            tuning_pb2.WatchJobRequest(job_id=reply.job_id, include_logs=True), timeout=300
        )
    ]
    job = d.wait_job(reply.job_id)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    report = json.loads(Path(job.result.result_json_path).read_text())
    after = _engine_lookups(scrape(url))
    return Seen(job, events, report, (after[0] - before[0], after[1] - before[1]))


@pytest.fixture(scope="module")
def daemon_runs(tmp_path_factory: pytest.TempPathFactory):
    """A daemon with metrics; the MLP tuned on it twice (the second run answered by the
    bank the first one filled)."""
    d = DaemonProcess(
        tmp_path_factory.mktemp("counts") / "d", extra_toml='[metrics]\nlisten = "127.0.0.1:0"\n'
    )
    try:
        d.start()
        url = metrics_address(d)
        path = samples.save(samples.build("mlp"), d.models / "mlp.onnx")
        first = _run(d, path, url)
        second = _run(d, path, url)
        yield d, first, second
    finally:
        d.close()


def _tasks_said(summary: list[str]) -> int:
    line = next(ln for ln in summary if ln.startswith("  tasks "))
    return int(re.match(r"  tasks\s+(\d+):", line).group(1))  # type: ignore[union-attr]


def _bank_said(summary: list[str]) -> dict[str, int]:
    line = next(ln for ln in summary if ln.startswith("  bank "))
    return {
        k: int(v) for k, v in re.findall(r"(add|hit|reserved|unsatisfied|update|total) (\d+)", line)
    }


def _progress(events: list) -> list[tuple[int, int]]:
    return [
        (e.progress.tasks_done, e.progress.tasks_total)
        for e in events
        if e.WhichOneof("event") == "progress"
    ]


def test_one_job_counts_its_tasks_and_bank_decisions_alike_on_every_surface(daemon_runs) -> None:
    _, first, _ = daemon_runs
    n = _tasks_said(first.summary)
    said = _bank_said(first.summary)
    # The summary's tasks, its bank line's total, the result JSON's tasks and its
    # sections' total_num (sgat+opat: each section counts its own tasks).
    assert n == len(first.report["tasks"]) == len(first.job.result.tasks) > 0
    assert said["total"] == n, first.summary
    sections = [first.report[k]["repo_summary"] for k in ("SGAT", "OPAT") if k in first.report]
    assert sum(s["total_num"] for s in sections) == n, sections
    assert sum(s["repo_hit_num"] for s in sections) == said["hit"], sections
    # Progress events count the same tasks, and end with all of them done.
    progress = _progress(first.events)
    assert progress and {t for _, t in progress} == {n}, progress
    assert progress[-1] == (n, n), progress
    # The daemon's lookup series moved by the job's tally: every task once.
    assert first.lookups == (said["hit"], n - said["hit"]), (first.lookups, first.summary)
    # The budget's stages were given no more than the budget, and what the budget does not
    # cover is outside it, not over it.
    b = first.report["budget"]
    assert sum(st["given_s"] for st in b["stages"].values()) <= b["budget_s"] + 1e-6, b
    assert all(st["over_s"] == 0.0 for st in b["stages"].values() if not st["counted"]), b
    assert b["outside_s"] > 0 and b["over_s"] == pytest.approx(
        max(0.0, b["spent_s"] - b["budget_s"]), abs=0.002
    )
    line = next(ln for ln in first.summary if ln.startswith("  budget "))
    assert f"{b['outside_s']:.1f} s of it outside the budget" in line, line
    assert ("over" in line) == (
        b["over_s"] >= 0.05 or any(st["over_s"] >= 0.05 for st in b["stages"].values())
    ), line


def test_a_bank_hit_job_moves_the_hit_series_by_its_summary_s_hit_count(daemon_runs) -> None:
    _, first, second = daemon_runs
    said = _bank_said(second.summary)
    n = _tasks_said(second.summary)
    assert n == _tasks_said(first.summary)
    assert said["hit"] == said["total"] == n, second.summary  # the bank answered every task
    assert second.lookups == (said["hit"], 0), (second.lookups, second.summary)
    assert _progress(second.events)[-1] == (n, n)


def test_the_stages_given_seconds_never_add_up_to_more_than_the_budget() -> None:
    """Stages that spend less than their share pass the rest on: the report says each was
    given what it kept, so search, session options and verification add up to the
    budget at most, and a stage's overrun is its device seconds beyond that."""
    from aoed.engine.budget import Budget
    from aoed.engine.ledger import JobLedger

    ledger = JobLedger("j")
    budget = Budget(2.0, ledger, True)
    for stage, spend in (("search", 0.2), ("session", 0.1), ("verify", 0.5)):
        ledger.enter(stage)
        if stage == "search":
            budget.for_tasks({"a": 1.0}, ["a"])
        else:
            getattr(budget, f"for_{stage}")()
        ledger.charge_device(spend, stage)
    ledger.enter(None)
    st = budget.report().stages
    assert sum(s.given_s for s in st.values()) <= 2.0, st
    assert st[Stage.SEARCH].given_s == 0.2 and st[Stage.SESSION].given_s == 0.1, st
    assert all(s.over_s == 0.0 for s in st.values()), st
    assert st[Stage.VERIFY].given_s == pytest.approx(1.7), st
    # The typed report is what the result JSON reads back; a GDAT result keeps the same
    # section but for the derived outside_s.
    doc = budget.report().to_dict()
    assert BudgetReport.from_dict(json.loads(json.dumps(doc))) == budget.report(), doc
    assert budget.report_doc() == {k: v for k, v in doc.items() if k != "outside_s"}


def test_bank_stats_through_the_daemon_are_the_local_ones(daemon_runs) -> None:
    d, _, _ = daemon_runs
    env = d.env()
    remote = run_aoe("bank", "stats", "--json", "--socket", str(d.socket), env=env)
    local = run_aoe("bank", "stats", "--json", "--bank", str(d.bank), env=env)
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got == want
    assert want["entries"] + want["defaults"] > 0 and "defaults" in want["layers"][0], want


def test_the_progress_bar_moves_and_says_the_stage_through_the_confirming_a_b(
    models: Path, tmp_path: Path
) -> None:
    from rich.console import Console

    from aoe._progress import Frame, Progress
    from aoe.config import load_config
    from aoed import embedded

    frames: list[Frame] = []
    events = []
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    config = load_config(env={}).replace(
        bank=tmp_path / "bank", runtime_dir=tmp_path / "run", parallel=1
    )
    with Progress(console=console, on_frame=frames.append, refresh_per_second=20) as bar:

        def seen(event) -> None:
            events.append(event)
            bar.emit(event)

        outcome: JobOutcome = embedded.tune(
            models / "mlp.onnx",
            JobSpec(budget_s=2.0),
            tmp_path / "out",
            config=config,
            progress=seen,
        )
    confirming = [f for f in frames if f.stage.startswith("confirming")]
    # The job row is refreshed while the confirming A/B runs, says what it waits for, and
    # its spinner and clock are those of a row that has not finished.
    assert len(confirming) >= 3, [f.stage for f in frames][-20:]
    assert all(f.spinning for f in confirming), confirming
    assert "rounds, a process per model" in confirming[0].stage
    # The embedded job's summary, result JSON and events count the same tasks.
    report = json.loads(Path(outcome.result_json).read_text())
    n = _tasks_said(summary_lines(outcome))
    progress = [(e.done, e.total) for e in events if e.kind == "progress"]
    assert n == len(report["tasks"]) and progress[-1] == (n, n), (n, progress)
    assert _bank_said(summary_lines(outcome))["total"] == n


@pytest.mark.parametrize(
    ("total", "given", "want", "kept"),
    [
        (10.0, False, 2.5, 2.5),  # a fitted budget keeps all the comparison needs
        (10.0, True, 2.5, 2.5),  # a given one while it is at most 40% of it
        (5.0, True, 2.5, 0.0),  # more than 40%: the comparison takes what is left
    ],
)
def test_the_runtime_comparison_keeps_its_seconds_from_the_search(total, given, want, kept):
    """The stages before the runtime comparison are offered the budget less the seconds
    kept for it; the comparison is offered everything left, those seconds included."""
    from aoed.engine.budget import SEARCH_SHARE, SESSION_SHARE, Budget, default_budget
    from aoed.engine.ledger import JobLedger

    ledger = JobLedger("j")
    budget = Budget(total, ledger, given)
    assert budget.reserve_runtime(want) == kept
    slices = budget.for_tasks({"a": 1.0}, ["a"])
    assert sum(slices.values()) == pytest.approx((total - kept) * SEARCH_SHARE)
    ledger.enter("search")
    ledger.charge_device(sum(slices.values()), "search")
    open_s = total - kept - sum(slices.values())
    assert budget.for_session() == pytest.approx(open_s * SESSION_SHARE)
    ledger.enter("session")
    ledger.charge_device(open_s * SESSION_SHARE, "session")
    assert budget.for_verify() == pytest.approx(open_s * (1 - SESSION_SHARE))
    ledger.enter("verify")
    ledger.charge_device(open_s * (1 - SESSION_SHARE), "verify")  # verification spends all
    assert budget.for_runtime() == pytest.approx(kept)
    # A fitted budget adds the comparison to what the model's own stages need.
    fitted = default_budget({"a": 20_000.0}, {"a": 3}, 40_000.0)
    assert default_budget({"a": 20_000.0}, {"a": 3}, 40_000.0, runtime_s=2.5) == pytest.approx(
        fitted + 2.5
    )

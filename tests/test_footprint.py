"""What jobs leave on disk: a run that fails before tuning leaves nothing; a run that ends
leaves the outputs docs/cli.md lists and no more; a daemon keeps each distinct input once,
for as long as a job refers to it, and one workspace per job across a kill -9. Real `aoe`
commands and a real daemon."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aoe.bank import open_bank
from aoe.v1 import bank_pb2, tuning_pb2
from aoed import samples
from tests.daemon_util import DaemonProcess, upload

from .conftest import run_aoe
from .helpers import wait_for

pytestmark = pytest.mark.slow

FAST = ("--local", "--budget", "2", "--parallel", "1", "--no-progress")


def _tree(root: Path) -> set[str]:
    """Every file and folder under `root`, relative, folders ending in "/"."""
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*")}


def _bad_calibration(tmp_path: Path) -> Path:
    folder = tmp_path / "calibration"
    folder.mkdir()
    np.savez(folder / "s.npz", x=np.zeros((1, 2), np.float32))  # no such input: an OptionError
    return folder


@pytest.mark.parametrize("case", ["missing", "not-onnx", "calibration"])
def test_a_run_that_fails_before_tuning_leaves_nothing(
    models: Path, tmp_path: Path, case: str
) -> None:
    model, extra = {
        "missing": (tmp_path / "missing.onnx", ()),
        "not-onnx": (tmp_path / "bad.onnx", ()),
        "calibration": (
            models / "cnn.onnx",
            ("--precision", "int8", "--calibration", str(_bad_calibration(tmp_path))),
        ),
    }[case]
    if case == "not-onnx":
        model.write_bytes(b"not a model")
    there, fresh = tmp_path / "there", tmp_path / "new" / "deeper"
    there.mkdir()
    for out in (there, fresh):
        r = run_aoe(
            "tune",
            str(model),
            "--output",
            str(out),
            "--bank",
            str(tmp_path / "bank"),
            *extra,
            *FAST,
        )
        assert r.returncode in (2, 3), r.stderr
    assert _tree(there) == set(), "a folder that was there stays, empty"
    assert not (tmp_path / "new").exists(), "folders the run made for its outputs go"


def test_a_run_leaves_its_outputs_and_nothing_else(models: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--output",
        str(out),
        "--bank",
        str(tmp_path / "bank"),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    (result,) = out.glob("aoe_result_*.json")
    tag = Path(json.loads(result.read_text())["workspace"]).name
    assert _tree(out) == {
        result.name,
        "aoe_workspace/",
        f"aoe_workspace/{tag}/",
        f"aoe_workspace/{tag}/job.log",
        f"aoe_workspace/{tag}/tunespace/",
        f"aoe_workspace/{tag}/tunespace/result/",
        f"aoe_workspace/{tag}/tunespace/result/{tag}_tune.onnx",
    }


def test_a_workspace_with_a_link_inside_is_not_taken_over(models: Path, tmp_path: Path) -> None:
    """An interrupted run's workspace is reused only as a real folder tree: a link where
    its scratch was leads nowhere, and what the link points at is left alone."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    (victim / "work").mkdir(parents=True)
    (victim / "work" / "keep.txt").write_text("mine")
    planted = out / "aoe_workspace" / "mlp_20200101000000"
    planted.mkdir(parents=True)
    (planted / ".running").write_text(
        json.dumps({"model": str((models / "mlp.onnx").absolute()), "job": ""})
    )
    (planted / "tunespace").symlink_to(victim)
    r = run_aoe(
        "tune",
        str(models / "mlp.onnx"),
        "--output",
        str(out),
        "--bank",
        str(tmp_path / "bank"),
        *FAST,
    )
    assert r.returncode == 0, r.stderr
    assert _tree(victim) == {"work/", "work/keep.txt"}
    (result,) = out.glob("aoe_result_*.json")
    assert Path(json.loads(result.read_text())["workspace"]).name != planted.name


def _trials(bank: Path) -> dict[str, int]:
    """task id -> trials in the bank's history."""
    out: dict[str, int] = {}
    with open_bank(bank, use_env=False) as reader:
        for _, rec in reader.records():
            if rec.WhichOneof("record") == "trial":
                task = json.loads(rec.trial.trial_json)["task"]
                out[task] = out.get(task, 0) + 1
    return out


def _inputs(d: DaemonProcess) -> list[Path]:
    return sorted(p for p in (d.state / "inputs").glob("*/*"))


@pytest.mark.long
def test_daemon_keeps_each_input_once_and_one_workspace_per_job_across_a_kill(
    tmp_path: Path,
) -> None:
    d = DaemonProcess(tmp_path / "d")
    model = d.models / "cnn.onnx"
    samples.save(samples.build("cnn"), model)
    try:
        d.start()
        jobs = []
        for budget in (3.0, 2.0, 1.5):  # the same model three times (options differ: three jobs)
            opts = tuning_pb2.JobOptions(budget_s=budget, precision=bank_pb2.PRECISION_INT8)
            req = tuning_pb2.SubmitJobRequest(model_id=upload(d.tuning(), model), options=opts)
            jobs.append(d.tuning().SubmitJob(req, timeout=30).job_id)
        killed = jobs[0]
        stream = d.tuning().WatchJob(
            tuning_pb2.WatchJobRequest(job_id=killed, include_logs=True), timeout=240
        )
        decided = set()
        for msg in stream:
            e = msg.event
            if e.WhichOneof("event") == "log" and e.log.logger == "task":
                decided.add(e.log.message.split(":", 1)[0])
                break
        stream.cancel()
        d.kill()
        assert decided, "the job decided a task before the kill"
        before = _trials(d.bank)
        d.start()
        done = [d.wait_job(j) for j in jobs]
        assert [j.state for j in done] == [tuning_pb2.JOB_STATE_SUCCEEDED] * 3, [
            j.error for j in done
        ]
        after = _trials(d.bank)
        # The input once, for the three jobs; nothing left in uploads; no per-job copy.
        (kept,) = _inputs(d)
        assert kept.read_bytes() == model.read_bytes()
        assert not list((d.state / "uploads").iterdir())
        for j in jobs:
            job_dir = d.state / "jobs" / j
            assert not (job_dir / "model").exists()
            (ws,) = (job_dir / "aoe_workspace").iterdir()  # one workspace, the killed job's too
            assert not (ws / ".running").exists() and not (ws / "tunespace" / "work").exists()
        # The killed job measured again none of what it had decided.
        doc = json.loads(Path(done[0].result.result_json_path).read_text())
        rows = {t["task_id"]: t for t in doc["tasks"]}
        for task in decided:
            assert after[task] == before[task] and rows[task]["attempt"] == 1, (
                task,
                before,
                after,
                rows[task],
            )
        assert [a["attempt"] for a in doc["resources"]["attempts"]] == [1, 2]
    finally:
        d.close()
    # Stopped: the state holds the job store, the job outputs, the one input (no worker logs).
    assert {p.name for p in d.state.iterdir()} - {"jobs.sqlite3-wal", "jobs.sqlite3-shm"} == {
        "jobs.sqlite3",
        "jobs",
        "uploads",
        "claimed",
        "inputs",
    }


def test_daemon_removes_an_input_with_the_last_job_that_refers_to_it(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d")
    # retention_days = 0.00004: 3.5 s
    d.config.write_text(
        d.config.read_text().replace("[daemon]\n", "[daemon]\nretention_days = 0.00004\n")
    )
    model = d.models / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    try:
        d.start()
        jobs = []
        for name, budget in (("a.onnx", 0.5), ("b.onnx", 0.6), ("a.onnx", 0.7)):
            opts = tuning_pb2.JobOptions(budget_s=budget)
            req = tuning_pb2.SubmitJobRequest(
                model_id=upload(d.tuning(), model, name), options=opts
            )
            jobs.append(d.tuning().SubmitJob(req, timeout=30).job_id)
        # Three jobs, two names: each name once (outputs are named after the model file).
        assert [p.name for p in _inputs(d)] == ["a.onnx", "b.onnx"]
        wait_for(  # the jobs run, end, and are removed 3.5 s later
            lambda: not _inputs(d) and not list((d.state / "jobs").iterdir()),
            180,
            "the inputs gone with the jobs, after retention",
            poll=0.2,
            detail=lambda: (_inputs(d), list((d.state / "jobs").iterdir())),
        )
    finally:
        d.close()

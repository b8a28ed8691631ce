"""Resume: a job killed with SIGKILL after it decided some tasks, run again, measures none
of them again and keeps what they chose; the report counts every run's trials. And one
job keeps one workspace across the kill. Real `aoe tune` processes, killed for real; the
kill point is the job's own log saying a task was decided (logged after its bank commit).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from aoe.bank import open_bank
from aoed.backends.ort.catalog import build_registry
from aoed.engine.assemble import tunable_tasks
from aoed.engine.prep import prepare
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

#: a task decision in a job.log (taskagent.py logs it once it is committed)
_DECIDED = re.compile(r" INFO aoed\.engine\.taskagent: (\S+): (\S+) \((\w+)\), ")
_TASKS_LINE = re.compile(r"tasks\s+(\d+): (\d+) measured, (\d+) from the bank")


def _kind(name: str, precision: str, job_type: str, calibrated: bool, *marks) -> object:
    """One case: (model, precision, job type, user calibration), named after them."""
    return pytest.param(
        name,
        precision,
        job_type,
        calibrated,
        id=f"{name}-{precision}-{job_type}" + ("-calibrated" if calibrated else ""),
        marks=marks,
    )


#: Every precision, every job type. The first two (exact, and int8 with both job types,
#: the kind that used to measure again) run in `make test`; the rest are `long` (`make
#: test-long`, which CI runs).
KINDS = [
    _kind("cnn", "exact", "opat", False),
    _kind("transformer", "int8", "sgat+opat", False),
    _kind("cnn", "int8", "opat", False, pytest.mark.long),
    _kind("cnn", "int8", "opat", True, pytest.mark.long),
    _kind("transformer", "int4", "sgat+opat", False, pytest.mark.long),
    _kind("transformer", "exact", "sgat", False, pytest.mark.long),
    _kind("transformer", "int8", "sgat", False, pytest.mark.long),
]


def _aoe(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aoe.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _decided(out: Path) -> dict[str, str]:
    """task id -> strategy, from the job logs under `out`."""
    found = {}
    for log in (out / "aoe_workspace").glob("*/job.log"):
        for m in _DECIDED.finditer(log.read_text(errors="replace")):
            found[m.group(1)] = m.group(2)
    return found


def _lossy(strategy: str) -> bool:
    """Whether `strategy` (of whichever family has it) is a lossy one."""
    reg = build_registry()
    for family in reg.families():
        try:
            return reg.get(family, strategy).precision != "exact"
        except KeyError:
            continue
    return False


def _killable(decided: dict[str, str], tasks: int, lossy_policy: bool) -> bool:
    """Time to kill: a task is decided; under a lossy policy, a lossy choice (the kind an
    interrupted run used to lose) or, where none comes, all tasks but one."""
    if not decided or not lossy_policy:
        return bool(decided)
    return any(_lossy(s) for s in decided.values()) or len(decided) >= tasks - 1


def _trials(bank: Path) -> dict[str, dict[str, int]]:
    """job id -> task id -> trials the bank's history holds."""
    out: dict[str, dict[str, int]] = {}
    with open_bank(bank, use_env=False) as reader:
        for _, rec in reader.records():
            if rec.WhichOneof("record") == "trial":
                doc = json.loads(rec.trial.trial_json)
                tasks = out.setdefault(doc["job"], {})
                tasks[doc["task"]] = tasks.get(doc["task"], 0) + 1
    return out


def _calibration(model: Path, folder: Path, n: int = 12) -> None:
    """`n` samples for `model` from N(0, 1), one .npz each, keyed by input name."""
    folder.mkdir()
    rng = np.random.default_rng(3)
    graph = onnx.load(str(model)).graph
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    for k in range(n):
        arrays = {
            name: rng.standard_normal(dims).astype(np.float32) for name, dims in inputs.items()
        }
        np.savez(folder / f"s{k:02d}.npz", **arrays)


@pytest.mark.parametrize(
    ("name", "precision", "job_type", "calibrated"),
    KINDS,
)
def test_a_killed_job_run_again_measures_nothing_it_decided(
    models: Path, tmp_path: Path, name: str, precision: str, job_type: str, calibrated: bool
) -> None:
    out, bank = tmp_path / "out", tmp_path / "bank"
    args = [
        "tune",
        str(models / f"{name}.onnx"),
        "--precision",
        precision,
        "--job-type",
        job_type,
        "--local",
        "--bank",
        str(bank),
        "--output",
        str(out),
        "--budget",
        "6",
        "--parallel",
        "1",
        "--no-progress",
    ]
    if calibrated:
        _calibration(models / f"{name}.onnx", tmp_path / "calibration")
        args += ["--calibration", str(tmp_path / "calibration")]

    prep = prepare(models / f"{name}.onnx", tmp_path / "prep")
    tasks = len(tunable_tasks(prep.model, prep.ctx, build_registry(), precision, job_type))
    first = _aoe(args)
    wait_for(
        lambda: _killable(_decided(out), tasks, precision != "exact") or first.poll() is not None,
        240,
        "the first run far enough into its job to be killed",
        poll=0.02,
    )
    first.send_signal(signal.SIGKILL)
    _, err = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL, f"the first run was not killed mid-job:\n{err}"
    assert not list(out.glob("aoe_result_*.json")), "the first run was killed before its end"
    before = _decided(out)  # a task's trials can be committed, its log line not yet written
    (job1,) = _trials(bank)
    measured1 = _trials(bank)[job1]
    assert before and set(before) <= set(measured1)

    second = _aoe(args)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    (result,) = out.glob("aoe_result_*.json")
    doc = json.loads(result.read_text())
    job2 = doc["basic"]["job_id"]
    trials = _trials(bank)
    # Not measured again: the second run wrote no trial for a task the first decided, and
    # the first run's trials are all there still.
    assert not set(measured1) & set(trials.get(job2, {})), (measured1, trials.get(job2))
    assert trials[job1] == measured1
    # The same strategies, reported as the first run's, answered from the bank.
    rows = {t["task_id"]: t for t in doc["tasks"]}
    for task, strategy in before.items():
        row = rows[task]
        assert row["update_mode"] == "hit" and row["attempt"] == 1, row
        assert row["strategy"] == strategy or any("backed off" in r for r in row["rejected"]), (
            strategy,
            row,
        )
        assert row["candidates"], "the first run's measurements are in the report"
    counts = _TASKS_LINE.search(stdout)
    assert counts and int(counts.group(3)) >= len(before), stdout
    # Every run's trials are reported, each attempt apart.
    res = doc["resources"]
    assert res["trials"] == sum(trials[job1].values()) + sum(trials.get(job2, {}).values())
    assert [a["attempt"] for a in res["attempts"]] == [1, 2]
    assert res["attempts"][0] == {
        "attempt": 1,
        "tasks": len(measured1),
        "trials": sum(measured1.values()),
    }
    # One job, one workspace: the second run continued in the one the kill left.
    (ws,) = [p for p in (out / "aoe_workspace").iterdir() if p.name != "logs"]
    assert (ws / "job.log").read_text().count(" INFO aoed.engine.onnxjob: job ") >= 2
    assert not (ws / ".running").exists() and not (ws / "tunespace" / "work").exists()


def test_a_run_takes_every_kept_record_but_with_repeat_tune_only_the_resumed_job_s() -> None:
    """The rule both job kinds resume by (engine/resume.py): ONNX task decisions and
    GDAT search stages alike."""
    from aoed.engine.resume import key_for, takes

    mine, other = {"job": "job-1"}, {"job": "job-2"}
    assert takes(mine, False, "") and takes(other, False, "job-1")
    assert takes(mine, True, "job-1") and not takes(other, True, "job-1")
    assert not takes(mine, True, "") and not takes({}, True, "")  # a fresh REPEAT_TUNE run
    # what a run depends on names its records; aoed's version is part of it
    assert key_for({"a": 1}) == key_for({"a": 1}) != key_for({"a": 2})
    assert key_for({"a": 1}).endswith(b"/") and key_for({"a": 1}) != key_for({"gdat": {"a": 1}})

"""The `aoe` command as the daemon's client, against a real `aoed` on a temp socket."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest

from aoed import samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("cli-daemon"))
    samples.save(samples.build("mlp"), d.models / "mlp.onnx")
    d.start()
    yield d
    d.close()


def _aoe(d: DaemonProcess, *args: str, cwd: Path | None = None):
    return run_aoe(*args, env={"AOED_SOCKET": str(d.socket)}, cwd=cwd)


def test_submit_watch_jobs_status_fetch(daemon: DaemonProcess, tmp_path: Path) -> None:
    r = _aoe(daemon, "submit", str(daemon.models / "mlp.onnx"), "--budget", "2", "--watch")
    assert r.returncode == 0, r.stderr
    assert "state verifying -> succeeded" in r.stdout and "\n  verdict      " in r.stdout
    job_id = (
        r.stdout.split("as job ", 1)[1].split()[0]
        if "as job " in r.stdout
        else r.stderr.split("as job ", 1)[1].split()[0]
    )
    jobs = _aoe(daemon, "jobs")
    assert jobs.returncode == 0 and job_id in jobs.stdout and "succeeded" in jobs.stdout
    status = _aoe(daemon, "status", job_id)
    assert status.returncode == 0 and "state     succeeded" in status.stdout
    fetched = _aoe(daemon, "fetch", job_id, "-o", str(tmp_path / "got"))
    assert fetched.returncode == 0, fetched.stderr
    files = sorted(p.name for p in (tmp_path / "got").iterdir())
    assert len(files) == 2 and any(f.endswith("_tune.onnx") for f in files)
    onnx.checker.check_model(onnx.load(next((tmp_path / "got").glob("*_tune.onnx"))))
    doc = json.loads(next((tmp_path / "got").glob("*.json")).read_text())
    assert "repo_add_num" in json.dumps(doc), "the AOE-shaped result JSON"


def test_tune_goes_to_the_daemon_and_writes_outputs_locally(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    model = tmp_path / "cnn.onnx"
    samples.save(samples.build("cnn"), model)
    r = _aoe(
        daemon,
        "tune",
        str(model),
        "--budget",
        "2",
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert f"tuning on the daemon at unix://{daemon.socket}" in r.stderr
    assert "Aoe process finished" in r.stdout
    outputs = sorted(p.name for p in (tmp_path / "out").iterdir())
    # No job type named: the default, sgat+opat.
    assert any(n.endswith("_tune.onnx") for n in outputs) and any(
        n.startswith("aoe_result_sgat_opat_") for n in outputs
    )
    # What daemon.md's example run shows it writing, in the same shape: those two files.
    page = (Path(__file__).resolve().parent.parent / "docs" / "daemon.md").read_text()
    shown = re.findall(r"^  (?:tuned model|report)\s+out/(\S+)$", page, re.M)
    shapes = sorted(
        re.sub(r"\d{14}", r"\\d{14}", re.sub(r"_\d+\.json$", r"_\\d+\\.json", n)) for n in shown
    )
    assert len(shapes) == 2 and len(outputs) == 2, (shown, outputs)
    for shape in shapes:
        assert [n for n in outputs if re.fullmatch(shape, n)], (
            f"daemon.md shows {shape}; written: {outputs}"
        )


def test_a_failed_job_exits_with_its_error_class(daemon: DaemonProcess) -> None:
    bad = daemon.models / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 20)
    r = _aoe(daemon, "submit", str(bad), "--watch")
    assert r.returncode == 3, (r.returncode, r.stderr)  # ModelError
    assert "not a readable ONNX model" in r.stderr


def test_without_a_daemon_the_commands_say_where_they_looked(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    r = run_aoe("jobs", env={"AOED_SOCKET": str(sock)})
    assert r.returncode == 7 and str(sock) in r.stderr


def test_bank_commands_work_on_the_daemon_s_bank(daemon: DaemonProcess, tmp_path: Path) -> None:
    model = tmp_path / "cnn.onnx"
    samples.save(samples.build("cnn"), model)
    assert _aoe(daemon, "submit", str(model), "--budget", "2", "--watch").returncode == 0
    stats = _aoe(daemon, "bank", "stats", "--socket", str(daemon.socket))
    assert stats.returncode == 0 and f"custom: {daemon.bank}" in stats.stdout, stats.stderr
    out = tmp_path / "bank.jsonl"
    # AOED_SOCKET and no --bank: the daemon
    exported = _aoe(daemon, "bank", "export", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    lines = out.read_text().splitlines()
    assert lines and "from the daemon's bank" in exported.stderr
    again = _aoe(daemon, "bank", "import", str(out))
    assert (
        again.returncode == 0
        and f"0 added, 0 updated, {len(lines)} kept, 0 refused" in again.stdout
    ), again.stdout
    dry = _aoe(daemon, "bank", "prune", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout
    assert f"history of the bank at {daemon.bank} (the daemon's" in dry.stdout
    trials = int(dry.stdout.split("would remove ")[1].split()[0])
    assert trials > 0
    # AOED_SOCKET alone (set for the commands above) never deletes the daemon's history.
    unseen = _aoe(daemon, "bank", "prune")
    assert unseen.returncode == 2 and not unseen.stdout, unseen.stdout
    assert f"the {trials} history trials of the bank at {daemon.bank}" in unseen.stderr
    assert "--yes" in unseen.stderr and f"--bank {daemon.bank}" in unseen.stderr
    # Named, it goes through the daemon (the bank's writer), saying which bank first.
    named = _aoe(daemon, "bank", "prune", "--bank", str(daemon.bank))
    first, result = named.stdout.splitlines()
    assert named.returncode == 0 and first.endswith(
        f"pruning the history of the bank at {daemon.bank} (the daemon's at unix://{daemon.socket})"
    ), (named.stdout, named.stderr)
    assert f"removed {trials} history trials" in result
    assert _aoe(daemon, "bank", "import", str(out)).returncode == 0  # the trials again
    assert _aoe(daemon, "bank", "prune", "--yes").returncode == 0
    assert "history 0 trials" in _aoe(daemon, "bank", "stats").stdout
    help_text = " ".join(_aoe(daemon, "bank", "prune", "--help").stdout.split())
    # One default, said once: the daemon's bank first (as the commands above took it).
    assert help_text.count("TUNE_BANK_PATH") == 1
    assert (
        "default: the daemon's bank with --socket or AOED_SOCKET set, else TUNE_BANK_PATH"
        in help_text
    )
    local = _aoe(daemon, "bank", "stats", "--bank", str(daemon.bank))
    assert local.returncode == 0 and "custom:" in local.stdout, "--bank reads the bank directly"

"""What a user reads when something is wrong: the real `aoe`, `aoed` and install.sh.

A closed pipe ends `aoe` quietly; a wrong model file is refused in the user's own
process before anything is imported, uploaded or queued; reasons are shown whole or cut
at a word; a drop-folder failure names the file as dropped; a configuration reports every
problem; a staged install says what it staged; the docs say what the code does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aoe.client import Client
from aoed import samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("messages")
    # A second drop folder whose own aoed.toml names an input no sample model has.
    shaped = root / "shaped"
    shaped.mkdir()
    (shaped / "aoed.toml").write_text("budget_s = 1\ninput_shapes = { nosuch = [1, 4] }\n")
    d = DaemonProcess(root, f'[[inbox]]\npath = "{shaped}"\nstable_s = 1.0\n')
    d.start()
    yield d
    d.close()


def _aoe_into_closed_pipe(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `aoe` with its stdout a pipe whose reader has already gone, as `| head -c 10`
    leaves it once head has its bytes (here on every run, not on a lucky one)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            [sys.executable, "-m", "aoe.cli", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=120,
        )
    finally:
        os.close(w)


def test_a_reader_that_goes_away_ends_aoe_quietly(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        assert c.ping()
    for args in (
        ("jobs", "--socket", str(daemon.socket)),
        ("daemon", "--socket", str(daemon.socket)),
        ("--help",),
    ):
        done = _aoe_into_closed_pipe(*args)
        assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, (
            args,
            done.stderr,
        )
        if args[0] != "--help":  # argparse drops its own help quietly when the write fails
            assert done.returncode == 128 + 13, (
                args,
                done.returncode,
                done.stderr,
            )  # as if killed by SIGPIPE


def test_a_missing_model_is_reported_before_the_engine_is_imported(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "aoe.cli", "tune", "missing.onnx", "--local"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 3 and "aoe: error: missing.onnx: no such model file" in r.stderr, (
        r.stderr
    )
    imported = {
        ln.rsplit("|", 1)[-1].strip()
        for ln in r.stderr.splitlines()
        if ln.startswith("import time:")
    }
    heavy = sorted(
        m for m in imported if m in ("trio", "onnxruntime", "numpy") or m.startswith("aoed")
    )
    assert not heavy, f"imported before the file was checked: {heavy}"
    assert not list(tmp_path.iterdir()), "nothing is left behind by a run that never started"


def _empty(folder: Path) -> Path:
    (folder / "empty.onnx").touch()
    return folder / "empty.onnx"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: Path("/etc/passwd"), "not a readable ONNX model"),
        (lambda p: p / "missing.onnx", "no such model file"),
        # a folder may be a TensorFlow SavedModel: one without saved_model.pb is refused
        (lambda p: p, "not a TensorFlow SavedModel (no saved_model.pb in it)"),
        (_empty, "the file is empty"),
    ],
    ids=["text", "missing", "folder", "empty"],
)
def test_submit_refuses_what_is_not_a_model_before_uploading(
    daemon: DaemonProcess, tmp_path: Path, make, words: str
) -> None:
    path = make(tmp_path)
    r = run_aoe("submit", str(path), "--socket", str(daemon.socket))
    assert r.returncode == 3 and words in r.stderr and path.name in r.stderr, (
        r.returncode,
        r.stderr,
    )
    uploads = daemon.state / "uploads"
    assert not uploads.exists() or not any(uploads.rglob("*")), "nothing was uploaded"
    with Client(daemon.socket) as c:
        assert path.name not in [j.model_name for j in c.jobs()], "nothing was queued"
    good = tmp_path / "mlp.onnx"
    samples.save(samples.build("mlp"), good)
    from aoe.modelfile import check_model_file

    check_model_file(good)  # a real model passes the same check


def test_a_field_of_the_wrong_wire_type_is_named_the_same_before_and_after_an_upload() -> None:
    """ir_version (field 1, a varint) written as a length-delimited field: aoe's check
    before an upload and the engine's over the bytes it loads say the same."""
    from aoe.errors import ModelError
    from aoe.modelfile import check_model_bytes

    with pytest.raises(ModelError) as err:
        check_model_bytes(b"\x0a\x01\x07", "m.onnx")
    assert str(err.value) == (
        "m.onnx: not a readable ONNX model (byte 0: field 1 (ir_version) has wire type 2, not 0); "
        "pass the .onnx model file"
    )


def test_a_dropped_model_s_failure_names_the_dropped_file_whole(daemon: DaemonProcess) -> None:
    dropped = daemon.inbox / "broken.onnx"
    # Valid protobuf framing, not a model: the watcher takes it and the engine refuses it.
    dropped.write_bytes(b"\x08\x07garbage" * 20)
    report = daemon.inbox.parent / "failed" / "broken.onnx.error.txt"
    wait_for(report.exists, 120.0, str(report))
    text = report.read_text()
    assert "error: broken.onnx: " in text and str(daemon.state) not in text, text

    with Client(daemon.socket) as c:
        (job,) = [j for j in c.jobs() if j.model_name == "broken.onnx"]
    assert len(job.error) > 60 and job.error.startswith("broken.onnx: "), job.error
    assert str(daemon.state) not in job.error, job.error
    listed = run_aoe("jobs", "--socket", str(daemon.socket))
    (row,) = [ln for ln in listed.stdout.splitlines() if ln.startswith(job.job_id)]
    assert "claimed" not in row, row
    shown = row.split("failed", 1)[1].split(None, 3)[-1].rstrip()  # the PROGRESS cell
    assert shown.endswith("…"), row
    cut = shown.removesuffix("…")
    assert job.error.startswith(cut) and job.error[len(cut)] in " ,;:", f"cut mid-word: {shown!r}"

    status = run_aoe("status", job.job_id, "--socket", str(daemon.socket))
    assert f"error     {job.error}\n" in status.stdout, status.stdout
    assert f"({dropped})" in status.stdout and "claimed" not in status.stdout, status.stdout


def _broken_models(folder: Path) -> dict[str, tuple[Path, list[str]]]:
    """The two broken models, with the options that break them: a model asked for an
    input it lacks, and a file whose protobuf framing holds no model."""
    mlp = folder / "mlp.onnx"
    samples.save(samples.build("mlp"), mlp)
    corrupt = folder / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage" * 50)
    return {"no-input": (mlp, ["--input-shape", "nosuch:1,4"]), "corrupt": (corrupt, [])}


def test_a_broken_model_gets_one_message_on_every_route(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The same broken file through the daemon (uploaded as a client would, so that the
    daemon's engine reads its own copy), embedded `aoe tune` and a drop folder: one
    message, after each route's own prefix, naming the file by the name the user gave
    it and never the daemon's copy in its state dir."""
    from aoe.v1 import tuning_pb2
    from tests.daemon_util import upload

    broken = _broken_models(tmp_path)
    shaped = daemon.root / "shaped"
    for path, _opts in broken.values():
        (shaped / path.name).write_bytes(path.read_bytes())
    stub = daemon.tuning()
    for case, (path, opts) in broken.items():
        shapes = [tuning_pb2.InputShape(name="nosuch", dims=[1, 4])] if opts else []
        job_id = stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_id=upload(stub, path),
                options=tuning_pb2.JobOptions(budget_s=1, input_shapes=shapes),
            ),
            timeout=30,
        ).job_id
        on_daemon = daemon.wait_job(job_id).error
        local = run_aoe(
            "tune", str(path), *opts, "--local", "--budget", "1", "--no-progress",
            "--output", str(tmp_path / case),
        )  # fmt: skip
        embedded = local.stderr.strip().splitlines()[-1].removeprefix("aoe: error: ")
        report = daemon.root / "failed" / f"{path.name}.error.txt"
        wait_for(report.exists, 120.0, str(report))
        (dropped,) = [
            ln.removeprefix("error: ")
            for ln in report.read_text().splitlines()
            if ln.startswith("error: ")
        ]
        assert on_daemon == embedded == dropped, (case, on_daemon, embedded, dropped)
        assert on_daemon.startswith(f"{path.name}: ") or f" {path.name} " in on_daemon, on_daemon
        assert str(daemon.state) not in on_daemon and "inputs/" not in on_daemon, on_daemon


def test_check_config_reports_every_problem(tmp_path: Path) -> None:
    config = tmp_path / "aoed.toml"
    config.write_text(
        '[daemon]\nmax_running_jobs = "two"\nmax_queued_jobs = 0\ncolour = "blue"\n'
        '[listen]\nsocket_mode = "0666"\n[tuning]\nparallel = 99\n[engine]\nmax_nodes = "many"\n'
        "[[inbox]]\nstable_s = 3\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "aoed", "--check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    expected = [
        "max_running_jobs = 'two': expected an integer",
        "max_queued_jobs = 0: must be between",
        "colour: unknown setting",
        "socket_mode = '0666'",
        "parallel = 99: must be between 1 and 32",
        "max_nodes = 'many': expected a whole number of nodes",
        "[[inbox]] #1: path is required",
    ]
    lines = r.stderr.splitlines()
    assert lines[0] == f"aoed: error: {len(expected)} problems in the configuration:", r.stderr
    for words in expected:
        assert sum(words in ln for ln in lines[1:]) == 1, (words, r.stderr)


def test_a_staged_install_says_what_it_staged_and_how_to_check_it(tmp_path: Path) -> None:
    dest = tmp_path / "stage"
    done = subprocess.run(
        ["sh", str(ROOT / "deploy" / "install.sh"), "--destdir", str(dest), "--no-venv"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    staged = sorted(str(p) for p in dest.rglob("*") if p.is_file())
    assert staged and all(f"install.sh:   {p}" in done.stdout.splitlines() for p in staged), (
        done.stdout
    )
    unit = dest / "usr/lib/systemd/system/aoed.service"
    assert f"systemd-analyze verify {unit}" in done.stdout, done.stdout
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "systemd-analyze verify DESTDIR/usr/lib/systemd/system/aoed.service" in readme


def test_the_bank_page_names_the_bank_the_code_uses_as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the defaults as root are checked as root")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("AOED_CONFIG", "TUNE_BANK_PATH", "AOED_SOCKET")
    }
    r = subprocess.run(
        [sys.executable, "-m", "aoed", "--check-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    bank = re.search(r"^  bank\s+(\S+)", r.stdout, re.MULTILINE).group(1)
    section = (
        (ROOT / "docs" / "bank.md")
        .read_text()
        .split("## Where it lives", 1)[1]
        .strip()
        .split("\n\n", 1)[0]
    )
    assert f"`{bank}` as root" in section, section


def test_event_numbers_are_per_job_with_gaps_where_log_lines_were(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    model = daemon.models / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    with Client(daemon.socket) as c:
        job = c.submit(model, options={"budget_s": 1.0})
        everything = [e.sequence for e in c.watch(job.job_id, include_logs=True)]
        no_logs = [e.sequence for e in c.watch(job.job_id)]
        assert everything == list(range(1, len(everything) + 1)), (
            "with log lines: 1, 2, 3... with no gaps"
        )
        assert set(no_logs) < set(everything) and no_logs == sorted(no_logs), (
            "without: increasing, with gaps"
        )
        # Resuming after any number seen loses nothing: the rest of the same stream.
        for seen in no_logs[:-1]:
            assert [e.sequence for e in c.watch(job.job_id, after_sequence=seen)] == [
                s for s in no_logs if s > seen
            ]
    api = (ROOT / "docs" / "API.md").read_text()
    assert "no gaps" not in api and "gaps where" in api, (
        "docs/API.md says what a watcher without logs sees"
    )

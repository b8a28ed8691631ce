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
import time
from pathlib import Path

import pytest

from aoe.client import Client
from aoed import samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("messages"))
    d.start()
    yield d
    d.close()


def _aoe_into_closed_pipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `aoe` with its stdout a pipe whose reader has already gone, as `| head -c 10`
    leaves it once head has its bytes (here on every run, not on a lucky one)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "aoe.cli", *args], stdout=w, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})}, timeout=120)  # fmt: skip
    finally:
        os.close(w)


def test_a_reader_that_goes_away_ends_aoe_quietly(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        assert c.ping()
    for args in (("jobs", "--socket", str(daemon.socket)), ("daemon", "--socket", str(daemon.socket)), ("--help",)):
        done = _aoe_into_closed_pipe(*args)
        assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, (args, done.stderr)
        if args[0] != "--help":  # argparse drops its own help quietly when the write fails
            assert done.returncode == 128 + 13, (args, done.returncode, done.stderr)  # as if killed by SIGPIPE


def _empty(folder: Path) -> Path:
    (folder / "empty.onnx").touch()
    return folder / "empty.onnx"


def _wait(cond, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)

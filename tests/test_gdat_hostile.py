"""Hostile .pt2 programs through a real daemon's drop folder and through `aoe tune`: each
fails its job before any rank process loads it, naming the member and why; its payload
(which torch's own loader runs: tests/test_gdat_archive.py) never runs; the daemon goes
on. And a daemon whose kernel refuses Landlock fails a GDAT job saying so, unless
[daemon] allow_unconfined_gdat says otherwise.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from aoe.errors import ModelError

from .conftest import run_aoe
from .daemon_util import DaemonProcess
from .helpers import wait_for

pytest.importorskip(
    "torch", reason="GDAT needs torch: pip install '.[gdat]' (make test installs it)"
)

from aoed import sandbox  # noqa: E402

from .hostile_pt2 import KINDS, root_of, tiny_program  # noqa: E402

pytestmark = pytest.mark.slow

#: One of each way torch's loader runs code from the file.
_RUNS_CODE = ("opaque_object", "sympy_expression", "guard")
_GDAT_INBOX = 'job_type = "gdat"\nworld_size = 2\nbudget_s = 3.0\n'


def test_hostile_programs_dropped_in_a_gdat_inbox_go_to_failed_naming_the_member(
    tmp_path: Path,
) -> None:
    base = tiny_program(tmp_path / "tiny.pt2")
    marker = tmp_path / "ran"
    d = DaemonProcess(tmp_path / "d")
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text(_GDAT_INBOX)
    d.start()
    try:
        for name in _RUNS_CODE:
            evil = KINDS[name].build(base, tmp_path / f"{name}.pt2", marker)
            (d.inbox / f"{name}.pt2").write_bytes(evil.read_bytes())
        failed = d.inbox.parent / "failed"
        for name in _RUNS_CODE:
            # The reason is written first, then the program moved beside it: wait for both.
            report = wait_for(
                lambda n=name: (
                    (failed / f"{n}.pt2").exists() and next(failed.glob(f"{n}.pt2.error.txt"), None)
                ),
                120,
                f"{name}.pt2 and its reason in failed/:\n{d.log()[-3000:]}",
            )
            text = report.read_text()
            kind = KINDS[name]
            assert f"{root_of(base)}/{kind.member}" in text and kind.why in text, text
            assert "refused before loading" in text, text
            # named as it was dropped, not as the daemon's claimed copy in its state dir
            assert str(d.inbox / f"{name}.pt2") in text and str(d.state) not in text, text
        assert not marker.exists()
        assert d.serving()
    finally:
        d.close()


def test_aoe_tune_refuses_a_hostile_program_in_one_line(tmp_path: Path) -> None:
    base = tiny_program(tmp_path / "tiny.pt2")
    marker = tmp_path / "ran"
    evil = KINDS["opaque_object"].build(base, tmp_path / "evil.pt2", marker)
    r = run_aoe(
        "tune",
        str(evil),
        "--job-type",
        "gdat",
        "--world-size",
        "2",
        "--bank",
        str(tmp_path / "bank"),
        "--output",
        str(tmp_path / "out"),
        "--no-progress",
        env={"AOED_RUNTIME_DIR": str(tmp_path / "rt")},
    )
    assert r.returncode == ModelError.exit_code, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"aoe: error: {evil}: refused before loading: tiny/data/constants/")
    assert "opaque_obj_0: is a pickled custom or opaque object" in line, line
    assert not marker.exists() and not (tmp_path / "bank").exists()


#: The daemon started under a seccomp filter that refuses Landlock's system calls, as
#: systemd's SystemCallFilter=@system-service (systemd 252) would without the unit's
#: own allowance (deploy/systemd/aoed.service).
_NO_LANDLOCK = textwrap.dedent("""
    import os, sys
    from aoed import sandbox

    sandbox._no_new_privs()
    sandbox._seccomp([444, 445, 446], all_threads=False)
    os.execv(sys.argv[1], sys.argv[1:])
""")


def test_a_daemon_whose_kernel_refuses_landlock_fails_a_gdat_job_naming_the_setting(
    tmp_path: Path,
) -> None:
    if not sandbox.landlock_abi()[0]:
        pytest.skip("no Landlock here: the refusal is the kernel's own, not a filter's")
    base = tiny_program(tmp_path / "tiny.pt2")
    d = DaemonProcess(tmp_path / "d")
    d.argv_prefix = [sys.executable, "-c", _NO_LANDLOCK]
    d.inbox.mkdir(parents=True)
    (d.inbox / "aoed.toml").write_text(_GDAT_INBOX)
    d.start()
    try:
        (d.inbox / "tiny.pt2").write_bytes(base.read_bytes())
        failed = d.inbox.parent / "failed"
        report = wait_for(
            lambda: next(failed.glob("tiny.pt2.error.txt"), None), 120, f"failed/:\n{d.log()}"
        )
        text = report.read_text()
        assert "refuses Landlock's system calls" in text and sandbox.UNCONFINED_SETTING in text
        assert d.serving()
    finally:
        d.close()

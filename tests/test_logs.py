"""The daemon's log lines: syslog priorities and job ids for journald, plain otherwise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from aoed.engine.engine import _current_job
from aoed.logs import configure, stderr_is_journal


def _lines(journal: bool, capsys) -> list[str]:
    handler = configure("info", journal=journal)
    try:
        log = logging.getLogger("logstest")  # not under aoed: other tests leave handlers there
        log.info("outside any job")
        token = _current_job.set("job-20261203-000000-abcd1234")
        try:
            log.warning("inside a job")
        finally:
            _current_job.reset(token)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("a bug")
    finally:
        logging.getLogger().removeHandler(handler)
    return capsys.readouterr().err.splitlines()


def test_journal_lines_carry_priorities_and_job_ids(capsys) -> None:
    lines = _lines(True, capsys)
    assert lines[0] == "<6>logstest: outside any job"
    assert lines[1] == "<4>logstest: job=job-20261203-000000-abcd1234 inside a job"
    assert lines[2].startswith("<3>logstest: a bug")
    assert all(line.startswith("<3>") for line in lines[3:]) and any("ValueError: boom" in x for x in lines[3:])


def test_plain_lines_have_time_and_level(capsys) -> None:
    lines = _lines(False, capsys)
    assert " INFO logstest: outside any job" in lines[0] and lines[0][:4].isdigit()
    assert "WARNING logstest: job=job-20261203-000000-abcd1234 inside a job" in lines[1]


def test_journal_stream_is_recognised_only_for_our_stderr(tmp_path) -> None:
    assert not stderr_is_journal({})
    assert not stderr_is_journal({"JOURNAL_STREAM": "1:2"})
    log = tmp_path / "err"
    code = ("import os,sys; from aoed.logs import stderr_is_journal; st=os.fstat(2); "
            "print(stderr_is_journal({'JOURNAL_STREAM': f'{st.st_dev}:{st.st_ino}'}))")
    with open(log, "w") as err:
        out = subprocess.run([sys.executable, "-c", code], stderr=err, capture_output=False, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ), check=True).stdout  # fmt: skip
    assert out.strip() == "True"

"""The daemon's log lines: syslog priorities and job ids for journald, plain otherwise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from aoed.logs import configure, cut, on_behalf_of, stderr_is_journal


def _lines(journal: bool, capsys) -> list[str]:
    handler = configure("info", journal=journal)
    try:
        log = logging.getLogger("logstest")  # not under aoed: other tests leave handlers there
        log.info("outside any job")
        with on_behalf_of("job-20261203-000000-abcd1234"):
            log.warning("inside a job")
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
    assert all(line.startswith("<3>") for line in lines[3:]) and any(
        "ValueError: boom" in x for x in lines[3:]
    )


def test_plain_lines_have_time_and_level(capsys) -> None:
    lines = _lines(False, capsys)
    assert " INFO logstest: outside any job" in lines[0] and lines[0][:4].isdigit()
    assert "WARNING logstest: job=job-20261203-000000-abcd1234 inside a job" in lines[1]


def test_journal_stream_is_recognised_only_for_our_stderr(tmp_path) -> None:
    assert not stderr_is_journal({})
    assert not stderr_is_journal({"JOURNAL_STREAM": "1:2"})
    log = tmp_path / "err"
    code = (
        "import os,sys; from aoed.logs import stderr_is_journal; st=os.fstat(2); "
        "print(stderr_is_journal({'JOURNAL_STREAM': f'{st.st_dev}:{st.st_ino}'}))"
    )
    with open(log, "w") as err:
        out = subprocess.run(
            [sys.executable, "-c", code],
            stderr=err,
            capture_output=False,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
            check=True,
        ).stdout
    assert out.strip() == "True"


def test_a_record_is_one_line_whatever_a_name_holds(capsys) -> None:
    name = (
        "evil\n2099-01-01 00:00:00,000 ERROR aoed.watch: forged\r\x1b[2K\u2028"
        + os.fsdecode(b"\xff")
        + ".onnx"
    )
    handler = configure("info", journal=False)
    logging.getLogger().removeHandler(handler)
    # Straight to the handler under test: pytest's own log capture would carry the raw
    # surrogate into the test's report, which a report sent between processes cannot hold.
    log = logging.getLogger("logstest")
    handler.handle(
        log.makeRecord(
            log.name, logging.WARNING, __file__, 0, "inbox: %s is not a model", (name,), None
        )
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "evil\\n2099-01-01 00:00:00,000 ERROR aoed.watch: forged\\r\\x1b[2K\\u2028\\xff.onnx "
        "is not a model"
    ), lines[0]


def test_cut_keeps_the_ends_of_a_huge_text() -> None:
    huge = "a" * 50 + "b" * 100_000 + "c" * 50
    short = cut(huge)
    assert (
        len(short) < 260
        and short.startswith("a" * 50)
        and short.endswith("c" * 50)
        and "…" in short
    )
    assert cut("/srv/models/m.onnx") == "/srv/models/m.onnx"

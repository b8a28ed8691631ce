"""The daemon's log lines: for journald when stderr is the journal, else plain.

When systemd connects stderr to the journal it sets JOURNAL_STREAM to the device and
inode of that stream; then each line starts with its syslog priority (`<6>` for info),
which journald turns into the entry's PRIORITY (so `journalctl -p warning` works), and
carries no timestamp (the journal has its own). Either way, a line logged on behalf of
a job carries `job=<id>`, so `journalctl -u aoed --grep job=job-2026...` follows one job.

File names and paths come from users, and a name may hold a newline: every record's
message is passed through `printable`, so one record is one line that no name can
forge (a traceback after it keeps its own lines). `cut` shortens a path or name that
would make an error message huge.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = [
    "EscapingFormatter",
    "configure",
    "current_job",
    "cut",
    "job_log",
    "printable",
    "stderr_is_journal",
]

_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


#: Characters that end a line or disguise text: C0 and C1 controls, DEL, line and
#: paragraph separators, zero-width and bidirectional marks, and the lone surrogates
#: that stand for bytes that are not UTF-8 in a file name.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ud800-\udfff]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    o = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if 0xDC80 <= o <= 0xDCFF:  # os.fsdecode's stand-in for the byte o - 0xDC00
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: str) -> str:
    """`text` on one line: control, separator and invisible characters written as
    escapes (`\\n`, `\\x1b`, `\\u2028`; a byte of a file name that is not UTF-8 as
    `\\xNN`). Safe to encode as UTF-8."""
    return _UNPRINTABLE.sub(_escape, text)


def cut(text: str, keep: int = 100) -> str:
    """`text`, or when it is longer than `2 * keep + 40` characters, its first and last
    `keep` with an ellipsis between them that says how many were left out."""
    if len(text) <= 2 * keep + 40:
        return text
    return f"{text[:keep]}…({len(text) - 2 * keep} characters)…{text[-keep:]}"


class EscapingFormatter(logging.Formatter):
    """A Formatter whose record lines pass through `printable`."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def stderr_is_journal(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    dev, _, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


#: The job on whose behalf the running task works: its log records carry the job's id
#: (here) and go to that job's log too (aoed.engine.engine).
_current_job: contextvars.ContextVar[str] = contextvars.ContextVar("aoed_job", default="")


def current_job() -> str:
    """The id of the job on whose behalf the calling task works ("" outside jobs)."""
    return _current_job.get()


@contextlib.contextmanager
def on_behalf_of(job_id: str) -> Iterator[None]:
    """Log records made inside (in this task and those it starts) are `job_id`'s."""
    token = _current_job.set(job_id)
    try:
        yield
    finally:
        _current_job.reset(token)


class _JobTag(logging.Filter):
    """Adds `record.job` ("job=<id> " or "") from the current-job context."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = current_job()
        record.job = f"job={job} " if job else ""
        return True


class _JournalFormatter(EscapingFormatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prio = _PRIORITY.get(record.levelno, 6)
        # Every line of a multi-line record (a traceback) keeps the record's priority.
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())


def configure(level: str, journal: bool | None = None) -> logging.Handler:
    """Send the daemon's log records at `level` and above to stderr; returns the handler."""
    journal = stderr_is_journal() if journal is None else journal
    handler = logging.StreamHandler(sys.stderr)
    if journal:
        handler.setFormatter(_JournalFormatter("%(name)s: %(job)s%(message)s"))
    else:
        handler.setFormatter(
            EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(job)s%(message)s")
        )
    handler.addFilter(_JobTag())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("aoed").setLevel(getattr(logging, level.upper()))
    # watchfiles logs every batch of file changes at INFO: the inbox's own lines say what matters.
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, root.level))
    return handler


class _JobFilter(logging.Filter):
    def __init__(self, job_id: str):
        super().__init__()
        self.job_id = job_id

    def filter(self, record: logging.LogRecord) -> bool:
        return current_job() == self.job_id


@contextlib.contextmanager
def job_log(path: Path, job_id: str) -> Iterator[None]:
    """Inside, log records made on behalf of `job_id` (this task and those it starts) also
    go to `path`, the job's own log; a daemon runs other jobs meanwhile, and theirs go to
    their own logs."""
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_JobFilter(job_id))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("aoed")
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)  # the job log wants INFO; the console handler filters its own
    root.addHandler(handler)
    try:
        with on_behalf_of(job_id):
            yield
    finally:
        root.removeHandler(handler)
        handler.close()

"""The daemon's log lines: for journald when stderr is the journal, else plain.

When systemd connects stderr to the journal it sets JOURNAL_STREAM to the device and
inode of that stream; then each line starts with its syslog priority (`<6>` for info),
which journald turns into the entry's PRIORITY (so `journalctl -p warning` works), and
carries no timestamp (the journal has its own). Either way, a line logged on behalf of
a job carries `job=<id>`, so `journalctl -u aoed --grep job=job-2026...` follows one job.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

__all__ = ["configure", "stderr_is_journal"]

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


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


class _JobTag(logging.Filter):
    """Adds `record.job` ("job=<id> " or "") from the engine's current-job context."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aoed.engine.engine import current_job

        job = current_job()
        record.job = f"job={job} " if job else ""
        return True


class _JournalFormatter(logging.Formatter):
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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(job)s%(message)s"))
    handler.addFilter(_JobTag())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("aoed").setLevel(getattr(logging, level.upper()))
    # watchfiles logs every batch of file changes at INFO: the inbox's own lines say what matters.
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, root.level))
    return handler

"""The daemon's open file descriptors: its limit raised at start, and a reserve that
acceptors which can choose keep free for the rest.

Every part of the daemon needs descriptors: gRPC's connections, the job store, the bank,
each inbox's watch and the files it moves, the pipes to worker processes. A service
manager's default soft limit (1024 under systemd) is far below its hard limit, so at
start the soft limit is raised to the hard one (`raise_soft_limit`, called once by
aoed.__main__).

An endpoint that strangers can reach and that the daemon does not need (the metrics
endpoint: aoed.metrics) takes no new connection while fewer than `FD_RESERVE`
descriptors are left (`descriptors_left`), so that however many connections are
opened to it, the job store, the bank, the inbox and gRPC still get theirs.
"""

from __future__ import annotations

import logging
import os
import resource

__all__ = ["FD_RESERVE", "descriptors_left", "raise_soft_limit"]

log = logging.getLogger(__name__)

#: Descriptors an optional acceptor leaves free for the daemon's own work: a handful for
#: each running job's workers and files, the store, the bank, the inboxes and some
#: gRPC clients.
FD_RESERVE = 128

#: What RLIM_INFINITY means for open files: the kernel's ceiling (fs.nr_open), which
#: setrlimit refuses to exceed.
_NR_OPEN = "/proc/sys/fs/nr_open"


def raise_soft_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; returns (soft, hard) as
    they are afterwards, logged with what the soft limit was. A limit that cannot be
    raised (a sandbox that denies it) is logged and kept: never an error."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(_NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning(
                "aoed: open files: the soft limit %d could not be raised to the hard limit %s (%s)",
                soft,
                _shown(hard),
                getattr(exc, "strerror", None) or exc,
            )
            return soft, hard
        log.info(
            "aoed: open files: soft limit raised from %d to %d (hard limit %s)",
            soft,
            target,
            _shown(hard),
        )
        return target, hard
    log.info("aoed: open files: soft limit %s, hard limit %s", _shown(soft), _shown(hard))
    return soft, hard


def descriptors_left() -> int:
    """How many more descriptors this process may open now: its soft limit less those
    open (counted in /proc/self/fd; where that cannot be read, the lowest free number,
    which the kernel hands out next, stands for the count)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:
        try:
            used = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # EMFILE: none left
            return 0
        os.close(used)
    return soft - used


def _shown(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)

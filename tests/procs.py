"""Which processes a process started, read from /proc (no psutil): for the tests that
check a cancelled or killed job leaves none of its children behind."""

from __future__ import annotations

from pathlib import Path


def children_running(parent: int, module: str) -> set[int]:
    """Pids of the processes `parent` started whose command line names `module` and that
    still exist (alive, or not yet reaped)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        # The parent pid is the second field after the command name, which ends at the last ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module.encode() in cmd:
            out.add(int(d.name))
    return out

"""Processes for the tests: which ones a process started, read from /proc (no psutil),
for the tests that check a cancelled or killed job leaves none of its children behind;
and a world of rank processes running a snippet of code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_ranks(code: str, *args: str, size: int = 2, timeout: float = 120) -> list[tuple[str, str]]:
    """Run `code` (python -c) as `size` processes at once, each given its rank and then
    `args` on its command line; each one's (stdout, stderr), once every one exited 0
    (else an AssertionError with their output)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(size)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


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

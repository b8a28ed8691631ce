"""Processes for the tests: which ones a process started, read from /proc (no psutil),
for the tests that check a cancelled or killed job leaves none of its children behind;
and a world of rank processes running a snippet of code."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_ranks(code: str, *args: str, size: int = 2, timeout: float = 120) -> list[tuple[str, str]]:
    """Run `code` (python -c) as `size` processes at once, each given its rank and then
    `args` on its command line; each one's (stdout, stderr), once every one exited 0
    (else an AssertionError with their output). Output goes to files, so a rank that
    writes much never blocks on a pipe while another is waited for; every rank is killed
    if the world overruns `timeout` or a wait fails.

    A rank that ran `code` to its end leaves at once (os._exit after flushing): gloo's
    threads, torn down by C++ destructors as the interpreter ends, now and then abort
    the process ("terminate called without an active exception") after its work is done
    and printed. A rank that raised still exits non-zero."""
    code += (
        "\nimport os as _os, sys as _sys\n_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)\n"
    )
    with contextlib.ExitStack() as stack:
        files = [
            (
                stack.enter_context(tempfile.TemporaryFile("w+")),
                stack.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in range(size)
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(rank), *args], stdout=out, stderr=err, text=True
            )
            for rank, (out, err) in enumerate(files)
        ]
        try:
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outs = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            outs.append((out.read(), err.read()))
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

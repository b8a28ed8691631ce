"""The machine a benchmark ran on, read from the system while it runs.

Absolute times only mean something next to what produced them: which CPU, how many cores
this process may use (a container or `taskset` can allow fewer than the machine has), how
much memory, and how busy the machine was. Load is read at the start and at the end of a
run, because other work on a shared machine is the main source of noise. The commit of
the code measured is read at the start too, so that every figure names the code it is
a promise about.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Machine"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _mem_gib() -> tuple[float, float] | None:
    """(total, available) GiB from /proc/meminfo; None where it cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    fields[key] = int(rest.split()[0])  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields:
        return None
    total = fields["MemTotal"] / 2**20
    return total, fields.get("MemAvailable", 0) / 2**20


def _load() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _revision() -> str:
    """The checkout's commit ("commit abc1234", "+ uncommitted changes" when tracked files
    differ from it); "commit unknown" outside a git checkout. The bench's own outputs
    (RESULTS.md and the plots), which an earlier section of the same run rewrites, do not
    count as changes to the code measured."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        dirty = git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":(exclude)bench/RESULTS.md",
            ":(exclude)bench/*.png",
        )
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    return f"commit {head}" + (" + uncommitted changes" if dirty else "")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@dataclass
class Machine:
    """A snapshot taken at construction (the start of a run); `finish()` at the end."""

    cpu: str = field(default_factory=_cpu_model)
    cores: int = field(default_factory=lambda: os.cpu_count() or 0)
    usable: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    memory: tuple[float, float] | None = field(default_factory=_mem_gib)
    load_start: tuple[float, float, float] | None = field(default_factory=_load)
    load_end: tuple[float, float, float] | None = None
    revision: str = field(default_factory=_revision)

    def finish(self) -> None:
        self.load_end = _load()

    def load_text(self) -> str:
        def one(load: tuple[float, float, float] | None) -> str:
            return "n/a" if load is None else f"{load[0]:.2f}"

        end = one(self.load_end) if self.load_end is not None else "not read"
        return f"load average (1 min) {one(self.load_start)} at the start, {end} at the end"

    def describe(self, *packages: str) -> str:
        """One line: CPU, cores, memory, load, OS, Python, the versions of `packages`,
        and the commit of the code measured."""
        cores = f"{self.cores} logical CPUs"
        if self.usable != self.cores:
            cores += f", {self.usable} of them usable by this process"
        mem = (
            "memory n/a"
            if self.memory is None
            else f"{self.memory[0]:.1f} GiB memory ({self.memory[1]:.1f} GiB available at the start)"
        )
        versions = ", ".join(f"{p} {_version(p)}" for p in packages)
        return (
            f"{self.cpu}, {cores}; {mem}; {self.load_text()}; {platform.system()} "
            f"{platform.release()} ({platform.machine()}); Python {platform.python_version()}"
            + (f", {versions}" if versions else "")
            + f"; the code measured: aoe at {self.revision}"
        )

"""Memory: what each of the engine's child processes may use, and whether a job fits.

The engine's children (the compile workers and one runner per device) each run under an
address-space limit. Unless `[engine] worker_memory_mb` sets it, the limit is derived at
start so that every child at its limit, and the daemon, fit in the memory there is:

    available  = [engine] memory_mb, else the smaller of MemAvailable (/proc/meminfo)
                 and what the process's cgroup has left (memory.max - memory.current)
    per child  = (available - DAEMON_RESERVE_MB) / (workers + 1 runner)

A child's address space bounds its resident memory, so the children together never take
more than `available - DAEMON_RESERVE_MB`, whatever the jobs do. When even
MIN_WORKER_MEMORY_MB each does not fit, fewer workers are started.

A job does all its work for one model in one child at a time, so it fits when its
estimated peak does (`job_need_mb`):

    need = CHILD_BASE_MB + PEAK_PER_MODEL_MB x (the model's MiB: file and external data)
         = 512 + 6 x model MiB

A job that does not fit is refused at submission (the daemon) or before its model is read
(prepare), with both figures, rather than failing later at the limit. The refusal is a
ModelError, as for a model over [engine] max_model_mb: this model does not fit this
machine, and submitting it again later will not change that (a drop folder sends it to
failed/ instead of retrying it).

A GDAT job runs its world's rank processes, outside the children's limits, so it is
counted by what its ranks take (`world_need_mb`):

    need = worlds at once x ranks x (RANK_BASE_MB + RANK_PER_MODEL_MB x model MiB)

Jobs share the memory the engine may use (`MemoryPlan.total_mb`): the daemon starts a
queued job only while the estimates of the jobs running and its own fit in it, and holds
it in the queue until they do (jobs.manager). Only a job that alone needs more than the
total could never run, and only that one is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from aoe.config import MIN_WORKER_MEMORY_MB, Config
from aoe.errors import ModelError

__all__ = [
    "CHILD_BASE_MB",
    "DAEMON_RESERVE_MB",
    "PEAK_PER_MODEL_MB",
    "MemoryPlan",
    "RANK_BASE_MB",
    "RANK_PER_MODEL_MB",
    "available_mb",
    "check_fits",
    "job_need_mb",
    "plan_memory",
    "world_need_mb",
]

log = logging.getLogger(__name__)

#: Kept for the engine's own process (the daemon measured 80 MiB resident after a job on a
#: 48 MiB model, gRPC and the job store included) and what the host does around it.
DAEMON_RESERVE_MB = 256
#: A child's address space before any model: the interpreter, onnx, onnxruntime, numpy
#: and the allocator's reservations (a small MLP's job passed under a 512 MiB limit).
CHILD_BASE_MB = 512
#: A child's peak per MiB of model: the confirming A/B holds four sessions of the whole
#: model in the runner. Measured with `aoe tune --budget 2` on MLPs of 3, 12, 48 and 192
#: MiB: the children's peak resident memory was 107, 163-171, 368-379 and 1206-1247 MiB
#: (6.0 MiB more per model MiB); under an address-space limit the 48 MiB one passed at
#: 1024 MiB (estimate: 800), the 192 MiB one failed at 1400 and passed at 1550 (estimate:
#: 1664). Activations are not counted: a job with huge inputs meets the limit itself.
PEAK_PER_MODEL_MB = 6
#: A GDAT rank's resident memory before any model, and per MiB of model: a world of 2 on
#: gloo peaked at 320 MiB per rank on a 22 KiB program, and at 682 MiB on an 80 MiB one
#: (torch, gloo, the model, its gradients, DDP's buckets and a copy for each configuration).
RANK_BASE_MB = 384
RANK_PER_MODEL_MB = 5


def job_need_mb(model_bytes: int) -> int:
    """The estimated peak address space of a child working on a model of `model_bytes`
    (its file and external data), in MiB."""
    return CHILD_BASE_MB + -(-PEAK_PER_MODEL_MB * model_bytes // (1 << 20))


def world_need_mb(world_size: int, model_bytes: int, worlds: int = 1) -> int:
    """The estimated resident memory of `worlds` GDAT worlds of `world_size` ranks at once,
    each rank holding a model of `model_bytes`, in MiB."""
    per_rank = RANK_BASE_MB + -(-RANK_PER_MODEL_MB * model_bytes // (1 << 20))
    return worlds * world_size * per_rank


def _meminfo_available_mb() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available_mb() -> int | None:
    """What the tightest memory.max over this process's cgroup and its ancestors leaves
    (cgroup v2); None without a limit."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    root = Path("/sys/fs/cgroup")
    best: int | None = None
    d = root / rel.lstrip("/")
    while True:
        try:
            limit = (d / "memory.max").read_text().strip()
            if limit != "max":
                used = int((d / "memory.current").read_text())
                left = max(0, int(limit) - used) >> 20
                best = left if best is None else min(best, left)
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            return best
        d = d.parent


def available_mb(config: Config) -> tuple[int | None, str]:
    """(MiB the engine's processes may use, where that figure comes from); None when
    the machine does not say."""
    if config.memory_mb:
        return config.memory_mb, config.sources.get("memory_mb", "[engine] memory_mb")
    meminfo, cgroup = _meminfo_available_mb(), _cgroup_available_mb()
    if cgroup is not None and (meminfo is None or cgroup < meminfo):
        return cgroup, "what the cgroup's memory.max leaves"
    if meminfo is not None:
        return meminfo, "MemAvailable"
    return None, "unknown"


@dataclass(frozen=True)
class MemoryPlan:
    #: MiB the engine's processes may use, and where the figure comes from
    available_mb: int | None
    source: str
    workers: int
    #: each child's address-space limit in MiB (0: none)
    child_mb: int
    derived: bool
    #: measurement runners: one per device
    runners: int = 1

    @property
    def children(self) -> int:
        return self.workers + self.runners

    def describe(self) -> str:
        """One line for logs and --check-config."""
        avail = (
            f"{self.available_mb} MiB available ({self.source})"
            if self.available_mb is not None
            else "memory unknown"
        )
        limit = f"{self.child_mb} MiB each" if self.child_mb else "no limit"
        how = (
            f"(available - {DAEMON_RESERVE_MB} MiB for the daemon) / {self.children}"
            if self.derived
            else "[engine] worker_memory_mb"
        )
        runners = "1 runner" if self.runners == 1 else f"{self.runners} runners"
        return (
            f"{avail}; {self.workers} compile workers + {runners} at {limit}, {how}; a job needs about "
            f"{CHILD_BASE_MB} + {PEAK_PER_MODEL_MB} x its model's MiB in one of them"
        )

    def total_mb(self) -> int | None:
        """What the jobs may hold together: what the engine may use, less the daemon's
        reserve (None when the machine does not say)."""
        return None if self.available_mb is None else self.available_mb - DAEMON_RESERVE_MB

    def job_limit_mb(self) -> int | None:
        """The most one child can give a job: its limit, else what the engine may use."""
        if self.child_mb:
            return self.child_mb
        return None if self.available_mb is None else self.available_mb - DAEMON_RESERVE_MB

    def why(self) -> str:
        """Where `job_limit_mb` comes from, for messages."""
        if not self.derived and self.child_mb:
            return "[engine] worker_memory_mb"
        shared = f", shared by {self.children} processes" if self.child_mb else ""
        return f"{self.available_mb} MiB available ({self.source}), less {DAEMON_RESERVE_MB} MiB for the daemon{shared}"

    def apply(self, config: Config) -> Config:
        """`config` with the derived limit and worker count in place (its source says
        how it was derived, which messages about it repeat)."""
        sources = dict(config.sources)
        if self.derived:
            sources["worker_memory_mb"] = self.why()
        return replace(
            config, worker_memory_mb=self.child_mb, parallel=self.workers, sources=sources
        )


def plan_memory(config: Config, available: tuple[int | None, str] | None = None) -> MemoryPlan:
    """The children's memory for `config` (`available`: as `available_mb` says, by
    default). Logs a warning when the configured figures cannot all fit."""
    avail, source = available if available is not None else available_mb(config)
    workers, runners = config.parallel, len(config.all_devices)
    if config.worker_memory_mb is not None:  # set: kept as given, even when it does not fit
        child = config.worker_memory_mb
        if avail is not None and child and child * (workers + runners) + DAEMON_RESERVE_MB > avail:
            log.warning(
                "engine: worker_memory_mb=%d for %d workers and a runner is more than the %d MiB available "
                "(%s): together they can exhaust the machine",
                child,
                workers,
                avail,
                source,
            )
        return MemoryPlan(avail, source, workers, child, derived=False, runners=runners)
    if avail is None:
        return MemoryPlan(None, source, workers, 0, derived=True, runners=runners)
    room = avail - DAEMON_RESERVE_MB
    fit = max(1, room // MIN_WORKER_MEMORY_MB - runners)
    if room < 2 * MIN_WORKER_MEMORY_MB:
        log.warning(
            "engine: %d MiB available (%s) is less than one compile worker and a runner need at %d MiB "
            "each besides the daemon: they may exhaust it",
            avail,
            source,
            MIN_WORKER_MEMORY_MB,
        )
    elif fit < workers:
        log.warning(
            "engine: %d MiB available (%s) fits %d compile workers of %d MiB besides the runner, not %d: "
            "starting %d",
            avail,
            source,
            fit,
            MIN_WORKER_MEMORY_MB,
            workers,
            fit,
        )
        workers = fit
    return MemoryPlan(
        avail,
        source,
        workers,
        max(MIN_WORKER_MEMORY_MB, room // (workers + runners)),
        derived=True,
        runners=runners,
    )


def check_fits(what: str, model_bytes: int, limit_mb: int | None, why: str) -> None:
    """ModelError naming `what`, the estimate and the limit (and `why` it is that) when a
    model of `model_bytes` needs more than `limit_mb`."""
    if not limit_mb:
        return
    need = job_need_mb(model_bytes)
    if need > limit_mb:
        raise ModelError(
            f"{what}: tuning it needs about {need} MiB in one process ({CHILD_BASE_MB} + {PEAK_PER_MODEL_MB} x its "
            f"{model_bytes / (1 << 20):.0f} MiB), more than the {limit_mb} MiB one may use here ({why}); tune it "
            "on a machine with more memory, or raise [engine] memory_mb or worker_memory_mb if it has more"
        )

"""What one job may ask of this daemon: checked when it is submitted, and again before a
stored job starts (a job a daemon with other limits, or an older one, stored).

A spec checks itself against what no machine can run (aoe.spec and aoe.sizes: labels,
the number of shapes and dimensions, a budget over a week, a priority out of range).
What depends on the machine is checked here, against the daemon's configuration, each
refusal naming the field as the API spells it, its value, the limit and where it is set:

    world_size     [limits] max_world_size, max_ranks_per_device (aoed.engine.worldsize):
                   every rank is a process and a log file
    input_shapes   [engine] max_tensor_mb: an input of more elements than that many bytes
                   (the engine checks the exact size, by element type, when it prepares)
    memory         the estimate alone more than the engine may use ([engine] memory_mb,
                   else what the machine has): it could never run (ModelError). A job
                   that fits alone but not beside the jobs running waits in the queue.
    attempts       [daemon] max_job_attempts: a job that was running when the daemon
                   stopped or died that many times is failed, not started again

These are OptionErrors (INVALID_ARGUMENT) and ModelErrors: asking again does not help,
so a drop folder sends the model to failed/ (a ResourceExhaustedError would make it
wait and try again).
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from aoe.errors import AoedError, ModelError, OptionError
from aoe.spec import JobSpec, JobType
from aoed.config import DaemonConfig
from aoed.engine.memory import MemoryPlan, check_fits, job_need_mb, world_need_mb
from aoed.engine.worldsize import MIN_WORLD_SIZE
from aoed.gdat.space import world_knobs

__all__ = ["check_attempts", "check_memory", "check_spec", "model_bytes", "need_mb"]


def check_spec(spec: JobSpec, cfg: DaemonConfig) -> None:
    """OptionError when `spec` asks for more than `cfg` allows (see the module doc)."""
    if spec.job_type == JobType.GDAT:
        cfg.world_limits.check(spec.world_size, spec.backend or "gloo")
    limit = cfg.engine.max_tensor_mb
    for name, dims in spec.input_shapes.items():
        n = math.prod(dims)
        if n > limit << 20:
            raise OptionError(
                f"input_shapes {name!r}: {list(dims)} is {n} elements, more than one tensor may "
                f"hold here ([engine] max_tensor_mb = {limit} MiB, at one byte an element); give "
                "the shape the model runs at"
            )


def _world(spec: JobSpec) -> tuple[int, int]:
    """(ranks, worlds at once) of a GDAT job: a world with other backend knobs runs
    beside the main one while it is measured."""
    backend = spec.backend or "gloo"
    ranks = spec.world_size or (MIN_WORLD_SIZE if backend == "gloo" else 1)
    return ranks, 2 if world_knobs(backend) else 1


def need_mb(spec: JobSpec, model_bytes: int) -> int:
    """A job's estimated memory (engine.memory): its child's peak, or its worlds'."""
    if spec.job_type == JobType.GDAT:
        ranks, worlds = _world(spec)
        return world_need_mb(ranks, model_bytes, worlds)
    return job_need_mb(model_bytes)


def check_memory(what: str, spec: JobSpec, model_bytes: int, plan: MemoryPlan) -> None:
    """ModelError with both figures when a job of `spec` on a model of `model_bytes`
    could never run here: an ONNX job needing more than one child may use, a GDAT job
    whose worlds need more than the engine may use."""
    if spec.job_type != JobType.GDAT:
        check_fits(what, model_bytes, plan.job_limit_mb(), plan.why())
        return
    total = plan.total_mb()
    need = need_mb(spec, model_bytes)
    if total is None or need <= total:
        return
    ranks, worlds = _world(spec)
    at_once = f"{worlds} worlds at once of " if worlds > 1 else "a world of "
    raise ModelError(
        f"{what}: tuning it runs {at_once}{ranks} ranks, about {need} MiB together (each rank "
        f"about {need // (ranks * worlds)} MiB: torch and the model's "
        f"{model_bytes / (1 << 20):.0f} MiB), more than the {total} MiB jobs may use here "
        f"({plan.available_mb} MiB available ({plan.source}), less the daemon's own); ask for "
        "a smaller world_size, or raise [engine] memory_mb if the machine has more"
    )


def check_attempts(attempts: int, cfg: DaemonConfig) -> None:
    """AoedError when a job already started `attempts` times, each run ended by the
    daemon stopping or dying under it, may not start again."""
    if attempts >= cfg.max_job_attempts:
        raise AoedError(
            f"the job was started {attempts} times and each run was interrupted (the daemon "
            "stopped, crashed or was killed while it ran); it is not started again "
            f"([daemon] max_job_attempts = {cfg.max_job_attempts}): submit it again to retry"
        )


def model_bytes(path: str | os.PathLike[str]) -> int:
    """The size of the model file at `path`, or of the files in a SavedModel's directory
    (0 when it is gone)."""
    try:
        st = os.stat(Path(path))
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size
        return sum(
            os.lstat(os.path.join(top, f)).st_size for top, _, files in os.walk(path) for f in files
        )
    except OSError:
        return 0

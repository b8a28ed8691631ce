"""Admission: what a job must pass to be queued, and to start.

At submit (`admit`, then `check_client` and `check_queue` under the manager's lock), in
this order, before any file of the job exists: the device the spec names is this
daemon's; the model's kind (its file name's suffix) is the job type's; the spec is under
the limits (jobs/limits.py); the state dir has its floor of free space; a daemon-side
file has one link and is under `[engine] max_model_mb` (a SavedModel's directory: each
of its files, which are only files and folders, and their total); the job's memory estimate is
not more than the engine may use; the file hashed is the file checked. Then, beside the
jobs already recorded: one client's active jobs and the queue's length.

Before a stored job starts (`check_start`): the limits again (a daemon with other
limits, or an older one, may have stored it) and its attempts; and `MemoryShare`, which
starts a job only while its memory estimate fits beside those of the jobs running.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import trio

from aoe.errors import OptionError, PermissionDeniedError, ResourceExhaustedError
from aoe.savedmodel import is_saved_model, saved_model_digest, saved_model_files
from aoe.spec import JobSpec, JobType, check_model_kind
from aoed import safefs, space
from aoed.config import DaemonConfig
from aoed.engine.engine import Engine
from aoed.engine.memory import MemoryPlan
from aoed.engine.modelio import check_size
from aoed.jobs import limits
from aoed.jobs.inputs import shown_path
from aoed.jobs.store import JobRow, Upload

__all__ = [
    "Admitted",
    "MemoryShare",
    "Submission",
    "admit",
    "check_client",
    "check_queue",
    "check_start",
]


@dataclass(frozen=True)
class Submission:
    """A model and its spec (checked where it was built): `model` is a daemon-side file."""

    model: Path
    spec: JobSpec
    #: who submitted it: "rpc:<client>" (see api.tuning.client_of) or "inbox:<folder>";
    #: the per-client limit counts active jobs of one source
    source: str = "rpc:local"
    #: an upload to consume: the file is moved into the job's folder
    upload: Upload | None = None
    #: a daemon-side folder for the outputs (confined by the caller); None: the job's own
    output_dir: Path | None = None
    #: `model` is a file of the daemon's own that nobody else can write (a claimed drop;
    #: an upload is one too): what was hashed is what the job runs
    private: bool = False

    @property
    def joinable(self) -> bool:
        """Whether later identical submissions may join this one's job. Only when its
        model is the daemon's own: a file named by path may be rewritten after it was
        hashed (its owner, or anyone who may write it, keeps that right), and a
        submission that joined would then get the result of bytes it never sent."""
        return self.private or self.upload is not None


@dataclass(frozen=True)
class Admitted:
    """A submission past the checks of `admit`."""

    #: the spec the job runs with (an ONNX job's on this daemon's device)
    spec: JobSpec
    #: the model's sha256, and the key identical submissions share (`dedup_key`)
    sha256: str
    key: str
    #: the daemon-side file as checked and hashed (None for an upload)
    checked: os.stat_result | None


async def admit(sub: Submission, cfg: DaemonConfig, engine: Engine) -> Admitted:
    """Check `sub` against this daemon (see the module doc) and hash its model.

    OptionError for a spec naming another device than this daemon's, or asking for more
    than its limits allow (jobs/limits.py); DiskFullError below the free-space floor;
    PermissionDeniedError for a daemon-side file with several hard links (before
    anything opens it), or one that changed while it was checked; ModelError for one
    over [engine] max_model_mb, or whose estimated peak is more than an engine process
    (a GDAT job: all of the engine) may use (memory.py)."""
    mine = [a.device.name for a in engine.device_set]
    # A spec's device name is normalized: it compares as it is.
    if sub.spec.device is not None and sub.spec.device not in mine:
        raise OptionError(
            f"device {sub.spec.device}: this daemon measures on {', '.join(mine)} (see aoe devices)"
        )
    # The kind is the file name's: an upload's as uploaded, a path's own.
    check_model_kind(
        sub.upload.file_name if sub.upload is not None else sub.model.name,
        sub.spec.job_type,
        sub.spec.entry,
        daemon=True,
    )
    # A GDAT job's devices are its world's (the backend's), not the engine's.
    spec = sub.spec if sub.spec.job_type == JobType.GDAT else sub.spec.on(mine[0])
    limits.check_spec(spec, cfg)
    space.check_floor(cfg.state_dir, cfg.min_free_bytes, "SubmitJob")
    size = sub.upload.size if sub.upload is not None else 0
    info: os.stat_result | None = None
    saved: list[tuple[str, os.stat_result]] | None = None
    if sub.upload is None and await trio.to_thread.run_sync(is_saved_model, sub.model):
        # A SavedModel's directory (api.tuning let only such a path through as a
        # folder): its files are walked, checked and counted as one model's.
        info = await trio.to_thread.run_sync(os.lstat, sub.model)
        saved = await trio.to_thread.run_sync(
            saved_model_files,
            sub.model,
            engine.config.max_model_mb << 20,
            "[engine] max_model_mb",
        )
        size = sum(st.st_size for _, st in saved)
    elif sub.upload is None:
        # The size is refused before the file is hashed: the limit is there so that
        # nobody reads 9 GiB.
        info = await trio.to_thread.run_sync(os.lstat, sub.model)
        size = info.st_size
        if info.st_nlink > 1:
            # The daemon reads what its submitter names; a hard link (which no path check
            # sees) would make it read a file the submitter could not. Uploads have one link.
            raise PermissionDeniedError(
                f"{sub.model}: the file has {info.st_nlink} hard links, and a hard link can make the daemon "
                "read a file its submitter could not; copy the file (cp, not ln) or upload it"
            )
        check_size(
            sub.model,
            info.st_size,
            engine.config.max_model_mb << 20,
            "[engine] max_model_mb",
        )
    name = sub.upload.file_name if sub.upload is not None else str(sub.model)
    limits.check_memory(name, spec, size, engine.memory)
    if saved is not None:
        sha = await trio.to_thread.run_sync(saved_model_digest, sub.model, saved)
    elif sub.upload is None:
        assert info is not None
        sha = await trio.to_thread.run_sync(_hash_checked, sub.model, info)
    else:
        sha = sub.upload.sha256
    return Admitted(spec, sha, dedup_key(sha, spec), info)


def dedup_key(sha: str, spec: JobSpec) -> str:
    """The key of a job on the model with digest `sha` and tuning options of `spec`:
    an identical submission joins the active job with this key."""
    return hashlib.sha256((sha + json.dumps(spec.tuning, sort_keys=True)).encode()).hexdigest()


def check_client(cfg: DaemonConfig, source: str, active: int) -> None:
    """ResourceExhaustedError when `source` has its limit of `active` jobs."""
    if active >= cfg.max_jobs_per_client:
        raise ResourceExhaustedError(
            f"{source} has {active} jobs queued or running (the limit per client is "
            f"{cfg.max_jobs_per_client}); submit again when one has finished"
        )


def check_queue(cfg: DaemonConfig, queued: int) -> None:
    """ResourceExhaustedError when `queued` jobs fill the queue."""
    if queued >= cfg.max_queued_jobs:
        raise ResourceExhaustedError(
            f"{queued} jobs are queued (the limit is {cfg.max_queued_jobs}); try again later"
        )


def check_start(row: JobRow, cfg: DaemonConfig, plan: MemoryPlan) -> None:
    """AoedError when the queued job `row` may not start (or resume) under the limits
    and the attempts the configuration allows now."""
    limits.check_attempts(row.attempts, cfg)
    limits.check_spec(row.spec, cfg)
    limits.check_memory(shown_path(row), row.spec, limits.model_bytes(row.model_path), plan)


class MemoryShare:
    """The memory estimates (MiB) of the running jobs: a job starts only while its own
    fits beside theirs (or runs alone), and holds it until it ends."""

    def __init__(self) -> None:
        self._held_mb: dict[str, int] = {}
        #: the job last told it waits for memory ("" once it started)
        self._waiting = ""

    def admit(self, row: JobRow, plan: MemoryPlan) -> tuple[bool, str]:
        """(whether `row` starts now, holding its estimate; what to tell it: why it
        waits, said once, else "")."""
        need = limits.need_mb(row.spec, limits.model_bytes(row.model_path))
        total, held = plan.total_mb(), sum(self._held_mb.values())
        if total is None or not self._held_mb or held + need <= total:
            self._held_mb[row.id] = need
            if self._waiting == row.id:
                self._waiting = ""
            return True, ""
        if self._waiting == row.id:
            return False, ""
        self._waiting = row.id
        return False, (
            f"waits for memory: it needs about {need} MiB, and {held} of the {total} MiB jobs "
            f"may use here are held by {len(self._held_mb)} running job(s); it starts when one ends"
        )

    def release(self, job_id: str) -> None:
        """The job ended: its estimate is free."""
        self._held_mb.pop(job_id, None)


def _hash_checked(path: Path, checked: os.stat_result) -> str:
    """The sha256 of the file at `path`, read through a descriptor that must still be
    the file `checked` was (the same inode, one link): a file swapped in since the
    check, a hard link to a file from elsewhere included, is refused
    (PermissionDeniedError), and so is a link at `path`."""
    why = ""
    try:
        fd = safefs.open_file(path, single_link=True)
    except (safefs.LinkedError, safefs.LinkRefusedError) as exc:
        why = exc.strerror or "a link"
    else:
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_dev, now.st_ino) == (checked.st_dev, checked.st_ino):
                return hashlib.file_digest(f, "sha256").hexdigest()
            why = "another file took its name"
    raise PermissionDeniedError(
        f"{path}: the file changed while it was checked ({why}); the daemon reads only the "
        "file it checked: submit it again once nobody changes it"
    )

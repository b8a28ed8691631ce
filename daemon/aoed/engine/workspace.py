"""A job's place on disk, in AOE's layout, with names no other job can take.

    {output}/aoe_workspace/{model}_{ts}/                   the job's workspace
        tunespace/result/{model}_{ts}_tune.onnx            the tuned model (kept)
        job.log                                            the job's log (kept)
        tunespace/work/                                    scratch: prepared model, samples,
                                                           task models, candidates, variants
    {output}/aoe_result_{job type}_{ts}_{pid}.json         the result document

Two jobs of one model started in the same second, in one process or several, must not
share a directory or a result file: both are created exclusively (mkdir, O_EXCL), and a
taken name gets a `_2`, `_3` ... suffix. A long model name is shortened (safefs.fit) so
that every name here fits NAME_MAX.

The output folder may be one others can write (a client names it): the folders and the
result file are made relative to folder descriptors, and a link planted at
`aoe_workspace` (or at any name the job would take) is never followed (see safefs). Scratch is removed once the outputs are written,
unless the job failed (it is what one debugs) or `keep_workspace` was asked for.

One job, one workspace, across interruptions: while a run works in its workspace it
holds `.running` there, a file locked with flock(2) and naming the run's model (and the
daemon's job id). The lock dies with the process, so a file that is present but not
locked is a run that was killed (or interrupted to resume later), and the next run of
that model and job into the same output directory continues in that workspace (its
job.log goes on; its scratch starts empty) instead of making a second one. A run that
ends removes the file; one that fails before tuning started removes its workspace
entirely, so a mistyped command leaves nothing behind (`release`).

A workspace can vanish under a running job (its output directory removed). Then every
file a worker writes or reads there fails, which reads as a failed candidate, a failed
measurement or a model error; `gone()` says what happened instead, and the job checks it
before it believes such a failure (see engine.py, context.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from aoe.errors import AoedError
from aoe.spec import JobType
from aoed import safefs

__all__ = ["RUNNING", "Workspace"]

#: the file a live run holds locked in its workspace (see the module's doc)
RUNNING = ".running"
_TAG_TAIL = re.compile(r"\d{14}(_\d+)?")


class Workspace:
    def __init__(self, output: Path, root: Path, tag: str):
        self.output = output
        self.root = root
        self.tag = tag  # "{model}_{ts}" (+ suffix): the stem of every name the job writes
        self.scratch = root / "tunespace" / "work"
        self.result_dir = root / "tunespace" / "result"
        self.log_path = root / "job.log"
        self._root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of `root` once made
        self._lock_fd = -1  # `.running`, locked while this run works here
        #: an interrupted run's workspace that this run continues in
        self.resumed = False
        #: set once tuning has started: from then on a failed job's workspace is kept
        self.started = False
        self._made_base = False  # this run made `aoe_workspace/` itself

    @classmethod
    def create(
        cls, output: Path, model_stem: str, owner: Mapping[str, str] | None = None
    ) -> Workspace:
        """The workspace of an interrupted run of the same `owner` (the model, the job)
        under `output`, taken over, else a fresh one; held until `release()`. AoedError
        naming the directory when it cannot be created (missing permission, full disk, a
        file in the way)."""
        owner = dict(owner or {})
        ts = time.strftime("%Y%m%d%H%M%S")
        base = output / "aoe_workspace"
        # room after the stem: "_{ts}_{n}" and the longest name made from the tag
        stem = safefs.fit(model_stem, len(f"_{ts}_9999_tune.onnx"))
        at = output  # what is being made, for the message
        try:
            output.mkdir(parents=True, exist_ok=True)
            made_base = not base.is_dir()
            # Resolved: the folder named is used, even through a link; below it, nothing
            # is followed.
            with safefs.opened_dir(output.resolve()) as out:
                at = base
                base_fd = safefs.make_dir(base.name, dir_fd=out)
            try:
                ws = cls._take_over(output, base, stem, owner)
                if ws is not None:
                    return ws
                for n in range(1, 10_000):
                    tag = f"{stem}_{ts}" + (f"_{n}" if n > 1 else "")
                    at = base / tag
                    try:
                        os.mkdir(tag, dir_fd=base_fd)
                    except FileExistsError:
                        continue
                    ws = cls(output, base / tag, tag)
                    ws._made_base = made_base
                    root = safefs.open_dir(tag, dir_fd=base_fd)
                    try:
                        st = os.fstat(root)
                        ws._root_id = (st.st_dev, st.st_ino)
                        ws._hold(owner, root)
                        tunespace = safefs.make_dir("tunespace", dir_fd=root)
                        try:
                            os.close(safefs.make_dir("result", dir_fd=tunespace))
                            # Scratch holds copies of the user's inputs (the model,
                            # calibration samples): the user's alone, whatever the umask;
                            # outputs follow the umask.
                            os.close(safefs.make_dir("work", dir_fd=tunespace, mode=0o700))
                        finally:
                            os.close(tunespace)
                    except OSError:
                        ws.release("failed")  # nothing started: the folder goes
                        raise
                    finally:
                        os.close(root)
                    return ws
            finally:
                os.close(base_fd)
        except OSError as exc:
            raise AoedError(
                f"{at}: cannot create the job's workspace ({exc.strerror or exc})"
            ) from None
        raise AoedError(f"{base}: no free workspace name for {stem}_{ts}")

    @classmethod
    def _take_over(
        cls, output: Path, base: Path, model_stem: str, owner: dict[str, str]
    ) -> Workspace | None:
        """An interrupted run's workspace of `model_stem` whose `.running` names `owner`,
        locked for this run and its scratch emptied; None when there is none.

        The output folder may be one others can write in (a daemon's client names it),
        so every step goes through directory descriptors opened without following links,
        and only a workspace this user made (its `.running` too) is taken over."""
        try:
            base_fd = _open_dir(base)
        except OSError:
            return None
        try:
            for tag in sorted(os.listdir(base_fd)):
                if not (
                    tag.startswith(f"{model_stem}_")
                    and _TAG_TAIL.fullmatch(tag[len(model_stem) + 1 :])
                ):
                    continue
                fd = _interrupted(base_fd, tag, owner)
                if fd < 0:
                    continue
                ws = cls(output, base / tag, tag)
                ws._lock_fd, ws.resumed = fd, True
                try:
                    st = os.stat(tag, dir_fd=base_fd, follow_symlinks=False)
                    ws._root_id = (st.st_dev, st.st_ino)
                    _clear_scratch(base_fd, tag)
                    ws.scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
                    ws.result_dir.mkdir(parents=True, exist_ok=True)
                except OSError:  # e.g. a link where tunespace/ was: not a workspace to reuse
                    ws.release("interrupted")
                    continue
                return ws
        finally:
            os.close(base_fd)
        return None

    def _hold(self, owner: Mapping[str, str], root_fd: int) -> None:
        """Create `.running` in a fresh workspace (`root_fd`), locked, naming `owner`.

        It is made under a name of its own, locked and written, then renamed into place:
        another run of the same model looking for an interrupted workspace (`_take_over`)
        must never find a `.running` that is not locked yet, or it would lock it first,
        and this run would fail to."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        tmp = f"{RUNNING}.{secrets.token_hex(4)}"
        fd = os.open(tmp, flags, 0o600, dir_fd=root_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(owner, sort_keys=True).encode())
            os.rename(tmp, RUNNING, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=root_fd)
            raise
        self._lock_fd = fd

    def release(self, outcome: str) -> None:
        """Let go of the workspace as the run ends (best effort, never raises).
        `outcome`: "done" (or cancelled for good): it stays, without `.running`;
        "failed": likewise, or removed entirely if tuning had not started in a workspace
        this run made; "interrupted": `.running` stays, unlocked, so that the next run
        of this job continues here."""
        fd, self._lock_fd = self._lock_fd, -1
        base_fd = -1
        try:
            base_fd = _open_dir(self.root.parent)
            st = os.stat(self.tag, dir_fd=base_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != self._root_id:
                return  # not the folder this run made (moved away, replaced): not ours to touch
            if outcome == "failed" and not self.started and not self.resumed:
                shutil.rmtree(self.tag, ignore_errors=True, dir_fd=base_fd)
                if self._made_base:
                    with contextlib.suppress(OSError):
                        self.root.parent.rmdir()  # only if nothing else is in it
            elif outcome != "interrupted" and fd >= 0:
                root_fd = _open_dir(self.tag, base_fd)
                try:
                    if (
                        os.stat(RUNNING, dir_fd=root_fd, follow_symlinks=False).st_ino
                        == os.fstat(fd).st_ino
                    ):
                        os.unlink(RUNNING, dir_fd=root_fd)
                finally:
                    os.close(root_fd)
        except OSError:
            pass
        finally:
            for d in (base_fd, fd):
                if d >= 0:
                    os.close(d)

    @property
    def timestamp(self) -> str:
        """The tag's time stamp (the tag is "{stem}_{ts}" or "{stem}_{ts}_{n}")."""
        for part in reversed(self.tag.split("_")):
            if len(part) == 14 and part.isdigit():
                return part
        return time.strftime("%Y%m%d%H%M%S")

    def task_dir(self, task_id: str) -> Path:
        return self.scratch / "tasks" / task_id

    def tuned_model_path(self) -> Path:
        return self.result_dir / f"{self.tag}_tune.onnx"

    def reserve_result(self, job_type: str) -> Path:
        """Claim `aoe_result_{job_type}_{ts}_{pid}.json` (suffixed when taken) in the
        output directory; returns its path (an empty file until written)."""
        stem = f"aoe_result_{JobType(job_type).slug}_{self.timestamp}_{os.getpid()}"
        try:
            with safefs.opened_dir(self.output.resolve()) as out:
                for n in range(1, 10_000):
                    name = f"{stem}.json" if n == 1 else f"{stem}_{n}.json"
                    if safefs.reserve(name, dir_fd=out):
                        return self.output / name
        except OSError as exc:
            raise AoedError(
                f"{self.output}: cannot write the result ({exc.strerror or exc})"
            ) from None
        raise AoedError(f"{self.output}: no free result file name for {stem}")

    def gone(self) -> str | None:
        """Why the job cannot go on here, when its workspace (or the output directory
        above it) was removed or replaced since it was made; None while it is there."""
        try:
            st = os.stat(self.root)
            here = self._root_id in (None, (st.st_dev, st.st_ino)) and self.scratch.is_dir()
        except OSError:
            here = False
        if here:
            return None
        if not self.output.is_dir():
            return f"output directory {self.output}: removed while the job ran, so its outputs cannot be written there"
        return (
            f"output directory {self.output}: the job's workspace {self.root} was removed while the job ran, "
            "so its outputs cannot be written there"
        )

    def clean(self) -> None:
        """Remove the scratch files (best effort)."""
        shutil.rmtree(self.scratch, ignore_errors=True)


def _open_dir(path: Path | str, dir_fd: int | None = None) -> int:
    """A descriptor of the directory `path` (relative to `dir_fd`), never through a link."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _interrupted(base_fd: int, tag: str, owner: Mapping[str, str]) -> int:
    """The locked descriptor of `tag`'s `.running` when an interrupted run of `owner`
    left it (made by this user; present, yet locked by no live run); -1 otherwise."""
    try:
        root_fd = _open_dir(tag, base_fd)
    except OSError:
        return -1
    fd = -1
    try:
        fd = os.open(RUNNING, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Locked: but a run that ended removes the file before it unlocks, so the file
        # must still be there (and be this one) to be an interrupted run's.
        st = os.fstat(fd)
        if st.st_ino != os.stat(RUNNING, dir_fd=root_fd, follow_symlinks=False).st_ino:
            raise BlockingIOError
        if st.st_uid != os.geteuid() or os.fstat(root_fd).st_uid != os.geteuid():
            raise PermissionError  # someone else's folder, whatever it says
        with os.fdopen(os.dup(fd), "r", encoding="utf-8") as f:
            if json.loads(f.read() or "{}") != owner:
                raise BlockingIOError  # another model's (or job's) workspace
    except (OSError, ValueError):
        if fd >= 0:
            os.close(fd)
        return -1
    finally:
        os.close(root_fd)
    return fd


def _clear_scratch(base_fd: int, tag: str) -> None:
    """Remove `tag`/tunespace/work, each folder on the way opened without following links."""
    root_fd = _open_dir(tag, base_fd)
    try:
        space_fd = _open_dir("tunespace", root_fd)
    except FileNotFoundError:
        return
    finally:
        os.close(root_fd)
    try:
        shutil.rmtree("work", ignore_errors=True, dir_fd=space_fd)
    finally:
        os.close(space_fd)

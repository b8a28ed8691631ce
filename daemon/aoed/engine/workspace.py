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

A workspace can vanish under a running job (its output directory removed). Then every
file a worker writes or reads there fails, which reads as a failed candidate, a failed
measurement or a model error; `gone()` says what happened instead, and the job checks it
before it believes such a failure (see engine.py, context.py).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from aoe.jobtypes import result_slug
from aoe.errors import AoedError
from aoed import safefs

__all__ = ["Workspace"]


class Workspace:
    def __init__(self, output: Path, root: Path, tag: str):
        self.output = output
        self.root = root
        self.tag = tag  # "{model}_{ts}" (+ suffix): the stem of every name the job writes
        self.scratch = root / "tunespace" / "work"
        self.result_dir = root / "tunespace" / "result"
        self.log_path = root / "job.log"
        self._root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of `root` once made

    @classmethod
    def create(cls, output: Path, model_stem: str) -> Workspace:
        """Make a fresh workspace under `output`. AoedError naming the directory when it
        cannot be created (missing permission, full disk, a file in the way)."""
        ts = time.strftime("%Y%m%d%H%M%S")
        base = output / "aoe_workspace"
        # room after the stem: "_{ts}_{n}" and the longest name made from the tag
        stem = safefs.fit(model_stem, len(f"_{ts}_9999_tune.onnx"))
        at = output  # what is being made, for the message
        try:
            output.mkdir(parents=True, exist_ok=True)
            # Resolved: the folder named is used, even through a link; below it, nothing
            # is followed.
            with safefs.opened_dir(output.resolve()) as out:
                at = base
                base_fd = safefs.make_dir(base.name, dir_fd=out)
            try:
                for n in range(1, 10_000):
                    tag = f"{stem}_{ts}" + (f"_{n}" if n > 1 else "")
                    at = base / tag
                    try:
                        os.mkdir(tag, dir_fd=base_fd)
                    except FileExistsError:
                        continue
                    root = safefs.open_dir(tag, dir_fd=base_fd)
                    try:
                        tunespace = safefs.make_dir("tunespace", dir_fd=root)
                        try:
                            os.close(safefs.make_dir("result", dir_fd=tunespace))
                            # Scratch holds copies of the user's inputs (the model,
                            # calibration samples): the user's alone, whatever the umask;
                            # outputs follow the umask.
                            os.close(safefs.make_dir("work", dir_fd=tunespace, mode=0o700))
                        finally:
                            os.close(tunespace)
                        st = os.fstat(root)
                    finally:
                        os.close(root)
                    ws = cls(output, base / tag, tag)
                    ws._root_id = (st.st_dev, st.st_ino)
                    return ws
            finally:
                os.close(base_fd)
        except OSError as exc:
            raise AoedError(f"{at}: cannot create the job's workspace ({exc.strerror or exc})") from None
        raise AoedError(f"{base}: no free workspace name for {stem}_{ts}")

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
        stem = f"aoe_result_{result_slug(job_type)}_{self.timestamp}_{os.getpid()}"
        try:
            with safefs.opened_dir(self.output.resolve()) as out:
                for n in range(1, 10_000):
                    name = f"{stem}.json" if n == 1 else f"{stem}_{n}.json"
                    if safefs.reserve(name, dir_fd=out):
                        return self.output / name
        except OSError as exc:
            raise AoedError(f"{self.output}: cannot write the result ({exc.strerror or exc})") from None
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
        return (f"output directory {self.output}: the job's workspace {self.root} was removed while the job ran, "
                "so its outputs cannot be written there")  # fmt: skip

    def clean(self) -> None:
        """Remove the scratch files (best effort)."""
        shutil.rmtree(self.scratch, ignore_errors=True)

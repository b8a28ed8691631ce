"""A job's inputs: the uploads not yet submitted, and the model files jobs refer to.

An upload is `uploads/<id>/<name>` in the state dir, counted by the upload quotas
(jobs/uploads.py) until a job consumes it or `upload_ttl_h` passes. A consumed upload is
kept once per content and name, `inputs/<sha256>/<name>`, and jobs refer to it; it is
removed with the last job that does (retention), and at start when none does (a crash
between keeping one and recording its job, or a job store restored from before).

A job's model as its submitter knows it (`shown_path`): a drop-folder job's is the file
as it was dropped, not the daemon's claimed copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

import trio

from aoed.config import DaemonConfig
from aoed.jobs.store import JobRow, JobStore, Upload
from aoed.jobs.uploads import UploadLedger

__all__ = ["Inputs", "shown_path"]

log = logging.getLogger(__name__)


class Inputs:
    """The uploads and kept models under the state dir (`cfg.uploads_dir`,
    `cfg.inputs_dir`: a reload keeps the state dir, so the configuration given here
    names them for good), with the upload quotas' accounting (`uploads`: UploadModel
    reserves, consuming and expiry release)."""

    def __init__(self, store: JobStore, cfg: DaemonConfig):
        self.store = store
        self._cfg = cfg
        self.uploads = UploadLedger(store.uploads_before(float("inf")))

    def get_upload(self, upload_id: str) -> Upload | None:
        """The upload `upload_id`, None when there is none (expired, or used)."""
        return self.store.get_upload(upload_id)

    def add_upload(self, up: Upload) -> None:
        """Record a received upload (its file complete, its sha256 checked)."""
        self.store.add_upload(up)

    async def sweep(self) -> None:
        """Remove the kept inputs no job refers to (at start)."""
        await trio.to_thread.run_sync(_sweep_inputs, self._cfg.inputs_dir, self.store.model_paths())

    async def consume(self, up: Upload, keep: bool) -> Path:
        """Take `up` out of the uploads; with `keep`, its content stays in the inputs,
        once (returns where)."""
        src = Path(up.path)
        dst = src
        if keep:
            dst = await trio.to_thread.run_sync(
                _keep_input, self._cfg.inputs_dir, src, up.sha256, up.file_name, up.size
            )
        self._remove_upload_file(src)
        self.uploads.release(up.id)
        self.store.delete_upload(up.id)
        return dst

    async def release(self, path: Path) -> None:
        """Remove a kept input (and its folder, once empty) that no job refers to."""
        if path.parent.parent != self._cfg.inputs_dir or self.store.model_refs(str(path)):
            return
        await trio.to_thread.run_sync(_remove_input, path)

    def expire(self, before: float) -> None:
        """Remove the uploads received before `before` and not submitted."""
        for up in self.store.uploads_before(before):
            self._remove_upload_file(Path(up.path))
            self.uploads.release(up.id)
            self.store.delete_upload(up.id)
            log.info("upload %s (%s) expired", up.id, up.file_name)

    def _remove_upload_file(self, path: Path) -> None:
        """An upload is `uploads/<id>/<name>`: the file and its folder go."""
        path.unlink(missing_ok=True)
        if path.parent.parent == self._cfg.uploads_dir:
            with contextlib.suppress(OSError):
                path.parent.rmdir()


def shown_path(row: JobRow) -> str:
    """The model's path as its submitter knows it: for a drop-folder job the file as it
    was dropped (the daemon works on a claimed copy inside its state dir, a path that
    means nothing to the user), else the path the job reads."""
    if row.source.startswith("inbox:"):
        return str(Path(row.source.removeprefix("inbox:")) / row.model_name)
    return row.model_path


def _keep_input(inputs: Path, src: Path, sha: str, name: str, size: int) -> Path:
    """Where the uploaded `src` (`size` bytes with digest `sha`, named `name`) is kept:
    `inputs/<sha>/<name>`, from the upload itself unless those bytes are kept under that
    name already. The same bytes uploaded under another name are kept again under it:
    the job's workspace and outputs are named after its model file, and a hard link
    would make the model a file with several links, which a job does not read."""
    folder = inputs / sha
    dst = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    if _size(dst) != size:
        os.replace(src, dst)
    return dst


def _size(path: Path) -> int:
    """The size of the regular file at `path`, -1 when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def _remove_input(path: Path) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # only once no other name is in it


def _sweep_inputs(inputs: Path, referenced: set[str]) -> None:
    """Remove the kept inputs no job refers to (a crash between keeping one and
    recording its job, or a job store restored from before)."""
    if not inputs.is_dir():
        return
    for folder in inputs.iterdir():
        if folder.is_dir() and not folder.is_symlink():
            for f in folder.iterdir():
                if str(f) not in referenced:
                    _remove_input(f)

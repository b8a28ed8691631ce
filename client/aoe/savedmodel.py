"""A TensorFlow SavedModel as aoe takes it (AOE's `--framework 3`), told from its files
alone: no TensorFlow is imported here.

Two forms carry one:

- a directory holding `saved_model.pb` (and, when it has variables, `variables/`), as
  `tf.saved_model.save` writes it: what `aoe tune DIR` and a daemon-side path name;
- a `.tar` archive of such a directory (the directory at the archive's root, or in one
  folder there): what a drop folder takes and what a client uploads, one file that is
  complete once it is renamed into place. Plain tar, never compressed: what it unpacks
  to is no larger than the archive, so the archive's size limit bounds both. It is read
  and unpacked only in the confined process that converts it
  (aoed.backends.tensorflow.convert), never by the daemon.

A job's SavedModel is converted to ONNX by tf2onnx in that process and tuned for
inference as that ONNX model (aoed.engine.onnxjob).

`saved_model_files` walks a directory as the daemon admits it: regular files and folders
only (a link or a device in it is refused, so that the daemon reads nothing its submitter
could not name), each file with one link, their total under a limit.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path

from aoe.errors import ModelError, PermissionDeniedError

__all__ = [
    "ARCHIVE_SUFFIX",
    "MAX_FILES",
    "SAVED_MODEL_PB",
    "check_saved_model",
    "is_saved_model",
    "is_saved_model_archive",
    "pack_saved_model",
    "saved_model_digest",
    "saved_model_files",
]

#: The file that makes a directory a SavedModel.
SAVED_MODEL_PB = "saved_model.pb"
#: The suffix of a SavedModel packed in one file.
ARCHIVE_SUFFIX = ".tar"
#: Files and folders a SavedModel (directory or archive) may hold: tf.saved_model.save
#: writes a handful; a walk or an unpacking that meets more stops there.
MAX_FILES = 10_000


#: Names of model files: a directory so named is a file gone wrong, not a SavedModel.
_FILE_SUFFIXES = (".onnx", ".pt2", ARCHIVE_SUFFIX)


def is_saved_model(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a directory (a SavedModel's, or one that was meant to be one)
    not named like a model file: the form a job tunes as a SavedModel.
    `check_saved_model` says whether it is one."""
    p = Path(path)
    return p.is_dir() and not p.name.lower().endswith(_FILE_SUFFIXES)


def is_saved_model_archive(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a SavedModel packed in a `.tar` archive."""
    return str(path).lower().endswith(ARCHIVE_SUFFIX)


def check_saved_model(path: str | os.PathLike[str], shown: str | None = None) -> None:
    """Return when the directory `path` holds a `saved_model.pb` that is a regular file;
    else ModelError naming the directory (as `shown`, else the path) and what is missing."""
    p = Path(path)
    where = str(p) if shown is None else shown
    pb = p / SAVED_MODEL_PB
    try:
        st = pb.lstat()
    except FileNotFoundError:
        raise ModelError(
            f"{where}: not a TensorFlow SavedModel (no {SAVED_MODEL_PB} in it); pass the directory "
            "tf.saved_model.save wrote, or an .onnx model"
        ) from None
    except OSError as exc:
        raise ModelError(f"{where}: cannot read {SAVED_MODEL_PB} ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{where}: {SAVED_MODEL_PB} is not a regular file")
    if st.st_size == 0:
        raise ModelError(f"{where}: {SAVED_MODEL_PB} is empty, not a SavedModel")


def saved_model_files(
    path: Path, max_bytes: int | None, setting: str = ""
) -> list[tuple[str, os.stat_result]]:
    """Each file under the SavedModel directory `path` (checked: `check_saved_model`),
    as (its path relative to `path`, its stat), in name order. ModelError when the
    directory holds anything but regular files and folders, more than MAX_FILES
    entries, or more than `max_bytes` in all (naming `setting`, the limit's);
    PermissionDeniedError for a file with several hard links (which no path check
    sees: it could make the daemon read a file its submitter could not)."""
    check_saved_model(path)
    files: list[tuple[str, os.stat_result]] = []
    total = count = 0
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(path / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            count += 1
            if count > MAX_FILES:
                raise ModelError(f"{path}: more than {MAX_FILES} files; not a SavedModel aoe tunes")
            name = f"{rel}/{e.name}" if rel else e.name
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                pending.append(name)
                continue
            if not stat.S_ISREG(st.st_mode):
                raise ModelError(
                    f"{path}: {name} is not a regular file or folder (a link, a device?); a "
                    "SavedModel holds only files and folders: copy it without links"
                )
            if st.st_nlink > 1:
                raise PermissionDeniedError(
                    f"{path}: {name} has {st.st_nlink} hard links, and a hard link can make the "
                    "daemon read a file its submitter could not; copy the SavedModel (cp -r, not "
                    "ln) or upload it"
                )
            total += st.st_size
            if max_bytes is not None and total > max_bytes:
                limit = f" ({setting})" if setting else ""
                raise ModelError(
                    f"{path}: the SavedModel's files are over the limit of "
                    f"{max_bytes >> 20} MiB{limit}"
                )
            files.append((name, st))
    files.sort()
    return files


def saved_model_digest(path: Path, files: list[tuple[str, os.stat_result]]) -> str:
    """The sha256 of the SavedModel directory `path` as `saved_model_files` listed it:
    each file's relative name and content, in name order. OSError when a file cannot be
    read; ModelError when one changed (another inode or size) since it was listed."""
    h = hashlib.sha256()
    for name, st in files:
        fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, st.st_size):
                raise ModelError(f"{path}: {name} changed while it was checked; submit it again")
            h.update(name.encode() + b"\0" + str(st.st_size).encode() + b"\0")
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def pack_saved_model(path: Path, folder: Path) -> Path:
    """The SavedModel directory `path` packed as `folder/<its name>.tar` (the directory
    at the archive's root under its own name), the form a daemon takes it in by upload;
    returns the archive. ModelError when it is not a SavedModel or holds anything but
    files and folders (which the converter would refuse)."""
    check_saved_model(path)
    archive = folder / f"{path.name}{ARCHIVE_SUFFIX}"
    with tarfile.open(archive, "w") as tar:
        pending = [(path, path.name)]
        while pending:
            top, name = pending.pop()
            tar.add(top, arcname=name, recursive=False)
            with os.scandir(top) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if e.is_dir(follow_symlinks=False):
                        pending.append((Path(e.path), f"{name}/{e.name}"))
                    elif e.is_file(follow_symlinks=False):
                        tar.add(e.path, arcname=f"{name}/{e.name}")
                    else:
                        raise ModelError(
                            f"{path}: {name}/{e.name} is not a regular file or folder (a link?); "
                            "a SavedModel holds only files and folders: copy it without links"
                        )
    return archive

"""What the client checks about a model file before anything is started or uploaded.

`check_model_file` answers at once, in the user's own process, what would otherwise come
back from a daemon after an upload or from the engine after its start: the file is
missing, is not a regular file, is empty, or is not an ONNX model. The ONNX check walks
the top-level fields of the protobuf (a tag and a length each, payloads skipped with a
seek), so it reads a few bytes of any model however large, where `onnx.load` would read
and parse all of it; it wants the fields ONNX declares for a ModelProto, with their
wire types, lengths that stay within the file, and an `ir_version` and a `graph`. The
engine still checks the model in full; this catches the wrong file early.

A problem with where the file is (missing, unreadable, not a regular file) names the path
as given; a problem with what it holds names the file by its name alone, which is what it
is called on every route: by `aoe tune` here, by the daemon (which keeps each upload under
the name it was given) and in a drop folder. The engine reads the same walk over the bytes
it loads (`check_model_bytes`), so a file that is not a model gets one message wherever it
is found.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import BinaryIO

from aoe.errors import ModelError

__all__ = ["check_model_bytes", "check_model_file", "stat_model_file"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def stat_model_file(path: Path, shown: str | None = None) -> os.stat_result:
    """`path`'s stat when it is a regular, non-empty file; else ModelError naming the file
    (as `shown`, else the path) and what is wrong with it (missing, unreadable, not a
    regular file, empty)."""
    where = str(path) if shown is None else shown
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelError(f"{where}: no such model file") from None
    except OSError as exc:
        raise ModelError(f"{where}: cannot read the model ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{where}: not a regular file; pass the .onnx model file")
    if st.st_size == 0:
        raise ModelError(f"{path.name}: the file is empty, not an ONNX model")
    return st


def check_model_file(path: str | os.PathLike[str], *, onnx: bool = True) -> None:
    """Return when `path` is a regular, non-empty file and (with `onnx`) its top-level
    protobuf fields are an ONNX ModelProto's with a graph; else raise ModelError naming
    the file and what is wrong with it. Imports nothing heavy unless `onnx`."""
    p = Path(path)
    stat_model_file(p)
    if not onnx:
        return
    try:
        # O_NONBLOCK: a file swapped for a pipe since the stat must not block the open.
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            why = _not_a_model(f, os.fstat(f.fileno()).st_size)
    except OSError as exc:
        raise ModelError(f"{p}: cannot read the model ({exc.strerror or exc})") from None
    if why:
        raise _not_readable(p.name, why)


def check_model_bytes(data: bytes, name: str) -> None:
    """Return when the top-level protobuf fields of `data` are an ONNX ModelProto's with a
    graph; else the ModelError `check_model_file` raises for a file `name` holding them."""
    why = _not_a_model(io.BytesIO(data), len(data))
    if why:
        raise _not_readable(name, why)


def _not_readable(name: str, why: str) -> ModelError:
    return ModelError(f"{name}: not a readable ONNX model ({why}); pass the .onnx model file")


def _not_a_model(f: BinaryIO, size: int) -> str:
    """Why the top-level fields in `f` are not an ONNX ModelProto's ("" when they are)."""
    from google.protobuf.descriptor import FieldDescriptor as FD
    from onnx import ModelProto

    fields = {fd.number: fd for fd in ModelProto.DESCRIPTOR.fields}
    seen: set[str] = set()
    while f.tell() < size:
        at = f.tell()
        tag = _varint(f)
        if tag is None:
            return f"a field tag at byte {at} is cut off"
        number, wire = tag >> 3, tag & 7
        fd = fields.get(number)
        if fd is not None:
            # Repeated scalars may be packed (one length-delimited run).
            scalar = fd.type not in (FD.TYPE_MESSAGE, FD.TYPE_STRING, FD.TYPE_BYTES)
            want = _LEN if not scalar else _VARINT
            if wire != want and not (scalar and fd.is_repeated and wire == _LEN):
                return f"byte {at}: field {number} ({fd.name}) has wire type {wire}, not {want}"
            seen.add(fd.name)
        elif wire not in (_VARINT, _I64, _LEN, _I32):  # an unknown field a newer ONNX may add
            return f"byte {at}: wire type {wire} is not one a model uses"
        if wire == _VARINT:
            if _varint(f) is None:
                return f"field {number} at byte {at} is cut off"
        else:
            length = {_I64: 8, _I32: 4}.get(wire) or _varint(f)
            if length is None or f.tell() + length > size:
                return f"field {number} at byte {at} runs past the end of the file"
            f.seek(length, os.SEEK_CUR)
    missing = [name for name in ("ir_version", "graph") if name not in seen]
    return f"no {' and no '.join(missing)}" if missing else ""


def _varint(f: BinaryIO) -> int | None:
    """The base-128 varint at the file's position; None when the file ends within it or
    it is longer than 10 bytes."""
    value = 0
    for shift in range(0, 70, 7):
        b = f.read(1)
        if not b:
            return None
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
    return None

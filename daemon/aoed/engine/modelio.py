"""Reading and writing model files safely, at any size.

`load_model` reads a user's model and its external data only from beside it (a
location that escapes the model's directory, by `..`, an absolute path or a symlink,
is refused, and so is an external data file with several hard links), within limits
on bytes and nodes that it checks before reading or walking what they count.
`save_model` writes a model atomically (temp file + rename) and puts its tensors in a
side file when the whole would not fit a protobuf (2 GiB), so large models round-trip.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import external_data_helper

from aoe.errors import AoedError, ModelError
from aoe.modelfile import check_model_bytes, stat_model_file
from aoed import safefs

__all__ = [
    "EXTERNAL_THRESHOLD",
    "PROTOBUF_LIMIT",
    "check_size",
    "count_nodes",
    "load_model",
    "save_model",
    "tensor_bytes",
    "tensors",
]

#: Above this many tensor bytes a model is saved with external data (protobuf's limit
#: is 2 GiB for the whole message; leave room for the graph).
EXTERNAL_THRESHOLD = 1 << 30
#: protobuf parses no message of 2 GiB or more.
PROTOBUF_LIMIT = 2 << 30


def load_model(
    path: Path,
    *,
    max_bytes: int | None = None,
    max_nodes: int | None = None,
    settings: tuple[str, str] = ("", ""),
    fits: Callable[[int], None] | None = None,
    expect: tuple[int, int] | None = None,
) -> onnx.ModelProto:
    """Load the model at `path` with its external data; ModelError naming the file and
    the tensor when anything is wrong. Messages name the file by its name alone, never
    the folder it is in: a daemon's copy of an upload, or of a file dropped in an inbox,
    lies in the daemon's own folders under the name the user gave it, and its messages
    are the ones `aoe tune` gives for the user's file.

    `max_bytes` bounds the model file and its external data together, `max_nodes` the
    nodes of all its graphs (subgraphs included); both are checked before the bytes
    they count are read (nodes: before anything walks the graph), and a message about
    one names its setting from `settings` (bytes, nodes) when given. External data is
    read only from regular files beside the model with a single link (see
    `_read_external`). `fits`, given the bytes about to be held (the file, then the file
    and its external data), raises when they are more than the caller can afford.

    With `expect`, the (device, inode) of the file checked when the model was submitted,
    the file is read only if the opened descriptor is still that file with one link: a
    name swapped since for another file, a hard link to a file from elsewhere included,
    is refused (ModelError) with nothing read."""
    bytes_setting, nodes_setting = settings
    if fits is not None:
        with contextlib.suppress(OSError):  # an unreadable file: _read_model_file says why
            fits(path.stat().st_size)
    data = _read_model_file(path, max_bytes, bytes_setting, expect)
    check_model_bytes(data, path.name)  # what `aoe` says of the file before an upload
    try:
        model = onnx.load_model_from_string(data)
    except MemoryError:
        raise  # the worker's memory limit, which it reports as such
    except Exception as exc:
        raise ModelError(f"{path.name}: not a readable ONNX model: {_undecodable(exc)}") from None
    del data
    if not model.HasField("graph"):
        raise ModelError(f"{path.name}: not an ONNX model (it holds no graph)")
    if max_nodes is not None:
        nodes = count_nodes(model.graph, stop_above=max_nodes)
        if nodes > max_nodes:
            raise ModelError(
                f"{path.name}: {nodes} nodes or more, over the limit of {max_nodes} nodes per model"
                f"{_named(nodes_setting)}"
            )
    external = [t for t in tensors(model) if external_data_helper.uses_external_data(t)]
    if external:
        budget = None if max_bytes is None else max_bytes - path.stat().st_size
        _read_external(path, model, external, budget, bytes_setting, fits)
    return model


def subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph under it (no recursion: nesting depth is the input's)."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(a.graphs)


def tensors(model: onnx.ModelProto, attributes: bool = True) -> Iterator[onnx.TensorProto]:
    """Every tensor that holds data in `model`: the initializers of its graph and every
    subgraph, then (unless not `attributes`) the tensors in node attributes (Constant
    values), those in the model's local functions included. What onnx walks to load and
    save external data, through onnx's public protos."""
    for g in subgraphs(model.graph):
        yield from g.initializer
    if not attributes:
        return
    bodies: list[onnx.GraphProto | onnx.FunctionProto] = [*subgraphs(model.graph)]
    for f in model.functions:
        bodies.append(f)
        for node in f.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    bodies += subgraphs(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    bodies += (s for g in a.graphs for s in subgraphs(g))
    for body in bodies:
        for node in body.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors


def count_nodes(graph: onnx.GraphProto, stop_above: int | None = None) -> int:
    """Nodes in `graph` and every subgraph under it; once the count passes `stop_above`,
    the count so far (a graph with too many top-level nodes is never walked: walking a
    million nodes in Python takes seconds)."""
    total = 0
    for g in subgraphs(graph):
        total += len(g.node)
        if stop_above is not None and total > stop_above:
            break
    return total


def check_size(path: Path, size: int, max_bytes: int | None, setting: str = "") -> None:
    """ModelError naming `path`'s file name (and `setting`, the limit's) when a model file of `size`
    bytes is over `max_bytes`."""
    if max_bytes is not None and size > max_bytes:
        raise ModelError(
            f"{path.name}: the model file is {_gib(size)}, over the limit of {_gib(max_bytes)}{_named(setting)}"
        )


def _named(setting: str) -> str:
    return f" ({setting})" if setting else ""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _read_model_file(
    path: Path, max_bytes: int | None, setting: str = "", expect: tuple[int, int] | None = None
) -> bytes:
    """The model file's bytes, refused before reading when it is not a regular file (a
    pipe would block), empty, over `max_bytes`, or past what protobuf can parse; with
    `expect`, also when the opened file is not that (device, inode) or has several
    links."""
    st = stat_model_file(path, shown=path.name)
    check_size(path, st.st_size, max_bytes, setting)
    if st.st_size >= PROTOBUF_LIMIT:
        raise ModelError(
            f"{path.name}: the model file is {_gib(st.st_size)}; protobuf reads files under 2 GiB: "
            "save the model with its weights as external data"
        )
    try:
        # O_NONBLOCK: a file swapped for a pipe since the stat must not block the open.
        # A submitted model's path names the file itself (resolved when it was submitted).
        nofollow = os.O_NOFOLLOW if expect is not None else 0
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if not stat.S_ISREG(now.st_mode):
                raise ModelError(f"{path.name}: not a regular file; pass the .onnx model file")
            if expect is not None and (
                (now.st_dev, now.st_ino) != tuple(expect) or now.st_nlink > 1
            ):
                why = (
                    f"it has {now.st_nlink} hard links"
                    if now.st_nlink > 1
                    else "another file took its name"
                )
                raise ModelError(
                    f"{path.name}: not the file that was submitted ({why}); nothing was read: submit it "
                    "again once nobody changes it"
                )
            if now.st_size >= PROTOBUF_LIMIT:
                raise ModelError(
                    f"{path.name}: the model file grew to {_gib(now.st_size)} while being read"
                )
            # Read what the file holds (+1 to see it grew): read(N) reserves N bytes up front,
            # which a worker under a memory limit cannot afford for N = 2 GiB.
            data = f.read(now.st_size + 1)
            if len(data) > now.st_size:
                raise ModelError(
                    f"{path.name}: the model file changed while being read; try again once it is complete"
                )
            return data
    except OSError as exc:
        raise ModelError(f"{path.name}: cannot read the model ({exc.strerror or exc})") from None


def _undecodable(exc: Exception) -> str:
    """Why protobuf refused the bytes, in words."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "MaxDepth" in text or "recursion" in text.lower():
        return (
            "messages nested deeper than protobuf's limit of 100 levels (If/Loop bodies inside bodies); "
            "flatten the control flow"
        )
    return f"protobuf cannot parse it: corrupt, truncated or not an ONNX file ({type(exc).__name__}: {text})"


def _read_external(
    path: Path,
    model: onnx.ModelProto,
    tensors: list[onnx.TensorProto],
    budget: int | None,
    setting: str = "",
    fits: Callable[[int], None] | None = None,
) -> None:
    """Read each tensor's external data into it (it then holds its data inline).

    Only regular files beside the model are read. A location that escapes the model's
    directory (by `..`, an absolute path, or a symlink anywhere on the way) is refused
    by path. A hard link cannot be: it is the outside file itself under a name inside,
    so a file with more than one link is refused, checked with lstat before it is
    opened (so that a refused file is never opened) and again on the open descriptor,
    which must be the inode that was checked. Offsets and lengths must lie inside the
    file, and all lengths together within `budget` bytes."""
    base = path.parent.resolve()
    plan = []
    for tensor in tensors:
        name = tensor.name
        try:
            info = external_data_helper.ExternalDataInfo(tensor)
        except (TypeError, ValueError):  # an offset or length that is not a number
            raise ModelError(
                f"{path.name}: tensor {name!r} has malformed external data fields "
                f"({', '.join(f'{e.key}={e.value!r}' for e in tensor.external_data)})"
            ) from None
        loc = str(info.location or "")
        if not loc or "\x00" in loc:
            raise ModelError(
                f"{path.name}: tensor {name!r} has no usable external data location ({loc!r})"
            )
        try:
            target = (base / loc).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            raise ModelError(
                f"{path.name}: external data file {loc!r} of tensor {name!r} cannot be resolved"
            ) from None
        if os.path.isabs(loc) or not target.is_relative_to(base) or target == base:
            how = "" if os.path.isabs(loc) or ".." in Path(loc).parts else ", through a symlink"
            raise ModelError(
                f"{path.name}: tensor {name!r} points outside the model's directory ({loc!r}{how}); "
                "external data must sit beside the model"
            )
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            raise ModelError(
                f"{path.name}: external data file {loc!r} of tensor {name!r} is missing"
            ) from None
        except OSError as exc:
            raise ModelError(
                f"{path.name}: external data file {loc!r} of tensor {name!r}: {exc.strerror or exc}"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(
                f"{path.name}: external data {loc!r} of tensor {name!r} is not a regular file"
            )
        if st.st_nlink > 1:
            raise ModelError(
                f"{path.name}: external data file {loc!r} of tensor {name!r} has {st.st_nlink} hard links, "
                "so it may be a file from elsewhere; copy it beside the model (cp, not ln)"
            )
        offset = int(info.offset or 0)
        length = st.st_size - offset if info.length is None else int(info.length)
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise ModelError(
                f"{path.name}: tensor {name!r} wants bytes {offset} to {offset + length} of {loc!r}, "
                f"beyond its end ({st.st_size} bytes)"
            )
        plan.append((tensor, target, st, offset, length))
    total = sum(p[4] for p in plan)
    if budget is not None and total > budget:
        raise ModelError(
            f"{path.name}: the model and its external data hold {_gib(total + path.stat().st_size)}, over "
            f"the limit of {_gib(budget + path.stat().st_size)}{_named(setting)}"
        )
    if fits is not None:
        fits(total + path.stat().st_size)
    for tensor, target, st, offset, length in plan:
        loc = str(external_data_helper.ExternalDataInfo(tensor).location)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ModelError(
                f"{path.name}: external data file {loc!r} of tensor {tensor.name!r}: "
                f"{exc.strerror or exc}"
            ) from None
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or now.st_nlink > 1:
                raise ModelError(
                    f"{path.name}: external data file {loc!r} of tensor {tensor.name!r} changed while "
                    "it was read; try again with the folder left alone"
                )
            data = os.pread(fd, length, offset)
        except OSError as exc:
            raise ModelError(
                f"{path.name}: cannot read external data {loc!r} ({exc.strerror or exc})"
            ) from None
        finally:
            os.close(fd)
        if len(data) != length:
            raise ModelError(
                f"{path.name}: external data file {loc!r} ended early (it changed while read)"
            )
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor data a model holds inline (initializers and Constant values)."""
    return sum(
        len(t.raw_data) or t.ByteSize()
        for t in tensors(model)
        if not external_data_helper.uses_external_data(t)
    )


#: An initializer of at least this many bytes goes to the external data file (onnx's
#: own threshold in `convert_model_to_external_data`).
_EXTERNAL_MIN_TENSOR = 1024


def _move_to_external(model: onnx.ModelProto, location: str, f: BinaryIO) -> None:
    """Write the raw data of `model`'s large initializers to `f`, one after another, and
    point each tensor at its bytes in the file `location` instead."""
    offset = 0
    for t in tensors(model, attributes=False):
        if t.HasField("raw_data") and len(t.raw_data) >= _EXTERNAL_MIN_TENSOR:
            f.write(t.raw_data)
            external_data_helper.set_external_data(t, location, offset, len(t.raw_data))
            offset += len(t.raw_data)
            t.ClearField("raw_data")


def save_model(model: onnx.ModelProto, path: Path, external_above: int = EXTERNAL_THRESHOLD) -> int:
    """Write `model` at `path` atomically, with external data beside it (`NAME.data`)
    when its tensors exceed `external_above` bytes; returns the bytes written. AoedError
    naming the file when it cannot.

    Both files are written through a descriptor of the folder (resolved: the folder
    named is used even through a link) with safefs.write_file: a link planted at either
    name, or at a temporary one, is never written through. Not fsynced, as before: the
    models saved are a job's scratch and outputs, which a crash makes the job redo."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = f"{path.name}.data"
    external = tensor_bytes(model) > external_above
    try:
        with safefs.opened_dir(path.parent.resolve()) as d:
            if external:
                copy = onnx.ModelProto()
                copy.CopyFrom(model)
                safefs.write_file(
                    data, lambda f: _move_to_external(copy, data, f), dir_fd=d, sync=False
                )
                model = copy
            blob = model.SerializeToString()
            safefs.write_file(path.name, lambda f: f.write(blob), dir_fd=d, sync=False)
            written = len(blob) + (os.stat(data, dir_fd=d).st_size if external else 0)
    except OSError as exc:
        raise AoedError(f"{path}: cannot write the model ({exc.strerror or exc})") from None
    return written

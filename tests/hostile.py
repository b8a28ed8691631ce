"""A hostile corpus, built in code: models and places that must end in a clear error.

Each kind is a function that writes its model (and any side files) into a given folder
and returns what to run: the model path and extra `aoe tune` options. Its `Kind` record
says which `aoe.errors` class the run must end in and a pattern its one-line message
must match (the message names the problem), or `error=None` for a model that is
legitimately tunable and may succeed (or fail with a ModelError whose message matches).

    for kind in KINDS.values():
        case = kind.build(folder / kind.name)      # Case(model, args)

Kinds that point external data outside their folder read `sentinel(folder)`: a file
holding valid weights, outside the folder, that nothing may open (test_hostile watches
it with inotify). Nothing here imports the engine; models are built with onnx helpers
or, where onnx would refuse to write them, as raw protobuf bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aoe.errors import AoedError, BankError, ModelError, OptionError

__all__ = ["KINDS", "Case", "Kind", "sentinel", "tiny_model"]

#: Every model here imports this default-domain opset unless the kind is about opsets.
OPSET = 17


@dataclass(frozen=True)
class Case:
    model: Path
    args: tuple[str, ...] = ()  # extra `aoe tune` options (bad places); last one wins


@dataclass(frozen=True)
class Kind:
    name: str
    build: Callable[[Path], Case]
    error: type[AoedError] | None  # None: a tunable model; it may also fail with a ModelError
    says: str  # regex the error message must match (re.search, case-insensitive)
    #: the daemon gets it by path, not uploaded: it needs its side files, or cannot be
    #: uploaded (a pipe, a folder, 9 GiB); SubmitJob may then refuse it at once, with the
    #: class's gRPC status, instead of failing a job
    by_path: bool = False
    #: points outside its folder: the sentinel must never be opened
    escapes: bool = False
    #: what the daemon cannot be given (a bad place of the CLI): why, else ""
    cli_only: str = ""


KINDS: dict[str, Kind] = {}


def kind(
    error: type[AoedError] | None, says: str, **extra
) -> Callable[[Callable[[Path], Path | Case]], Callable]:
    def register(fn: Callable[[Path], Path | Case]) -> Callable:
        def build(folder: Path) -> Case:
            folder.mkdir(parents=True, exist_ok=True)
            out = fn(folder)
            return out if isinstance(out, Case) else Case(out)

        name = fn.__name__
        KINDS[name] = Kind(name, build, error, says, **extra)
        return fn

    return register


# --------------------------------------------------------------------------- building blocks


def tiny_model(
    nodes: list[onnx.NodeProto] | None = None,
    inputs: list[onnx.ValueInfoProto] | None = None,
    outputs: list[onnx.ValueInfoProto] | None = None,
    initializers: list[onnx.TensorProto] | None = None,
    opsets: dict[str, int] | None = None,
    name: str = "hostile",
) -> onnx.ModelProto:
    """x[1,4] float -> Relu -> y[1,4] unless told otherwise."""
    graph = helper.make_graph(
        nodes if nodes is not None else [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        name,
        inputs
        if inputs is not None
        else [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        outputs
        if outputs is not None
        else [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=initializers or [],
    )
    imports = [helper.make_opsetid(d, v) for d, v in (opsets or {"": OPSET}).items()]
    model = helper.make_model(graph, opset_imports=imports, producer_name="hostile")
    model.ir_version = 8
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def sentinel(folder: Path) -> Path:
    """The file outside `folder` that an escaping kind points at: 4 valid float32s, so a
    loader that followed the pointer would succeed silently. Created on first use."""
    path = folder.parent.parent / f"outside-{folder.name}" / "secret.bin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    return path


def _external(folder: Path, location: str, offset: int = 0, length: int = 16) -> Path:
    """x[1,4] + w[1,4] where w is external data at `location` (as written, unchecked)."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1, 4])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    # Named after its folder: kinds with the same location differ in bytes, so a daemon
    # never joins one kind's job to another's.
    model = tiny_model(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w], name=folder.name
    )
    return _save(model, folder / "model.onnx")


def _chain(n: int) -> bytes:
    """A serialized model of `n` Relu nodes in a chain, written as raw protobuf so that a
    million nodes take seconds, not minutes."""
    out = helper.make_tensor_value_info(f"t{n - 1}", TensorProto.FLOAT, [1, 4])
    head = tiny_model([helper.make_node("Relu", ["x"], ["t0"], name="n0")], outputs=[out])
    graph = head.graph.SerializeToString()  # node 0, the input and the output
    head.ClearField("graph")

    def node(i: int) -> bytes:  # NodeProto: input = 1, output = 2, name = 3, op_type = 4
        a, o, name = b"t%d" % (i - 1), b"t%d" % i, b"n%d" % i
        p = b"\x0a%c%s\x12%c%s\x1a%c%s\x22\x04Relu" % (len(a), a, len(o), o, len(name), name)
        return b"\x0a%c%s" % (len(p), p)  # GraphProto.node = 1; every length here is < 128

    nodes = b"".join([node(i) for i in range(1, n)])
    # ModelProto.graph = 7: the two merge
    return head.SerializeToString() + _field(7, graph + nodes)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _nested_if(depth: int) -> bytes:
    """A serialized model of `depth` If nodes, each in the then-branch of the one before
    (the innermost passes x through, each else-branch negates it), written as raw
    protobuf: the protobuf library itself refuses to build messages nested this deep."""

    def graph(
        name: str, node: bytes, out: str
    ) -> bytes:  # GraphProto: node = 1, name = 2, output = 12
        vi = helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 4]).SerializeToString()
        return _field(1, node) + _field(2, name.encode()) + _field(12, vi)

    def attr(
        name: str, g: bytes
    ) -> bytes:  # AttributeProto: name = 1, g = 6, type = 20 (GRAPH = 5)
        return _field(1, name.encode()) + _field(6, g) + _varint(20 << 3) + _varint(5)

    body = graph(
        f"g{depth}",
        helper.make_node("Identity", ["x"], [f"o{depth}"]).SerializeToString(),
        f"o{depth}",
    )
    for level in range(depth - 1, -1, -1):
        out = "y" if level == 0 else f"o{level}"
        neg = graph(
            f"e{level}",
            helper.make_node("Neg", ["x"], [f"e{level}"]).SerializeToString(),
            f"e{level}",
        )
        node = (
            _field(1, b"c")
            + _field(2, out.encode())
            + _field(3, f"if{level}".encode())
            + _field(4, b"If")
            + _field(5, attr("then_branch", body))
            + _field(5, attr("else_branch", neg))
        )
        body = graph(f"g{level}", node, out)
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    head = tiny_model([], inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]), c])
    return head.SerializeToString() + _field(7, _field(1, node))  # the If joins head's graph


# --------------------------------------------------------------------------- not a model at all


@kind(ModelError, r"the file is empty")
def empty_file(folder: Path) -> Path:
    (p := folder / "model.onnx").write_bytes(b"")
    return p


@kind(ModelError, r"not a readable ONNX model")
def random_bytes(folder: Path) -> Path:
    (p := folder / "model.onnx").write_bytes(np.random.default_rng(1).bytes(4096))
    return p


@kind(ModelError, r"not a readable ONNX model")
def truncated_protobuf(folder: Path) -> Path:
    data = tiny_model().SerializeToString()
    (p := folder / "model.onnx").write_bytes(data[: len(data) * 2 // 3])
    return p


@kind(ModelError, r"not a readable ONNX model")
def tensor_not_model(folder: Path) -> Path:
    """A valid protobuf of another message type: a serialized TensorProto."""
    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "t")
    (p := folder / "model.onnx").write_bytes(t.SerializeToString())
    return p


@kind(ModelError, r"not a regular file", by_path=True)
def model_is_fifo(folder: Path) -> Path:
    """A named pipe: reading it would block forever."""
    os.mkfifo(p := folder / "model.onnx")
    return p


@kind(ModelError, r"not a regular file", by_path=True)
def model_is_directory(folder: Path) -> Path:
    (p := folder / "model.onnx").mkdir()
    return p


@kind(ModelError, r"\(no graph\)")
def model_without_graph(folder: Path) -> Path:
    """A ModelProto with an IR version and opsets but no graph at all."""
    model = tiny_model()
    model.ClearField("graph")
    return _save(model, folder / "model.onnx")


# --------------------------------------------------------------------------- broken graphs


@kind(ModelError, r"topologically sorted.*'b'")
def graph_cycle(folder: Path) -> Path:
    """n1 reads b, which n2 computes from n1's output. ONNX wants nodes in topological
    order, and no order of a cycle is one, so the checker names the input."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
        helper.make_node("Relu", ["a"], ["b"], name="n2"),
        helper.make_node("Relu", ["a"], ["y"], name="n3"),
    ]
    return _save(tiny_model(nodes), folder / "model.onnx")


@kind(ModelError, r"topologically sorted.*'nowhere'")
def undefined_input(folder: Path) -> Path:
    nodes = [helper.make_node("Add", ["x", "nowhere"], ["y"], name="add")]
    return _save(tiny_model(nodes), folder / "model.onnx")


@kind(ModelError, r"No Op registered for FrobnicateAll")
def unknown_op(folder: Path) -> Path:
    return _save(
        tiny_model([helper.make_node("FrobnicateAll", ["x"], ["y"], name="frob")]),
        folder / "model.onnx",
    )


@kind(ModelError, r"cannot load.*com\.example\.nope:Frob")
def unknown_domain(folder: Path) -> Path:
    nodes = [helper.make_node("Frob", ["x"], ["y"], name="frob", domain="com.example.nope")]
    return _save(
        tiny_model(nodes, opsets={"": OPSET, "com.example.nope": 1}), folder / "model.onnx"
    )


@kind(None, r"opset|Relu")
def opset_1(folder: Path) -> Path:
    """Opset 1 is ancient but real: converted to 13 (or kept), a Relu is tunable. It may
    also fail, saying which opset."""
    return _save(tiny_model(opsets={"": 1}), folder / "model.onnx")


@kind(ModelError, r"opset 1000 is newer")
def opset_1000(folder: Path) -> Path:
    return _save(tiny_model(opsets={"": 1000}), folder / "model.onnx")


@kind(ModelError, r"ir_version 1000")
def ir_version_1000(folder: Path) -> Path:
    model = tiny_model()
    model.ir_version = 1000
    return _save(model, folder / "model.onnx")


@kind(ModelError, r"no outputs")
def no_outputs(folder: Path) -> Path:
    return _save(tiny_model(outputs=[]), folder / "model.onnx")


@kind(ModelError, r"SSA.*'y'")
def duplicate_output_names(folder: Path) -> Path:
    nodes = [
        helper.make_node("Relu", ["x"], ["y"], name="a"),
        helper.make_node("Neg", ["x"], ["y"], name="b"),
    ]
    return _save(tiny_model(nodes), folder / "model.onnx")


@kind(ModelError, r"'x' is not a tensor")
def input_without_type(folder: Path) -> Path:
    return _save(tiny_model(inputs=[onnx.ValueInfoProto(name="x")]), folder / "model.onnx")


@kind(ModelError, r"'s' is a tensor of object")
def string_input(folder: Path) -> Path:
    """A tensor of strings: the tuner cannot make up input data for it."""
    nodes = [helper.make_node("Identity", ["s"], ["y"], name="id")]
    return _save(
        tiny_model(
            nodes,
            inputs=[helper.make_tensor_value_info("s", TensorProto.STRING, [1, 4])],
            outputs=[helper.make_tensor_value_info("y", TensorProto.STRING, [1, 4])],
        ),
        folder / "model.onnx",
    )


@kind(ModelError, r"'x'.*zero-size")
def zero_size_input(folder: Path) -> Path:
    """An input with a 0 dimension: nothing to compute, nothing to time."""
    return _save(
        tiny_model(
            inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [0, 4])],
            outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [0, 4])],
        ),
        folder / "model.onnx",
    )


@kind(None, r"'e'|zero|empty")
def zero_size_initializer(folder: Path) -> Path:
    """An empty weight concatenated to a real input: valid and runnable (Concat with a
    [1, 0] tensor), so it may tune; if not, the error names the tensor."""
    e = numpy_helper.from_array(np.zeros((1, 0), np.float32), "e")
    nodes = [
        helper.make_node("Concat", ["x", "e"], ["c"], axis=1, name="cat"),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    return _save(tiny_model(nodes, initializers=[e]), folder / "model.onnx")


@kind(ModelError, r"initializer 'w' has shape \[1, 4\] of float32 \(16 bytes\) but stores 12 bytes")
def raw_data_mismatch(folder: Path) -> Path:
    """An initializer whose raw bytes (3 floats) do not fill its dims (1x4)."""
    w = TensorProto(
        name="w", data_type=TensorProto.FLOAT, dims=[1, 4], raw_data=struct.pack("<3f", 1, 2, 3)
    )
    model = tiny_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w])
    return _save(model, folder / "model.onnx")


@kind(ModelError, r"data type 99")
def bad_dtype_enum(folder: Path) -> Path:
    """An initializer of tensor type 99, which no ONNX version defines."""
    w = TensorProto(name="w", data_type=99, dims=[1, 4], raw_data=b"\0" * 16)
    model = tiny_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w])
    return _save(model, folder / "model.onnx")


# --------------------------------------------------------------------------- sizes and limits


@kind(ModelError, r"'x'.*1099511627776.*limit")
def dims_2_pow_40(folder: Path) -> Path:
    """An input of 2^40 x 4 floats (16 TiB). It once reached the samples stage and ended
    in numpy's "array is too big" traceback; prep's per-tensor limit refuses it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1 << 40, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1 << 40, 4])
    return _save(tiny_model(inputs=[x], outputs=[y]), folder / "model.onnx")


@kind(ModelError, r"'w'.*limit")
def dims_overflow_int64(folder: Path) -> Path:
    """An initializer whose dims multiply past 2^63 (each fits an int64, their product
    does not): a C++ size_t product wraps to a small number."""
    w = TensorProto(
        name="w", data_type=TensorProto.FLOAT, dims=[1 << 32, 1 << 32, 4], raw_data=b"\0" * 16
    )
    model = tiny_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w])
    return _save(model, folder / "model.onnx")


#: Nodes of the `million_nodes` kind; prep's node limit is 200k.
MILLION = 1_000_000


@kind(ModelError, r"1000000 nodes.*limit")
def million_nodes(folder: Path) -> Path:
    """A chain of a million Relu nodes (35 MB): refused by prep's node limit right after
    parsing, before anything walks the graph in Python (which took minutes)."""
    (p := folder / "model.onnx").write_bytes(_chain(MILLION))
    return p


@kind(ModelError, r"9.0 GiB, over the limit of 8.0 GiB", by_path=True)
def model_file_9_gib(folder: Path) -> Path:
    """A sparse 9 GiB file (no disk used): over the model-size limit before any read.
    By path for the daemon: nobody uploads 9 GiB to test a limit."""
    with open(p := folder / "model.onnx", "wb") as f:
        f.write(tiny_model().SerializeToString())
        f.truncate(9 << 30)
    return p


@kind(ModelError, r"nested deeper than")
def nested_if_200(folder: Path) -> Path:
    """If bodies 200 deep: 600 levels of protobuf messages, past protobuf's recursion
    limit (100), so it cannot even be parsed."""
    (p := folder / "model.onnx").write_bytes(_nested_if(200))
    return p


@kind(None, r"If|nested")
def nested_if_25(folder: Path) -> Path:
    """25 deep parses (75 message levels): legitimate if odd; nothing in it is tunable,
    so it may succeed with the input shipped, or fail naming why."""
    (p := folder / "model.onnx").write_bytes(_nested_if(25))
    return p


# --------------------------------------------------------------------------- names


@kind(ModelError, r"node name b'.*' is not valid UTF-8")
def non_utf8_names(folder: Path) -> Path:
    """A node and a tensor named with bytes that are not UTF-8 (onnx cannot write them:
    the placeholder is patched in the serialized bytes, same length)."""
    mark = "\x01PATCHME\x01"
    nodes = [
        helper.make_node("Relu", ["x"], [mark], name=mark),
        helper.make_node("Neg", [mark], ["y"], name="neg"),
    ]
    # as long as the mark: lengths stay right
    bad = b"\xff\xfe\xc0" + b"A" * (len(mark) - 4) + b"\xff"
    data = tiny_model(nodes).SerializeToString().replace(mark.encode(), bad)
    (p := folder / "model.onnx").write_bytes(data)
    return p


@kind(ModelError, r"100000 characters.*limit")
def very_long_names(folder: Path) -> Path:
    """A tensor and a node named with 100k characters: legal in ONNX, but every message,
    log line and report that names them would be 100 kB long."""
    long = "n" * 100_000
    nodes = [
        helper.make_node("Relu", ["x"], [long], name=long),
        helper.make_node("Neg", [long], ["y"], name="neg"),
    ]
    return _save(tiny_model(nodes), folder / "model.onnx")


# --------------------------------------------------------------------------- the runtime


@kind(ModelError, r"cannot load.*sideways")
def fails_at_session_creation(folder: Path) -> Path:
    """Resize with mode "sideways": onnx checks no attribute's string values, onnxruntime's
    kernel refuses it when the session is created."""
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="sideways", name="resize")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])
    return _save(
        tiny_model(nodes, inputs=[x], outputs=[y], initializers=[scales]), folder / "model.onnx"
    )


@kind(ModelError, r"cannot run.*'gather'.*out of data bounds")
def fails_at_run_time(folder: Path) -> Path:
    """Gather of the input's row 7 on an axis of size 1: valid until it runs."""
    i = numpy_helper.from_array(np.array([7], np.int64), "i")
    nodes = [helper.make_node("Gather", ["x", "i"], ["y"], axis=0, name="gather")]
    return _save(tiny_model(nodes, initializers=[i]), folder / "model.onnx")


@kind(None, r"NaN|finite")
def nan_output(folder: Path) -> Path:
    """y = x + sqrt(-1): every output is NaN. A model may legitimately produce NaN, and
    nothing tunable changes that; it may succeed (input shipped) or fail naming NaN."""
    m = numpy_helper.from_array(np.full((1, 4), -1.0, np.float32), "m")
    nodes = [
        helper.make_node("Sqrt", ["m"], ["s"], name="sqrt"),
        helper.make_node("Add", ["x", "s"], ["y"], name="add"),
    ]
    return _save(tiny_model(nodes, initializers=[m]), folder / "model.onnx")


# --------------------------------------------------------------------------- external data


@kind(ModelError, r"'w'.*outside", by_path=True, escapes=True)
def external_dotdot(folder: Path) -> Path:
    return _external(folder, os.path.relpath(sentinel(folder), folder))


@kind(ModelError, r"'w'.*outside", by_path=True, escapes=True)
def external_absolute(folder: Path) -> Path:
    return _external(folder, str(sentinel(folder)))


@kind(ModelError, r"'w' points outside.*symlink", by_path=True, escapes=True)
def external_symlink(folder: Path) -> Path:
    (folder / "weights.bin").symlink_to(sentinel(folder))
    return _external(folder, "weights.bin")


@kind(ModelError, r"'w' has 2 hard links", by_path=True, escapes=True)
def external_hardlink(folder: Path) -> Path:
    """A hard link is a second name for the outside file's inode: no path check sees it.

    What is safe: refuse external data whose file has more than one link (lstat, before
    any open, and again on the opened descriptor). Ownership is no test: the file is
    the user's own in `aoe tune`, and a daemon's clients own what they put in its
    folders. Linux's fs.protected_hardlinks stops users linking files they cannot write,
    but not their owner or root, and may be off. A legitimate hard-linked weight file
    costs a `cp`, which the message says."""
    os.link(sentinel(folder), folder / "weights.bin")
    return _external(folder, "weights.bin")


@kind(ModelError, r"'w' wants bytes 4 to 20.*beyond its end", by_path=True)
def external_past_eof(folder: Path) -> Path:
    (folder / "weights.bin").write_bytes(b"\0" * 8)
    return _external(folder, "weights.bin", offset=4, length=16)


@kind(ModelError, r"'w' is missing", by_path=True)
def external_missing(folder: Path) -> Path:
    return _external(folder, "weights.bin")


@kind(ModelError, r"'w'.*not a regular file", by_path=True)
def external_fifo(folder: Path) -> Path:
    """External data in a named pipe: opening it to read would block forever."""
    os.mkfifo(folder / "weights.bin")
    return _external(folder, "weights.bin")


# --------------------------------------------------------------------------- bad places (CLI)

_PLACE = "a bad place of the command line; the daemon's paths are confined (test_daemon)"


@kind(OptionError, r"--output .*(writ|permission|read-only)", cli_only=_PLACE)
def output_unwritable(folder: Path) -> Case:
    """An --output folder that exists but cannot be written. Root writes any folder
    whatever its mode, so as root it is /proc, which nobody can create files in."""
    model = _save(tiny_model(), folder / "model.onnx")
    if os.geteuid() == 0:
        return Case(model, ("--output", "/proc"))
    (out := folder / "readonly").mkdir()
    out.chmod(0o500)
    return Case(model, ("--output", str(out)))


@kind(OptionError, r"--output .*not a directory", cli_only=_PLACE)
def output_is_file(folder: Path) -> Case:
    model = _save(tiny_model(), folder / "model.onnx")
    (out := folder / "out.txt").write_text("a file, not a folder\n")
    return Case(model, ("--output", str(out)))


@kind(BankError, r"not a directory", cli_only=_PLACE)
def bank_is_file(folder: Path) -> Case:
    model = _save(tiny_model(), folder / "model.onnx")
    (bank := folder / "bank").write_text("a file, not a bank\n")
    return Case(model, ("--bank", str(bank)))

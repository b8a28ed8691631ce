"""A `.pt2` archive checked against what `torch.export.save` writes for a plain program,
before any torch loader sees it: `check_pt2()`.

torch's loader (torch 2.13: `torch.export.pt2_archive._package.load_pt2` and
`torch._export.serde.serialize`) runs code from the archive in several places that
TORCH_FORCE_WEIGHTS_ONLY_LOAD does not cover:

- a constant declared `use_pickle` whose member is `opaque_obj_*` is unpickled with
  Python's own pickle module (not the weights-only one), and one that is `custom_obj_*`
  with TorchScript's unpickler;
- a symbolic size (`expr_str` in models/model.json) is parsed with `sympy.sympify`,
  which evaluates Python;
- `guards_code` in models/model.json is compiled with `exec` into a function that
  runs with every forward;
- a node's target is a dotted name looked up attribute by attribute from `torch`,
  `operator` or `math`, and called with every forward;
- a pytree spec's context may name a module to import (`__enum__`, defaultdict);
- members under data/aotinductor/ are shared libraries it loads.

So this module reads the archive as data (zipfile, json, ast, pickletools; it imports no
torch and runs in the daemon as in a rank) and refuses, with a ModelError naming the
archive, the member and why:

- a zip that two readers could see differently (data before the first member, a comment
  or anything after the end record, members that overlap, a name in the central
  directory that its local header does not repeat), a compressed or encrypted member
  (torch writes every member stored: a member's size is its bytes in the file, so no
  member, and no sum of them, can exceed the file: no zip bomb), a link or folder;
- a member name that is absolute, has `..`, `.` or empty parts, a backslash, a NUL, a
  second root folder, or appears twice; any member outside the layout below;
- a JSON member over MAX_JSON_BYTES, malformed, or not of its expected shape;
- a weight or constant that is pickled, a custom or opaque object, a torchbind class;
- a node target, operator argument, symbolic expression, guard, pytree spec or pickled
  global outside the allowlists below.

The layout (ROOT is the archive's one top folder, named after the file when saved):

    ROOT/archive_format                 "pt2"
    ROOT/archive_version                "0"
    ROOT/byteorder                      "little" or "big"
    ROOT/.data/version                  a number
    ROOT/.data/serialization_id         digits
    ROOT/models/model.json              the program (schema 8.x)
    ROOT/data/weights/model_weights_config.json
    ROOT/data/weights/weight_N          raw bytes of a parameter or buffer
    ROOT/data/constants/model_constants_config.json
    ROOT/data/constants/tensor_N        raw bytes of a constant tensor
    ROOT/data/sample_inputs/model.pt    the example inputs (torch.save: a zip whose
                                        data.pkl may name only the tensor globals below)
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickletools
import re
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any, NoReturn, cast

from aoe.errors import ModelError

__all__ = ["MAX_JSON_BYTES", "MAX_MEMBERS", "check_pt2"]

#: A JSON member larger than this is refused (it is parsed in the daemon).
MAX_JSON_BYTES = 128 << 20
#: An archive with more members than this is refused.
MAX_MEMBERS = 200_000
#: The example inputs' pickle (data.pkl) larger than this is refused.
MAX_PICKLE_BYTES = 16 << 20

_NUMBERED = re.compile(r"(weight|tensor)_(0|[1-9][0-9]{0,8})")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_NAME = re.compile(_IDENT)
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?")
_FIXED = {
    "archive_format",
    "archive_version",
    "byteorder",
    ".data/version",
    ".data/serialization_id",
    "models/model.json",
    "data/weights/model_weights_config.json",
    "data/constants/model_constants_config.json",
    "data/sample_inputs/model.pt",
}
_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
_CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
_MODEL = "models/model.json"

#: Node targets (and operator arguments) besides torch.ops.aten.OP.OVERLOAD: what
#: torch's own verifier lets an exported program call.
_HIGHER_ORDER = {
    "cond",
    "while_loop",
    "map_impl",
    "scan",
    "associative_scan",
    "invoke_subgraph",
    "wrap_with_set_grad_enabled",
    "wrap_with_autocast",
    "auto_functionalized",
    "auto_functionalized_v2",
    "with_effects",
}
_BUILTIN_TARGETS = {
    *(
        f"_operator.{op}"
        for op in (
            "getitem add mul sub truediv ge le gt lt eq ne floordiv mod and_ or_ not_ pow neg "
            "abs lshift rshift"
        ).split()
    ),
    "math.ceil",
    "math.floor",
    "math.trunc",
    "builtins.round",
    *(f"torch.sym_{op}" for op in "int float ite max min not sqrt sum".split()),
    "torch._C._set_grad_enabled",
    "torch.autograd.grad_mode.set_grad_enabled",
    "torch.amp.autocast_mode._enter_autocast",
    "torch.amp.autocast_mode._exit_autocast",
}
_ATEN = re.compile(rf"torch\.ops\.aten\.(?!__){_IDENT}\.(?!__){_IDENT}")

#: Calls a symbolic size may make (sympy's classes and torch's functions it names).
_SYMPY_CALLS = {
    *"Symbol Integer Float Rational Add Mul Pow Mod Max Min Abs Eq Ne Lt Le Gt Ge".split(),
    *"StrictLessThan StrictGreaterThan LessThan GreaterThan Equality Unequality".split(),
    *"And Or Not Piecewise ExprCondPair".split(),
    *"FloorDiv ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv".split(),
    *"LShift RShift PowByNatural FloatPow FloatTrueDiv IntTrueDiv".split(),
    *"IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt".split(),
    *"RoundDecimal ToFloat Identity".split(),
}
#: Names a symbolic size may use bare (sympy's constants).
_SYMPY_NAMES = {"true", "false", "oo", "zoo", "nan", "S", "pi", "E", "I", "Half", "One", "Zero"}
_SYMPY_KEYWORDS = {
    *"integer positive negative nonnegative nonpositive real finite zero nonzero".split(),
    *"rational even odd prime commutative evaluate precision".split(),
}
#: Calls a guard may make (torch's sympy interpreter names, and math's).
_GUARD_CALLS = {
    *"Abs Eq Ne Gt Lt Le Ge Min Max Mod PythonMod FloorDiv TrueDiv PowByNatural".split(),
    *"IsNonOverlappingAndDenseIndicator floor ceiling FloorToInt FloatPow CeilToInt".split(),
    *"RoundToInt RoundDecimal TruncToInt IntTrueDiv FloatTrueDiv ToFloat".split(),
    *"sym_min sym_max sym_float sym_int sym_ite sym_not sym_sqrt".split(),
}
_GUARD_MATH = {"floor", "ceil", "trunc", "isnan", "isinf", "isfinite", "sqrt", "inf"}

#: Pytree node types a spec may name (those torch registers itself).
_TREESPEC_TYPES = {
    None,
    "builtins.tuple",
    "builtins.list",
    "builtins.dict",
    "collections.OrderedDict",
    "collections.namedtuple",
    "torch.fx.immutable_collections.immutable_list",
    "torch.fx.immutable_collections.immutable_dict",
}

#: Globals the example inputs' pickle may name: tensors and their storages, OrderedDict.
_PICKLE_GLOBALS = {
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_tensor_v3",
    "torch._utils _rebuild_parameter",
    "collections OrderedDict",
    "torch device",
    *(
        f"torch {kind}Storage"
        for kind in (
            "Float Double Half BFloat16 Long Int Short Char Byte Bool ComplexFloat "
            "ComplexDouble QInt8 QUInt8 QInt32 UntypedStorage"
        ).split()
    ),
    "torch UntypedStorage",
}
_PICKLE_REFUSED = {"STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD", "PERSID"}
_PICKLE_REFUSED |= {"EXT1", "EXT2", "EXT4"}
#: What torch.save writes into the example inputs' zip (under its own root folder).
_INNER = re.compile(
    r"data\.pkl|version|byteorder|\.format_version|\.storage_alignment|\.data/version|"
    r"\.data/serialization_id|data/(0|[1-9][0-9]{0,8})"
)

_LOCAL_HEADER = b"PK\x03\x04"
_END_RECORD = b"PK\x05\x06"


class _Refused(Exception):
    """One problem with the archive: the member at fault (or "") and why."""

    def __init__(self, member: str, why: str):
        super().__init__(why)
        self.member, self.why = member, why


def _fail(member: str, why: str) -> NoReturn:
    raise _Refused(member, why)


# --------------------------------------------------------------------------- the zip


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of `f`, as a seekable file (a stored member)."""

    def __init__(self, f: IO[bytes], start: int, size: int):
        self._f, self._start, self._size, self._pos = f, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._size - self._pos))
        if not n:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _file_size(f: IO[bytes]) -> int:
    f.seek(0, os.SEEK_END)
    return f.tell()


def _zip_members(f: IO[bytes], what: str) -> tuple[zipfile.ZipFile, dict[str, tuple[int, int]]]:
    """The zip in `f` and, for each member, (data offset, size); _Refused for anything a
    reader other than Python's could see otherwise, or that is not a stored file."""
    size = _file_size(f)
    f.seek(0)
    if f.read(4) != _LOCAL_HEADER:
        _fail(what, "does not start with a zip member (data before it, or not a zip)")
    if size < 22:
        _fail(what, "not a zip archive")
    f.seek(size - 22)
    tail = f.read(22)
    if tail[:4] != _END_RECORD or tail[20:22] != b"\0\0":
        _fail(what, "has a comment or data after the zip's end record")
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        _fail(what, f"not a zip archive: {exc}")
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        _fail(what, f"{len(infos)} members, more than {MAX_MEMBERS}")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        _fail(dup, "appears twice in the archive")
    offset_cd = struct.unpack("<I", tail[16:20])[0]
    if offset_cd != 0xFFFFFFFF and zf.start_dir != offset_cd:
        _fail(what, "has data before its first member")
    spans: dict[str, tuple[int, int]] = {}
    headers: list[tuple[int, int, str]] = []
    for info in infos:
        name = info.filename
        mode = info.external_attr >> 16
        if name.endswith("/") or stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            _fail(name, "is a folder, a link or a special file, not a plain file")
        if info.flag_bits & 0x1:
            _fail(name, "is encrypted")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            _fail(
                name,
                "is compressed (torch.export.save stores every member as it is): save the "
                "program again with torch.export.save",
            )
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) < 30 or header[:4] != _LOCAL_HEADER:
            _fail(name, "its local header is missing")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
        if f.read(name_len) != info.orig_filename.encode(encoding, "replace"):
            _fail(name, "its local header names another member")
        start = info.header_offset + 30 + name_len + extra_len
        spans[name] = (start, info.file_size)
        headers.append((info.header_offset, start + info.file_size, name))
    # Members must not overlap (one region read under several names) and must end
    # before the central directory.
    end = 0
    for begin, stop, name in sorted(headers):
        if begin < end:
            _fail(name, "overlaps another member")
        end = stop
    if end > zf.start_dir:
        _fail(what, "a member runs into the zip's central directory")
    return zf, spans


def _member_name(name: str) -> tuple[str, str]:
    """(root folder, path under it) of a member name; _Refused when it could point
    anywhere else."""
    if "\0" in name or "\\" in name or name.startswith("/") or len(name) > 4096:
        _fail(name, "is not a plain relative name")
    parts = name.split("/")
    if len(parts) < 2 or any(p in ("", ".", "..") for p in parts):
        _fail(name, "has an empty, '.' or '..' part, or is not inside the archive's folder")
    return parts[0], "/".join(parts[1:])


# --------------------------------------------------------------------------- JSON


def _read_json(zf: zipfile.ZipFile, name: str, limit: int) -> Any:
    info = zf.getinfo(name)
    if info.file_size > limit:
        _fail(name, f"{info.file_size} bytes, more than {limit} for a JSON member")
    try:
        return json.loads(zf.read(name))
    except (ValueError, RecursionError) as exc:
        _fail(name, f"malformed JSON: {str(exc)[:200]}")
    except (zipfile.BadZipFile, OSError) as exc:
        _fail(name, f"cannot be read: {exc}")


def _walk(doc: Any) -> Iterator[tuple[str, Any, dict]]:
    """(key, value, the dict holding it) for every key of every dict in `doc`, without
    recursion (a deep document must not exhaust the stack)."""
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                yield k, v, item
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))


def _payloads(doc: Any, member: str, prefix: str) -> dict[str, dict]:
    """The entries of a weights or constants config: {fqn: payload}; _Refused for
    anything torch would unpickle or that is not a raw tensor `prefix`N."""
    config = doc.get("config") if isinstance(doc, dict) and len(doc) == 1 else None
    if not isinstance(config, dict):
        _fail(member, 'expected {"config": {name: payload, ...}}')
    for fqn, payload in config.items():
        if not isinstance(payload, dict):
            _fail(member, f"{fqn!r}: expected an object")
        path = payload.get("path_name")
        kind = "weight" if prefix == "weight_" else "constant"
        if payload.get("use_pickle") is not False:
            _fail(
                member,
                f"{kind} {fqn!r} ({path}) is pickled (use_pickle: {payload.get('use_pickle')!r}); "
                "only plain tensors are loaded: a tensor subclass, a custom or opaque object "
                "would run code from the file",
            )
        if (
            not isinstance(path, str)
            or not path.startswith(prefix)
            or not _NUMBERED.fullmatch(path)
        ):
            _fail(member, f"{kind} {fqn!r}: {path!r} is not a raw tensor member ({prefix}N)")
        if not isinstance(payload.get("tensor_meta"), dict):
            _fail(member, f"{kind} {fqn!r}: no tensor_meta")
    return config


def _check_target(target: Any, member: str, where: str) -> None:
    if not isinstance(target, str):
        _fail(member, f"{where}: a target that is not a string")
    if _ATEN.fullmatch(target) or target in _BUILTIN_TARGETS:
        return
    hop = target.removeprefix("torch.ops.higher_order.")
    if hop != target and hop in _HIGHER_ORDER:
        return
    _fail(
        member,
        f"{where}: calls {target[:200]!r}, which is not an ATen operator or one of the few "
        "built-ins an exported program calls",
    )


def _check_ast(text: Any, member: str, what: str, ok: Callable[[ast.AST], bool]) -> None:
    if not isinstance(text, str) or len(text) > 100_000:
        _fail(member, f"{what}: expected a short string")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        _fail(member, f"{what} {text[:200]!r}: not an expression")
    for node in ast.walk(tree):
        if not ok(node):
            _fail(member, f"{what} {text[:200]!r}: {type(node).__name__} is not allowed there")


_ARITH = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.BoolOp,
    ast.operator,
    ast.unaryop,
    ast.cmpop,
    ast.boolop,
    ast.Load,
)


def _sympy_node(node: ast.AST) -> bool:
    """What sympy may evaluate: calls of its classes by name with plain arguments (a
    symbol's name, a number, a number written as a string as in Float('1.5'))."""
    if isinstance(node, _ARITH):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool)) or (
            isinstance(node.value, str)
            and (_NAME.fullmatch(node.value) or _NUMBER.fullmatch(node.value)) is not None
        )
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS
    if isinstance(node, ast.keyword):
        return node.arg in _SYMPY_KEYWORDS
    if isinstance(node, ast.Name):
        return (
            node.id in _SYMPY_CALLS
            or node.id in _SYMPY_NAMES
            or re.fullmatch(r"[a-z]{1,3}[0-9]+", node.id) is not None
        )
    return False


def _guard_node(node: ast.AST) -> bool:
    """What a guard may be: sizes and strides of the inputs (L['x'].size()[0]), numbers,
    arithmetic, comparisons, and torch's sympy functions and math's by name."""
    if isinstance(node, _ARITH):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool)) or (
            isinstance(node.value, str) and _NAME.fullmatch(node.value) is not None
        )
    if isinstance(node, ast.Name):
        return node.id in ("L", "math", "inf") or node.id in _GUARD_CALLS
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant)
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "math":
            return node.attr in _GUARD_MATH
        return node.attr in ("size", "stride", "storage_offset")
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute):  # x.size() and math.floor(x)
            return not node.keywords and (
                not node.args or (isinstance(f.value, ast.Name) and f.value.id == "math")
            )
        return isinstance(f, ast.Name) and f.id in _GUARD_CALLS and not node.keywords
    return False


def _check_treespec(text: Any, member: str) -> None:
    if not isinstance(text, str):
        _fail(member, "a pytree spec that is not a string")
    try:
        protocol, schema = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        _fail(member, f"a malformed pytree spec {text[:200]!r}")
    if protocol != 1:
        _fail(member, f"a pytree spec of protocol {protocol!r}, not 1")
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            _fail(member, "a pytree spec of an unexpected shape")
        if node["type"] not in _TREESPEC_TYPES:
            _fail(member, f"a pytree spec names the type {str(node['type'])[:200]!r}")
        context = node["context"]
        if context is not None:
            try:
                parsed = json.loads(context)
            except (ValueError, TypeError, RecursionError):
                _fail(member, "a pytree spec with a malformed context")
            # torch reads a context with a hook that imports the module of any
            # {"__enum__": ...} in it.
            if any(k == "__enum__" for k, _v, _d in _walk(parsed)):
                _fail(member, "a pytree spec's context names an enum class to import")
        if not isinstance(node["children_spec"], list):
            _fail(member, "a pytree spec of an unexpected shape")
        stack.extend(node["children_spec"])


def _check_program(doc: Any, member: str) -> None:
    if not isinstance(doc, dict) or not isinstance(doc.get("graph_module"), dict):
        _fail(member, "not an exported program (no graph_module)")
    verifiers = doc.get("verifiers")
    if (
        not isinstance(verifiers, list)
        or not verifiers
        or not set(verifiers) <= {"ATEN", "TRAINING", ""}
    ):
        _fail(member, f"verifiers {verifiers!r}: expected ATEN or TRAINING")
    guards = doc.get("guards_code", [])
    if not isinstance(guards, list):
        _fail(member, "guards_code: expected a list")
    for guard in guards:
        _check_ast(guard, member, "guard", _guard_node)
    for key, value, holder in _walk(doc["graph_module"]):
        if key == "target":  # only a node has one (torch._export.serde.schema.Node)
            _check_target(value, member, f"node {str(holder.get('name'))[:100]!r}")
        elif key == "as_operator":
            _check_target(value, member, "an operator argument")
        elif key == "expr_str":
            _check_ast(value, member, "symbolic expression", _sympy_node)
        elif key in ("in_spec", "out_spec"):
            _check_treespec(value, member)
        elif key in ("as_custom_obj", "custom_obj") or (key == "custom_obj_values" and value):
            _fail(member, "uses a custom (torchbind or opaque) object: only tensors are loaded")
        elif key == "source_fn_stack" and isinstance(value, str):
            for entry in value.split(";"):
                target = entry.rsplit(",", 1)[-1]
                if target.startswith("#") or "__" in target:
                    _fail(member, f"metadata names {target[:200]!r}")


# --------------------------------------------------------------------------- example inputs


def _check_pickle(data: bytes, member: str) -> None:
    """The example inputs' pickle names only tensor globals and builds no object."""
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in _PICKLE_REFUSED:
                _fail(member, f"the pickle uses {op.name}: only tensors and containers are loaded")
            if op.name == "GLOBAL" and arg not in _PICKLE_GLOBALS:
                _fail(member, f"the pickle names {str(arg)[:200]!r}: only tensors are loaded")
    except (ValueError, EOFError, struct.error) as exc:
        _fail(member, f"a malformed pickle: {exc}")


def _check_sample_inputs(f: IO[bytes], start: int, size: int, member: str) -> None:
    inner = _Window(f, start, size)
    try:
        zf, _spans = _zip_members(cast("IO[bytes]", inner), member)  # a file in all but name
    except _Refused as exc:
        _fail(member, f"{exc.member if exc.member != member else 'the zip'}: {exc.why}")
    roots = set()
    pickles = []
    for name in zf.namelist():
        try:
            root, rest = _member_name(name)
        except _Refused as exc:
            _fail(member, f"{name[:200]!r} {exc.why}")
        roots.add(root)
        if not _INNER.fullmatch(rest):
            _fail(member, f"an unexpected member {name[:200]!r}")
        if rest == "data.pkl":
            pickles.append(name)
    if len(roots) != 1 or len(pickles) != 1:
        _fail(member, "not one torch.save archive")
    info = zf.getinfo(pickles[0])
    if info.file_size > MAX_PICKLE_BYTES:
        _fail(member, f"data.pkl: {info.file_size} bytes, more than {MAX_PICKLE_BYTES}")
    _check_pickle(zf.read(pickles[0]), member)


# --------------------------------------------------------------------------- the archive


def _check(f: IO[bytes], max_json_bytes: int) -> None:
    zf, spans = _zip_members(f, "")
    members: dict[str, str] = {}
    roots = set()
    for name in zf.namelist():
        root, rest = _member_name(name)
        roots.add(root)
        if len(roots) > 1:
            _fail(name, "lies outside the archive's one top folder")
        members[rest] = name
    for rest, name in members.items():
        folder, _, base = rest.rpartition("/")
        if rest in _FIXED:
            continue
        if folder == "data/weights" and base.startswith("weight_") and _NUMBERED.fullmatch(base):
            continue
        if folder == "data/constants" and base.startswith("tensor_") and _NUMBERED.fullmatch(base):
            continue
        why = "is not part of a program saved by torch.export.save"
        if rest.startswith("data/aotinductor/"):
            why = "is compiled code (AOTInductor), which is never loaded"
        elif base.startswith(("opaque_obj_", "custom_obj_")):
            why = "is a pickled custom or opaque object"
        _fail(name, why)
    missing = sorted(_FIXED - set(members))
    if missing:
        _fail("", f"has no {missing[0]}: not a program saved by torch.export.save")

    def small(rest: str, pattern: str) -> None:
        name = members[rest]
        if zf.getinfo(name).file_size > 64 or not re.fullmatch(
            pattern, zf.read(name).decode("ascii", "replace")
        ):
            _fail(name, f"expected {pattern!r}")

    small("archive_format", "pt2")
    small("archive_version", "0")
    small("byteorder", "little|big")
    small(".data/version", r"[0-9]{1,4}\n?")
    small(".data/serialization_id", "[0-9]{1,64}")

    for config_name, prefix in ((_WEIGHTS_CONFIG, "weight_"), (_CONSTANTS_CONFIG, "tensor_")):
        name = members[config_name]
        payloads = _payloads(_read_json(zf, name, max_json_bytes), name, prefix)
        folder = config_name.rpartition("/")[0]
        named = {p["path_name"] for p in payloads.values()}
        for path in named:
            if f"{folder}/{path}" not in members:
                _fail(name, f"names {path}, which the archive does not hold")
        for rest, member in members.items():
            if rest.startswith(f"{folder}/{prefix}") and rest.rpartition("/")[2] not in named:
                _fail(member, f"is not named in {config_name}")

    name = members[_MODEL]
    _check_program(_read_json(zf, name, max_json_bytes), name)
    name = members[_SAMPLE_INPUTS]
    _check_sample_inputs(f, *spans[name], name)


def check_pt2(
    source: str | os.PathLike[str] | IO[bytes],
    *,
    name: str = "",
    max_json_bytes: int = MAX_JSON_BYTES,
) -> None:
    """Check a .pt2 (a path, or an open binary file that is read from its start) against
    the layout in the module doc, reading it as data only. Raises ModelError naming the
    archive (`name`, else the path), the member and why; returns None when it passes.
    Blocking (runs in a thread in async code); uncancellable."""
    label = name or (os.fspath(source) if isinstance(source, (str, os.PathLike)) else "archive")
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                _check(f, max_json_bytes)
        else:
            source.seek(0)
            _check(source, max_json_bytes)
    except _Refused as exc:
        where = f"{exc.member[:300]}: " if exc.member else ""
        raise ModelError(
            f"{label}: refused before loading: {where}{exc.why}. A GDAT program must be a "
            "torch.export program saved with torch.export.save, holding only tensors"
        ) from None
    except OSError as exc:
        raise ModelError(f"{label}: cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, zipfile.BadZipFile, KeyError, struct.error) as exc:
        raise ModelError(f"{label}: refused before loading: not a readable zip ({exc})") from None

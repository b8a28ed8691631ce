"""Hostile .pt2 archives, built the way an attacker would: a real program saved by
`torch.export.save`, rewritten member by member with zipfile (members added, replaced
or dropped; the zip's own fields bent).

    base = tiny_program(folder / "tiny.pt2")
    evil = KINDS["opaque_object"].build(base, folder / "evil.pt2", marker)

A kind that runs code (`runs_code`) runs `payload(marker)` when torch loads it (or, for a
guard, when the loaded module is called): Python that writes `marker`, or with
`probe=True` tries what a confined process may not do and writes what the kernel
answered into `marker`. Every kind names the member (`member`) and a word of the reason
(`why`) that aoed.backends.torch.archive's refusal must say.
"""

from __future__ import annotations

import io
import json
import pickle
import stat
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["KINDS", "Kind", "payload", "rewrite", "root_of", "tiny_program"]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.layers(x) * self.scale


def tiny_program(path: Path) -> Path:
    """A real program with a dynamic batch (so its sizes are symbolic expressions)."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(Tiny(), (torch.randn(8, 32),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, str(path))
    return path


def root_of(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return z.namelist()[0].split("/")[0]


def payload(marker: Path, probe: bool = False) -> str:
    """Python source a hostile archive runs: writes `marker`; with `probe`, writes into
    `marker` (JSON) what the kernel answered to a write of outside.txt in the folder
    above `marker`'s and to a TCP connection to the port in `marker`.port."""
    if not probe:
        return f"open({str(marker)!r}, 'w').write('ran')"
    return (
        "import json, os, socket\n"
        "out = {}\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        fn(); out[name] = 'ok'\n"
        "    except OSError as e:\n"
        "        out[name] = e.errno\n"
        f"marker = {str(marker)!r}\n"
        "outside = os.path.join(os.path.dirname(os.path.dirname(marker)), 'outside.txt')\n"
        "attempt('outside', lambda: open(outside, 'w').write('x'))\n"
        "port = int(open(marker + '.port').read())\n"
        "attempt('connect', lambda: socket.create_connection(('127.0.0.1', port), 5))\n"
        "open(marker, 'w').write(json.dumps(out))\n"
    )


class _Exec:
    """Unpickling this runs `code` (pickle calls exec with it)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code, {}))


def _exec_expr(marker: Path) -> str:
    """An expression that runs `payload(marker)`: written without double quotes (torch
    puts a guard's text between them) and with no bare name before a dot (sympy would
    take it for a symbol)."""
    return f"exec(__import__('codecs').decode('{payload(marker).encode().hex()}', 'hex'))"


def _pickled(code: str) -> bytes:
    return pickle.dumps(_Exec(code), protocol=2)


def rewrite(
    src: Path,
    dst: Path,
    edit: Callable[[str, bytes], bytes | None] = lambda rest, data: data,
    add: dict[str, bytes] | None = None,
    *,
    infos: Callable[[zipfile.ZipInfo], None] | None = None,
    compress: bool = False,
) -> Path:
    """`src` rewritten into `dst`: each member's bytes through `edit(path under the
    root, bytes)` (None drops it), then `add`'s members (paths under the root, or
    absolute names when they start with "!"); `infos` may bend each new member's
    ZipInfo; `compress` deflates every member."""
    root = root_of(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a duplicate name is the point of one kind
            items = [(i.filename.split("/", 1)[1], zin.read(i.filename)) for i in zin.infolist()]
            items = [(rest, edit(rest, data)) for rest, data in items]
            items += list((add or {}).items())
            for rest, data in items:
                if data is None:
                    continue
                name = rest[1:] if rest.startswith("!") else f"{root}/{rest}"
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
                if infos is not None:
                    infos(info)
                zout.writestr(info, data)
    return dst


def _json_edit(member: str, change: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    def edit(rest: str, data: bytes) -> bytes:
        if rest != member:
            return data
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()

    return edit


_CONSTANTS = "data/constants/model_constants_config.json"
_WEIGHTS = "data/weights/model_weights_config.json"
_MODEL = "models/model.json"


def _pickled_entry(path_name: str) -> dict:
    return {"path_name": path_name, "is_param": False, "use_pickle": True, "tensor_meta": None}


def _opaque(src: Path, dst: Path, marker: Path, probe: bool = False) -> Path:
    # torch's loader: pickle.loads(member) for a constant at opaque_obj_N.
    def change(doc: dict) -> None:
        doc["config"]["evil"] = _pickled_entry("opaque_obj_0")

    return rewrite(
        src,
        dst,
        _json_edit(_CONSTANTS, change),
        {"data/constants/opaque_obj_0": _pickled(payload(marker, probe=probe))},
    )


def _opaque_probe(src: Path, dst: Path, marker: Path) -> Path:
    return _opaque(src, dst, marker, probe=True)


def _pickled_tensor(src: Path, dst: Path, marker: Path) -> Path:
    # A member named like a raw tensor, declared pickled in the config.
    def change(doc: dict) -> None:
        doc["config"]["evil"] = _pickled_entry("tensor_7")

    return rewrite(
        src, dst, _json_edit(_CONSTANTS, change), {"data/constants/tensor_7": _pickled("0")}
    )


def _pickled_weight(src: Path, dst: Path, marker: Path) -> Path:
    def change(doc: dict) -> None:
        first = next(iter(doc["config"].values()))
        first["use_pickle"] = True

    return rewrite(src, dst, _json_edit(_WEIGHTS, change))


def _sympy(src: Path, dst: Path, marker: Path) -> Path:
    # torch's loader: sympy.sympify(expr_str), which evaluates Python.
    def change(doc: dict) -> None:
        stack = [doc]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                if "expr_str" in item:
                    item["expr_str"] = f"({_exec_expr(marker)} or 0) + {item['expr_str']}"
                    return
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        raise AssertionError("the program has no symbolic size")

    return rewrite(src, dst, _json_edit(_MODEL, change))


def _guard(src: Path, dst: Path, marker: Path) -> Path:
    # torch: exec() of each guard, into a function every call of the module runs.
    def change(doc: dict) -> None:
        doc["guards_code"] = [f"{_exec_expr(marker)} is None"]

    return rewrite(src, dst, _json_edit(_MODEL, change))


def _target(src: Path, dst: Path, marker: Path) -> Path:
    # torch: a node's target is looked up attribute by attribute from torch, and called.
    def change(doc: dict) -> None:
        doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.load_library"

    return rewrite(src, dst, _json_edit(_MODEL, change))


def _enum(src: Path, dst: Path, marker: Path) -> Path:
    # torch: a pytree context is read with a hook that imports the module an enum names.
    def change(doc: dict) -> None:
        sig = doc["graph_module"]["module_call_graph"][0]["signature"]
        spec = json.loads(sig["in_spec"])
        spec[1]["children_spec"][1]["context"] = json.dumps(
            [{"__enum__": True, "fqn": "no_such_module:Fly", "name": "UP"}]
        )
        sig["in_spec"] = json.dumps(spec)

    return rewrite(src, dst, _json_edit(_MODEL, change))


def _sample_inputs(src: Path, dst: Path, marker: Path) -> Path:
    # The example inputs' own zip, its data.pkl naming a global that runs code.
    def edit(rest: str, data: bytes) -> bytes:
        if rest != "data/sample_inputs/model.pt":
            return data
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():
                body = zin.read(info.filename)
                if info.filename.endswith("/data.pkl"):
                    body = _pickled(payload(marker))
                zout.writestr(info.filename, body)
        return out.getvalue()

    return rewrite(src, dst, edit)


def _extra(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, add={"data/weights/notes.txt": b"hello"})


def _aoti(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, add={"data/aotinductor/model/model.so": b"\x7fELF"})


def _dotdot(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, add={"data/../../escape.json": b"{}"})


def _absolute(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, add={"!/tmp/escape.json": b"{}"})


def _duplicate(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, add={_CONSTANTS: b'{"config": {}}'})


def _link(src: Path, dst: Path, marker: Path) -> Path:
    def bend(info: zipfile.ZipInfo) -> None:
        if info.filename.endswith("/weight_0"):
            info.external_attr = (stat.S_IFLNK | 0o777) << 16

    return rewrite(src, dst, infos=bend)


def _bomb(src: Path, dst: Path, marker: Path) -> Path:
    # 64 MiB of zeros deflated to 64 KiB, as a weight.
    def edit(rest: str, data: bytes) -> bytes:
        return bytes(64 << 20) if rest == "data/weights/weight_0" else data

    return rewrite(src, dst, edit, compress=True)


def _malformed(src: Path, dst: Path, marker: Path) -> Path:
    return rewrite(src, dst, lambda rest, data: data[: len(data) // 2] if rest == _MODEL else data)


def _prepended(src: Path, dst: Path, marker: Path) -> Path:
    dst.write_bytes(b"#!/bin/sh\n" + src.read_bytes())
    return dst


@dataclass(frozen=True)
class Kind:
    name: str
    build: Callable[[Path, Path, Path], Path]
    #: the member the refusal names (under the root), "" for the archive itself
    member: str
    #: a word of the reason
    why: str
    #: torch runs its payload: "load" (torch.export.load), "call" (the loaded module)
    runs_code: str = ""


KINDS = {
    k.name: k
    for k in (
        Kind("opaque_object", _opaque, "data/constants/opaque_obj_0", "opaque", "load"),
        Kind("opaque_object_probe", _opaque_probe, "data/constants/opaque_obj_0", "opaque"),
        Kind("pickled_constant", _pickled_tensor, _CONSTANTS, "pickled"),
        Kind("pickled_weight", _pickled_weight, _WEIGHTS, "pickled"),
        Kind("sympy_expression", _sympy, _MODEL, "symbolic expression", "load"),
        Kind("guard", _guard, _MODEL, "guard", "call"),
        Kind("node_target", _target, _MODEL, "torch.ops.load_library"),
        Kind("pytree_enum", _enum, _MODEL, "enum"),
        Kind("sample_inputs_global", _sample_inputs, "data/sample_inputs/model.pt", "exec"),
        Kind("extra_member", _extra, "data/weights/notes.txt", "not part of a program"),
        Kind("aotinductor", _aoti, "data/aotinductor/model/model.so", "compiled code"),
        Kind("dotdot_member", _dotdot, "data/../../escape.json", ".."),
        Kind("absolute_member", _absolute, "!/tmp/escape.json", "relative"),
        Kind("duplicate_member", _duplicate, _CONSTANTS, "twice"),
        Kind("link_member", _link, "data/weights/weight_0", "link"),
        Kind("zip_bomb", _bomb, "data/weights/weight_0", "compressed"),
        Kind("malformed_json", _malformed, _MODEL, "malformed JSON"),
        Kind("prepended_data", _prepended, "", "does not start with a zip member"),
    )
}

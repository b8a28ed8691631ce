"""An OpenVINO artifact: the IR (`name.xml` + `name.bin`) and its compile config.

A model that ships on OpenVINO is the IR `ov.save_model` wrote and a small JSON file
beside it, `name.ovconfig.json`, holding the compile config it was measured with:
`{"format": 1, "device": "CPU", "config": {KEY: value}}`. The config is data (it may
come from a shared folder or another machine), so it is checked on every read against
`ALLOWED`, a fixed list of compile properties with the values each may take; nothing
else reaches `compile_model`. The measurement worker and `aoe.session` open an artifact
through `open_compiled` alike, so what a user runs is what was measured.

`OvSession` gives the artifact the small surface of an onnxruntime session that user
code calls (`run(output_names, feeds)`, `get_inputs()`, `get_outputs()`), so code does
not change with the runtime. openvino is imported only when an artifact is opened.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aoe.errors import ModelError

__all__ = [
    "ALLOWED",
    "CONFIG_SUFFIX",
    "VARIANTS",
    "CompileConfig",
    "RuntimeDecision",
    "OvSession",
    "config_path",
    "is_artifact",
    "open_compiled",
    "port_name",
    "read_config",
    "write_config",
]

#: The file beside `name.xml` that holds its compile config.
CONFIG_SUFFIX = ".ovconfig.json"
#: The format of that file this code reads and writes.
FORMAT = 1
#: Largest thread or stream count a config may ask for (any real CPU has fewer).
MAX_COUNT = 1024

_PRECISIONS = ("f32", "bf16", "f16")
#: The compile properties a config may set, each with the values it may take (a tuple)
#: or the type of a count (int: 0 <= n <= MAX_COUNT). Nothing else is ever passed.
ALLOWED: dict[str, tuple[str, ...] | type] = {
    "INFERENCE_PRECISION_HINT": _PRECISIONS,
    "PERFORMANCE_HINT": ("LATENCY",),
    "NUM_STREAMS": int,
    "INFERENCE_NUM_THREADS": int,
    "ENABLE_CPU_PINNING": ("YES", "NO"),
}
#: The devices an artifact may name (the tuner measures on the CPU plugin).
DEVICES = ("CPU",)


@dataclass(frozen=True)
class CompileConfig:
    """What `compile_model` is given: the device and the checked properties."""

    device: str = "CPU"
    config: Mapping[str, str | int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "device": self.device, "config": dict(self.config)}

    @classmethod
    def checked(cls, data: Any, where: str = "compile config") -> CompileConfig:
        """`data` (as read from JSON) checked against ALLOWED; ModelError naming `where`
        and the field otherwise."""
        if not isinstance(data, dict):
            raise ModelError(f"{where}: not a JSON object; write it again with `aoe tune`")
        unknown = sorted(set(data) - {"format", "device", "config"})
        if unknown:
            raise ModelError(f"{where}: unknown field {unknown[0]!r}; only format, device, config")
        if data.get("format") != FORMAT:
            raise ModelError(
                f"{where}: format {data.get('format')!r}, this aoe reads format {FORMAT}; "
                "tune the model again with this version"
            )
        device = data.get("device", "CPU")
        if device not in DEVICES:
            raise ModelError(
                f"{where}: device {device!r} not supported (only {', '.join(DEVICES)})"
            )
        raw = data.get("config", {})
        if not isinstance(raw, dict):
            raise ModelError(f"{where}: config is not a JSON object of compile properties")
        return cls(device, check_properties(raw, where))


def check_properties(raw: Mapping[str, Any], where: str = "compile config") -> dict[str, str | int]:
    """`raw` compile properties checked against ALLOWED (ModelError naming the key)."""
    out: dict[str, str | int] = {}
    for key, value in raw.items():
        allowed = ALLOWED.get(key)
        if allowed is None:
            raise ModelError(
                f"{where}: property {key!r} is not allowed (allowed: {', '.join(ALLOWED)})"
            )
        if allowed is int:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
                raise ModelError(
                    f"{where}: {key} must be an integer in 0..{MAX_COUNT}, not {value!r}"
                )
            out[key] = value
        elif not isinstance(allowed, tuple) or value not in allowed:
            raise ModelError(
                f"{where}: {key} {value!r} not allowed (choose from: {', '.join(map(str, allowed))})"  # type: ignore[arg-type]
            )
        else:
            out[key] = str(value)
    return out


#: The builds of a model OpenVINO competes with (aoed.backends.openvino.build).
VARIANTS = ("f32", "bf16", "f16", "int8", "int8_bf16", "int8_general")


@dataclass(frozen=True)
class RuntimeDecision:
    """Which runtime's build of a model shipped, as a bank's model-level record keeps it
    (its `runtime` parameter): OpenVINO's `variant` build, run with `options`, so that a
    second run of the model and `aoe compile` rebuild the same artifact; `version` is
    the OpenVINO that measured it ("" when not known): another version's build was never
    measured, so a run there measures again."""

    runtime: str
    variant: str
    options: Mapping[str, str | int] = field(default_factory=dict)
    version: str = ""

    def to_json(self) -> str:
        doc = {"runtime": self.runtime, "variant": self.variant, "options": dict(self.options)}
        if self.version:
            doc["version"] = self.version
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def checked(cls, data: Any, where: str = "runtime") -> RuntimeDecision:
        """`data` (a JSON object, or its text) checked; ModelError naming `where` and the
        field otherwise."""
        if isinstance(data, str | bytes):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise ModelError(f"{where}: not JSON ({exc})") from None
        if not isinstance(data, dict) or not (
            {"runtime", "variant", "options"}
            <= set(data)
            <= {"runtime", "variant", "options", "version"}
        ):
            raise ModelError(
                f"{where}: expected an object of runtime, variant, options (and version)"
            )
        version = data.get("version", "")
        if not isinstance(version, str) or not re.fullmatch(r"[0-9A-Za-z.+_-]{0,64}", version):
            raise ModelError(f"{where}: version {version!r} is not a version")
        if data["runtime"] != "openvino":
            raise ModelError(f"{where}: runtime {data['runtime']!r} is not one that ships builds")
        if data["variant"] not in VARIANTS:
            raise ModelError(
                f"{where}: variant {data['variant']!r} is not one of {', '.join(VARIANTS)}"
            )
        if not isinstance(data["options"], dict):
            raise ModelError(f"{where}: options is not an object of compile properties")
        return cls("openvino", data["variant"], check_properties(data["options"], where), version)


def config_path(xml: str | os.PathLike[str]) -> Path:
    """The compile config's file for the IR `xml` (name.xml -> name.ovconfig.json)."""
    p = Path(xml)
    return p.with_name(p.stem + CONFIG_SUFFIX)


def is_artifact(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names an OpenVINO IR (by its suffix)."""
    return Path(path).suffix.lower() == ".xml"


def read_config(xml: str | os.PathLike[str]) -> CompileConfig:
    """The checked compile config beside `xml`; ModelError naming the file otherwise
    (a missing file too: an IR without its config was never measured as it is)."""
    path = config_path(xml)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelError(
            f"{path}: cannot read the compile config of {os.fspath(xml)} ({exc.strerror or exc}); "
            "keep it beside the .xml as `aoe tune` wrote it"
        ) from None
    if len(text) > 64 * 1024:
        raise ModelError(f"{path}: {len(text)} bytes, too large for a compile config")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ModelError(f"{path}: not JSON ({exc})") from None
    return CompileConfig.checked(data, str(path))


def write_config(xml: str | os.PathLike[str], config: CompileConfig) -> Path:
    """Write `config` beside `xml`; returns its path."""
    path = config_path(xml)
    path.write_text(json.dumps(config.to_json(), sort_keys=True) + "\n", encoding="utf-8")
    return path


def open_compiled(model: str | os.PathLike[str], config: CompileConfig) -> Any:
    """`model` (an IR .xml or an ONNX file) compiled with `config` (checked again here):
    an `openvino.CompiledModel`. ModelError when openvino is missing or refuses it."""
    from aoe.ovdevices import quiet

    quiet()
    try:
        import openvino as ov
    except ImportError:
        raise ModelError(
            f"{os.fspath(model)}: runs on OpenVINO, which is not installed here; "
            "pip install 'aoed[openvino]' (or openvino)"
        ) from None
    props = check_properties(config.config)
    try:
        return ov.Core().compile_model(os.fspath(model), config.device, props)
    except Exception as exc:  # openvino raises RuntimeError subclasses with long texts
        raise ModelError(
            f"{os.fspath(model)}: OpenVINO could not compile it: {str(exc).splitlines()[0]}"
        ) from None


@dataclass(frozen=True)
class Port:
    """An input or output as onnxruntime's NodeArg shows it: name, shape, type."""

    name: str
    shape: list[int | str]
    type: str


_TYPES = {
    "f32": "tensor(float)",
    "f16": "tensor(float16)",
    "bf16": "tensor(bfloat16)",
    "f64": "tensor(double)",
    "i64": "tensor(int64)",
    "i32": "tensor(int32)",
    "i8": "tensor(int8)",
    "u8": "tensor(uint8)",
    "boolean": "tensor(bool)",
}


def port_name(p: Any, i: int, kind: str) -> str:
    """The name by which users know OpenVINO's port `p` (the `i`th `kind`: input or
    output): its model's own input or output name. OpenVINO merges the names of tensors
    it folds together (an input with the no-op Reshape after it, an output with the
    Identity before it), and `get_any_name()` may then give the internal one; the
    port's Parameter or Result is still named after the model's own."""
    names = p.get_names()
    if not names:
        return f"{kind}_{i}"
    own = str(p.get_node().get_friendly_name()).rsplit("/sink_port_", 1)[0]
    if own in names:
        return own
    return str(min(names, key=lambda n: (n.startswith("/"), len(n), n)))


def _port(p: Any, i: int, kind: str) -> Port:
    name = port_name(p, i, kind)
    shape: list[int | str] = [
        d.get_length() if d.is_static else f"dim_{k}" for k, d in enumerate(p.get_partial_shape())
    ]
    et = p.get_element_type().get_type_name()
    return Port(name, shape, _TYPES.get(et, f"tensor({et})"))


class OvSession:
    """An OpenVINO artifact opened as `aoe.session` opens an ONNX one (module doc)."""

    def __init__(self, model: str | os.PathLike[str], config: CompileConfig):
        self.compiled = open_compiled(model, config)
        self.config = config
        self._request = self.compiled.create_infer_request()
        self._inputs = [_port(p, i, "input") for i, p in enumerate(self.compiled.inputs)]
        self._outputs = [_port(p, i, "output") for i, p in enumerate(self.compiled.outputs)]

    def get_inputs(self) -> list[Port]:
        return list(self._inputs)

    def get_outputs(self) -> list[Port]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[Any]:
        """The outputs named (all, in order, for None) for `feeds` (by input name), as
        numpy arrays that the next run does not overwrite."""
        import numpy as np

        got = self._request.infer({k: feeds[k] for k in (p.name for p in self._inputs)})
        outs = [np.array(got[p]) for p in self.compiled.outputs]
        if output_names is None:
            return outs
        index = {p.name: i for i, p in enumerate(self._outputs)}
        missing = [n for n in output_names if n not in index]
        if missing:
            raise ValueError(
                f"no output {missing[0]!r} (outputs: {', '.join(p.name for p in self._outputs)})"
            )
        return [outs[index[n]] for n in output_names]

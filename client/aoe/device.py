"""Devices: one value naming what a job measures on, from its options down to the runner.

A device is an ONNX Runtime execution provider, an index and the provider options that
change which implementation runs. `Device.parse("cuda:1")` reads the spelling users
type; `device.provider` names the provider (this module is the one place that maps a
device kind to a provider name); `device.fingerprint()` is what bank keys use, so a
measurement on one device is never applied on another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aoe.errors import OptionError
from aoe.signature import DeviceFingerprint, device_fingerprint

__all__ = ["CPU", "KINDS", "Device"]

# kind -> (execution provider, the onnxruntime distribution that brings it, what it is)
_KINDS = {
    "cpu": ("CPUExecutionProvider", "onnxruntime", "CPU"),
    "cuda": ("CUDAExecutionProvider", "onnxruntime-gpu", "NVIDIA GPU"),
    "tensorrt": ("TensorrtExecutionProvider", "onnxruntime-gpu", "NVIDIA GPU (TensorRT)"),
    "cann": ("CANNExecutionProvider", "onnxruntime-cann", "Ascend NPU"),
}
KINDS = tuple(_KINDS)


@dataclass(frozen=True)
class Device:
    kind: str = "cpu"
    index: int = 0
    #: provider options that change the implementation (sorted pairs: hashable)
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise OptionError(f"device {self.kind!r}: unknown kind (one of {', '.join(_KINDS)})")
        if self.index < 0:
            raise OptionError(f"device {self.kind}:{self.index}: the index must be >= 0")

    @classmethod
    def parse(cls, spec: str, options: Mapping[str, str] | None = None) -> Device:
        """`cpu`, `cuda`, `cuda:1`, `cann:0`, `tensorrt:0`; OptionError when malformed."""
        kind, sep, index = spec.strip().lower().partition(":")
        if sep and not index.isdigit():
            raise OptionError(f"device {spec!r}: expected KIND or KIND:INDEX, e.g. cuda:0")
        opts = tuple(sorted((str(k), str(v)) for k, v in (options or {}).items()))
        return cls(kind, int(index) if sep else 0, opts)

    @property
    def name(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def __str__(self) -> str:
        return self.name

    @property
    def provider(self) -> str:
        """The onnxruntime execution provider that runs this device."""
        return _KINDS[self.kind][0]

    @property
    def distribution(self) -> str:
        """The onnxruntime package that brings the provider."""
        return _KINDS[self.kind][1]

    @property
    def description(self) -> str:
        return f"{_KINDS[self.kind][2]} {self.index}" if self.kind != "cpu" else "CPU"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def provider_options(self) -> dict[str, str]:
        """Options for the provider when a session is created on this device."""
        opts = dict(self.options)
        if not self.is_cpu:
            opts.setdefault("device_id", str(self.index))
        return opts

    def fingerprint(self) -> DeviceFingerprint:
        """What bank keys use: provider, hardware, runtime and the implementation options
        (not the index: identical devices share what was learned)."""
        return device_fingerprint(self.provider, dict(self.options))

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "options": dict(self.options)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Device:
        return cls(data["kind"], int(data.get("index", 0)), tuple(sorted(dict(data.get("options", {})).items())))


CPU = Device()

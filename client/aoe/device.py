"""Devices: one value naming what a job measures on, from its options down to the runner.

A device is an ONNX Runtime execution provider, an index and the provider options that
change which implementation runs. `Device.parse("cuda:1")` reads the spelling users
type; `device.provider` names the provider (this module is the one place that maps a
device kind to a provider name); `device.fingerprint()` is what bank keys use, so a
measurement on one device is never applied on another: for a GPU it covers the GPU's
model, compute capability and the driver, CUDA, cuDNN and TensorRT versions
(aoe.accelerators), never the index, so identical GPUs share what was learned.

On the CPU a device may be a set of cores (`cpu:0-7`, `cpu:8-15`, `cpu:3`): its runner is
pinned to them, and its fingerprint counts them (a decision made on one core is not one
for eight), so identical core sets share what was learned and plain `cpu` keeps the
fingerprint it always had.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from aoe.errors import DeviceError, OptionError

if TYPE_CHECKING:
    from aoe.keys import DeviceFingerprint

__all__ = ["CPU", "KINDS", "Device", "kind_of"]

# kind -> (execution provider, the onnxruntime distribution that brings it, what it is)
_KINDS = {
    "cpu": ("CPUExecutionProvider", "onnxruntime", "CPU"),
    "cuda": ("CUDAExecutionProvider", "onnxruntime-gpu", "NVIDIA GPU"),
    "tensorrt": ("TensorrtExecutionProvider", "onnxruntime-gpu", "NVIDIA GPU (TensorRT)"),
    "cann": ("CANNExecutionProvider", "onnxruntime-cann", "Ascend NPU"),
}
KINDS = tuple(_KINDS)


def kind_of(provider: str) -> str:
    """The device kind an onnxruntime execution provider runs; ValueError if unknown."""
    for kind, (name, _dist, _what) in _KINDS.items():
        if name == provider:
            return kind
    raise ValueError(
        f"unknown execution provider {provider!r} (known: {', '.join(v[0] for v in _KINDS.values())})"
    )


#: kinds that run on an NVIDIA GPU: one physical device under two providers
_NVIDIA = frozenset({"cuda", "tensorrt"})


class Device(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a job measures on; a msgspec Struct, as it crosses into the engine's children
    inside their messages (aoed.engine.messages)."""

    kind: str = "cpu"
    index: int = 0
    #: provider options that change the implementation (sorted pairs: hashable)
    options: tuple[tuple[str, str], ...] = ()
    #: a CPU device's own cores (sorted); empty: the machine's, shared
    cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise OptionError(f"device {self.kind!r}: unknown kind (one of {', '.join(_KINDS)})")
        if self.index < 0:
            raise OptionError(f"device {self.kind}:{self.index}: the index must be >= 0")
        if self.cores and self.kind != "cpu":
            raise OptionError(
                f"device {self.kind}:{self.index}: only a CPU device is a set of cores"
            )

    @classmethod
    def _parse_cores(cls, spec: str, text: str) -> tuple[int, ...]:
        cores: set[int] = set()
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
                raise OptionError(
                    f"device {spec!r}: expected cpu:FIRST-LAST or cpu:N[,M...], e.g. cpu:0-7"
                )
            cores.update(range(int(lo), int(hi if dash else lo) + 1))
        return tuple(sorted(cores))

    @classmethod
    def parse(cls, spec: str, options: Mapping[str, str] | None = None) -> Device:
        """`cpu`, `cpu:0-7` (a set of cores), `cuda`, `cuda:1`, `cann:0`, `tensorrt:0`;
        OptionError when malformed."""
        kind, sep, index = spec.strip().lower().partition(":")
        opts = tuple(sorted((str(k), str(v)) for k, v in (options or {}).items()))
        if kind == "cpu" and sep:
            return cls("cpu", 0, opts, cls._parse_cores(spec, index))
        if sep and not index.isdigit():
            raise OptionError(f"device {spec!r}: expected KIND or KIND:INDEX, e.g. cuda:0")
        return cls(kind, int(index) if sep else 0, opts)

    @property
    def name(self) -> str:
        if self.kind == "cpu":
            return f"cpu:{_spell_cores(self.cores)}" if self.cores else "cpu"
        return f"{self.kind}:{self.index}"

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

    def default_providers(self) -> list[list[Any]]:
        """The providers a session on this device names (aoe.sessionopts's `providers`),
        before any is tuned: its own with the device's options; a TensorRT device falls
        back to CUDA for what TensorRT does not build (onnxruntime's own arrangement);
        the CPU names none (it always comes last)."""
        if self.is_cpu:
            return []
        own = [self.provider, {k: v for k, v in self.options if k != "device_id"}]
        return [own, [_KINDS["cuda"][0], {}]] if self.kind == "tensorrt" else [own]

    def provider_options(self) -> dict[str, str]:
        """Options for the provider when a session is created on this device."""
        opts = dict(self.options)
        if not self.is_cpu:
            opts.setdefault("device_id", str(self.index))
        return opts

    @property
    def lock_name(self) -> str:
        """The name of the physical device, for its machine-wide lock: `cuda:0` and
        `tensorrt:0` are one GPU, and must never measure at once."""
        return f"gpu:{self.index}" if self.kind in _NVIDIA else self.name

    def accelerator(self) -> dict[str, str]:
        """What the fingerprint says of the hardware under the provider: {} for the CPU;
        for an NVIDIA GPU its model, compute capability, driver, and the CUDA, cuDNN and
        TensorRT versions ("" where unknown). Raises DeviceError when this machine has no
        such GPU."""
        if self.kind == "cpu":
            return {}
        from aoe.accelerators import discover, runtime_versions

        versions = runtime_versions()
        if self.kind == "cann":
            # No NPU discovery yet (it needs an Ascend machine to be checked on): the
            # package still tells onnxruntime-cann builds apart.
            return {"model": "Ascend NPU", "package": versions["package"]}
        found = discover()
        gpu = found.gpu(self.physical_index())
        if gpu is None:
            have = ", ".join(f"{g.index}: {g.name}" for g in found.gpus) or found.note or "none"
            raise DeviceError(
                f"{self.name} ({self.description}): this machine has no such NVIDIA GPU (GPUs: "
                f"{have}); see `aoe devices --local`"
            )
        return {
            "model": gpu.name,
            "compute_capability": gpu.compute_capability,
            "driver": gpu.driver_version,
            "cuda": versions["cuda"],
            "cudnn": versions["cudnn"],
            "tensorrt": versions["tensorrt"],
        }

    def physical_index(self) -> int:
        """nvidia-smi's index of this device. CUDA numbers the GPUs CUDA_VISIBLE_DEVICES
        lets it see, in that list's order (indices or GPU-UUIDs); set CUDA_DEVICE_ORDER=
        PCI_BUS_ID where several GPUs differ, so that CUDA counts as nvidia-smi does."""
        visible = [
            v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
        ]
        if not visible or self.kind not in _NVIDIA:
            return self.index
        if self.index >= len(visible):
            raise DeviceError(
                f"{self.name}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)} GPU(s)"
            )
        entry = visible[self.index]
        if entry.isdigit():
            return int(entry)
        from aoe.accelerators import discover

        for gpu in discover().gpus:
            if gpu.uuid and gpu.uuid.startswith(entry):
                return gpu.index
        raise DeviceError(
            f"{self.name}: CUDA_VISIBLE_DEVICES names {entry!r}, which nvidia-smi does not list"
        )

    def fingerprint(self) -> DeviceFingerprint:
        """What bank keys use: provider, hardware, runtime and the implementation options
        (not the index: identical devices share what was learned). Raises DeviceError
        for a GPU this machine does not have."""
        # Imported here: aoe.fingerprint asks this module for the CPU's provider.
        from aoe.fingerprint import device_fingerprint

        options = dict(self.options)
        if self.cores:
            options["cores"] = str(len(self.cores))
        return device_fingerprint(self.provider, options, self.accelerator())

    def overlaps(self, other: Device) -> bool:
        """Whether the two share hardware: one GPU under two providers, or CPU core sets
        with a core in common (plain `cpu` is every core)."""
        if self.is_cpu and other.is_cpu:
            return not self.cores or not other.cores or bool(set(self.cores) & set(other.cores))
        return self.lock_name == other.lock_name


def _spell_cores(cores: tuple[int, ...]) -> str:
    """`0-3,6`: runs of cores as FIRST-LAST."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


CPU = Device()

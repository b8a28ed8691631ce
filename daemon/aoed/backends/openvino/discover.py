"""What OpenVINO offers on this machine: whether it is installed, its devices, and what
its CPU plugin can compute in (OPTIMIZATION_CAPABILITIES: BF16 where the CPU has AMX or
AVX512-BF16, FP16, INT8).

`find` never raises: a machine without openvino, or one whose openvino fails to load,
gets an `Offer` that says why, so `--runtime auto` goes on with onnxruntime alone and
the report says so once.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

__all__ = ["Offer", "find", "installed"]


@dataclass(frozen=True)
class Offer:
    """OpenVINO here: its version, its devices, the CPU's capabilities; `why_not` is
    set (and the rest empty) when it cannot be used."""

    version: str = ""
    devices: tuple[str, ...] = ()
    capabilities: frozenset[str] = field(default_factory=frozenset)
    cpu_name: str = ""
    why_not: str = ""

    @property
    def usable(self) -> bool:
        return not self.why_not and "CPU" in self.devices

    def has(self, capability: str) -> bool:
        """Whether the CPU plugin computes in `capability` (BF16, FP16, INT8)."""
        return capability in self.capabilities

    def to_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "devices": list(self.devices),
            "capabilities": sorted(self.capabilities),
            "cpu": self.cpu_name,
            "why_not": self.why_not,
        }


def installed() -> bool:
    """Whether openvino can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("openvino") is not None
    except (ImportError, ValueError):
        return False


def find() -> Offer:
    """OpenVINO on this machine (module doc); imports openvino when it is installed."""
    if not installed():
        return Offer(why_not="openvino is not installed (pip install 'aoed[openvino]')")
    try:
        import openvino as ov

        core = ov.Core()
        devices = tuple(core.available_devices)
        caps: frozenset[str] = frozenset()
        name = ""
        if "CPU" in devices:
            caps = frozenset(str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
            name = str(core.get_property("CPU", "FULL_DEVICE_NAME"))
        version = str(ov.get_version()).split("-")[0]
    except Exception as exc:  # a broken install: said, never fatal
        return Offer(why_not=f"openvino failed to load: {str(exc).splitlines()[0]}")
    if "CPU" not in devices:
        return Offer(version, devices, caps, name, why_not="openvino offers no CPU device here")
    return Offer(version, devices, caps, name)

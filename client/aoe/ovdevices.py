"""What OpenVINO offers on this machine: whether it is installed, its version, and its
devices (CPU, GPU.0, NPU, ...), each with its FULL_DEVICE_NAME and what it computes in
(OPTIMIZATION_CAPABILITIES: BF16 where the CPU has AMX or AVX512-BF16, FP16, INT8, ...).

One discovery for every side: `aoe devices --local` lists it, the daemon's device
listing names it on its CPU device, and the engine's OpenVINO builds
(aoed.backends.openvino) read the CPU's capabilities from it.

aoe tunes on OpenVINO's CPU device only (`TUNED`): a job on the cpu device compares
OpenVINO's builds of its model with onnxruntime's. The other devices OpenVINO lists are
reported as it lists them, not tuned on.

`find` never raises: a machine without openvino, or one whose openvino fails to load,
gets an `Offer` that says why, so `--runtime auto` goes on with onnxruntime alone and
the report says so once. It imports openvino (inside the function, and only where it is
installed), after `quiet()`. A process that must never fork (the daemon, once gRPC has
started) does not import openvino at all: it runs this module, `python -m
aoe.ovdevices`, which prints the offer as one JSON object (`to_plain`), and reads it
back with `from_plain(Offer, ...)`.

`quiet()` comes before every import of openvino or nncf in aoe and aoed. Without it,
openvino 2026.4 sends a usage event on import (openvino.tools.ovc, through
openvino_telemetry) from a process it forks from a thread, and writes a consent folder
in the user's home, unless that user opted out; nncf sends its own. Both fall back to a
stub of their own where openvino_telemetry cannot be imported, which `quiet()` arranges
for this process.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from aoe.plain import to_plain

__all__ = ["TUNED", "Offer", "OvDevice", "find", "installed", "installed_version", "main", "quiet"]

#: The OpenVINO device aoe tunes and ships on (aoed.engine.runtimestage: a CPU job only).
TUNED = "CPU"


@dataclass(frozen=True)
class OvDevice:
    """One device as OpenVINO lists it: its name (`CPU`, `GPU.0`, `NPU`), its
    FULL_DEVICE_NAME and its OPTIMIZATION_CAPABILITIES ("" and empty where the plugin
    does not say)."""

    name: str
    full_name: str = ""
    capabilities: frozenset[str] = field(default_factory=frozenset)

    @property
    def tuned(self) -> bool:
        """Whether aoe tunes on it (`TUNED`)."""
        return self.name == TUNED

    def describe(self) -> str:
        """One line for people: the hardware, what it computes in, and whether aoe
        tunes on it."""
        caps = f" ({', '.join(sorted(self.capabilities))})" if self.capabilities else ""
        use = (
            "competes with onnxruntime in jobs on the cpu device"
            if self.tuned
            else f"aoe does not tune on OpenVINO's {self.name.split('.')[0]} yet"
        )
        return f"{self.full_name or self.name}{caps}; {use}"


@dataclass(frozen=True)
class Offer:
    """OpenVINO here: its version and its devices; `why_not` is set when it cannot be
    used (empty `hardware` where it did not load at all)."""

    version: str = ""
    hardware: tuple[OvDevice, ...] = ()
    why_not: str = ""

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices' names, in OpenVINO's order."""
        return tuple(d.name for d in self.hardware)

    def device(self, name: str) -> OvDevice | None:
        return next((d for d in self.hardware if d.name == name), None)

    @property
    def capabilities(self) -> frozenset[str]:
        """What the CPU plugin computes in (empty without a CPU)."""
        cpu = self.device(TUNED)
        return cpu.capabilities if cpu is not None else frozenset()

    @property
    def cpu_name(self) -> str:
        cpu = self.device(TUNED)
        return cpu.full_name if cpu is not None else ""

    @property
    def usable(self) -> bool:
        return not self.why_not and TUNED in self.devices

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


def installed_version() -> str | None:
    """The version of the openvino distribution installed here, as its metadata says
    (nothing imported); None where there is none."""
    import importlib.metadata

    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return None


def quiet() -> None:
    """Keep openvino and nncf, imported after this, from sending usage telemetry from
    this process or writing in the user's home (module doc): `import openvino_telemetry`
    fails here from now on, so each takes its own stub."""
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _described(core: Any, name: str) -> OvDevice:
    """`name` with its full name and capabilities. The CPU's must be readable (they
    decide the builds: an error goes up); another device's unreadable property is left
    empty, since it only describes that device."""
    try:
        full = str(core.get_property(name, "FULL_DEVICE_NAME"))
        caps = frozenset(str(c) for c in core.get_property(name, "OPTIMIZATION_CAPABILITIES"))
    except Exception:
        if name == TUNED:
            raise
        return OvDevice(name)
    return OvDevice(name, full, caps)


@functools.lru_cache(maxsize=1)
def find() -> Offer:
    """OpenVINO on this machine (module doc), found once per process; imports openvino
    when it is installed. Never raises."""
    if not installed():
        return Offer(why_not="openvino is not installed (pip install 'aoed[openvino]')")
    quiet()
    try:
        import openvino as ov

        core = ov.Core()
        hardware = tuple(_described(core, str(d)) for d in core.available_devices)
        version = str(ov.get_version()).split("-")[0]
    except Exception as exc:  # a broken install: said, never fatal
        return Offer(why_not=f"openvino failed to load: {_first_line(exc)}")
    if TUNED not in (d.name for d in hardware):
        return Offer(version, hardware, why_not="openvino offers no CPU device here")
    return Offer(version, hardware)


def main() -> None:
    """`python -m aoe.ovdevices`: this machine's offer as one line of JSON."""
    print(json.dumps(to_plain(find())))


if __name__ == "__main__":
    main()

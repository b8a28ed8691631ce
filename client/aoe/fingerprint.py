"""Device fingerprints: what a measurement was made on, the device half of a bank key.

A fingerprint names the execution provider and its options, the CPU model and ISA flags
(or, for a GPU or NPU, its model, compute capability and driver and library versions:
`aoe.accelerators`), and the runtime version. Its digest is part of every bank key, so
a decision measured on one device is never served on another (`aoe.signature` makes the
task half).

Light: the standard library and `aoe.keys` only (no onnx, no onnxruntime, whose version
is read from the installed distribution's metadata), so a compiler or a training script
computes the fingerprint a daemon would. Fingerprints are cached per process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
from collections.abc import Mapping

from aoe.keys import DeviceFingerprint, canonical_json, digest

__all__ = ["cpu_model_and_flags", "device_fingerprint"]

# ISA features that change which kernels a runtime picks on x86 and Arm CPUs.
_ISA_FLAGS = frozenset(
    {
        "sse4_1",
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512dq",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "avx_vnni",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
        "asimd",
        "asimddp",
        "sve",
        "sve2",
        "i8mm",
        "bf16",
    }
)


def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """This machine's CPU model (as /proc/cpuinfo names it, else `platform`'s) and the ISA
    flags among _ISA_FLAGS it has, sorted ("unknown" and () where nothing says).
    `platform.processor()` is not asked: on Linux it runs `uname -p` in a child, which a
    daemon would start with its own environment (the service manager's variables too)."""
    model = platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and model in (
                    "",
                    platform.machine(),
                ):
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or "unknown", tuple(sorted(flags & _ISA_FLAGS))


def _runtime_version() -> str:
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        for dist in ("onnxruntime-gpu", "onnxruntime-cann", "onnxruntime-openvino"):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return "unknown"


@functools.lru_cache(maxsize=16)
def _fingerprint(
    execution_provider: str, options_json: str, accelerator_json: str = "{}", runtime: str = ""
) -> DeviceFingerprint:
    options = json.loads(options_json)
    accelerator = json.loads(accelerator_json)
    flags: tuple[str, ...]
    if accelerator:
        # An accelerator's kernels are the GPU's (or NPU's) and its libraries', not the
        # host CPU's: identical GPUs on different hosts share what was learned.
        hardware, flags = str(accelerator.get("model", "unknown")), ()
    else:
        hardware, flags = cpu_model_and_flags()
    runtime = runtime or _runtime_version()
    desc: dict[str, object] = {
        "ep": execution_provider,
        "hardware": hardware,
        "isa": list(flags),
        "runtime": runtime,
        "options": options,
    }
    # Only where there is one: the CPU's description (and so every existing bank key) is
    # exactly what it was before accelerators were described.
    if accelerator:
        desc["accelerator"] = accelerator
    text = canonical_json(desc)
    return DeviceFingerprint(
        execution_provider=execution_provider,
        hardware=hardware,
        isa_flags=flags,
        runtime_version=runtime,
        options=options,
        canonical_json=text,
        digest=digest(text),
        accelerator=accelerator,
    )


def device_fingerprint(
    execution_provider: str | None = None,
    options: Mapping[str, str] | None = None,
    accelerator: Mapping[str, str] | None = None,
    *,
    runtime_version: str | None = None,
) -> DeviceFingerprint:
    """Return the fingerprint of this machine's `execution_provider` (default: the CPU's;
    cached per process).

    `options` are the provider options that change which implementation runs (for CPU:
    none), so a change to them changes the digest. `accelerator` describes the GPU or NPU
    the provider runs on (model, compute capability, driver and library versions: see
    aoe.accelerators); every one of its values is part of the digest, so a decision made
    on one GPU model or library version is never served on another. Without one, the
    hardware is this machine's CPU model and ISA flags.

    `runtime_version` is the onnxruntime release the decisions are for (default: the
    installed one's, "unknown" where none is): a compiler that reads the bank without
    onnxruntime installed (aoed-client alone) names the release its models will run on.
    """
    if execution_provider is None:
        from aoe.device import CPU  # aoe.device maps device kinds to providers; it imports us

        execution_provider = CPU.provider
    return _fingerprint(
        execution_provider,
        canonical_json(dict(options or {})),
        canonical_json({str(k): str(v) for k, v in (accelerator or {}).items()}),
        runtime_version or "",
    )

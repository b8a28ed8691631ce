"""Gradient-layout signatures and torch host fingerprints: the bank keys of GDAT records.

What decides how a data-parallel step's gradients can be grouped and reduced is the list
of gradients DDP reduces (the shapes and dtypes of the parameters that require a
gradient, in registration order: DDP buckets them in that order, reversed), the size of
the world and the collective backend. That is a *gradient layout*; its signature is the
`TaskSignature` of a GDAT record (op type `DistributedDataParallel`, domain `aoe.gdat`),
so GDAT records live in the same bank, under the same key layout, with the same layers,
export, import and provenance as operator records. Parameter names and values are left
out: the same network in two scripts has one layout.

The measurement was made on a *torch host*: its fingerprint names the collective
provider (`torch.distributed`), the backend, the hardware (the CPU model and ISA flags,
or the accelerator's name) and the torch version, so a record is applied only where all
of them match.

Pure functions of plain values: this module imports neither torch nor trio, so the
training-side helper (`aoe.gdat`) and the daemon compute the same keys.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aoe.errors import OptionError
from aoe.fingerprint import cpu_model_and_flags
from aoe.keys import DeviceFingerprint, TaskSignature, bank_key, canonical_json
from aoe.keys import digest as _digest

__all__ = [
    "BACKENDS",
    "GDAT_PROVIDER",
    "LAYOUT_DOMAIN",
    "LAYOUT_OP",
    "PRECISIONS",
    "GradientLayout",
    "bucket_sizes",
    "gdat_key",
    "host_fingerprint",
    "parse_backend",
    "parse_precision",
    "torch_version",
]

#: The execution provider field of a GDAT record's device fingerprint.
GDAT_PROVIDER = "torch.distributed"
#: op type and domain of a gradient layout's signature.
LAYOUT_OP = "DistributedDataParallel"
LAYOUT_DOMAIN = "aoe.gdat"
#: Version of the layout's canonical form (the signature's "opset").
LAYOUT_VERSION = 1

#: Collective backends, and the device kind (as aoe.device spells it) each rank uses.
BACKENDS = {"gloo": "cpu", "nccl": "cuda", "hccl": "cann"}
#: Gradient precision policies, least lossy first: a policy allows the compression
#: hooks of its own class and of every class before it, each behind its own gate.
PRECISIONS = ("exact", "fp16", "bf16", "lowrank")

_ELEMENT_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def parse_backend(raw: str, where: str = "--backend") -> str:
    """A backend name (gloo, nccl, hccl); OptionError otherwise."""
    name = str(raw).strip().lower()
    if name not in BACKENDS:
        raise OptionError(f"{where} {raw}: expected one of {', '.join(BACKENDS)}")
    return name


def parse_precision(raw: str, where: str = "--gradient-precision") -> str:
    """A gradient precision policy (exact, fp16, bf16, lowrank); OptionError otherwise."""
    name = str(raw).strip().lower()
    if name not in PRECISIONS:
        raise OptionError(f"{where} {raw}: expected one of {', '.join(PRECISIONS)}")
    return name


@dataclass(frozen=True)
class GradientLayout:
    """The gradients one rank reduces: (dtype, shape) per parameter that requires a
    gradient, in registration order; with the world size and backend of the world."""

    params: tuple[tuple[str, tuple[int, ...]], ...]
    world_size: int
    backend: str

    @classmethod
    def of(
        cls, params: Iterable[tuple[str, Sequence[int]]], world_size: int, backend: str
    ) -> GradientLayout:
        """From (dtype, shape) pairs; torch dtypes may keep their `torch.` prefix."""
        norm = tuple(
            (str(d).removeprefix("torch."), tuple(int(s) for s in shape)) for d, shape in params
        )
        return cls(norm, int(world_size), backend)

    def sizes_bytes(self) -> list[int]:
        """Bytes of each gradient, in registration order."""
        out = []
        for dtype, shape in self.params:
            n = 1
            for s in shape:
                n *= s
            out.append(n * _ELEMENT_BYTES.get(dtype, 4))
        return out

    @property
    def grad_bytes(self) -> int:
        return sum(self.sizes_bytes())

    def canonical(self) -> str:
        return canonical_json(
            {
                "kind": "gdat",
                "version": LAYOUT_VERSION,
                "world_size": self.world_size,
                "backend": self.backend,
                "params": [[d, list(s)] for d, s in self.params],
            }
        )

    def signature(self) -> TaskSignature:
        text = self.canonical()
        return TaskSignature(LAYOUT_OP, LAYOUT_DOMAIN, LAYOUT_VERSION, text, _digest(text))


def torch_version() -> str:
    """The installed torch's version, read without importing torch ("" when absent)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=16)
def _host(backend: str, accelerator: str, version: str) -> DeviceFingerprint:
    hardware, flags = cpu_model_and_flags()
    hardware = accelerator or hardware
    options = {"backend": backend, "device": BACKENDS.get(backend, "cpu")}
    desc = {
        "ep": GDAT_PROVIDER,
        "hardware": hardware,
        "isa": list(flags),
        "runtime": version,
        "options": options,
    }
    text = canonical_json(desc)
    return DeviceFingerprint(GDAT_PROVIDER, hardware, flags, version, options, text, _digest(text))


def host_fingerprint(
    backend: str, accelerator: str = "", version: str | None = None
) -> DeviceFingerprint:
    """The fingerprint of this machine as a GDAT world of `backend` runs on it: the
    accelerator's name (`accelerator`, e.g. the GPU model; empty on CPU worlds) or the
    CPU model, the CPU's ISA flags and the torch version (default: the installed one)."""
    return _host(backend, accelerator, torch_version() if version is None else version)


def gdat_key(layout: GradientLayout, host: DeviceFingerprint, precision: str) -> bytes:
    """The bank key of a gradient layout on a torch host under a gradient precision."""
    return bank_key(layout.signature().digest, host.digest, precision)


def bucket_sizes(
    sizes: Sequence[int], cap_bytes: int, first_bytes: int | None = None
) -> tuple[int, ...]:
    """The byte sizes of the buckets DDP forms from gradients of `sizes` (registration
    order) with a bucket cap and a first-bucket cap, as its C++ reducer does when it
    rebuilds buckets after the first step: gradients in the order they become ready
    (about the reverse of registration), a bucket closed once it reaches its limit.
    Two configurations with the same buckets are one configuration to measure."""
    limits = [first_bytes if first_bytes is not None else cap_bytes, cap_bytes]
    out: list[int] = []
    current, which = 0, 0
    for size in reversed(sizes):
        current += size
        if current >= limits[min(which, 1)]:
            out.append(current)
            current, which = 0, which + 1
    if current:
        out.append(current)
    return tuple(out)

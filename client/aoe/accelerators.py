"""Accelerators on this machine: the GPUs onnxruntime's CUDA and TensorRT providers can
run on, and the versions of the libraries under them.

Nothing here needs CUDA to import or to run; each source answers when it is there:

- the GPUs: `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`. It ships with the
  driver wherever a GPU is usable and reads the same NVML data nvidia-ml-py would, so it
  costs no dependency; a machine without it has no GPU to offer.
- onnxruntime's build info (`onnxruntime/capi/build_and_package_info.py`), read as data
  and never imported: the package (onnxruntime, onnxruntime-gpu, onnxruntime-cann), its
  version, and the CUDA (and cuDNN, where the build says) it was built against.
- the installed CUDA, cuDNN and TensorRT wheels (nvidia-cuda-runtime*, nvidia-cudnn-*,
  tensorrt*): what onnxruntime-gpu loads when they are on the path.

`accelerator_facts(device)` is what a device fingerprint covers (see aoe.fingerprint): the
GPU model, its compute capability and the driver, CUDA, cuDNN and TensorRT versions.
"""

from __future__ import annotations

import ast
import csv
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from aoe.device import Device
from aoe.errors import DeviceError

__all__ = [
    "GPU_QUERY",
    "Discovery",
    "GpuInfo",
    "LocalDevice",
    "discover",
    "local_devices",
    "parse_build_info",
    "parse_gpus",
    "runtime_versions",
]

#: The fields asked of nvidia-smi, in the order its CSV answers them.
GPU_QUERY = ("index", "name", "compute_cap", "memory.total", "driver_version", "uuid", "pci.bus_id")

#: How nvidia-smi spells a field it has no value for.
_NO_VALUE = frozenset(
    {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "[Insufficient Permissions]"}
)

#: Seconds nvidia-smi may take: it answers in tens of milliseconds, but a driver that is
#: being reset can hold it much longer, and discovery must not hang a command.
_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as nvidia-smi describes it ("" where it has no value)."""

    index: int
    name: str
    compute_capability: str
    memory_mib: int
    driver_version: str
    uuid: str = ""
    pci_bus_id: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Discovery:
    """The GPUs found, and why there are none when there are none."""

    gpus: tuple[GpuInfo, ...]
    #: why `gpus` is empty (or what was only partly read); "" when all went well
    note: str = ""

    def gpu(self, index: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.index == index), None)


def _value(text: str) -> str:
    text = text.strip()
    return "" if text in _NO_VALUE else text


def parse_gpus(text: str, fields: tuple[str, ...] = GPU_QUERY) -> list[GpuInfo]:
    """The GPUs in nvidia-smi's answer to `--query-gpu=<fields> --format=csv,noheader,nounits`.

    Each line is one GPU, its values in the order of `fields`, separated by ", ".
    Raises ValueError naming the line when one has another number of values, or an
    index or memory size that is not a number."""
    gpus = []
    for n, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), 1):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(fields):
            raise ValueError(
                f"nvidia-smi line {n}: {len(row)} values for {len(fields)} fields "
                f"({', '.join(fields)}): {', '.join(row)!r}"
            )
        values = dict(zip(fields, (_value(v) for v in row), strict=True))
        try:
            index = int(values["index"])
            memory = int(float(values.get("memory.total") or 0))
        except ValueError:
            raise ValueError(
                f"nvidia-smi line {n}: index {values['index']!r} or memory "
                f"{values.get('memory.total')!r} is not a number"
            ) from None
        gpus.append(
            GpuInfo(
                index=index,
                name=values.get("name", ""),
                compute_capability=values.get("compute_cap", ""),
                memory_mib=memory,
                driver_version=values.get("driver_version", ""),
                uuid=values.get("uuid", ""),
                pci_bus_id=values.get("pci.bus_id", ""),
            )
        )
    return gpus


def _smi(fields: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("nvidia-smi")
    assert exe is not None
    return subprocess.run(
        [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=_SMI_TIMEOUT_S,
        check=False,
    )


@functools.lru_cache(maxsize=1)
def discover() -> Discovery:
    """The NVIDIA GPUs of this machine, as nvidia-smi lists them (cached per process).

    Never raises: a machine without nvidia-smi, or whose driver does not answer, has no
    GPUs, and `note` says why."""
    if shutil.which("nvidia-smi") is None:
        return Discovery((), "no nvidia-smi on PATH (no NVIDIA driver installed)")
    fields: tuple[str, ...] = GPU_QUERY
    try:
        r = _smi(fields)
        if r.returncode != 0 and "compute_cap" in r.stdout + r.stderr:
            # Drivers before 510 do not know the field: ask again without it.
            fields = tuple(f for f in GPU_QUERY if f != "compute_cap")
            r = _smi(fields)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Discovery((), f"nvidia-smi did not answer: {exc}")
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return Discovery(
            (), f"nvidia-smi failed (exit {r.returncode}): {why[0] if why else 'no message'}"
        )
    try:
        gpus = parse_gpus(r.stdout, fields)
    except ValueError as exc:
        return Discovery((), str(exc))
    note = (
        "" if fields == GPU_QUERY else "this driver's nvidia-smi does not report compute capability"
    )
    return Discovery(tuple(gpus), note)


def parse_build_info(text: str) -> dict[str, str]:
    """The `name = 'value'` assignments of onnxruntime's build_and_package_info.py, as
    strings; anything else in the file is ignored (it is read, never run)."""
    out: dict[str, str] = {}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, (str, int, float))
        ):
            out[node.targets[0].id] = str(node.value.value)
    return out


def _build_info() -> dict[str, str]:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return {}
    for root in spec.submodule_search_locations:
        path = Path(root) / "capi" / "build_and_package_info.py"
        try:
            return parse_build_info(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return {}


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


@functools.lru_cache(maxsize=1)
def runtime_versions() -> dict[str, str]:
    """What this process's onnxruntime is and runs on (cached per process): `onnxruntime`
    (version), `package` (the distribution: onnxruntime, onnxruntime-gpu, ...), and where
    known `cuda`, `cudnn` and `tensorrt` ("" where unknown or absent)."""
    info = _build_info()
    package = info.get("package_name", "")
    version = info.get("__version__", "") or _dist_version(
        package or "onnxruntime", "onnxruntime-gpu"
    )
    return {
        "onnxruntime": version,
        "package": package,
        # The build's own word first: it is what the provider library was linked against.
        "cuda": info.get("cuda_version", "")
        or _dist_version(
            "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12"
        ),
        "cudnn": info.get("cudnn_version", "")
        or _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
        "tensorrt": _dist_version(
            "tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-libs", "tensorrt-cu12-libs"
        ),
    }


@dataclass(frozen=True)
class LocalDevice:
    """A device this machine offers onnxruntime: the CPU, or a provider on a GPU."""

    device: Device
    #: the GPU under it (None: the CPU, or an NPU not discovered)
    gpu: GpuInfo | None = None
    #: why this onnxruntime cannot run it ("" when it can)
    unusable: str = ""

    def describe(self, cores: int | None = None) -> str:
        """One line for people: the hardware (a CPU's `cores`, default: those this
        process may run on), its memory and the library versions."""
        v = runtime_versions()
        runtime = f"{v['package'] or 'onnxruntime'} {v['onnxruntime']}"
        if self.gpu is None:
            if self.device.is_cpu:
                from aoe.fingerprint import device_fingerprint

                cores = cores or len(os.sched_getaffinity(0))
                return f"{device_fingerprint().hardware} ({cores} cores), {runtime}"
            return f"{self.device.description}, {runtime}"
        g = self.gpu
        libs = [f"driver {g.driver_version or '?'}"]
        libs += [
            f"{name} {v[key]}"
            for key, name in (("cuda", "CUDA"), ("cudnn", "cuDNN"), ("tensorrt", "TensorRT"))
            if v[key]
        ]
        cc = f"compute {g.compute_capability}, " if g.compute_capability else ""
        return f"{g.name} ({cc}{g.memory_mib} MiB), {', '.join(libs)}, {runtime}"


def _providers() -> tuple[str, ...]:
    import onnxruntime as ort

    return tuple(ort.get_available_providers())


def local_devices(providers: tuple[str, ...] | None = None) -> list[LocalDevice]:
    """Every device this machine offers: the CPU, then per GPU nvidia-smi lists (those
    CUDA_VISIBLE_DEVICES shows, numbered as CUDA numbers them) one `cuda:N` and one
    `tensorrt:N`, then `cann:0` where onnxruntime has the CANN provider. `providers`
    (default: onnxruntime's available providers) decides which are usable."""
    from aoe.device import CPU

    providers = _providers() if providers is None else providers
    out = [LocalDevice(CPU)]
    found = discover()
    count = len(found.gpus)
    for n in range(count):
        for kind in ("cuda", "tensorrt"):
            dev = Device(kind, n)
            try:
                gpu = found.gpu(dev.physical_index())
            except DeviceError:  # CUDA_VISIBLE_DEVICES shows fewer
                break
            if gpu is None:
                break
            why = (
                ""
                if dev.provider in providers
                else (f"this onnxruntime has no {dev.provider}; install {dev.distribution}")
            )
            out.append(LocalDevice(dev, gpu, why))
    if (npu := Device("cann", 0)).provider in providers:
        out.append(LocalDevice(npu))
    return out

"""onnxruntime sessions on a device: the one place a session meets a provider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aoe.device import CPU, Device
from aoe.errors import DeviceError

__all__ = ["check_device", "providers_for", "session"]


def check_device(device: Device) -> tuple[str, ...]:
    """The providers this onnxruntime offers; DeviceError when `device`'s is missing."""
    import onnxruntime as ort

    available = tuple(ort.get_available_providers())
    if device.provider not in available:
        raise DeviceError(
            f"{device.name} ({device.description}) needs onnxruntime's {device.provider}, which this "
            f"onnxruntime {ort.__version__} does not have (it has {', '.join(available)}); install "
            f"{device.distribution}, or choose another device (e.g. --device cpu)"
        )
    return available


def providers_for(options: dict[str, Any] | None, device: Device = CPU) -> list[Any]:
    """The providers a session on `device` gets: those `options` name (with theirs; the
    device's own options under its own provider), else the device's provider; then the
    CPU. DeviceError when this onnxruntime lacks one of them (onnxruntime itself would
    only warn, and run the model on the CPU)."""
    import onnxruntime as ort

    from aoe._session import session_providers

    if options and options.get("providers"):
        providers = session_providers(options, device.index)
        providers = [(n, {**dict(device.options), **o} if n == device.provider else o) for n, o in providers]
    elif device.is_cpu:
        return [CPU.provider]
    else:
        providers = [(device.provider, device.provider_options()), (CPU.provider, {})]
    available = ort.get_available_providers()
    for name, _ in providers:
        if name not in available:
            raise DeviceError(f"{device.name}: a candidate runs on {name}, which this onnxruntime {ort.__version__} "
                              f"does not have (it has {', '.join(available)})")  # fmt: skip
    return providers


def session(model: str | Path | bytes, options: dict[str, Any] | None = None, device: Device = CPU):
    """An InferenceSession for `model` (a path or serialized bytes) on `device`, with the
    session options as data (see aoe._session), their providers first; CPU serves what
    the device cannot. DeviceError for a provider this onnxruntime lacks."""
    import onnxruntime as ort

    from aoe._session import make_session_options

    data = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(data, make_session_options(options), providers=providers_for(options, device))

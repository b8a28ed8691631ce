"""onnxruntime sessions on a device: the one place a session meets a provider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aoe.device import CPU, Device
from aoe.errors import DeviceError

__all__ = ["check_device", "session"]


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


def session(model: str | Path | bytes, options: dict[str, Any] | None = None, device: Device = CPU):
    """An InferenceSession for `model` (a path or serialized bytes) on `device`, with the
    session options as data (see aoe._session); CPU serves what the device cannot."""
    import onnxruntime as ort

    from aoe._session import make_session_options

    providers: list[Any] = [(device.provider, device.provider_options())] if not device.is_cpu else []
    providers.append(CPU.provider)
    data = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(data, make_session_options(options), providers=providers)

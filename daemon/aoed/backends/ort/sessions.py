"""onnxruntime sessions on a device: the one place a session meets a provider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aoe.device import CPU, Device
from aoe.errors import DeviceError

__all__ = ["BoundRun", "check_device", "providers_for", "session"]


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


def providers_for(
    options: dict[str, Any] | None,
    device: Device = CPU,
    files: dict[str, dict[str, str]] | None = None,
) -> list[Any]:
    """The providers a session on `device` gets: those `options` name (with theirs; the
    device's own options under its own provider), else the device's provider; then the
    CPU. `files`: the engine's own provider options that name files (never from
    `options`, see aoe.sessionopts.session_providers). DeviceError when this onnxruntime
    lacks one of them (onnxruntime itself would only warn, and run the model on the CPU)."""
    import onnxruntime as ort

    from aoe.sessionopts import session_providers

    if not (options and options.get("providers")) and not device.is_cpu:
        options = {**(options or {}), "providers": [[device.provider, {}]]}
    if options and options.get("providers"):
        providers = session_providers(options, device.index, files)
        providers = [
            (n, {**dict(device.options), **o} if n == device.provider else o) for n, o in providers
        ]
    else:
        return [CPU.provider]
    available = ort.get_available_providers()
    for name, _ in providers:
        if name not in available:
            raise DeviceError(
                f"{device.name}: a candidate runs on {name}, which this onnxruntime {ort.__version__} "
                f"does not have (it has {', '.join(available)})"
            )
    return providers


def session(
    model: str | Path | bytes,
    options: dict[str, Any] | None = None,
    device: Device = CPU,
    files: dict[str, dict[str, str]] | None = None,
):
    """An InferenceSession for `model` (a path or serialized bytes) on `device`, with the
    session options as data (see aoe.sessionopts), their providers first; CPU serves what
    the device cannot; `files` as for `providers_for`. DeviceError for a provider this
    onnxruntime lacks."""
    import onnxruntime as ort

    from aoe.sessionopts import make_session_options

    data = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(
        data, make_session_options(options), providers=providers_for(options, device, files)
    )


#: device kind -> where onnxruntime places an OrtValue for it
_MEMORY = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda", "cann": "cann"}


class BoundRun:
    """Runs of a session with its inputs and outputs in the device's memory (I/O binding).

    Inputs are copied to the device once, when this is made, so a timed run moves no
    data between host and device; outputs stay there. The first run lets onnxruntime
    allocate the outputs (and capture a CUDA graph, where the options ask for one,
    which needs bound inputs and outputs); they are then bound in place, so later runs
    write to the same addresses, as CUDA graphs require. Each call synchronizes the
    outputs, so the host's clock around it times the device's work (onnxruntime's run
    waits for its stream already; this also covers providers with streams of their own).
    """

    def __init__(self, sess: Any, feeds: dict[str, Any], device: Device = CPU):
        import onnxruntime as ort

        memory = _MEMORY[device.kind]
        index = 0 if device.is_cpu else device.index
        self._sess, self._binding = sess, sess.io_binding()
        self._kept = []  # the device copies live as long as the binding
        for name, array in feeds.items():
            value = ort.OrtValue.ortvalue_from_numpy(array, memory, index)
            self._binding.bind_ortvalue_input(name, value)
            self._kept.append(value)
        self._names = [o.name for o in sess.get_outputs()]
        for name in self._names:
            self._binding.bind_output(name, memory, index)
        self._first = True

    def __call__(self) -> None:
        self._sess.run_with_iobinding(self._binding)
        self._binding.synchronize_outputs()
        if self._first:
            self._first = False
            for name, value in zip(self._names, self._binding.get_outputs(), strict=True):
                self._binding.bind_ortvalue_output(name, value)
                self._kept.append(value)

    def outputs(self) -> list[Any]:
        """The last run's outputs, copied to the host (runs once if none has)."""
        if self._first:
            self()
        return self._binding.copy_outputs_to_cpu()

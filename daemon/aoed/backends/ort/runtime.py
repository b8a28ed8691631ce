"""ONNX Runtime as the engine's runtime (aoed.engine.runtime.Runtime): the backend's own
functions gathered behind the seam, none rewritten here.

Its worker (worker.py) prepares models, builds candidates and writes the tuned model;
its runner (runner.py) measures on one device; its strategies are catalog.py's; devices
are discovered by aoe.accelerators (the client's, which `aoe devices` shows too), and a
tuned model opens for users with `aoe.session`, which applies the session options the
model carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aoed.engine.registry import StrategyRegistry

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from aoe.accelerators import LocalDevice
    from aoe.signature import TensorInfo
    from aoed.engine.runtime import Runtime

__all__ = ["ORT", "OrtRuntime"]


@dataclass(frozen=True)
class OrtRuntime:
    """ONNX Runtime; `runner_module` is replaced for a stand-in device (tests/fake_cann.py)."""

    name: str = "onnxruntime"
    worker_module: str = "aoed.backends.ort.worker"
    runner_module: str = "aoed.backends.ort.runner"
    opener: str = "aoe.session"

    def devices(self, providers: tuple[str, ...] | None = None) -> list[LocalDevice]:
        from aoe.accelerators import local_devices

        return local_devices(providers)

    def versions(self) -> dict[str, str]:
        from aoe.accelerators import runtime_versions

        return runtime_versions()

    def registry(self, plugins: Iterable[str] = ()) -> StrategyRegistry:
        from aoed.backends.ort.catalog import build_registry

        return build_registry(plugins)

    def activation_ranges(
        self,
        model: onnx.ModelProto,
        infos: Mapping[str, TensorInfo],
        samples: Iterable[Mapping[str, np.ndarray]],
    ) -> dict[str, tuple[float, float]]:
        from aoed.backends.ort.probe import activation_ranges

        return activation_ranges(model, infos, samples)


#: The one ONNX Runtime backend.
ORT = OrtRuntime()

if TYPE_CHECKING:
    _conforms: Runtime = ORT  # mypy checks that ORT implements the seam

"""The runtimes by name: the one place outside a backend that names one.

Whoever opens an engine (the daemon, `aoe tune`, `aoe compile`, `aoe bank verify`) asks
here for the runtime it runs on and hands it to the engine (aoed.engine.runtime), which
never imports a backend. A second runtime adds one line to `RUNTIMES`.
"""

from __future__ import annotations

import importlib

from aoe.errors import OptionError
from aoed.engine.messages import RuntimeBuildReply, RuntimeBuildRequest
from aoed.engine.runtime import Runtime

__all__ = ["BUILDS", "DEFAULT", "DEPLOYED", "RUNTIMES", "build_for", "load_runtime"]

#: runtime name -> (module, attribute) of its Runtime; imported only when asked for
RUNTIMES: dict[str, tuple[str, str]] = {
    "onnxruntime": ("aoed.backends.ort.runtime", "ORT"),
}
DEFAULT = "onnxruntime"
#: runtime name -> the module of its measurement worker (the protocol of
#: aoed.backends.ort.deployed): what the runner starts for a candidate of that runtime.
#: OpenVINO competes at the model level (backends/openvino): it has a worker, no engine.
DEPLOYED: dict[str, str] = {
    "onnxruntime": "aoed.backends.ort.deployed",
    "openvino": "aoed.backends.openvino.deployed",
}


#: runtime name -> (module, function) that builds a whole model for it, in the variants
#: a RuntimeBuildRequest names (a compile worker's `runtime_build`, and `aoe compile`).
BUILDS: dict[str, tuple[str, str]] = {
    "openvino": ("aoed.backends.openvino.build", "build"),
}


def build_for(req: RuntimeBuildRequest) -> RuntimeBuildReply:
    """The builds `req` asks of its runtime (in this process). ValueError for a runtime
    that builds no whole model."""
    try:
        module, attr = BUILDS[req.runtime]
    except KeyError:
        raise ValueError(f"runtime {req.runtime!r}: no model-level build for it") from None
    reply: RuntimeBuildReply = getattr(importlib.import_module(module), attr)(req)
    return reply


def load_runtime(name: str = DEFAULT) -> Runtime:
    """The runtime called `name`. OptionError naming the runtimes there are otherwise."""
    try:
        module, attr = RUNTIMES[name]
    except KeyError:
        raise OptionError(
            f"runtime {name!r}: no such runtime; choose one of {', '.join(sorted(RUNTIMES))}"
        ) from None
    runtime: Runtime = getattr(importlib.import_module(module), attr)
    return runtime

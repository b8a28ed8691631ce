"""The runtime seam: what a runtime backend gives the engine, and all the engine asks of it.

A runtime is the library that runs a model (today ONNX Runtime: backends/ort/). The
engine never imports one: whoever opens the engine picks a runtime by name
(aoed.backends.runtimes, the one place that maps names to backends) and hands it over,
and every stage reaches it through this protocol. A backend implements:

  discover    `devices()`: the devices this machine offers it, and why any is unusable;
              `versions()`: what the runtime is, for results and `aoe devices`.
  strategies  `registry(plugins)`: the strategy registry (registry.py), so the ways to run
              a task are `registry.strategies_for(family, precision, kind)`; its
              `session_space` is the model-wide option space on accelerators.
  prepare, build, write
              `worker_module`: the compile worker (`python -m`, or the `line_handler` a
              remote executor calls) that answers WORKER_REQUESTS: it prepares the model,
              builds each candidate and writes the artifact (the tuned model).
  measure     `runner_module`: the measurement runner, one per device, that answers
              RUNNER_REQUESTS (MeasureRequest: candidates timed interleaved).
  calibrate in process
              `activation_ranges(...)`: for `aoe compile`, which prepares a model in its
              own process with no worker.
  open        `opener`: the client's function that opens the artifact for users (named
              only: the light client holds it, and the daemon never imports it).

Requests and replies are the messages of messages.py, in JSON lines: a runtime's children
speak them, so the agents (pool.py, device.py) and executors (executor.py) do not know
which runtime serves them. A stand-in for hardware this machine lacks is a runtime with
another `runner_module` (tests/fake_cann.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from aoed.engine.messages import (
    AssembleRequest,
    CalibrateRequest,
    CheckRequest,
    CompareRequest,
    CompileRequest,
    DescribeRequest,
    ExtractRequest,
    MeasureRequest,
    PingRequest,
    PrepareRequest,
    ProfileRequest,
    RebuildRequest,
    Request,
    RuntimeBuildRequest,
    SamplesRequest,
    VariantsRequest,
)
from aoed.engine.registry import StrategyRegistry

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from aoe.accelerators import LocalDevice
    from aoe.signature import TensorInfo

__all__ = ["RUNNER_REQUESTS", "WORKER_REQUESTS", "Runtime"]

#: What a compile worker answers: that it is alive (ping), prepare a model (prepare,
#: samples, calibrate, extract), build and check a candidate (compile, variants, describe,
#: check, rebuild), write the artifact (assemble), build the model for another runtime
#: that competes at the model level (runtime_build: backends/openvino).
WORKER_REQUESTS: tuple[type[Request], ...] = (
    PingRequest,
    PrepareRequest,
    SamplesRequest,
    CalibrateRequest,
    ExtractRequest,
    CompileRequest,
    VariantsRequest,
    DescribeRequest,
    CheckRequest,
    RebuildRequest,
    AssembleRequest,
    RuntimeBuildRequest,
)
#: What a measurement runner answers: its device's facts (ping), candidates timed
#: (measure), per-node times (profile), outputs compared (compare).
RUNNER_REQUESTS: tuple[type[Request], ...] = (
    PingRequest,
    MeasureRequest,
    ProfileRequest,
    CompareRequest,
)


class Runtime(Protocol):
    """One runtime backend (module docstring). Values, not resources: nothing to close."""

    #: the runtime's name, as aoed.backends.runtimes and the config spell it
    @property
    def name(self) -> str: ...

    #: the module of the compile worker (WORKER_REQUESTS)
    @property
    def worker_module(self) -> str: ...

    #: the module of the measurement runner (RUNNER_REQUESTS)
    @property
    def runner_module(self) -> str: ...

    #: the client's function that opens a tuned model for users, as `module.function`
    @property
    def opener(self) -> str: ...

    def devices(self, providers: tuple[str, ...] | None = None) -> list[LocalDevice]:
        """Every device this machine offers the runtime, usable or not (with why);
        `providers`: what a runner reported, instead of asking this process's runtime."""
        ...

    def versions(self) -> dict[str, str]:
        """What the runtime is and runs on (its version, the libraries under it)."""
        ...

    def registry(self, plugins: Iterable[str] = ()) -> StrategyRegistry:
        """Its strategy registry, then those `plugins` register (OptionError for a broken
        plugin); its workers build the same one."""
        ...

    def activation_ranges(
        self,
        model: onnx.ModelProto,
        infos: Mapping[str, TensorInfo],
        samples: Iterable[Mapping[str, np.ndarray]],
    ) -> dict[str, tuple[float, float]]:
        """(min, max) of every float activation of `model` over `samples`, in this process."""
        ...

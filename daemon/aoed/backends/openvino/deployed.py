"""The measurement worker of an OpenVINO candidate: `python -m aoed.backends.openvino.deployed`.

It answers the JSON-lines protocol of aoed.backends._deployed (load, first, warm,
turn, unload, describe), so the runner drives OpenVINO and onnxruntime candidates side
by side with the one procedure (measure.rounds: alternating turns, each worker stopped
between its turns). A candidate is an IR (.xml + .bin) or an ONNX file that OpenVINO
reads, and its options are the compile properties it runs with, checked against the
allow-list of aoe.ovartifact (the same function `aoe.session` opens an artifact with),
so what is timed here is what a user runs.
"""

from __future__ import annotations

import sys
from typing import Any

from aoe.ovartifact import CompileConfig, OvSession, check_properties

__all__ = ["MODULE", "describe", "open_session"]

#: This worker, as the runner starts it.
MODULE = "aoed.backends.openvino.deployed"


def open_session(model: str, options: dict[str, Any]) -> OvSession:
    """`model` compiled for the CPU with `options` (compile properties, checked)."""
    return OvSession(model, CompileConfig("CPU", check_properties(options, "candidate options")))


def describe(sess: OvSession) -> dict[str, Any]:
    """What a compiled model runs with, as OpenVINO reports it."""
    out: dict[str, Any] = {"runtime": "openvino"}
    for key in (
        "INFERENCE_PRECISION_HINT",
        "PERFORMANCE_HINT",
        "NUM_STREAMS",
        "INFERENCE_NUM_THREADS",
        "ENABLE_CPU_PINNING",
    ):
        try:
            out[key] = str(sess.compiled.get_property(key))
        except Exception:  # a property the plugin does not report
            out[key] = None
    return out


def main() -> int:
    from aoed.backends._deployed import serve

    return serve(open_session, describe)


if __name__ == "__main__":
    sys.exit(main())

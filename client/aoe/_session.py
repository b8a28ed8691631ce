"""Session options as plain data: the one mapping between a JSON dict and ORT options.

The tuner measures candidates under these options, stores the winner's in the tuned
model's `metadata_props` (key `aoe.session_options`), and `aoe.session()` rebuilds the
same setup from them, so what users run is what was measured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["METADATA_KEY", "make_session_options", "normalize_options"]

METADATA_KEY = "aoe.session_options"

_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
_MODES = {"sequential": "ORT_SEQUENTIAL", "parallel": "ORT_PARALLEL"}
_KEYS = {"intra_op_num_threads", "inter_op_num_threads", "execution_mode", "graph_optimization_level", "config"}


def normalize_options(options: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Validate and return a plain copy of `options` (a dict or its JSON); ValueError if wrong."""
    if options is None:
        return {}
    if isinstance(options, str):
        options = json.loads(options)
    unknown = set(options) - _KEYS
    if unknown:
        raise ValueError(f"unknown session option(s): {', '.join(sorted(unknown))}")
    out = dict(options)
    if "graph_optimization_level" in out and out["graph_optimization_level"] not in _LEVELS:
        raise ValueError(f"graph_optimization_level must be one of {', '.join(_LEVELS)}")
    if "execution_mode" in out and out["execution_mode"] not in _MODES:
        raise ValueError(f"execution_mode must be one of {', '.join(_MODES)}")
    for k in ("intra_op_num_threads", "inter_op_num_threads"):
        if k in out and (not isinstance(out[k], int) or out[k] < 0):
            raise ValueError(f"{k} must be a non-negative integer")
    if "config" in out:
        out["config"] = {str(k): str(v) for k, v in dict(out["config"]).items()}
    return out


def make_session_options(options: Mapping[str, Any] | str | None = None):
    """Return an `onnxruntime.SessionOptions` built from `options` (see normalize_options)."""
    import onnxruntime as ort

    opts = normalize_options(options)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if "intra_op_num_threads" in opts:
        so.intra_op_num_threads = opts["intra_op_num_threads"]
    if "inter_op_num_threads" in opts:
        so.inter_op_num_threads = opts["inter_op_num_threads"]
    if "execution_mode" in opts:
        so.execution_mode = getattr(ort.ExecutionMode, _MODES[opts["execution_mode"]])
    if "graph_optimization_level" in opts:
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _LEVELS[opts["graph_optimization_level"]]
        )
    for k, v in opts.get("config", {}).items():
        so.add_session_config_entry(k, v)
    return so

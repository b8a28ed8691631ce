"""Session options as plain data: the one mapping between a JSON dict and ORT options.

The tuner measures candidates under these options, stores the winner's in the tuned
model's `metadata_props` (key `aoe.session_options`), and `aoe.session()` rebuilds the
same setup from them, so what users run is what was measured.

On an accelerator the options also name the providers, in onnxruntime's order of
preference, each with its options: `"providers": [[provider, {option: value}], ...]`,
e.g. TensorRT's with `trt_fp16_enable` "1", then CUDA's with none (the CPU provider
always comes last, for what the others do not take; `device_id` is the session's,
never stored).

Options are data (a bank record, a model's metadata), so this is where they meet
onnxruntime: only what the tuner sets passes (aoe.recordcheck.check_session_options),
and nothing here sets a path. Config entries come from an allowlist, so none that
writes a file (`session.collect_node_memory_stats_to_file`, ...) is ever set; provider
options that name files (TensorRT's caches) are never taken from the options, only from
the caller's own `files` (`session_providers`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from aoe.recordcheck import LEVELS, MODES, SESSION_KEYS

__all__ = [
    "METADATA_KEY",
    "make_session_options",
    "normalize_options",
    "normalize_providers",
    "session_providers",
    "trt_files",
]

METADATA_KEY = "aoe.session_options"

#: each level and mode of aoe.recordcheck, as onnxruntime's enums name it
_LEVELS = dict(
    zip(
        LEVELS,
        ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"),
        strict=True,
    )
)
_MODES = dict(zip(MODES, ("ORT_SEQUENTIAL", "ORT_PARALLEL"), strict=True))


def normalize_options(options: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Validate and return a plain copy of `options` (a dict or its JSON); ValueError
    (aoe.recordcheck.RecordError for what the tuner never sets) naming the option if wrong."""
    from aoe.recordcheck import MAX_OPTIONS_JSON, check_session_options, loads

    if options is None:
        return {}
    if isinstance(options, str):
        options = loads(options, "session options", MAX_OPTIONS_JSON)
    if not isinstance(options, Mapping):
        raise ValueError("session options must be a JSON object")
    unknown = set(options) - SESSION_KEYS
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
        if not isinstance(out["config"], Mapping):
            raise ValueError("config must be an object of config entries")
        out["config"] = {str(k): str(v) for k, v in dict(out["config"]).items()}
    if "providers" in out:
        out["providers"] = normalize_providers(out["providers"])
    return check_session_options(out)


def normalize_providers(value: Any) -> list[list[Any]]:
    """`value` as `[[provider, {option: str}], ...]`; ValueError naming the provider and
    the option when a provider is unknown, listed twice, is the CPU's, or takes no such
    option (aoe.provider_options), or when `device_id` is given (it is the session's)."""
    from aoe.device import kind_of
    from aoe.provider_options import check_options

    if not isinstance(value, list):
        raise ValueError("providers must be a list of [provider, {option: value}] pairs")
    out: list[list[Any]] = []
    for item in value:
        if not (
            isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], Mapping)
        ):
            raise ValueError(f"providers: {item!r} is not a [provider, {{option: value}}] pair")
        name, opts = str(item[0]), {str(k): str(v) for k, v in item[1].items()}
        kind = kind_of(name)  # ValueError for an unknown provider
        if kind == "cpu":
            raise ValueError(
                "providers: the CPU provider is always last and takes no options; leave it out"
            )
        if any(name == seen for seen, _ in out):
            raise ValueError(f"providers: {name} is listed twice")
        if "device_id" in opts:
            raise ValueError(
                f"providers: {name}: device_id is chosen when the session is made, not stored"
            )
        check_options(kind, opts, f"providers: {name}")
        out.append([name, dict(sorted(opts.items()))])
    return out


def session_providers(
    options: Mapping[str, Any],
    device_id: int = 0,
    files: Mapping[str, Mapping[str, str]] | None = None,
) -> list[tuple[str, dict[str, str]]]:
    """The `providers` argument of an InferenceSession for `options` (see
    normalize_options) on accelerator `device_id`: each provider the options name, with
    its options and the device id, then the CPU provider.

    `files` (provider -> options) are the caller's own options that name files, such as
    TensorRT's engine and timing caches (`trt_files`): never from data, added to the
    providers the options name. ValueError for one that names no file
    (aoe.recordcheck.FILE_OPTIONS)."""
    from aoe.device import CPU, kind_of
    from aoe.recordcheck import FILE_OPTIONS

    named = normalize_options({"providers": options.get("providers", [])})["providers"]
    own = {}
    for name, opts in (files or {}).items():
        kind = kind_of(name)
        odd = sorted(k for k in opts if (kind, k) not in FILE_OPTIONS)
        if odd:
            raise ValueError(f"files: {name}: {', '.join(odd)} name no file; pass them as options")
        own[name] = {str(k): str(v) for k, v in opts.items()}
    return [
        (name, {**opts, **own.get(name, {}), "device_id": str(device_id)}) for name, opts in named
    ] + [(CPU.provider, {})]


def trt_files(
    folder: str | os.PathLike[str], calibration_table: str = ""
) -> dict[str, dict[str, str]]:
    """`files` for `session_providers` that keep TensorRT's built engines and its timing
    cache in `folder` (made by the caller), so that later sessions load them instead of
    building again; with `calibration_table`, the int8 calibration table to read."""
    opts = {
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": os.fspath(folder),
        "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": os.fspath(folder),
    }
    if calibration_table:
        opts["trt_int8_calibration_table_name"] = calibration_table
    from aoe.device import Device

    return {Device("tensorrt").provider: opts}


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

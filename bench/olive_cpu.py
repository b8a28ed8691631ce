"""Olive's CPU recipe for a transformer ONNX file, as a user runs it from its CLI.

    olive run --config CONFIG

The workflow is the one Olive's own BERT-on-CPU examples chain: `OrtTransformersOptimization`
(onnxruntime's transformers optimizer, with the model type a user names), then
`OnnxDynamicQuantization` (dynamic int8, Olive's defaults), then `OrtSessionParamsTuning`
(Olive times the session options it searches by default on dummy inputs of the model's
own shapes, and keeps the fastest). The input is the local ONNX file; nothing is fetched.
Olive runs in a process of its own, so that its imports and threads never share one with
the bench's measurements; what it keeps is the model Olive writes and the session options
its tuning chose, as aoe.sessionopts spells them, so the bench times exactly that.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

__all__ = ["TIMEOUT_S", "OliveBuild", "cpu_recipe"]

#: Olive's whole workflow on one small transformer takes about 25 s on 2 cores.
TIMEOUT_S = 600.0
PASSES = ("OrtTransformersOptimization", "OnnxDynamicQuantization", "OrtSessionParamsTuning")
#: onnxruntime's enums, as Olive's tuning writes them, to aoe.recordcheck's names
_MODES = {0: "sequential", 1: "parallel"}
_LEVELS = {0: "disable", 1: "basic", 2: "extended", 99: "all"}


@dataclass(frozen=True)
class OliveBuild:
    model: Path
    options: dict[str, Any]  # session options, as aoe.sessionopts spells them


def _dummy_data(model: Path) -> dict[str, Any]:
    """Olive's DummyDataContainer over the model's own inputs (names, fixed shapes, types)."""
    proto = onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    names, shapes, types = [], [], []
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        names.append(vi.name)
        shapes.append([d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim])
        types.append(str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)))
    return {
        "name": "dummy",
        "type": "DummyDataContainer",
        "load_dataset_config": {
            "input_names": names,
            "input_shapes": shapes,
            "input_types": types,
        },
    }


def _config(model: Path, out: Path, model_type: str, num_heads: int, hidden_size: int) -> dict:
    """The workflow (module doc); num_heads and hidden_size 0: the optimizer reads them
    from the graph."""
    cpu = {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}
    return {
        "input_model": {"type": "ONNXModel", "model_path": str(model)},
        "systems": {"local": {"type": "LocalSystem", "accelerators": [cpu]}},
        "data_configs": [_dummy_data(model)],
        "passes": {
            "optimize": {
                "type": PASSES[0],
                "model_type": model_type,
                "num_heads": num_heads,
                "hidden_size": hidden_size,
            },
            "quantize": {"type": PASSES[1]},
            "session_params": {"type": PASSES[2], "data_config": "dummy"},
        },
        "host": "local",
        "target": "local",
        "cache_dir": str(out / "cache"),
        "output_dir": str(out / "output"),
        "log_severity_level": 3,
    }


def session_options(settings: dict[str, Any] | None) -> dict[str, Any]:
    """The session options of Olive's `inference_settings` (the ones it set; None is
    onnxruntime's default), as aoe.sessionopts spells them; ValueError for one that has
    no such spelling."""
    from aoe.sessionopts import normalize_options

    got = dict((settings or {}).get("session_options") or {})
    opts: dict[str, Any] = {}
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if (n := got.pop(key, None)) is not None:
            opts[key] = int(n)
    if (mode := got.pop("execution_mode", None)) is not None:
        opts["execution_mode"] = _MODES[int(mode)]
    if (level := got.pop("graph_optimization_level", None)) is not None:
        opts["graph_optimization_level"] = _LEVELS[int(level)]
    left = {k: v for k, v in got.items() if v is not None}
    if left:
        raise ValueError(f"Olive's session options {sorted(left)} have no aoe spelling")
    return normalize_options(opts)


def cpu_recipe(
    model: Path, out: Path, model_type: str, *, num_heads: int = 0, hidden_size: int = 0
) -> OliveBuild:
    """Olive's CPU recipe (module doc) on `model` under `out`: the model it writes and the
    session options it chose. RuntimeError with Olive's last error line when it fails or
    outlasts TIMEOUT_S."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "olive.json"
    config.write_text(json.dumps(_config(model, out, model_type, num_heads, hidden_size)))
    cmd = [sys.executable, "-m", "olive", "run", "--config", str(config), "--disable_telemetry"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Olive timed out after {TIMEOUT_S:.0f} s") from None
    (out / "olive.log").write_text(proc.stdout + proc.stderr)
    written = out / "output" / "model_config.json"
    if proc.returncode != 0 or not written.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        raise RuntimeError(f"Olive exit {proc.returncode}: {why.strip()[:200]}")
    conf = json.loads(written.read_text())["config"]
    return OliveBuild(Path(conf["model_path"]), session_options(conf.get("inference_settings")))

"""Compile worker: `python -m aoed.backends.ort.worker`, one of N in the compile pool.

A compile request names a task model, a family and a strategy. The worker applies the
strategy's rewrite, checks the candidate model, saves it, and loads it into an
onnxruntime session (single-threaded) so that a candidate the runtime rejects fails
here, not on the device. It never measures and never touches the bank.

Request:  {"id", "task_model", "family", "strategy", "prefix", "out", "ranges"}
Reply:    {"id", "ok", "applicable", "error", "compile_s"}
"""

from __future__ import annotations

import sys
import time
from typing import Any

import onnx


def _compile(req: dict[str, Any]) -> dict[str, Any]:
    from aoe._session import make_session_options
    from aoe.signature import ModelContext
    from aoed.backends.ort import strategies
    from aoed.engine.tasks import TaskView, apply_rewrites, constant_values

    t0 = time.perf_counter()
    model = onnx.load(req["task_model"])
    strategy = strategies.get(req["family"], req["strategy"])
    nodes = list(model.graph.node)
    view = TaskView(
        nodes=nodes,
        consts=constant_values(model.graph),
        infos=ModelContext(model).tensors,
        opset=ModelContext(model).opset(""),
        prefix=req.get("prefix", req["strategy"]),
        ranges={k: (float(v[0]), float(v[1])) for k, v in req.get("ranges", {}).items()},
    )
    rewrite = strategy.apply(view)
    if rewrite is None:
        return {"ok": False, "applicable": False, "error": "not applicable"}
    candidate = apply_rewrites(model, {tuple(n.name for n in nodes): rewrite})
    onnx.checker.check_model(candidate)
    onnx.save(candidate, req["out"])
    import onnxruntime as ort

    so = make_session_options({"intra_op_num_threads": 1})
    ort.InferenceSession(req["out"], so, providers=["CPUExecutionProvider"])
    return {"ok": True, "applicable": True, "compile_s": time.perf_counter() - t0}


def main() -> int:
    from aoed.backends.ort._wire import serve
    from aoed.backends.ort.strategies import load_plugins

    load_plugins()
    return serve(_compile)


if __name__ == "__main__":
    sys.exit(main())

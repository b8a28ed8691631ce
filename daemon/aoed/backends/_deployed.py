"""The worker side of measurement as deployed: one candidate's model in a process of
its own, answering JSON lines (backends/ort/deployed.py says why and drives it).

Every runtime's worker (`python -m aoed.backends.ort.deployed`, `python -m
aoed.backends.openvino.deployed`) serves this one protocol with its own way to open a
model, so the runner times candidates of several runtimes with one procedure:

  load      {model, options, inputs}: open the model (dropping the last), read its feeds
  first     {outputs}: one run, its outputs written to an .npz
  warm      {warmup_s}: runs for about that long; seconds per run
  turn      {samples, batch}: one untimed run, then `samples` timed batches
  unload    drop the model and its memory
  describe  the process id and what the open model runs with

Inputs come from .npz files only (no pickle); whatever a library prints goes to stderr,
never into the protocol.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["serve"]


def serve(
    open_session: Callable[[str, dict[str, Any]], Any],
    describe_session: Callable[[Any], dict[str, Any]],
) -> int:
    """The worker: answer one JSON request per stdin line until EOF, opening each model
    with `open_session` (a model path and its options -> an object with
    `run(None, feeds)` and `get_inputs()`) and saying what it runs with
    `describe_session`."""
    from aoed.backends._wire import child_main

    child_main(["--parent", str(os.getppid())])
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # whatever a library prints goes to the log, never into the protocol
    sys.stdout = sys.stderr
    state: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = _answer(json.loads(line), state, open_session, describe_session)
        except Exception as exc:  # the request's failure: the runner reports it for its candidate
            reply = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        try:
            proto.write(json.dumps(reply) + "\n")
        except BrokenPipeError:
            os._exit(0)
    return 0


def _answer(
    req: dict[str, Any],
    state: dict[str, Any],
    open_session: Callable[[str, dict[str, Any]], Any],
    describe_session: Callable[[Any], dict[str, Any]],
) -> dict[str, Any]:
    op = req.get("op")
    if op == "load":
        state.clear()
        gc.collect()
        try:
            sess = open_session(str(req["model"]), dict(req.get("options") or {}))
        except Exception as exc:
            return {"error": f"load: {exc}".splitlines()[0]}
        names = {i.name for i in sess.get_inputs()}
        with np.load(req["inputs"], allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files if k in names}
        state.update(sess=sess, feeds=feeds)
        return {"ok": True}
    if op == "unload":
        state.clear()
        gc.collect()
        return {"ok": True}
    if op == "describe":
        return {"pid": os.getpid(), "session": describe_session(state["sess"]) if state else None}
    sess, feeds = state["sess"], state["feeds"]
    if op == "first":
        try:
            outs = sess.run(None, feeds)
        except Exception as exc:
            return {"error": f"run: {exc}".splitlines()[0]}
        arrays: dict[str, Any] = {}
        for i, o in enumerate(outs):
            a = np.asarray(o)
            if a.dtype == object:
                return {"error": f"run: output {i} is not a tensor"}
            arrays[f"o{i}"] = a
        np.savez(req["outputs"], **arrays)
        return {"ok": True, "count": len(arrays)}
    if op == "warm":
        t0, n = time.perf_counter(), 0
        while n < 1 or (time.perf_counter() - t0 < float(req["warmup_s"]) and n < 200):
            sess.run(None, feeds)
            n += 1
        return {"per_run_s": (time.perf_counter() - t0) / n}
    if op == "turn":
        sess.run(None, feeds)  # untimed: a cold cache stays out of the samples
        got = []
        batch = int(req["batch"])
        for _ in range(int(req["samples"])):
            t = time.perf_counter()
            for _ in range(batch):
                sess.run(None, feeds)
            got.append((time.perf_counter() - t) / batch)
        return {"samples_s": got}
    raise ValueError(f"unknown request {op!r}")

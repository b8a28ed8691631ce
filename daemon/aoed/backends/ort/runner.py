"""Measurement runner: `python -m aoed.backends.ort.runner`, one per device.

The device agent owns exactly one runner and sends it one request at a time, so
measurements on a device are serialized by construction.

Requests (messages in aoed.engine.messages; every one names its `device`):
  ping     -> PingReply(cores, providers); fails when the device's provider is missing
  measure  MeasureRequest(candidates, inputs, reference, plan) -> MeasureReply: per
           candidate a Measurement (timing, accuracy against the reference, or why not)
  profile  ProfileRequest -> ProfileReply(nodes: {name: us}, total_us, load_s)
           (unoptimized unless options say otherwise, so node names are the model's)
  compare  CompareRequest(reference, candidate, options, inputs) -> Accuracy (the worst
           over the inputs)

Method: every candidate gets the same inputs; one run gives its outputs, compared with
the reference candidate's; then the shared procedure of measure.py times them
(interleaved rounds, bounded by the plan's budget).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aoe.device import CPU, Device
from aoe.errors import DeviceError
from aoed.backends.ort import deployed
from aoed.backends.ort.measure import Timing, interleaved, rounds
from aoed.backends.ort.sessions import BoundRun, check_device, providers_for, session
from aoed.backends.runtimes import DEPLOYED
from aoed.engine.messages import (
    Accuracy,
    CompareRequest,
    Measurement,
    MeasureReply,
    MeasureRequest,
    PingReply,
    PingRequest,
    ProfileReply,
    ProfileRequest,
)


def _load_inputs(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


#: Session config that keeps an idle session's intra-op threads from spinning.
NO_SPIN = {"session.intra_op.allow_spinning": "0"}


def quiet(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` with spinning off unless they set it. Several sessions measured in turn
    share the cores: each idle session's threads spin on them and slow the one running.
    Measured here with the engine's own interleaving on 2 cores, a ResNet-18 timed 53.5 ms
    beside four other sessions and 21.4 ms alone; with spinning off, 21.5 ms beside them."""
    opts = dict(options or {})
    opts["config"] = {**NO_SPIN, **opts.get("config", {})}
    return opts


def _session(
    model: Path,
    options: dict[str, Any] | None,
    device: Device = CPU,
    files: dict[str, dict[str, str]] | None = None,
):
    return session(str(model), quiet(options), device, files)


def accuracy(ref: list[np.ndarray], out: list[np.ndarray]) -> dict[str, float]:
    """max abs error, max error relative to the reference's largest magnitude, cosine."""
    if len(ref) != len(out):
        raise ValueError("candidate has a different number of outputs")
    max_abs = 0.0
    scale = 0.0
    dot = nr = no = 0.0
    for r, o in zip(ref, out, strict=True):
        r = np.asarray(r)
        o = np.asarray(o)
        if r.shape != o.shape:
            raise ValueError(f"output shape {o.shape} differs from the reference {r.shape}")
        if r.dtype.kind not in "fc":
            if not np.array_equal(r, o):
                max_abs = math.inf
            continue
        r64 = r.astype(np.float64).ravel()
        o64 = o.astype(np.float64).ravel()
        if not np.all(np.isfinite(o64)):
            return {"max_abs_error": math.inf, "max_rel_error": math.inf, "cosine": 0.0}
        if r64.size:
            max_abs = max(max_abs, float(np.max(np.abs(r64 - o64))))
            scale = max(scale, float(np.max(np.abs(r64))))
        dot += float(r64 @ o64)
        nr += float(r64 @ r64)
        no += float(o64 @ o64)
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if nr == 0 and no == 0:
        cos = 1.0
    elif nr == 0 or no == 0:
        cos = 0.0
    else:
        cos = dot / math.sqrt(nr * no)
    return {"max_abs_error": max_abs, "max_rel_error": rel, "cosine": cos}


def measure(req: MeasureRequest) -> MeasureReply:
    """Raises DeviceError when the reference candidate cannot be loaded or run."""
    if req.plan.deployed and req.device.is_cpu:
        return _measure_deployed(req)
    feeds = _load_inputs(req.inputs)
    device = req.device
    results: dict[str, Measurement] = {}
    sessions = {}
    for c in req.candidates:
        if c.runtime != "onnxruntime":
            results[c.id] = Measurement(
                False,
                error=f"load: a {c.runtime} candidate is measured as deployed only, on the CPU",
            )
            continue
        try:
            sess = _session(c.model, c.options, device, c.files)
            names = {i.name for i in sess.get_inputs()}
            sessions[c.id] = (sess, {k: v for k, v in feeds.items() if k in names})
        except Exception as exc:
            results[c.id] = Measurement(False, error=f"load: {exc}".splitlines()[0])
    outputs = {}
    # On an accelerator a host run would time copies to and from the device with the
    # model (and CUDA graphs need bound memory): runs bind inputs and outputs in device
    # memory. The first run, here, is outside the timing, and so is session creation,
    # where TensorRT builds its engines.
    bound: dict[str, BoundRun] = {}
    for cid, (sess, f) in list(sessions.items()):
        try:
            if device.is_cpu:
                outputs[cid] = sess.run(None, f)
            else:
                bound[cid] = BoundRun(sess, f, device)
                outputs[cid] = bound[cid].outputs()
        except Exception as exc:
            results[cid] = Measurement(False, error=f"run: {exc}".splitlines()[0])
            del sessions[cid]
    acc = _compared(req.reference, outputs, results)
    if device.is_cpu:
        runs = {
            cid: (lambda sess=sess, f=f: sess.run(None, f))
            for cid, (sess, f) in sessions.items()
            if cid in acc
        }
    else:
        runs = {cid: bound[cid] for cid in sessions if cid in acc}
    timings = interleaved(runs, req.plan, keep=req.reference)
    return _reply(timings, acc, results)


def _measure_deployed(req: MeasureRequest) -> MeasureReply:
    """`measure` with each candidate in a process of its own (deployed.py)."""
    results: dict[str, Measurement] = {}
    outputs = {}
    with deployed.workers_for(req.inputs) as workers:
        errors = {
            c.id: f"load: no measurement worker for runtime {c.runtime!r}"
            for c in req.candidates
            if c.runtime not in DEPLOYED
        }
        errors.update(
            workers.load(
                [
                    (c.id, c.model, c.options, DEPLOYED[c.runtime])
                    for c in req.candidates
                    if c.runtime in DEPLOYED
                ]
            )
        )
        for cid, why in errors.items():
            results[cid] = Measurement(False, error=why)
        for c in req.candidates:
            if c.id in errors:
                continue
            try:
                outputs[c.id] = workers.first(c.id)
            except deployed.WorkerError as exc:
                results[c.id] = Measurement(False, error=str(exc))
                workers.drop(c.id)
        acc = _compared(req.reference, outputs, results)
        for cid in list(outputs):
            if cid not in acc:
                workers.drop(cid)
        names = [c.id for c in req.candidates if c.id in acc]
        timings = rounds(workers, names, req.plan, keep=req.reference)
    return _reply(timings, acc, results)


def _compared(
    ref_id: str | None, outputs: dict[str, list[np.ndarray]], results: dict[str, Measurement]
) -> dict[str, dict[str, float]]:
    """Each candidate's accuracy against the reference's outputs (`outputs` by candidate;
    an empty dict without a reference); a candidate whose outputs cannot be compared
    gets its failure in `results` instead. DeviceError when the reference has no outputs."""
    if ref_id is not None and ref_id not in outputs:
        err = results[ref_id].error if ref_id in results else "reference missing"
        raise DeviceError(f"reference candidate failed: {err}")
    acc = {}
    for cid in outputs:
        if ref_id is None:
            acc[cid] = {}
            continue
        try:
            acc[cid] = accuracy(outputs[ref_id], outputs[cid])
        except ValueError as exc:
            results[cid] = Measurement(False, error=str(exc))
    return acc


def _reply(
    timings: dict[str, Timing], acc: dict[str, dict[str, float]], results: dict[str, Measurement]
) -> MeasureReply:
    for cid, t in timings.items():
        if t.dropped and not t.repeats:  # never timed: it overran the budget
            results[cid] = Measurement(
                False, error=t.reason, dropped=True, reason=t.reason, **acc[cid]
            )
        else:
            summary = t.summary()
            summary["rounds_us"] = tuple(summary["rounds_us"])
            results[cid] = Measurement(True, **summary, **acc[cid])
    return MeasureReply(results)


def profile(req: ProfileRequest) -> ProfileReply:
    from aoe.sessionopts import make_session_options

    feeds = _load_inputs(req.inputs)
    device = req.device
    # No optimization by default: the runtime's fusions rename the nodes they fuse, and
    # the profile must name the prepared model's nodes to map onto tasks one to one.
    options = req.options or {"graph_optimization_level": "disable"}
    so = make_session_options(options)
    so.enable_profiling = True
    so.profile_file_prefix = str(req.workdir / "profile")
    import onnxruntime as ort

    t_load = time.perf_counter()
    sess = ort.InferenceSession(str(req.model), so, providers=providers_for(options, device))
    load_s = time.perf_counter() - t_load
    names = {i.name for i in sess.get_inputs()}
    f = {k: v for k, v in feeds.items() if k in names}
    for _ in range(3):
        sess.run(None, f)
    runs = req.runs
    t0 = time.perf_counter()
    for _ in range(runs):
        sess.run(None, f)
    total = (time.perf_counter() - t0) / runs * 1e6
    path = sess.end_profiling()
    try:
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)
    finally:
        os.unlink(path)
    nodes: dict[str, float] = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") == "Node" and name.endswith("_kernel_time"):
            node = name[: -len("_kernel_time")]
            nodes[node] = nodes.get(node, 0.0) + float(ev.get("dur", 0))
    n = runs + 3
    return ProfileReply({k: v / n for k, v in nodes.items()}, total, load_s)


def _top1(ref: list[np.ndarray], out: list[np.ndarray]) -> tuple[int, int]:
    """(agreeing rows, rows) of the arg-max over classifier-shaped outputs ([rows, classes],
    float, at least two classes); (0, 0) when there are none."""
    agree = rows = 0
    for r, o in zip(ref, out, strict=True):
        r, o = np.asarray(r), np.asarray(o)
        if r.ndim == 2 and r.shape[1] >= 2 and r.dtype.kind == "f" and r.shape == o.shape:
            agree += int(np.sum(np.argmax(r, axis=1) == np.argmax(o, axis=1)))
            rows += r.shape[0]
    return agree, rows


def compare(req: CompareRequest) -> Accuracy:
    """Accuracy of `candidate` against `reference` over several input files: the worst
    max error and the lowest cosine over them, the cosine's 5th percentile, and for
    classifier-shaped outputs the share of rows whose top-1 class agrees."""
    device = req.device
    ref = _session(req.reference, None, device)
    if req.runtime == "openvino":  # compared here, never timed here: no neighbours to mind
        from aoe.ovartifact import CompileConfig, OvSession, check_properties

        cand = OvSession(req.candidate, CompileConfig("CPU", check_properties(req.options)))
    elif req.runtime != "onnxruntime":
        raise ValueError(f"runtime {req.runtime!r}: no way to compare its outputs here")
    else:
        cand = _session(req.candidate, req.options, device)
    worst = {"max_abs_error": 0.0, "max_rel_error": 0.0, "cosine": 1.0}
    cosines = []
    agree = rows = 0
    for path in req.inputs:
        feeds = _load_inputs(path)
        r_out = ref.run(None, {i.name: feeds[i.name] for i in ref.get_inputs()})
        c_out = cand.run(None, {i.name: feeds[i.name] for i in cand.get_inputs()})
        acc = accuracy(r_out, c_out)
        worst["max_abs_error"] = max(worst["max_abs_error"], acc["max_abs_error"])
        worst["max_rel_error"] = max(worst["max_rel_error"], acc["max_rel_error"])
        worst["cosine"] = min(worst["cosine"], acc["cosine"])
        cosines.append(acc["cosine"])
        a, n = _top1(r_out, c_out)
        agree, rows = agree + a, rows + n
    return Accuracy(
        **worst,
        samples=len(req.inputs),
        cosine_p5=float(np.percentile(cosines, 5)) if cosines else 1.0,
        top1_agreement=agree / rows if rows else None,
        top1_rows=rows,
    )


def ping(req: PingRequest) -> PingReply:
    providers = check_device(req.device)
    return PingReply(len(os.sched_getaffinity(0)), tuple(providers))


_OPS: dict[type, Any] = {
    PingRequest: ping,
    MeasureRequest: measure,
    ProfileRequest: profile,
    CompareRequest: compare,
}


def _handle(req: Any) -> Any:
    return _OPS[type(req)](req)


def line_handler() -> Callable[[bytes], bytes]:
    """This runner's protocol for one request line (its answer line): what an executor
    that carries the lines itself runs (aoed.engine.rayexec)."""
    from aoed.backends._wire import line_server

    return line_server(_handle, tuple(_OPS))


def main() -> int:
    from aoed.backends._wire import child_main, serve

    child_main()
    return serve(_handle, tuple(_OPS))


if __name__ == "__main__":
    sys.exit(main())

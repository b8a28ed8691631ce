"""Re-measure bank entries on this device and flag those that no longer hold.

A bank entry keeps no weights, but its signature says everything that decides speed:
op types, attributes, wiring, shapes and dtypes, which inputs are constant. So a task
is rebuilt from its signature alone, with random constants, and the rebuild is accepted
only if its own signature has the entry's digest. The default form and the entry's
strategy are then measured interleaved on the device (the runner process the tuner
uses), and the verdict is:

  confirmed    the strategy is still clearly faster than the default, within accuracy
  regressed    it is not (any more) clearly faster
  inaccurate   its outputs are outside the entry's precision policy
  skipped      not measurable here: another device, model-wide session options, or a
               task that cannot be rebuilt exactly (e.g. a tensor attribute)
  error        the strategy no longer applies, or the measurement failed

Fresh measurements are appended to the bank's history (as every trial is).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from aoe.errors import DeviceError
from aoe.signature import ModelContext, device_fingerprint, task_signature

__all__ = ["Verdict", "rebuild_task", "verify_entries"]

_REBUILD_SEED = 20240601


@dataclass
class Verdict:
    key: str
    op_type: str
    strategy: str
    verdict: str  # confirmed | regressed | inaccurate | skipped | error
    detail: str = ""
    winner: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)


class RebuildError(Exception):
    """The task cannot be rebuilt exactly from its signature."""


def _attribute(name: str, value: object) -> onnx.AttributeProto:
    if isinstance(value, dict):
        raise RebuildError(f"attribute {name!r} holds a tensor or graph, which signatures keep only as a hash")
    if isinstance(value, list) and not value:
        raise RebuildError(f"attribute {name!r} is an empty list of unknown type")
    return helper.make_attribute(name, value)


def rebuild_task(canonical_json: str, digest: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A standalone model of the task a signature describes, with random constants as
    initializers; returns (model, constants by name). Raises RebuildError when the
    rebuild's signature is not `digest`."""
    try:
        desc = json.loads(canonical_json)
        nodes_desc, inputs_desc, outputs_desc = desc["nodes"], desc["inputs"], desc["outputs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RebuildError(f"unreadable signature ({exc})") from None
    rng = np.random.default_rng(_REBUILD_SEED)
    inputs, inits, consts = [], [], {}
    for i, t in enumerate(inputs_desc):
        name, dt = f"i{i}", np.dtype(t["dtype"])
        if t.get("const"):
            if dt.kind == "f":
                value = (rng.standard_normal(t["shape"]) * 0.1).astype(dt)
            else:
                value = rng.integers(0, 8, size=t["shape"]).astype(dt)
            consts[name] = value
            inits.append(numpy_helper.from_array(value, name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(dt)
            inputs.append(helper.make_tensor_value_info(name, elem, t["shape"]))
    n_out = [1] * len(nodes_desc)
    for nd in nodes_desc:
        for ref in nd["in"]:
            if ref.startswith("n"):
                j, k = (int(x) for x in ref[1:].split("."))
                n_out[j] = max(n_out[j], k + 1)
    n_out[-1] = max(n_out[-1], len(outputs_desc))
    nodes = []
    for j, nd in enumerate(nodes_desc):
        # Wiring refs are already unique tensor names: "i<m>" inputs, "n<j>.<k>" outputs.
        node = helper.make_node(
            nd["op"], list(nd["in"]), [f"n{j}.{k}" for k in range(n_out[j])], name=f"n{j}", domain=nd["domain"] or None
        )
        node.attribute.extend(_attribute(k, v) for k, v in sorted(nd["attrs"].items()))
        nodes.append(node)
    outputs = [
        helper.make_tensor_value_info(f"n{len(nodes) - 1}.{k}", helper.np_dtype_to_tensor_dtype(np.dtype(t["dtype"])), t["shape"])
        for k, t in enumerate(outputs_desc)
    ]
    opsets = dict(desc.get("opsets", {}))
    opsets.setdefault("", 13)
    graph = helper.make_graph(nodes, "verify", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())])
    model.ir_version = 8
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as exc:
        raise RebuildError(f"the rebuilt task does not check ({exc})".splitlines()[0]) from None
    ctx = ModelContext(model)
    try:
        sig = task_signature(list(model.graph.node), ctx)
    except ValueError as exc:
        raise RebuildError(str(exc)) from None
    if sig.digest != digest:
        raise RebuildError("the rebuilt task's signature differs from the entry's")
    return model, consts


def _ranges(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """(min, max) of every float tensor of `model` on `feeds` (static quantization)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for vi in m.graph.value_info:
        if vi.name not in have:
            m.graph.output.append(vi)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    values.update(feeds)
    return {k: (float(v.min()), float(v.max())) for k, v in values.items() if v.dtype.kind == "f" and v.size}


def _prepare_candidates(entry, workdir: Path) -> tuple[list[dict[str, Any]], Path]:
    """Default and strategy models of an entry's rebuilt task, and their inputs."""
    from aoed.backends.ort import strategies
    from aoed.engine.policy import policy
    from aoed.engine.tasks import TaskView, apply_rewrites

    model, consts = rebuild_task(entry.signature.canonical_json, entry.signature.digest)
    ctx = ModelContext(model)
    rng = np.random.default_rng(7)
    feeds = {}
    for vi in model.graph.input:
        info = ctx.tensors[vi.name]
        dt = np.dtype(info.dtype)
        feeds[vi.name] = (rng.standard_normal(info.shape).astype(dt) if dt.kind == "f"
                          else rng.integers(0, 8, size=info.shape).astype(dt))  # fmt: skip
    precision = bank_precision(entry)
    view = TaskView(
        nodes=list(model.graph.node), consts=consts, infos=ctx.tensors, opset=ctx.opset(""),
        prefix="aoe/verify", ranges=_ranges(model, feeds) if policy(precision).lossy else {},
    )  # fmt: skip
    try:
        strat = strategies.get(entry.strategy.family, entry.strategy.name)
        rewrite = strat.apply(view)
    except KeyError as exc:
        raise LookupError(str(exc).strip("'\"")) from None
    if rewrite is None:
        raise LookupError(f"strategy {entry.strategy.name} no longer applies to this task")
    tuned = apply_rewrites(model, {tuple(n.name for n in model.graph.node): rewrite})
    default_path, tuned_path, inputs = workdir / "default.onnx", workdir / "strategy.onnx", workdir / "inputs.npz"
    onnx.save(model, str(default_path))
    onnx.save(tuned, str(tuned_path))
    np.savez(inputs, **feeds)
    return [
        {"id": "default", "model": str(default_path), "options": {}},
        {"id": "strategy", "model": str(tuned_path), "options": {}},
    ], inputs


def bank_precision(entry) -> str:
    from aoe.v1 import bank_pb2

    return bank_pb2.Precision.Name(entry.strategy.precision).removeprefix("PRECISION_").lower()


def sample_entries(entries: Sequence, sample_size: int, seed: int, op_type: str = "") -> list:
    """`sample_size` entries (all when 0) chosen with `seed`, anchor op type filtered."""
    pool = [e for e in entries if not op_type or e.signature.op_type.split("+")[0] == op_type]
    if sample_size and sample_size < len(pool):
        pool = random.Random(seed).sample(pool, sample_size)
    return pool


async def verify_entries(entries: Sequence, budget_s: float, logdir: Path) -> tuple[list[Verdict], list[tuple[bytes, dict]]]:
    """Re-measure `entries` (aoe.v1.BankEntry) on this machine's CPU, one at a time on
    one runner process; returns the verdicts and the history trials to record.
    Cancellation stops the runner."""
    import trio

    from aoed.engine.device import DeviceAgent
    from aoed.engine.job import clearly_faster
    from aoed.engine.policy import policy

    here = device_fingerprint("CPUExecutionProvider").digest
    verdicts: list[Verdict] = []
    trials: list[tuple[bytes, dict]] = []
    agent = DeviceAgent("cpu", None, logdir)
    with tempfile.TemporaryDirectory(prefix="aoe-verify-") as tmp:
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            for n, e in enumerate(entries):
                v = Verdict(e.key, e.signature.op_type, e.strategy.name, "skipped")
                verdicts.append(v)
                if e.device.digest != here:
                    v.detail = f"measured on another device ({e.device.hardware}, onnxruntime {e.device.runtime_version})"
                    continue
                if e.strategy.family == "session":
                    v.detail = "model-wide session options: re-tune the model to check them"
                    continue
                work = Path(tmp) / f"e{n}"
                work.mkdir()
                try:
                    cands, inputs = await trio.to_thread.run_sync(_prepare_candidates, e, work)
                except RebuildError as exc:
                    v.detail = f"cannot rebuild the task: {exc}"
                    continue
                except LookupError as exc:
                    v.verdict, v.detail = "error", str(exc)
                    continue
                try:
                    reply = await agent.submit({
                        "op": "measure", "candidates": cands, "inputs": str(inputs), "reference": "default",
                        "budget_s": budget_s, "min_rounds": 8, "max_rounds": 25, "samples": 5,
                    })  # fmt: skip
                except DeviceError as exc:
                    v.verdict, v.detail = "error", str(exc)
                    continue
                results = reply.get("results", {})
                base, win = results.get("default", {}), results.get("strategy", {})
                for cid, r in results.items():
                    name = e.strategy.name if cid == "strategy" else cid
                    trials.append((e.key.encode(), {"verify": True, "strategy": name, "time": time.time(), **r}))
                v.winner, v.baseline = win, base
                if not (reply.get("ok", True) and base.get("ok") and win.get("ok")):
                    v.verdict = "error"
                    v.detail = reply.get("error") or win.get("error") or base.get("error") or "measurement failed"
                elif not policy(bank_precision(e)).task_ok(win):
                    v.verdict = "inaccurate"
                    v.detail = f"max rel error {win.get('max_rel_error'):.3g}, cosine {win.get('cosine'):.6f}"
                elif clearly_faster(win, base):
                    v.verdict = "confirmed"
                    v.detail = f"{win['median_us']:.1f} us vs default {base['median_us']:.1f} us"
                else:
                    v.verdict = "regressed"
                    v.detail = (f"{win['median_us']:.1f} us vs default {base['median_us']:.1f} us "
                                f"(banked {e.winner.median_us:.1f} vs {e.baseline.median_us:.1f})")  # fmt: skip
            nursery.cancel_scope.cancel()
    return verdicts, trials

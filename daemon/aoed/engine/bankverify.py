"""Re-measure bank entries on this device and flag those that no longer hold (`aoe bank verify`).

A bank entry keeps no weights, but its signature says everything that decides speed:
op types, attributes, wiring, shapes and dtypes, which inputs are constant. So a task
is rebuilt from its signature alone, with random constants, and the rebuild is accepted
only if its own signature has the entry's digest. The default form and the entry's
strategy are then measured interleaved on the device (the runner process the tuner
uses, through the machine-wide device lock), and the verdict is:

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
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from aoe.errors import AoedError, DeviceError
from aoe.recordcheck import RecordError, check_record
from aoe.signature import ModelContext, task_signature
from aoe.bankrecord import BankRecord
from aoed.engine.decisions import clearly_faster
from aoed.engine.ledger import JobLedger, new_job_id
from aoed.engine.messages import (
    Candidate,
    MeasurePlan,
    MeasureReply,
    MeasureRequest,
    PrepareReply,
    PrepareRequest,
    RebuildReply,
    RebuildRequest,
    SamplesReply,
    SamplesRequest,
)
from aoed.engine.policy import policy
from aoed.engine.pool import model_step
from aoed.engine.prep import Limits

if TYPE_CHECKING:
    from aoed.engine.engine import Engine

__all__ = ["RebuildError", "Verdict", "rebuild_task", "sample_entries", "verify_entries"]

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
        raise RebuildError(
            f"attribute {name!r} holds a tensor or graph, which signatures keep only as a hash"
        )
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
            nd["op"],
            list(nd["in"]),
            [f"n{j}.{k}" for k in range(n_out[j])],
            name=f"n{j}",
            domain=nd["domain"] or None,
        )
        node.attribute.extend(_attribute(k, v) for k, v in sorted(nd["attrs"].items()))
        nodes.append(node)
    outputs = [
        helper.make_tensor_value_info(
            f"n{len(nodes) - 1}.{k}",
            helper.np_dtype_to_tensor_dtype(np.dtype(t["dtype"])),
            t["shape"],
        )
        for k, t in enumerate(outputs_desc)
    ]
    opsets = dict(desc.get("opsets", {}))
    opsets.setdefault("", 13)
    graph = helper.make_graph(nodes, "verify", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    )
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


def sample_entries(
    entries: Sequence[BankRecord], sample_size: int, seed: int, op_type: str = ""
) -> list[BankRecord]:
    """`sample_size` entries (all when 0) chosen with `seed`, anchor op type filtered."""
    pool = [e for e in entries if not op_type or e.signature.op_type.split("+")[0] == op_type]
    if sample_size and sample_size < len(pool):
        pool = random.Random(seed).sample(pool, sample_size)
    return pool


async def _models_by_signature(
    engine: Engine, models: Sequence[Path], workdir: Path, ledger: JobLedger
) -> dict[str, tuple[Path, Path]]:
    """Model signature digest -> (prepared model, an input sample) for `models`."""
    out: dict[str, tuple[Path, Path]] = {}
    for i, src in enumerate(models):
        work = workdir / f"model{i}"
        prep: PrepareReply = await model_step(
            engine.pool,
            PrepareRequest(src, work, limits=Limits.of(engine.config)),
            ledger,
            src,
            "graph preparation",
        )
        samples: SamplesReply = await model_step(
            engine.pool,
            SamplesRequest(prep.prepared, work, prep.inputs, prep.int_high),
            ledger,
            src,
            "writing input samples",
        )
        out[prep.model_signature.digest] = (prep.prepared, samples.held_back[0])
    return out


async def _verify_options(
    engine: Engine,
    e: BankRecord,
    v: Verdict,
    model: tuple[Path, Path],
    budget_s: float,
    ledger: JobLedger,
) -> list[tuple[bytes, dict]]:
    """A/B a model-level entry's session options on the model they were chosen for."""
    options = json.loads(e.strategy)
    path, inputs = model
    cands = (Candidate("without", path), Candidate("with", path, options))
    try:
        reply: MeasureReply = await engine.device.call(
            MeasureRequest(
                cands,
                inputs,
                "without",
                engine.device.device,
                MeasurePlan.fixed(15, max(budget_s, 2.0)),
            ),
            ledger,
        )
    except DeviceError as exc:
        v.verdict, v.detail = "error", str(exc)
        return []
    results = reply.results
    win, base = results["with"], results["without"]
    v.winner, v.baseline = win.summary(), base.summary()
    if not (win.ok and base.ok):
        v.verdict, v.detail = "error", win.error or base.error
    elif not options:
        v.verdict, v.detail = "confirmed", "no session options stored: nothing to re-check"
    elif clearly_faster(win, base):
        v.verdict = "confirmed"
        v.detail = f"with {options}: {win.median_us:.1f} us, clearly faster than without ({base.median_us:.1f} us)"
    else:
        v.verdict = "regressed"
        v.detail = f"with {options}: {win.median_us:.1f} us, not clearly faster than without ({base.median_us:.1f} us)"
    return [
        (e.key, {"verify": True, "strategy": name, "time": time.time(), **r.summary()})
        for name, r in results.items()
    ]


async def verify_entries(
    engine: Engine, entries: Sequence[BankRecord], budget_s: float, models: Sequence[Path] = ()
) -> tuple[list[Verdict], list[tuple[bytes, dict]]]:
    """Re-measure `entries` on the engine's device, one at a time; returns the verdicts
    and the history trials to record. A model-level entry (session options) is checked
    on its model when `models` include it (by model signature), else skipped saying so.
    Cancellation stops at once (see the agents)."""
    here = engine.device.device.fingerprint().digest
    verdicts: list[Verdict] = []
    trials: list[tuple[bytes, dict]] = []
    ledger = JobLedger(new_job_id().replace("job-", "verify-"))
    with tempfile.TemporaryDirectory(prefix="aoe-verify-") as tmp:
        by_sig = await _models_by_signature(engine, models, Path(tmp), ledger) if models else {}
        for n, e in enumerate(entries):
            v = Verdict(e.key.decode(), e.signature.op_type, e.strategy, "skipped")
            verdicts.append(v)
            if e.family == "gdat":
                v.detail = (
                    "a DDP configuration for a gradient layout (GDAT): re-measure it with aoe tune "
                    "--job-type gdat --repeat-tune"
                )
                continue
            if e.device.digest != here:
                v.detail = f"measured on another device ({e.device.hardware}, onnxruntime {e.device.runtime_version})"
                continue
            if e.family == "session":
                if e.signature.digest in by_sig:
                    try:  # a bank is data: only options this tuner sets are measured
                        check_record(e, engine.registry.vocabulary())
                    except RecordError as exc:
                        v.verdict, v.detail = "error", f"not a record this tuner writes ({exc})"
                        continue
                    trials += await _verify_options(
                        engine, e, v, by_sig[e.signature.digest], budget_s, ledger
                    )
                else:
                    v.detail = (
                        "model-wide session options: pass the model (--model FILE) to re-check them"
                    )
                continue
            req = RebuildRequest(
                e.signature.canonical_json,
                e.signature.digest,
                e.family,
                e.strategy,
                e.precision,
                Path(tmp) / f"e{n}",
            )
            try:
                rebuilt: RebuildReply = await engine.pool.call(req, ledger)
            except AoedError as exc:  # the worker failed, not the entry
                v.verdict, v.detail = "error", str(exc)
                continue
            if not rebuilt.ok:
                v.verdict, v.detail = rebuilt.verdict, rebuilt.detail
                continue
            assert rebuilt.default and rebuilt.candidate and rebuilt.inputs
            cands = (
                Candidate("default", rebuilt.default),
                Candidate("strategy", rebuilt.candidate),
            )
            try:
                measured: MeasureReply = await engine.device.call(
                    MeasureRequest(
                        cands,
                        rebuilt.inputs,
                        "default",
                        engine.device.device,
                        MeasurePlan(budget_s),
                    ),
                    ledger,
                )
            except DeviceError as exc:
                v.verdict, v.detail = "error", str(exc)
                continue
            results = measured.results
            base, win = results["default"], results["strategy"]
            for cid, r in results.items():
                name = e.strategy if cid == "strategy" else cid
                trials.append(
                    (e.key, {"verify": True, "strategy": name, "time": time.time(), **r.summary()})
                )
            v.winner, v.baseline = win.summary(), base.summary()
            if not (base.ok and win.ok):
                v.verdict, v.detail = "error", win.error or base.error or "measurement failed"
            elif not policy(e.precision).task_ok(win.accuracy()):
                v.verdict = "inaccurate"
                v.detail = f"max rel error {win.max_rel_error:.3g}, cosine {win.cosine:.6f}"
            elif clearly_faster(win, base):
                v.verdict = "confirmed"
                v.detail = f"{win.median_us:.1f} us, clearly faster than the default's {base.median_us:.1f} us"
            else:
                v.verdict = "regressed"
                v.detail = (
                    f"{win.median_us:.1f} us, not clearly faster than the default's {base.median_us:.1f} us "
                    f"(banked {e.winner.median_us:.1f} us vs {e.baseline.median_us:.1f} us)"
                )
    return verdicts, trials

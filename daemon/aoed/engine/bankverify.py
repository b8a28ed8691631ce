"""Re-measure bank entries on this device and flag those that no longer hold (`aoe bank verify`).

A bank entry keeps no weights, but its signature says everything that decides speed:
op types, attributes, wiring, shapes and dtypes, which inputs are constant; and the
entry describes the inputs it was decided on (engine/taskinputs.py: how its activations
were distributed, the values of its small constants). So a task is rebuilt from its
signature and that description, with random weights, and the rebuild is accepted only
if its own signature has the entry's digest. The default form and the entry's strategy
are then measured interleaved on the device (the runner process the tuner uses, through
the machine-wide device lock), and the verdict is:

  confirmed     the strategy is clearly faster than the default (the tuner's rule on
                paired rounds: decisions.clearly_faster), within accuracy
  regressed     it is clearly slower: the whole 90% interval of the round ratio lies
                above 1 (decisions.clearly_slower), on cores that are free
  inaccurate    its outputs are outside the entry's precision policy, on inputs drawn
                like those it was decided on
  inconclusive  neither clearly faster nor clearly slower; or slower while the cores
                are busy (session.busy_cores_note's probe); or outside the policy on
                inputs not drawn like the task's (an entry that keeps no description):
                said why, condemning nothing
  skipped       not measurable here: another device, model-wide session options
                without their model, or a task that cannot be rebuilt (a tensor
                attribute, constants it keeps no values of), said why in one line
  error         the strategy no longer applies, or the measurement failed

Every entry gets a verdict: nothing one entry does ends the run. Fresh measurements are
appended to the bank's history (as every trial is).
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

from aoe.bankrecord import BankRecord
from aoe.errors import AoedError, DeviceError
from aoe.recordcheck import RecordError, check_record
from aoe.signature import ModelContext, task_signature
from aoed.engine.decisions import clearly_faster, clearly_slower, paired_ratio
from aoed.engine.ledger import JobLedger, new_job_id
from aoed.engine.messages import (
    Candidate,
    Measurement,
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
from aoed.engine.taskinputs import TaskInputs

if TYPE_CHECKING:
    from aoed.engine.engine import Engine

__all__ = [
    "RebuildError",
    "Verdict",
    "judge_speed",
    "rebuild_task",
    "sample_entries",
    "task_feeds",
    "verify_entries",
]

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


def _positive_inputs(nodes_desc: Sequence[dict[str, Any]]) -> set[str]:
    """The task inputs that must be positive to mean anything: a BatchNormalization's
    variance (a negative one is a NaN after its square root)."""
    return {
        nd["in"][4]
        for nd in nodes_desc
        if nd["op"] == "BatchNormalization" and len(nd["in"]) > 4 and nd["in"][4].startswith("i")
    }


def rebuild_task(
    canonical_json: str, digest: str, described: TaskInputs | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A standalone model of the task a signature describes; returns (model, constants
    by name). Constants the entry `described` are as they were (GELU's scalars, Reshape
    targets), the others random initializers. Raises RebuildError when the rebuild does
    not check or its signature is not `digest`, saying why in one line."""
    try:
        desc = json.loads(canonical_json)
        nodes_desc, inputs_desc, outputs_desc = desc["nodes"], desc["inputs"], desc["outputs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RebuildError(f"unreadable signature ({exc})") from None
    rng = np.random.default_rng(_REBUILD_SEED)
    positive = _positive_inputs(nodes_desc)
    inputs, inits, consts = [], [], {}
    for i, t in enumerate(inputs_desc):
        name, dt = f"i{i}", np.dtype(t["dtype"])
        if t.get("const"):
            try:
                value = described.draw(i, dt, t["shape"], rng) if described else None
            except ValueError as exc:
                raise RebuildError(str(exc)) from None
            if value is None and dt.kind == "f":
                value = (rng.standard_normal(t["shape"]) * 0.1).astype(dt)
                if name in positive:
                    value = np.abs(value) + np.array(0.5, dt)
            elif value is None:
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
    except Exception as exc:  # onnx raises several kinds; each says what did not fit
        why = _first_line(exc)
        if described is None and any(consts[n].dtype.kind in "iu" for n in consts):
            # random shapes and axes: the likely cause, and what would cure it
            why += (
                "; the entry keeps no values of its integer constants (shapes, axes), "
                "so they were made up: re-tune its model to record them"
            )
        raise RebuildError(f"the rebuilt task does not check: {why}") from None
    ctx = ModelContext(model)
    try:
        sig = task_signature(list(model.graph.node), ctx)
    except ValueError as exc:
        raise RebuildError(_first_line(exc)) from None
    if sig.digest != digest:
        raise RebuildError("the rebuilt task's signature differs from the entry's")
    return model, consts


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without its trailing colon."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__).rstrip(":").strip()


def task_feeds(
    model: onnx.ModelProto, described: TaskInputs | None
) -> tuple[dict[str, np.ndarray], str]:
    """Inputs for a rebuilt task (`rebuild_task`): drawn as `described`, else floats
    N(0, 1) and integers in [0, 8); and, when they are not drawn like the task's, why
    ("" when they are). ValueError when a described input does not fit."""
    ctx = ModelContext(model)
    rng = np.random.default_rng(7)
    feeds, unknown = {}, []
    for vi in model.graph.input:
        info = ctx.tensors[vi.name]
        dt = np.dtype(info.dtype)
        value = described.draw(int(vi.name[1:]), dt, info.shape, rng) if described else None
        if value is None:
            unknown.append(vi.name)
            value = (
                rng.standard_normal(info.shape).astype(dt)
                if dt.kind == "f"
                else rng.integers(0, 8, size=info.shape).astype(dt)
            )
        feeds[vi.name] = value
    if described is None:
        return feeds, (
            "inputs drawn from N(0, 1) and constants at random, not like the task's: the entry "
            "keeps no description of what it was decided on (written before aoed kept one)"
        )
    if unknown:
        return (
            feeds,
            f"inputs {', '.join(unknown)} drawn from N(0, 1): the entry does not describe them",
        )
    return feeds, ""


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


async def _busy(engine: Engine, ledger: JobLedger, workdir: Path) -> str:
    """Why a slower reading on this device condemns nothing now: its cores are busy
    (session.busy_cores_note's rule, measured on its probe), or the probe could not
    tell; "" when they are free (or there is one core, which the probe cannot judge)."""
    import trio

    from aoed.engine.session import QUIET_SCALING, busy_cores_note, probe_model

    cores = engine.device.cores
    if cores < 2:
        return ""
    model, inputs = await trio.to_thread.run_sync(probe_model, workdir / "cores_probe")
    cands = (
        Candidate("one", model, {"intra_op_num_threads": 1}),
        Candidate("every", model, {"intra_op_num_threads": cores}),
    )
    try:
        reply: MeasureReply = await engine.device.call(
            MeasureRequest(cands, inputs, "every", engine.device.device, MeasurePlan.fixed(7, 0.5)),
            ledger,
        )
    except DeviceError as exc:
        return f"whether the cores are free could not be measured ({exc}), so nothing is condemned"
    one, every = reply.results["one"], reply.results["every"]
    if busy_cores_note(one, every, cores) is None:
        return ""
    if not (one.ok and every.ok and every.median_us > 0):
        return "whether the cores are free could not be measured, so nothing is condemned"
    return (
        f"the cores are busy: a product ran {one.median_us / every.median_us:.2f}x as fast on {cores} "
        f"threads as on one (at least {QUIET_SCALING}x when they are free), so a slower reading "
        "condemns nothing; verify again when the machine is quiet"
    )


async def judge_speed(
    engine: Engine,
    v: Verdict,
    win: Measurement,
    base: Measurement,
    names: tuple[str, str],
    ledger: JobLedger,
    workdir: Path,
) -> None:
    """The tuner's rule on paired rounds (decisions.py), `names` = (winner, baseline) as
    the detail says them: confirmed when the winner is clearly faster; regressed only
    when it is clearly slower (the whole 90% interval of the round ratio above 1) on
    free cores; inconclusive otherwise, saying why."""
    what, other = names
    med, lo, hi = paired_ratio(win, base)
    figures = (
        f"{what}: {win.median_us:.1f} us, {other}: {base.median_us:.1f} us; median round ratio "
        f"{med:.3f}, 90% interval [{lo:.3f}, {hi:.3f}]"
    )
    if clearly_faster(win, base):
        v.verdict, v.detail = "confirmed", f"clearly faster ({figures})"
    elif clearly_slower(win, base):
        busy = await _busy(engine, ledger, workdir)
        if busy:
            v.verdict, v.detail = "inconclusive", f"slower ({figures}), but {busy}"
        else:
            v.verdict, v.detail = (
                "regressed",
                f"clearly slower: the interval lies above 1 ({figures})",
            )
    else:
        v.verdict = "inconclusive"
        v.detail = f"neither clearly faster nor clearly slower ({figures})"


async def _verify_options(
    engine: Engine,
    e: BankRecord,
    v: Verdict,
    model: tuple[Path, Path],
    budget_s: float,
    ledger: JobLedger,
    workdir: Path,
) -> list[tuple[bytes, dict[str, Any]]]:
    """A/B a model-level entry's session options on the model they were chosen for, as
    deployed: each form in a process of its own (MeasurePlan.deployed), as the tuner
    decided them."""
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
                MeasurePlan.fixed(15, max(budget_s, 2.0), deployed=True),
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
    else:
        await judge_speed(engine, v, win, base, (f"with {options}", "without"), ledger, workdir)
    return [
        (e.key, {"verify": True, "strategy": name, "time": time.time(), **r.summary()})
        for name, r in results.items()
    ]


async def _verify_task(
    engine: Engine, e: BankRecord, v: Verdict, budget_s: float, ledger: JobLedger, workdir: Path
) -> list[tuple[bytes, dict[str, Any]]]:
    """Rebuild an operator or subgraph entry's task, measure its default and strategy
    forms interleaved, and judge: accuracy first (on inputs drawn like those it was
    decided on, or saying why not), then speed (`judge_speed`)."""
    req = RebuildRequest(
        e.signature.canonical_json,
        e.signature.digest,
        e.family,
        e.strategy,
        e.precision,
        workdir,
        dict(e.params),
    )
    try:
        rebuilt: RebuildReply = await engine.pool.call(req, ledger)
    except AoedError as exc:  # the worker failed, not the entry
        v.verdict, v.detail = "error", f"rebuilding the task failed: {exc}"
        return []
    if not rebuilt.ok:
        v.verdict, v.detail = rebuilt.verdict, rebuilt.detail
        return []
    assert rebuilt.default and rebuilt.candidate and rebuilt.inputs
    cands = (Candidate("default", rebuilt.default), Candidate("strategy", rebuilt.candidate))
    try:
        measured: MeasureReply = await engine.device.call(
            MeasureRequest(
                cands,
                rebuilt.inputs,
                "default",
                engine.device.device,
                MeasurePlan(budget_s, race=False),  # both measured every round: paired
            ),
            ledger,
        )
    except DeviceError as exc:
        v.verdict, v.detail = "error", str(exc)
        return []
    results = measured.results
    base, win = results["default"], results["strategy"]
    trials = [
        (
            e.key,
            {
                "verify": True,
                "strategy": e.strategy if cid == "strategy" else cid,
                "time": time.time(),
                **r.summary(),
            },
        )
        for cid, r in results.items()
    ]
    v.winner, v.baseline = win.summary(), base.summary()
    if not (base.ok and win.ok):
        v.verdict, v.detail = "error", win.error or base.error or "measurement failed"
        return trials
    accuracy = f"max rel error {win.max_rel_error:.3g}, cosine {win.cosine:.6f}"
    if not policy(e.precision).task_ok(win.accuracy()):
        if rebuilt.unlike:
            v.verdict = "inconclusive"
            v.detail = (
                f"outputs outside the {e.precision} policy ({accuracy}), but {rebuilt.unlike}"
            )
        else:
            v.verdict = "inaccurate"
            v.detail = f"{accuracy}, on inputs drawn like those it was decided on"
        return trials
    await judge_speed(engine, v, win, base, (e.strategy, "default"), ledger, workdir)
    v.detail += f"; banked {e.winner.median_us:.1f} us vs {e.baseline.median_us:.1f} us"
    if rebuilt.unlike:
        v.detail += f"; {rebuilt.unlike}"
    return trials


def _not_measurable(e: BankRecord, here: str) -> str:
    """Why `e` is not measured on this device ("" when it is)."""
    if e.family == "gdat":
        return (
            "a DDP configuration for a gradient layout (GDAT): re-measure it with aoe tune "
            "--job-type gdat --repeat-tune"
        )
    if e.device.digest != here:
        return f"measured on another device ({e.device.hardware}, onnxruntime {e.device.runtime_version})"
    return ""


async def verify_entries(
    engine: Engine, entries: Sequence[BankRecord], budget_s: float, models: Sequence[Path] = ()
) -> tuple[list[Verdict], list[tuple[bytes, dict[str, Any]]]]:
    """Re-measure `entries` on the engine's device, one at a time; returns the verdicts
    (one per entry, whatever happens to it) and the history trials to record. A
    model-level entry (session options) is checked on its model when `models` include it
    (by model signature), else skipped saying so. Cancellation stops at once (see the
    agents)."""
    here = engine.device.device.fingerprint().digest
    verdicts: list[Verdict] = []
    trials: list[tuple[bytes, dict[str, Any]]] = []
    ledger = JobLedger(new_job_id().replace("job-", "verify-"))
    with tempfile.TemporaryDirectory(prefix="aoe-verify-") as tmp:
        by_sig = await _models_by_signature(engine, models, Path(tmp), ledger) if models else {}
        for n, e in enumerate(entries):
            v = Verdict(e.key.decode(), e.signature.op_type, e.strategy, "skipped")
            verdicts.append(v)
            v.detail = _not_measurable(e, here)
            if v.detail:
                continue
            if e.family != "session":
                trials += await _verify_task(engine, e, v, budget_s, ledger, Path(tmp) / f"e{n}")
            elif e.signature.digest not in by_sig:
                v.detail = (
                    "model-wide session options: pass the model (--model FILE) to re-check them"
                )
            else:
                try:  # a bank is data: only options this tuner sets are measured
                    check_record(e, engine.registry.vocabulary())
                except RecordError as exc:
                    v.verdict, v.detail = "error", f"not a record this tuner writes ({exc})"
                    continue
                model = by_sig[e.signature.digest]
                trials += await _verify_options(
                    engine, e, v, model, budget_s, ledger, Path(tmp) / f"e{n}"
                )
    return verdicts, trials

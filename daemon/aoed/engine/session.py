"""Model-wide session options, searched in context on the assembled model.

One dimension at a time (coordinate descent): the current options against each value of
the next dimension (optimization level, execution mode), measured on the whole model as
deployed, each candidate in a process of its own (MeasurePlan.deployed), so an option
that oversubscribes the cores is measured doing so; a value is kept only when it clearly
beats the current options (see `decisions`). Gains compound across dimensions, and the result is stored
as the model-level bank record, under the model's signature, by AOE's rules. The
record is written after end-to-end verification, together with what that verification
reverted in context (`remember_context`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoe.bankrecord import BankRecord
from aoe.device import Device
from aoe.errors import DeviceError
from aoe.recordcheck import SESSION_FAMILY
from aoe.signature import TaskSignature, canonical_json
from aoe.spec import Stage
from aoed.bank.writer import BankWrite
from aoed.engine import bankrules, decisions
from aoed.engine.budget import Budget
from aoed.engine.context import JobContext
from aoed.engine.messages import Candidate, Measurement, MeasurePlan

__all__ = [
    "QUIET_SCALING",
    "base_options",
    "merge_options",
    "SessionChoice",
    "busy_cores",
    "busy_cores_note",
    "fewer_threads",
    "probe_model",
    "remember_context",
    "search_session",
]

#: How much faster `probe_model` must run on all of a CPU's cores than on one for the
#: thread count to be tuned. Measured here on 2 free cores: 1.78-1.86x; with a busy loop
#: on one of them, 0.99x at first.
QUIET_SCALING = 1.4


def probe_model(folder: Path) -> tuple[Path, Path]:
    """Write the probe (one [256, 512] x [512, 512] float product, fixed values) and its
    inputs into `folder`, unless they are there already; (model, inputs)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model, inputs = folder / "cores_probe.onnx", folder / "cores_probe.npz"
    if model.exists() and inputs.exists():  # a job probes up to three times
        return model, inputs
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((512, 512)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="probe")],
        "cores_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    np.savez(inputs, x=rng.standard_normal((256, 512)).astype(np.float32))
    return model, inputs


def busy_cores_note(one: Measurement, every: Measurement, cores: int) -> str | None:
    """Why the thread count is not tuned when the probe on one thread (`one`) and on all
    `cores` (`every`) shows the cores busy; None when they are free."""
    if not (one.ok and every.ok and every.median_us > 0):
        return "session options: intra-op threads not tuned: the cores probe could not be measured"
    scaling = one.median_us / every.median_us
    if math.isfinite(scaling) and scaling >= QUIET_SCALING:
        return None
    return (
        f"session options: intra-op threads not tuned: a product ran {scaling:.2f}x as fast on {cores} threads as on "
        f"one (at least {QUIET_SCALING}x when the cores are free); other work holds them, and a thread count "
        f"chosen now would not hold once it stops"
    )


def dimensions(cores: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The option values tried, per dimension, on a device with `cores` cores.

    Spinning is not one: sessions are measured with it off (runner.quiet), so it cannot
    be told apart, and a user's single session spins or not as it likes. Nor is the
    intra-op thread count, for the same reason: with spinning off, every parallel kernel
    of an all-core session pays a thread wake-up that a deployed session (spinning on, the
    default) does not, and a session on fewer threads pays none, so fewer threads won
    here where they lose once deployed. Measured on hf_llama_gqa (2 cores), the int8 model
    with the `intra_op_num_threads=1` its job had chosen ran 1.11x quantize_dynamic's
    speed with spinning off and 0.79x with onnxruntime's defaults. `cores` is kept for
    devices whose dimensions depend on it.
    """
    del cores
    return [
        (
            "graph_optimization_level",
            [{"graph_optimization_level": lv} for lv in ("basic", "extended")],
        ),
        ("execution_mode", [{"execution_mode": "parallel"}]),
    ]


def base_options(device: Device) -> dict[str, Any]:
    """The options the search starts from on `device`: none on the CPU; on an
    accelerator its providers as a session on it names them (Device.default_providers)."""
    return {} if device.is_cpu else {"providers": device.default_providers()}


def merge_options(current: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """`current` with `change` applied: session options replaced, `config` entries merged,
    and each provider's options merged into that provider's. A change that brings a
    provider in sets the order (its providers first, in its order); one that only sets
    options keeps the current order."""
    out = {**current, **{k: v for k, v in change.items() if k != "providers"}}
    if "config" in current or "config" in change:
        out["config"] = {**current.get("config", {}), **change.get("config", {})}
    if "providers" in change:
        now = [name for name, _ in current.get("providers", [])]
        merged = {name: dict(opts) for name, opts in current.get("providers", [])}
        for name, opts in change["providers"]:
            merged[name] = {**merged.get(name, {}), **opts}
        asked = [name for name, _ in change["providers"]]
        order = asked + [n for n in now if n not in asked] if set(asked) - set(now) else now
        out["providers"] = [[name, merged[name]] for name in order]
    return out


def accelerator_dimensions(ctx: JobContext) -> list[tuple[str, list[dict[str, Any]]]]:
    """The model-wide option space of the job's accelerator (the backend's, through the
    registry). Its options name no file: TensorRT's caches are the measuring session's
    own (`JobContext.provider_files`), never part of what the bank stores."""
    space = ctx.registry.session_space
    if space is None or ctx.prep is None:
        return []
    return space(ctx.device.device, ctx.spec.precision, frozenset(ctx.prep.op_types))


@dataclass
class SessionChoice:
    options: dict[str, Any]
    mode: str  # hit | add | update | reserved | unsatisfied
    #: the model-level record to store after verification (None: nothing new measured)
    write: BankRecord | dict[str, Any] | None = None
    trials: int = 0


async def search_session(
    ctx: JobContext,
    model_path: Path,
    signature: TaskSignature,
    ans: bankrules.BankAnswer,
    budget: Budget,
) -> SessionChoice:
    """Choose model-wide session options for the model at `model_path`, within what
    `budget` has left (dimensions it cannot afford are not tried); a device failure ends
    the search with what it found."""
    if ans.usable(ctx.spec.repeat_tune, ctx.run.resumes):
        if ans.record is not None:
            return SessionChoice(json.loads(ans.record.strategy), "hit")
        return SessionChoice({}, "hit")
    await ctx.stage(Stage.SESSION, "tuning session options")
    key = ctx.key(signature)
    base = base_options(ctx.device.device)
    current: dict[str, Any] = dict(base)
    base_res: Measurement | None = None
    cur_res: Measurement | None = None
    trials: list[tuple[bytes, dict[str, Any]]] = []
    dims = dimensions(ctx.device.cores) if ctx.device.device.is_cpu else accelerator_dimensions(ctx)
    pool = budget.for_session()
    for i, (dim, values) in enumerate(dims):
        share = min(2.0, pool / (len(dims) - i), budget.open_s)
        seconds, load = budget.measurable(share, [model_path] * (len(values) + 1))
        if seconds < 0.3:
            why = (
                f" (loading its {len(values) + 1} sessions would take about {load:.2f} s of {share:.2f} s)"
                if share >= 0.3
                else ""
            )
            ctx.notes.append(
                f"session options: {', '.join(d for d, _ in dims[i:])} not tried, the budget is "
                f"spent{why}"
            )
            break
        cands = {"current": current}
        for v in values:
            cands[canonical_json(v)] = merge_options(current, v)
        before = ctx.ledger.device_by.get("session", 0.0)
        try:
            measured = await ctx.measure(
                [Candidate(k, model_path, o) for k, o in cands.items()],
                "current",
                seconds,
                plan=MeasurePlan(deployed=True),
                category="session",
            )
        except DeviceError as exc:
            ctx.notes.append(f"session options: search stopped at {dim} ({exc})")
            break
        pool -= ctx.ledger.device_by.get("session", 0.0) - before
        trials += [
            (
                key,
                {
                    "task": "session",
                    "dimension": dim,
                    "options": cands[k],
                    "job": ctx.job_id,
                    **r.summary(),
                },
            )
            for k, r in measured.items()
        ]
        if base_res is None:
            base_res = measured["current"]
        best = decisions.best(measured, "current", lambda m: ctx.policy.task_ok(m.accuracy()))
        if best != "current":
            current = cands[best]
        cur_res = measured[best]
    if base_res is None or cur_res is None:  # nothing measured: keep the defaults, store nothing
        spent = any("budget is spent" in n for n in ctx.notes)
        return SessionChoice({}, "skipped" if spent else "failed", None, 0)
    await ctx.write_bank(BankWrite(trials=tuple(trials)))
    strategy = canonical_json(current)
    rec = ans.record
    if rec is None:
        if current != base:
            write = bankrules.make_record(
                key,
                signature,
                ctx.fingerprint,
                strategy,
                SESSION_FAMILY,
                ctx.spec.precision,
                cur_res,
                base_res,
                ctx.job_id,
                ctx.run.model.name,
            )
            return SessionChoice(current, "add", write, len(trials))
        return SessionChoice(
            {}, "unsatisfied", {"default_us": base_res.median_us, "job": ctx.job_id}, len(trials)
        )
    if strategy != rec.strategy and current != base:
        write = bankrules.make_record(
            key,
            signature,
            ctx.fingerprint,
            strategy,
            SESSION_FAMILY,
            ctx.spec.precision,
            cur_res,
            base_res,
            ctx.job_id,
            ctx.run.model.name,
        )
        return SessionChoice(current, "update", write, len(trials))
    return SessionChoice(json.loads(rec.strategy), "reserved", None, len(trials))


def fewer_threads(options: dict[str, Any], cores: int) -> bool:
    """Whether `options` run fewer intra-op threads than the device has cores."""
    threads = options.get("intra_op_num_threads") or 0
    return 0 < int(threads) < cores


async def busy_cores(ctx: JobContext, seconds: float) -> str | None:
    """`busy_cores_note` of the probe measured on the job's device now."""
    import trio

    model, inputs = await trio.to_thread.run_sync(
        probe_model, ctx.workspace.scratch / "cores_probe"
    )
    cores = ctx.device.cores
    try:
        got = await ctx.measure(
            [
                Candidate("one", model, {"intra_op_num_threads": 1}),
                Candidate("every", model, {"intra_op_num_threads": cores}),
            ],
            "every",
            seconds,
            inputs=inputs,
            plan=MeasurePlan.fixed(7, seconds),
            category="session",
        )
    except DeviceError as exc:
        return f"session options: intra-op threads not tuned: the cores probe failed ({exc})"
    return busy_cores_note(got["one"], got["every"], cores)


async def remember_context(
    ctx: JobContext,
    signature: TaskSignature,
    ans: bankrules.BankAnswer,
    choice: SessionChoice,
    reverted: Iterable[str],
    confirmed: str,
    evidence: tuple[Measurement, Measurement] | None,
    baseline_us: float = 0.0,
    runtime: str = "",
) -> None:
    """Store the model-level record: the session options the confirming A/B kept (as
    `choice.options`; "{}" when none), its rounds as their evidence (`evidence`: with
    options, without), the signature digests of tasks reverted in this model's context
    (so `aoe compile` and bank-hit runs leave them unchanged) and the confirmation
    itself (`confirmed`, JSON; the bank-hit path reuses it), and the other runtime whose
    build shipped (`runtime`: aoe.ovartifact.RuntimeDecision's JSON; "" for onnxruntime).
    `baseline_us` times the
    input model for a record that has no timing yet. Nothing is written when the bank
    already holds exactly this."""
    reverted = sorted(reverted)
    options = canonical_json(choice.options)
    old = ans.record
    params = {"reverted": ",".join(reverted)} if reverted else {}
    if confirmed:
        params["confirmed"] = confirmed
    if runtime:
        params["runtime"] = runtime
    if old is not None and evidence is None and old.strategy == options and old.params == params:
        return
    key = ctx.key(signature)
    if evidence is not None:
        win, base = evidence
        rec = bankrules.make_record(
            key,
            signature,
            ctx.fingerprint,
            options,
            SESSION_FAMILY,
            ctx.spec.precision,
            win,
            base,
            ctx.job_id,
            ctx.run.model.name,
            params,
        )
    elif old is not None:
        rec = dataclasses.replace(old, strategy=options, params=params)
    elif isinstance(choice.write, BankRecord):
        rec = dataclasses.replace(choice.write, strategy=options, params=params)
    else:  # no options and nothing measured for them: AOE's "default stays best" record
        doc = dict(choice.write) if isinstance(choice.write, dict) else dict(ans.default or {})
        doc.update({"reverted": reverted, "job": doc.get("job", ctx.job_id)})
        if not doc.get("default_us"):  # the input model as the confirming A/B measured it
            doc["default_us"] = baseline_us
        if confirmed:
            doc["confirmed"] = confirmed
        doc.pop("runtime", None)
        if runtime:
            doc["runtime"] = runtime
        if ans.default is not None and doc == dict(ans.default):
            return
        await ctx.write_bank(BankWrite(defaults=((key, doc),)))
        return
    await ctx.write_bank(BankWrite(entries=(rec,)))

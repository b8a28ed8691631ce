"""Model-wide session options, searched in context on the assembled model.

One dimension at a time (coordinate descent): the current options against each value of
the next dimension (threads, spinning, optimization level, execution mode), measured
interleaved on the whole model; a value is kept only when it clearly beats the current
options (see `decisions`). Gains compound across dimensions, and the result is stored
as the model-level bank record, under the model's signature, by AOE's rules. The
record is written after end-to-end verification, together with what that verification
reverted in context (`remember_context`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoe.signature import TaskSignature, canonical_json
from aoed.bank._codec import BankRecord
from aoed.bank.writer import BankWrite
from aoed.engine import bankrules, decisions
from aoed.engine.assemble import SESSION_FAMILY
from aoed.engine.context import JobContext
from aoed.engine.messages import Candidate, Measurement

__all__ = ["SessionChoice", "remember_context", "search_session"]


def dimensions(cores: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The option values tried, per dimension, on a device with `cores` cores."""
    threads = sorted({1, max(1, cores // 2), cores})
    return [
        ("intra_op_num_threads", [{"intra_op_num_threads": t} for t in threads]),
        ("allow_spinning", [{"config": {"session.intra_op.allow_spinning": "0"}}]),
        ("graph_optimization_level", [{"graph_optimization_level": lv} for lv in ("basic", "extended")]),
        ("execution_mode", [{"execution_mode": "parallel"}]),
    ]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if "config" in a or "config" in b:
        out["config"] = {**a.get("config", {}), **b.get("config", {})}
    return out


@dataclass
class SessionChoice:
    options: dict[str, Any]
    mode: str  # hit | add | update | reserved | unsatisfied
    #: the model-level record to store after verification (None: nothing new measured)
    write: BankRecord | dict[str, Any] | None = None
    trials: int = 0


async def search_session(
    ctx: JobContext, model_path: Path, signature: TaskSignature, ans: bankrules.BankAnswer
) -> SessionChoice:
    """Choose model-wide session options for the model at `model_path`."""
    if ans.usable(ctx.opts.repeat_tune):
        if ans.record is not None:
            return SessionChoice(json.loads(ans.record.strategy), "hit")
        return SessionChoice({}, "hit")
    ctx.emit("stage", "tuning session options")
    key = ctx.key(signature)
    current: dict[str, Any] = {}
    base_res: Measurement | None = None
    cur_res: Measurement | None = None
    trials: list[tuple[bytes, dict[str, Any]]] = []
    for dim, values in dimensions(ctx.device.cores):
        cands = {"current": current}
        for v in values:
            cands[canonical_json(v)] = _merge(current, v)
        measured = await ctx.measure(
            [Candidate(k, model_path, o) for k, o in cands.items()], "current", budget_s=2.0
        )
        trials += [(key, {"task": "session", "dimension": dim, "options": cands[k], "job": ctx.job_id,
                          **r.summary()}) for k, r in measured.items()]  # fmt: skip
        if base_res is None:
            base_res = measured["current"]
        best = decisions.best(measured, "current", lambda m: ctx.policy.task_ok(m.accuracy()))
        if best != "current":
            current = cands[best]
        cur_res = measured[best]
    assert base_res is not None and cur_res is not None
    await ctx.write_bank(BankWrite(trials=tuple(trials)))
    strategy = canonical_json(current)
    rec = ans.record
    if rec is None:
        if current:
            write = bankrules.make_record(key, signature, ctx.fingerprint, strategy, SESSION_FAMILY,
                                          ctx.opts.precision, cur_res, base_res, ctx.job_id, ctx.opts.model.name)  # fmt: skip
            return SessionChoice(current, "add", write, len(trials))
        return SessionChoice({}, "unsatisfied", {"default_us": base_res.median_us, "job": ctx.job_id}, len(trials))
    if strategy != rec.strategy and current:
        write = bankrules.make_record(key, signature, ctx.fingerprint, strategy, SESSION_FAMILY,
                                      ctx.opts.precision, cur_res, base_res, ctx.job_id, ctx.opts.model.name)  # fmt: skip
        return SessionChoice(current, "update", write, len(trials))
    return SessionChoice(json.loads(rec.strategy), "reserved", None, len(trials))


async def remember_context(
    ctx: JobContext,
    signature: TaskSignature,
    ans: bankrules.BankAnswer,
    choice: SessionChoice,
    reverted: Iterable[str],
) -> None:
    """Store the model-level record with the signature digests of the tasks reverted in
    this model's context, so `aoe compile` and bank-hit runs leave them unchanged."""
    reverted = sorted(reverted)
    write = choice.write
    if write is None:  # nothing newly measured: rewrite only if the set changed
        if reverted == sorted(bankrules.reverted_digests(ans)):
            return
        write = ans.record if ans.record is not None else dict(ans.default or {})
    if isinstance(write, BankRecord):
        params = {k: v for k, v in write.params.items() if k != "reverted"}
        if reverted:
            params["reverted"] = ",".join(reverted)
        await ctx.write_bank(BankWrite(entries=(dataclasses.replace(write, params=params),)))
    else:
        await ctx.write_bank(BankWrite(defaults=((ctx.key(signature), {**write, "reverted": reverted}),)))

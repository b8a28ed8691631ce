"""The lossy gate: a lossy bank entry re-checked on this model before it is applied.

A lossy entry's accuracy was judged on the model that tuned it, on that model's weights
and activations. Under a lossy policy every lossy hit is checked again here, on this
model's task (its real activations, its weights) against the task's accuracy gate, and
then, as the search does, in the model's context; an entry that fails, or whose strategy
no longer builds, is tuned again as a miss (`bankrules.BankAnswer("miss")`), with a note
that says why.
"""

from __future__ import annotations

from aoe.errors import AoedError, DeviceError
from aoe.partition import Task
from aoed.engine import bankrules, incontext
from aoed.engine.context import JobContext
from aoed.engine.messages import (
    Candidate,
    CompileReply,
    CompileRequest,
    ExtractRequest,
    MeasurePlan,
)
from aoed.engine.pool import model_step
from aoed.engine.registry import DEFAULT

__all__ = ["gate_lossy_hits"]


async def gate_lossy_hits(
    ctx: JobContext, tasks: list[Task], answers: dict[str, bankrules.BankAnswer]
) -> None:
    """A lossy bank entry was judged on another model's weights: check it on this one's
    (its task's real activations, this model's weights) before it is applied; one that
    fails the task's accuracy gate is tuned again, as a miss."""
    assert ctx.prep is not None
    lossy = {
        t.id: a.record
        for t in tasks
        if (a := answers[t.id]).kind == "hit"
        and a.record is not None
        and ctx.registry.get(t.family, a.record.strategy).precision != "exact"
    }
    if not lossy:
        return
    by_id = {t.id: t for t in tasks}
    root = ctx.workspace.scratch / "gate"
    await model_step(
        ctx.pool,
        ExtractRequest(ctx.prep.prepared, tuple(by_id[t] for t in lossy), ctx.held_back[0], root),
        ctx.ledger,
        ctx.run.shown_model,
        "extracting tasks",
    )
    for tid, rec in lossy.items():
        d = root / tid
        cands = [Candidate(DEFAULT, d / "default.onnx")]
        for name in (DEFAULT, rec.strategy):
            req = CompileRequest(
                d / "task.onnx",
                by_id[tid].family,
                name,
                f"aoe/{tid}",
                d / f"{name}.onnx",
                ctx.ranges,
            )
            try:
                reply: CompileReply = await ctx.pool.call(req, ctx.ledger)
            except AoedError:  # as in the search: a failed build is the candidate's
                break
            if not reply.applicable:
                break
        else:
            cands.append(Candidate(rec.strategy, d / f"{rec.strategy}.onnx"))
        why = "its strategy no longer builds here"
        if len(cands) == 2:
            try:
                m = await ctx.measure(
                    cands,
                    DEFAULT,
                    0.05,
                    d / "inputs.npz",
                    MeasurePlan(0.05, 1, 1, 1),
                    category="verify",
                )
            except DeviceError as exc:
                m, why = {}, f"its accuracy could not be measured ({exc})"
            got = m.get(rec.strategy)
            if got is not None and got.ok and ctx.policy.task_ok(got.accuracy()):
                continue
            if got is not None and got.ok:
                # as in the search: the model may absorb what the task alone does not
                ok, detail = incontext.verdict(
                    ctx, await incontext.model_accuracy(ctx, by_id[tid], rec.strategy)
                )
                if ok:
                    continue
                why = f"on this model's weights it was {detail}"
        ctx.notes.append(f"bank entry {rec.strategy} for {tid} not applied: {why}; tuned again")
        answers[tid] = bankrules.BankAnswer("miss")

"""The job supervisor: one job's pipeline from model file to tuned model and report.

    prepare (worker) -> samples (worker) -> calibrate (worker, lossy) -> bank lookups
    -> profile (device) -> extract task models (worker) -> task agents (pool + device)
    -> assemble (worker) -> accuracy budget (device, lossy) -> session options (device)
    -> verify (device) -> remember context (bank) -> tuned model (worker) -> result JSON

The supervisor decides the order and keeps the job's results; it never compiles,
measures or loads a model itself: the work happens in the engine's child processes, so
a crash in onnxruntime costs a request, never the host, and the event loop stays free.
"""

from __future__ import annotations

import logging
import resource

import trio

from aoe.errors import AoedError, ModelError
from aoe.partition import Task
from aoed.bank._codec import BankRecord
from aoed.engine import bankrules
from aoed.engine.assemble import tuned_metadata
from aoed.engine.context import JobContext
from aoed.engine.job import JobResult, TaskResult
from aoed.engine.messages import (
    Build,
    CalibrateRequest,
    CheckReply,
    CheckRequest,
    ExtractRequest,
    PrepareReply,
    PrepareRequest,
    ProfileReply,
    ProfileRequest,
    SamplesReply,
    SamplesRequest,
    error_from_wire,
    from_wire,
)
from aoed.engine.outputs import result_json, write_json
from aoed.engine.registry import DEFAULT
from aoed.engine.session import remember_context, search_session
from aoed.engine.taskagent import TaskAgent, TaskDecision
from aoed.engine.verify import REVERTED, hold_to_budget, verify

__all__ = ["run_stages"]

log = logging.getLogger(__name__)


async def _work(ctx: JobContext, request, reply_cls, what: str):
    """One request to the compile pool, its failure raised as the error the worker named
    (a crashed worker while preparing is the model's fault: ModelError)."""
    reply = await ctx.pool.call(request, ctx.ledger)
    if not reply.get("ok"):
        if reply.get("error_class") in (None, "CandidateError"):
            raise ModelError(f"{ctx.opts.model}: {what} failed: {reply.get('error')}")
        raise error_from_wire(reply, AoedError)
    return reply if reply_cls is None else from_wire(reply_cls, reply)


async def run_stages(ctx: JobContext) -> JobResult:
    opts, ws = ctx.opts, ctx.workspace
    ctx.emit("stage", f"preparing {opts.model.name}")
    prep: PrepareReply = await _work(
        ctx, PrepareRequest(opts.model, ws.scratch, opts.precision, dict(opts.input_shapes),
                            opts.keep_initializer_inputs), PrepareReply, "graph preparation")  # fmt: skip
    ctx.prep = prep
    ctx.notes.extend(prep.notes)
    samples: SamplesReply = await _work(
        ctx, SamplesRequest(prep.prepared, ws.scratch, prep.inputs, prep.int_high, opts.calibration,
                            ctx.policy.lossy), SamplesReply, "writing input samples")  # fmt: skip
    ctx.held_back = samples.held_back
    if ctx.policy.lossy:
        ctx.emit("stage", "calibrating")
        await _work(ctx, CalibrateRequest(prep.prepared, samples.calibrate, ws.scratch / "ranges.json"),
                    None, "calibration")  # fmt: skip
        ctx.ranges = ws.scratch / "ranges.json"

    tasks = list(prep.tasks)
    model_ans = await ctx.lookup(prep.model_signature)
    context_reverted = set() if opts.repeat_tune else bankrules.reverted_digests(model_ans)

    # Bank lookups first: what the bank answers costs no measurement.
    results: dict[str, TaskResult] = {t.id: TaskResult(t.id, t.anchor, t.op_type, t.instances) for t in tasks}
    chosen: dict[str, str] = {}
    hits: dict[str, BankRecord] = {}
    lossy_cost: dict[str, tuple[float, float]] = {}
    answers = {t.id: await ctx.lookup(t.signature) for t in tasks}
    hit_choices = {tid: a.record.strategy for tid, a in answers.items() if a.kind == "hit" and a.record is not None}
    if hit_choices:
        check: CheckReply = await _work(ctx, CheckRequest(prep.prepared, prep.tasks, hit_choices, ctx.ranges),
                                        CheckReply, "checking bank entries")  # fmt: skip
        for tid, why in check.failures.items():
            ctx.notes.append(f"bank entry for {tid} ignored: {why}")
            answers[tid] = bankrules.BankAnswer("miss")
    to_tune: list[Task] = []
    for t in tasks:
        a, r = answers[t.id], results[t.id]
        if a.kind == "hit" and a.record is not None:
            hits[t.id] = a.record
            r.bank_layer = a.layer
        if not a.usable(opts.repeat_tune):
            to_tune.append(t)
        elif a.record is not None:
            rec = a.record
            r.strategy, r.update_mode = rec.strategy, "hit"
            r.before_us, r.after_us = rec.baseline.median_us, rec.winner.median_us
            r.accuracy = {"max_abs_error": rec.max_abs_error, "max_rel_error": rec.max_rel_error, "cosine": rec.cosine}
            chosen[t.id] = rec.strategy
            if t.signature.digest in context_reverted:
                chosen[t.id] = DEFAULT
                r.applied = False
                r.error = f"{REVERTED} (a verification of this model, remembered in the bank)"
            if rec.precision != "exact":
                lossy_cost[t.id] = ((rec.baseline.median_us - rec.winner.median_us) * r.instances, 1.0 - rec.cosine)
        else:
            r.update_mode, r.bank_layer = "hit", f"{a.layer} (default stays best)"
            r.before_us = r.after_us = a.default_us
            chosen[t.id] = DEFAULT

    decided = await _tune_tasks(ctx, tasks, to_tune, results, hits)
    fallback: dict[str, str] = {}
    failed = sum(d.failed_candidates for d in decided)
    trials = sum(d.trials for d in decided)
    for d in decided:
        chosen[d.task.id] = d.strategy
        fallback[d.task.id] = d.fallback
        if d.lossy_cost is not None:
            lossy_cost[d.task.id] = d.lossy_cost

    assembled = ws.scratch / "assembled.onnx"
    await ctx.assemble([Build(assembled, dict(chosen))])
    e2e_gate: dict[str, float] | None = None
    if ctx.policy.lossy:
        ctx.emit("stage", "checking accuracy end to end")
        e2e_gate = await hold_to_budget(ctx, chosen, fallback, lossy_cost, results, assembled)

    session = await search_session(ctx, assembled, prep.model_signature, model_ans)
    trials += session.trials
    total = len(tasks) + 1
    ctx.emit("progress", "session options", total, total)

    ctx.emit("stage", "verifying end to end")
    v = await verify(ctx, chosen, fallback, results, assembled, session.options,
                     from_bank=not to_tune and session.mode == "hit")  # fmt: skip
    ctx.notes.extend(v.notes)
    by_id = {t.id: t for t in tasks}
    reverted = [by_id[tid].signature.digest for tid, r in results.items() if r.error.startswith(REVERTED)]
    await remember_context(ctx, prep.model_signature, model_ans, session, reverted)
    if v.outcome != "tuned":
        for r in results.values():
            if r.strategy != DEFAULT and r.applied:
                r.applied = False
                r.error = r.error or f"not applied: end-to-end verification kept {v.outcome}"

    tuned_path = ws.tuned_model_path()
    meta = tuned_metadata(v.options, opts.precision, ctx.fingerprint.digest)
    source = {"assembled": prep.prepared, "prepared": prep.prepared, "input": opts.model}[v.source]
    await ctx.assemble([Build(tuned_path, dict(v.choices), meta)], source=source)

    ledger = ctx.ledger
    resources = {
        "device_s": round(ledger.device_s, 3),
        "duty_cycle": round(ledger.duty_cycle, 4),
        "device_requests": ledger.device_requests,
        "compile_s": round(ledger.compile_s, 3),
        "compile_requests": ledger.compile_requests,
        "trials": trials,
        "failed_candidates": failed,
        "peak_worker_rss_mb": round(ledger.peak_child_rss_mb, 1),
        "engine_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
    }
    result = JobResult(
        job_id=ctx.job_id,
        model=str(opts.model),
        tuned_model=str(tuned_path),
        result_json="",
        workspace=str(ws.root),
        baseline_ms=v.baseline.median_us / 1000.0,
        tuned_ms=v.final.median_us / 1000.0,
        tuning_time_s=ledger.elapsed_s,
        precision=opts.precision,
        device=str(opts.device),
        session_options=v.options,
        tasks=sorted(results.values(), key=lambda r: -r.share),
        repo=bankrules.repo_summary([r.update_mode for r in results.values()] + [session.mode]),
        accuracy=e2e_gate if e2e_gate is not None and v.outcome == "tuned" else v.final.accuracy(),
        verified=v.outcome,
        notes=ctx.notes,
        calibration=samples.source,
        resources=resources,
        timeline=_timeline(decided),
        budget={
            "task_min_cosine": ctx.policy.task_min_cosine,
            "task_max_rel_error": ctx.policy.task_max_rel_error,
            "min_cosine": ctx.policy.e2e_min_cosine,
            "max_rel_error": ctx.policy.e2e_max_rel_error,
        },
    )
    json_path = await trio.to_thread.run_sync(ws.reserve_result, opts.job_type)
    result.result_json = str(json_path)
    await trio.to_thread.run_sync(write_json, json_path, result_json(result, opts.job_type))
    return result


async def _tune_tasks(
    ctx: JobContext, tasks: list[Task], to_tune: list[Task], results: dict[str, TaskResult],
    hits: dict[str, BankRecord],
) -> list[TaskDecision]:
    """Profile the model, extract the tasks to tune and run one agent per task, most
    expensive first; returns their decisions in the order they came."""
    total = len(tasks) + 1
    ctx.emit("progress", "bank", total - len(to_tune) - 1, total)
    if not to_tune:
        return []
    assert ctx.prep is not None
    ctx.emit("stage", "profiling baseline")
    profile = from_wire(ProfileReply, await ctx.device.call(
        ProfileRequest(ctx.prep.prepared, ctx.held_back[0], ctx.workspace.scratch, ctx.opts.device), ctx.ledger))  # fmt: skip
    model_us = sum(profile.nodes.values()) or 1.0
    share = {}
    for t in tasks:
        share[t.id] = sum(profile.nodes.get(n, 0.0) for tt in (t, *t.twins) for n in tt.node_names) / model_us
        results[t.id].share = share[t.id]
    to_tune = sorted(to_tune, key=lambda t: -share[t.id])
    ctx.emit("stage", f"extracting {len(to_tune)} tasks")
    await _work(ctx, ExtractRequest(ctx.prep.prepared, tuple(to_tune), ctx.held_back[0],
                                    ctx.workspace.scratch / "tasks"), None, "extracting tasks")  # fmt: skip
    ctx.emit("stage", f"tuning {len(to_tune)} tasks")
    share_sum = sum(share[t.id] for t in to_tune) or 1.0
    decided: list[TaskDecision] = []

    async def one(t: Task, budget: float) -> None:
        d = await TaskAgent(ctx, t, results[t.id], hits.get(t.id), budget).run()
        d.decided_at = ctx.ledger.elapsed_s
        decided.append(d)
        ctx.emit("progress", "tasks", total - 1 - len(to_tune) + len(decided), total)

    async with trio.open_nursery() as nursery:
        for t in to_tune:
            budget = min(5.0, max(0.5, ctx.opts.budget_s * share[t.id] / share_sum))
            nursery.start_soon(one, t, budget)
    return decided


def _timeline(decided: list[TaskDecision]) -> list[tuple[float, float]]:
    """(seconds into the job, estimated model gain in us) after each task decision."""
    gain, out = 0.0, []
    for d in decided:
        r = d.result
        gain += max(0.0, r.before_us - r.after_us) * r.instances
        out.append((round(d.decided_at, 3), round(gain, 3)))
    return out

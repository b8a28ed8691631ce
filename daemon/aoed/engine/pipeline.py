"""The job pipeline: one job's stages from model file to tuned model and report.

`run_stages` is the list of stages; each is a function that states what it takes and
returns what it found (a frozen dataclass), so a stage reads only what came before it:

    prepare         model, samples, calibration (workers); the context's prepared part
    bank_lookups    an interrupted run's decisions (resume.py), bank entries re-checked
                    on this model (lossy hits re-gated: lossygate.py)        -> Known
    search          profile (device), budget, task models (worker), one task agent
                    per task the bank did not answer (pool + device: search.py)
                                                                             -> Searched
    assemble        the model with every choice; lossy: held to the accuracy budget,
                    then the lossy choices' bank writes                      -> Assembled
    session_options model-wide session options (device)                      -> SessionChoice
    verify_stage    end to end against the input, or the bank's confirmation -> Proposal
    runtime_stage   OpenVINO's builds of the model against the proposal, as
                    deployed (worker + device: runtimestage.py)              -> RuntimeChoice
    confirm_stage   the confirming A/B (device: confirmstage.py, confirm.py):
                    what ships                                               -> Confirmed
    remember        the model-level record (bank)
    outputs         the tuned model and the result JSON                      -> JobOutcome

The pipeline decides the order and keeps the job's results; it never compiles,
measures or loads a model itself: the work happens in the engine's child processes, so
a crash in onnxruntime costs a request, never the host, and the event loop stays free.
A device that fails or runs slow costs the stage it happened in (the job goes on with
what it has, and says so); the confirming A/B is the figure the job reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.bankrecord import BankRecord
from aoe.figures import interval, pct
from aoe.outcome import JobOutcome, UpdateMode, bank_tally
from aoe.partition import Task
from aoe.spec import Runtime, Stage
from aoed import safefs
from aoed.engine import bankrules, confirm, decisions, resume
from aoed.engine.assemble import tuned_metadata
from aoed.engine.budget import PREPARE_S_PER_MIB, Budget
from aoed.engine.confirmstage import confirm_proposal
from aoed.engine.context import JobContext
from aoed.engine.estimates import say_estimate
from aoed.engine.job import TaskResult
from aoed.engine.lossygate import gate_lossy_hits
from aoed.engine.messages import (
    Build,
    CalibrateRequest,
    CheckReply,
    Measurement,
    PointCheck,
    PrepareReply,
    PrepareRequest,
    Request,
    SamplesReply,
    SamplesRequest,
)
from aoed.engine.outputs import ResultDetails, result_json, write_json
from aoed.engine.pool import model_step
from aoed.engine.prep import Limits
from aoed.engine.registry import DEFAULT
from aoed.engine.runtimestage import RuntimeChoice, compete
from aoed.engine.search import search_tasks
from aoed.engine.session import (
    SessionChoice,
    busy_cores,
    fewer_threads,
    remember_context,
    search_session,
)
from aoed.engine.taskagent import TaskDecision
from aoed.engine.verify import REVERTED, Verified, hold_to_budget, step_to, verify

__all__ = ["run_stages"]

log = logging.getLogger(__name__)


async def run_stages(ctx: JobContext) -> JobOutcome:
    """One job's stages, in order; each takes what the ones before it found and returns
    what it finds (the per-task table, `TaskResult`s, is the job's, filled in as it goes)."""
    model = await prepare(ctx)
    known = await bank_lookups(ctx, model)
    found = await search(ctx, model, known)
    assembled = await assemble(ctx, known, found)
    session = await session_options(ctx, model, known, found, assembled)
    proposal = await verify_stage(ctx, model, known, found, assembled, session)
    runtime = await runtime_stage(ctx, model, known, proposal, found.budget)
    confirmed = await confirm_stage(ctx, proposal, found.budget, runtime)
    await remember(ctx, model, known, session, proposal, confirmed)
    return await outputs(ctx, model, known, found, assembled, session, confirmed)


@dataclass(frozen=True)
class Prepared:
    """What preparing the model found: the prepared model and its tasks, the samples."""

    prep: PrepareReply
    samples: SamplesReply

    @property
    def tasks(self) -> list[Task]:
        return list(self.prep.tasks)


async def prepare(ctx: JobContext) -> Prepared:
    """Prepare the model, write its samples, calibrate (lossy); fills the context's
    prepared fields (`prep`, `held_back`, `ranges`, `run_key`), read-only from here on."""
    opts, run, ws = ctx.spec, ctx.run, ctx.workspace
    ctx.ledger.enter("prepare")
    await ctx.stage(Stage.PREPARE, f"preparing {run.model.name}")
    with contextlib.suppress(OSError):
        # limits grow with the model; of an unreadable one, prep says why
        ctx.ledger.scale_to_model((await trio.to_thread.run_sync(run.model.stat)).st_size)
    say_estimate(
        ctx,
        "prepare",
        ctx.ledger.model_mb * PREPARE_S_PER_MIB,
        f"preparing: about {{:.1f}} s for a {ctx.ledger.model_mb:.0f} MiB model file, outside the budget "
        f"({PREPARE_S_PER_MIB * 1000:.0f} ms per MiB as measured on a 2-core machine)",
    )
    prep: PrepareReply = await _work(
        ctx,
        PrepareRequest(
            run.model,
            ws.scratch,
            opts.precision,
            dict(opts.input_shapes),
            opts.keep_initializer_inputs,
            opts.job_type,
            Limits.of(ctx.config),
            run.model_file,
            ctx.device.device.kind,
            dict(opts.shape_profile.dims),
            opts.shape_profile.gears,
        ),
        "graph preparation",
    )
    ctx.prep = prep
    ctx.notes.extend(prep.notes)
    samples: SamplesReply = await _work(
        ctx,
        SamplesRequest(
            prep.prepared,
            ws.scratch,
            prep.inputs,
            prep.int_high,
            opts.calibration_dir,
            ctx.policy.lossy,
        ),
        "writing input samples",
    )
    ctx.held_back = samples.held_back
    if ctx.policy.lossy:
        await ctx.stage(Stage.CALIBRATE, "calibrating")
        await _work(
            ctx,
            CalibrateRequest(prep.prepared, samples.calibrate, ws.scratch / "ranges.json"),
            "calibration",
        )
        ctx.ranges = ws.scratch / "ranges.json"
    ws.started = (
        True  # the model is read and its samples made: a failure from here is one to inspect
    )
    ctx.run_key = resume.run_key(ctx, prep.digest, samples.digest)
    return Prepared(prep, samples)


@dataclass(frozen=True)
class Known:
    """What the bank (and an interrupted run of this job) answered before any search."""

    #: every task's row of the job's table, by task id
    results: dict[str, TaskResult]
    #: decisions an interrupted run committed, by task id (resume.py)
    restored: dict[str, TaskDecision]
    #: the tasks the bank did not answer, in graph order
    to_tune: list[Task]
    #: the bank's entries for tasks tuned again (REPEAT_TUNE)
    hits: dict[str, BankRecord]
    #: the strategy the bank chose per task it answered
    chosen: dict[str, str]
    #: (gain in us, error) of each lossy choice the bank answered
    lossy_cost: dict[str, tuple[float, float]]
    #: the bank's model-level answer (session options, confirmation, reversals)
    model_ans: bankrules.BankAnswer


async def bank_lookups(ctx: JobContext, model: Prepared) -> Known:
    """What the bank answers costs no measurement: restore an interrupted run's
    decisions, look every other task up (bank entries re-checked on this model: that
    their strategies apply, and under a lossy policy that they pass its accuracy gate)."""
    opts, run, prep, tasks = ctx.spec, ctx.run, model.prep, model.tasks
    ctx.ledger.enter("bank")
    restored = await _restore(ctx, tasks)
    model_ans = await ctx.lookup(prep.model_signature)
    context_reverted = set() if opts.repeat_tune else bankrules.reverted_digests(model_ans)
    results: dict[str, TaskResult] = {
        t.id: TaskResult(t.id, t.anchor, t.op_type, t.instances, t.family) for t in tasks
    }
    results.update({tid: d.result for tid, d in restored.items()})
    chosen: dict[str, str] = {}
    hits: dict[str, BankRecord] = {}
    lossy_cost: dict[str, tuple[float, float]] = {}
    answers = {t.id: await ctx.lookup(t.signature) for t in tasks if t.id not in restored}
    hit_choices = {
        tid: a.record.strategy
        for tid, a in answers.items()
        if a.kind == "hit" and a.record is not None
    }
    if hit_choices:
        check: CheckReply = await _work(
            ctx,
            ctx.check_request(prep.tasks, hit_choices),
            "checking bank entries",
        )
        for tid, why in check.failures.items():
            ctx.notes.append(f"bank entry for {tid} ignored: {why}")
            answers[tid] = bankrules.BankAnswer("miss")
        if ctx.policy.lossy and not opts.repeat_tune:
            await gate_lossy_hits(ctx, [t for t in tasks if t.id in answers], answers)
    to_tune: list[Task] = []
    for t in tasks:
        if t.id in restored:
            continue
        a, r = answers[t.id], results[t.id]
        if a.kind == "hit" and a.record is not None:
            hits[t.id] = a.record
            r.bank_layer = a.layer
        if not a.usable(opts.repeat_tune, run.resumes):
            to_tune.append(t)
        elif a.record is not None:
            rec = a.record
            r.strategy, r.update_mode = rec.strategy, "hit"
            r.before_us, r.after_us = rec.baseline.median_us, rec.winner.median_us
            r.accuracy = {
                "max_abs_error": rec.max_abs_error,
                "max_rel_error": rec.max_rel_error,
                "cosine": rec.cosine,
            }
            chosen[t.id] = rec.strategy
            if t.signature.digest in context_reverted:
                chosen[t.id] = DEFAULT
                r.applied = False
                r.error = f"{REVERTED} (a verification of this model, remembered in the bank)"
            if rec.precision != "exact":
                lossy_cost[t.id] = (
                    (rec.baseline.median_us - rec.winner.median_us) * r.instances,
                    1.0 - rec.cosine,
                )
        else:
            r.update_mode, r.bank_layer = "hit", f"{a.layer} (default stays best)"
            r.before_us = r.after_us = a.default_us
            chosen[t.id] = DEFAULT
    return Known(results, restored, to_tune, hits, chosen, lossy_cost, model_ans)


@dataclass(frozen=True)
class Searched:
    """Every task's choice after the search, with what a lossy choice falls back to."""

    budget: Budget
    #: the decisions of this run's task agents and of the interrupted run, in that order
    decided: list[TaskDecision]
    #: the strategy per task: the bank's, else the search's
    chosen: dict[str, str]
    fallback: dict[str, str]
    fallback_us: dict[str, float]
    lossy_cost: dict[str, tuple[float, float]]
    #: candidates that failed, and trials measured, over the task agents
    failed: int
    trials: int
    #: per lossy choice, the other lossy candidates it steps down to (TaskDecision)
    alternates: dict[str, tuple[tuple[str, float, float], ...]] = field(default_factory=dict)


async def search(ctx: JobContext, model: Prepared, known: Known) -> Searched:
    """Profile, set the budget, and run one task agent per task the bank did not answer
    (search.py); collect their decisions with the bank's and the restored ones."""
    budget, agents = await search_tasks(ctx, model.tasks, known.to_tune, known.results, known.hits)
    decided = [*known.restored.values(), *agents]
    chosen, lossy_cost = dict(known.chosen), dict(known.lossy_cost)
    fallback: dict[str, str] = {}
    fallback_us: dict[str, float] = {}
    for d in decided:
        chosen[d.task.id] = d.strategy
        fallback[d.task.id] = d.fallback
        fallback_us[d.task.id] = d.fallback_us
        if d.lossy_cost is not None:
            lossy_cost[d.task.id] = d.lossy_cost
    return Searched(
        budget,
        decided,
        chosen,
        fallback,
        fallback_us,
        lossy_cost,
        sum(d.failed_candidates for d in decided),
        sum(d.trials for d in decided),
        {d.task.id: d.alternates for d in decided if d.alternates},
    )


@dataclass(frozen=True)
class Assembled:
    """The model with every task's choice applied, and its end-to-end accuracy (lossy)."""

    path: Path
    #: the choices it holds (lossy ones backed off to meet the accuracy budget)
    chosen: dict[str, str]
    e2e_gate: dict[str, float] | None


async def assemble(ctx: JobContext, known: Known, found: Searched) -> Assembled:
    """Build the model with every choice applied; under a lossy policy, back lossy
    choices off until it meets the end-to-end accuracy budget, then commit the lossy
    choices' bank writes (or their fallbacks')."""
    assert ctx.prep is not None
    path = ctx.workspace.scratch / "assembled.onnx"
    chosen = dict(found.chosen)
    ctx.ledger.enter("assemble")
    lossy_cost = dict(found.lossy_cost)
    refused = await ctx.assemble([Build(path, dict(chosen))])
    # a choice the model fails with at a profile point: never proposed, never banked; a
    # lossy one steps to an alternate that holds, if it has one
    refused, left = await _alternates(ctx, path, chosen, refused, found, known.results, lossy_cost)
    for tid, why in left.items():
        r = known.results[tid]
        r.applied, r.error = False, f"not applied: {why}"
        r.update_mode = UpdateMode.UNSATISFIED  # nothing of it reaches the bank
        ctx.notes.append(f"{tid}: {why}; left out")
    e2e_gate: dict[str, float] | None = None
    if ctx.policy.lossy:
        ctx.ledger.enter("accuracy")
        await ctx.stage(Stage.ACCURACY, "checking accuracy end to end")
        e2e_gate = await hold_to_budget(
            ctx,
            chosen,
            found.fallback,
            lossy_cost,
            known.results,
            path,
            found.fallback_us,
            found.alternates,
        )
    # Lossy choices reach the bank only now, as what the model kept; one the model failed
    # with at a profile point reaches it neither as itself nor as its fallback.
    for d in found.decided:
        if d.pending is not None and d.task.id not in refused:
            if chosen[d.task.id] not in (d.strategy, d.fallback):
                continue  # an alternate: measured beside the choice, never its own entry
            kept = chosen[d.task.id] == d.strategy
            w = d.pending if kept else d.fallback_write
            if w is not None and (w.entries or w.defaults):
                await ctx.write_bank(w)
            if not kept:
                known.results[d.task.id].update_mode = d.fallback_mode
    return Assembled(path, chosen, e2e_gate)


#: Rounds of stepping refused lossy choices to their alternates at assembly.
ALTERNATE_ROUNDS = 3


async def _alternates(
    ctx: JobContext,
    path: Path,
    chosen: dict[str, str],
    refused: dict[str, str],
    found: Searched,
    results: Mapping[str, TaskResult],
    lossy_cost: dict[str, tuple[float, float]],
) -> tuple[dict[str, str], dict[str, str]]:
    """Each choice the model at `path` failed with at a profile point (`refused`) steps
    to the fastest of its alternates more accurate than it (TaskDecision.alternates),
    and the model is built and checked again, up to `ALTERNATE_ROUNDS` times; `chosen`
    and `lossy_cost` change in place. Returns (every choice refused on the way, the
    refusals that left their task out: task id -> why)."""
    everyone, left = dict(refused), {}
    tried: dict[str, set[str]] = {}
    for turn in range(ALTERNATE_ROUNDS + 1):
        stepped = False
        for tid, why in refused.items():
            now = chosen.pop(tid)
            tried.setdefault(tid, set()).add(now)
            alts = found.alternates.get(tid, ())
            error = next((a[2] for a in alts if a[0] == now), lossy_cost.get(tid, (0.0, 1.0))[1])
            alt = decisions.next_alternate(alts, error, tried[tid])
            if alt is None or turn == ALTERNATE_ROUNDS:
                left[tid] = why
                continue
            name = chosen[tid] = step_to(alt, results[tid], tid, found.fallback_us, lossy_cost)
            results[tid].rejected.append(f"{why}; stepped to {name}")  # why names the strategy
            ctx.notes.append(f"{tid}: {why}; {name} instead (the next fastest within the gate)")
            stepped = True
        if not stepped:
            break
        refused = await ctx.assemble([Build(path, dict(chosen))])
        everyone.update(refused)
    return everyone, left


async def session_options(
    ctx: JobContext, model: Prepared, known: Known, found: Searched, assembled: Assembled
) -> SessionChoice:
    """Model-wide session options for the assembled model (the bank's, or searched
    within what the budget has left)."""
    ctx.ledger.enter("session")
    session = await search_session(
        ctx, assembled.path, model.prep.model_signature, known.model_ans, found.budget
    )
    return session


@dataclass(frozen=True)
class Proposal:
    """What verification proposes to ship, and the confirmation the bank holds of
    exactly these choices and options (None: the confirming A/B runs)."""

    verified: Verified
    cached: dict[str, Any] | None


async def verify_stage(
    ctx: JobContext,
    model: Prepared,
    known: Known,
    found: Searched,
    assembled: Assembled,
    session: SessionChoice,
) -> Proposal:
    """Verify the assembled model end to end against the input (verify.py), unless
    every choice came from the bank, which also holds their confirmation."""
    from_bank = not known.to_tune and session.mode == "hit"
    cached = (
        bankrules.confirmed(known.model_ans) if from_bank and not ctx.spec.repeat_tune else None
    )
    choice_key = bankrules.choices_digest(model.tasks, assembled.chosen, session.options)
    if (
        cached is not None
        and cached.get("choices") == choice_key
        and bankrules.confirmed_job_type(cached) in (None, ctx.spec.job_type)
    ):
        v = Verified(
            dict(assembled.chosen),
            session.options,
            "tuned",
            "assembled",
            None,
            None,
            [
                f"verification and the confirming A/B answered from the bank (job {cached.get('job', '?')})"
            ],
        )
    else:
        cached = None
        ctx.ledger.enter("verify")
        await ctx.stage(Stage.VERIFY, "verifying end to end")
        v = await verify(
            ctx,
            dict(assembled.chosen),
            found.fallback,
            known.results,
            assembled.path,
            session.options,
            found.budget,
            from_bank=from_bank,
        )
    ctx.notes.extend(v.notes)
    return Proposal(v, cached)


async def runtime_stage(
    ctx: JobContext, model: Prepared, known: Known, proposal: Proposal, budget: Budget
) -> RuntimeChoice:
    """Another runtime's builds of the input against the proposal (runtimestage.py);
    the bank's, when its confirmation of these choices shipped one. A confirmation of
    onnxruntime's model from the bank answers this stage too: the job that stored it
    compared the runtimes (or had none to compare), and a run the bank answers measures
    nothing it decided (REPEAT_TUNE compares again), unless this job asks for OpenVINO
    by name."""
    cached = proposal.cached
    asked = ctx.spec.runtime if ctx.spec.runtime != Runtime.AUTO else Runtime(ctx.config.runtime)
    if cached is not None and cached.get("runtime") != "openvino" and asked != Runtime.OPENVINO:
        return RuntimeChoice()
    banked = bankrules.runtime_of(known.model_ans) if cached is not None else None
    return await compete(ctx, proposal.verified, model.samples.calibrate, budget, banked)


@dataclass(frozen=True)
class Confirmed:
    """The confirming A/B's verdict, the file that ships and what it holds."""

    #: the proposal as confirmed (intra-op threads may have been dropped before the A/B)
    verified: Verified
    confirmation: confirm.Confirmation
    ship: Path
    #: the session options' rounds (with, without) when the A/B kept them
    evidence: tuple[Measurement, Measurement] | None
    choices: dict[str, str]
    options: dict[str, Any]
    #: the runtime of what ships, and (another runtime's) the options it runs with
    runtime: RuntimeChoice = RuntimeChoice()
    #: the confirmation is the bank's (the job that confirmed these choices)
    banked: bool = False


async def confirm_stage(
    ctx: JobContext, proposal: Proposal, budget: Budget, runtime: RuntimeChoice
) -> Confirmed:
    """The confirming A/B of the proposal, or of another runtime's build when it won
    (confirmstage.py): what ships."""
    v, cached = proposal.verified, proposal.cached
    if cached is not None and (runtime.other != (cached.get("runtime") == "openvino")):
        cached = None  # the bank's confirmation is of another runtime's model than this
    ctx.ledger.enter("confirm")
    await ctx.stage(
        Stage.CONFIRM,
        "confirming: the bank's confirmation, session options re-checked"
        if cached is not None
        else f"confirming: the A/B of the input and the proposal, {confirm.ROUNDS} rounds, a process per model",
    )
    if cached is None and fewer_threads(v.options, ctx.device.cores):
        busy = await busy_cores(ctx, 0.5)
        if busy is not None:  # the thread count would be confirmed under the same load
            dropped = v.options["intra_op_num_threads"]
            v = dataclasses.replace(
                v, options={k: o for k, o in v.options.items() if k != "intra_op_num_threads"}
            )
            if not v.options and v.outcome == "options only":  # nothing left to propose
                v = dataclasses.replace(v, outcome="reverted to input", source="input")
            ctx.notes.append(
                f"{busy} (intra_op_num_threads={dropped} dropped before the confirming A/B)"
            )
    conf, ship, evidence = await confirm_proposal(ctx, v, cached, budget, runtime)
    ctx.notes.extend(conf.notes)
    if runtime.other:
        if conf.shipped == "tuned":
            return Confirmed(v, conf, ship, None, {}, {}, runtime, cached is not None)
        variant = runtime.variant
        runtime = RuntimeChoice(table=runtime.table, offer=runtime.offer)
        if v.outcome == "reverted to input":
            return Confirmed(v, conf, ship, None, {}, {}, runtime, cached is not None)
        # The other runtime's build beat onnxruntime's proposal in the comparison but not
        # the input in the A/B: the proposal it displaced is confirmed on its own, as it
        # would have been had the other runtime not competed.
        lost = conf.proposal or {}
        figures = (
            f" ({pct(lost['improvement'])}, 95% interval {interval(lost['improvement_ci95'])})"
            if lost.get("improvement_ci95")
            else ""
        )
        ctx.notes.append(
            f"runtime: OpenVINO's {variant} build was not confirmed against the "
            f"input{figures}: onnxruntime's proposal is confirmed instead"
        )
        cached = None
        conf, ship, evidence = await confirm_proposal(ctx, v, None, budget, None)
        ctx.notes.extend(conf.notes)
    return Confirmed(
        v,
        conf,
        ship,
        evidence,
        v.choices if conf.shipped == "tuned" else {},
        v.options if conf.options_kept else {},
        runtime,
        cached is not None,
    )


async def remember(
    ctx: JobContext,
    model: Prepared,
    known: Known,
    session: SessionChoice,
    proposal: Proposal,
    confirmed: Confirmed,
) -> None:
    """Keep the model-level record in the bank (`remember_context`): the options that
    shipped, the tasks reverted in this model's context and the confirmation; then mark
    the tasks whose choice did not ship as not applied."""
    tasks, results, model_ans, conf = (
        model.tasks,
        known.results,
        known.model_ans,
        confirmed.confirmation,
    )
    digests = {t.id: t.signature.digest for t in tasks}
    reverted = [digests[tid] for tid, r in results.items() if r.error.startswith(REVERTED)]
    confirmed_doc = cached_json = ""
    shipped_rt = confirmed.runtime
    if confirmed.banked:
        cached_json = str(
            model_ans.record.params.get("confirmed")
            if model_ans.record
            else (model_ans.default or {}).get("confirmed", "")
        )
    else:
        # Keyed by what the next reader of the bank (a bank-hit run, `aoe compile`) will
        # derive from it: each task's stored strategy but those reverted in context, and
        # the options stored with the model.
        stored = {
            tid: r.strategy
            for tid, r in results.items()
            if r.update_mode not in ("skipped", "failed") and digests[tid] not in reverted
        }
        stored_options = confirmed.options if conf.shipped != "input" else {}
        confirmed_doc = conf.params(
            bankrules.choices_digest(tasks, stored, stored_options),
            ctx.job_id,
            str(ctx.spec.job_type),
            shipped_rt.runtime,
        )
    await remember_context(
        ctx,
        model.prep.model_signature,
        model_ans,
        SessionChoice(
            confirmed.options if conf.shipped != "input" else {}, session.mode, session.write
        ),
        reverted,
        confirmed_doc or cached_json,
        confirmed.evidence,
        conf.baseline_ms * 1000,
        shipped_rt.decision().to_json() if shipped_rt.other else "",
    )
    for tid, r in results.items():
        if r.strategy != DEFAULT and r.applied and confirmed.choices.get(tid) != r.strategy:
            r.applied = False
            shipped = (
                f"{confirmed.runtime.runtime} {confirmed.runtime.variant} build"
                if confirmed.runtime.other
                else conf.shipped
            )
            r.error = r.error or f"not applied: the confirming A/B shipped {shipped}"


async def outputs(
    ctx: JobContext,
    model: Prepared,
    known: Known,
    found: Searched,
    assembled: Assembled,
    session: SessionChoice,
    confirmed: Confirmed,
) -> JobOutcome:
    """Put the file that ships in place and write the result JSON; returns the job's
    result (the figures are the confirming A/B's)."""
    opts, run, ws, results = ctx.spec, ctx.run, ctx.workspace, known.results
    conf, v = confirmed.confirmation, confirmed.verified
    tuned_path = ws.tuned_model_path()
    ctx.ledger.enter("outputs")
    shipped_rt = confirmed.runtime
    if shipped_rt.other:
        tuned_path = tuned_path.with_suffix(".xml")
        await trio.to_thread.run_sync(_ship_ir, confirmed.ship, tuned_path, shipped_rt.options)
    else:
        await _ship(ctx, confirmed.ship, tuned_path, confirmed.choices, confirmed.options)
    ctx.ledger.enter(None)
    ledger = ctx.ledger
    resources = {
        "device_s": round(ledger.device_s, 3),
        "duty_cycle": round(ledger.duty_cycle, 4),
        "device_requests": ledger.device_requests,
        "compile_s": round(ledger.compile_s, 3),
        "compile_requests": ledger.compile_requests,
        "trials": found.trials + session.trials,
        "attempt": ctx.attempt,
        "attempts": _attempts(ctx, found.decided, session.trials),
        "failed_candidates": found.failed,
        "peak_worker_rss_mb": round(ledger.peak_child_rss_mb, 1),
        "engine_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
        "device_intervals": [(round(a, 6), round(b, 6)) for a, b in ledger.device_intervals],
        "home_device": ctx.device.device.name,
        "devices": ledger.per_device(),
    }
    if checks := ctx.point_checks.get(str(confirmed.ship)):
        ctx.notes.append(
            "the shipped model at each point of the shape profile, against the input: "
            + "; ".join(_check_text(c) for c in checks)
        )
    accuracy: dict[str, Any]
    if shipped_rt.other:
        accuracy = dict(shipped_rt.accuracy)
    elif ctx.policy.lossy and ctx.accuracy is not None and conf.shipped != "input":
        accuracy = ctx.accuracy.report()
    elif assembled.e2e_gate is not None and conf.shipped != "input":
        accuracy = dict(assembled.e2e_gate)
    else:
        accuracy = (
            {"max_abs_error": 0.0, "max_rel_error": 0.0, "cosine": 1.0}
            if conf.shipped == "input"
            else (v.final.accuracy() if v.final is not None else {})
        )
    outcome = JobOutcome(
        job_id=ctx.job_id,
        model=str(run.model),
        tuned_model=str(tuned_path),
        result_json="",
        precision=opts.precision,
        job_type=opts.job_type,
        device=str(ctx.device.device),
        tuning_time_s=ledger.elapsed_s,
        figures=conf.figures,
        tasks=tuple(r.outcome() for r in sorted(results.values(), key=lambda r: -r.share)),
        bank=bank_tally(r.update_mode for r in results.values()),
        resources={k: v for k, v in resources.items() if isinstance(v, int | float)},
        budget=found.budget.report(),
        session_options=confirmed.options,
        accuracy=accuracy,
        accuracy_budget={
            "task_min_cosine": ctx.policy.task_min_cosine,
            "task_max_rel_error": ctx.policy.task_max_rel_error,
            "min_cosine": ctx.policy.e2e_min_cosine,
            "max_rel_error": ctx.policy.e2e_max_rel_error,
        },
        calibration=model.samples.source,
        verified=v.outcome,
        runtime=shipped_rt.runtime,
        runtime_options=dict(shipped_rt.options),
        notes=tuple(ctx.notes),
        workspace=str(ws.root),
    )
    details = ResultDetails(
        {r.task_id: r.candidates for r in results.values()},
        resources,
        _timeline(found.decided),
        conf.to_json(),
        _decision(v),
        _device_info(ctx, confirmed.runtime.offer),
        _shapes(ctx, confirmed.ship),
        list(confirmed.runtime.table),
    )
    json_path = await trio.to_thread.run_sync(ws.reserve_result, opts.job_type)
    outcome = dataclasses.replace(outcome, result_json=str(json_path))
    await trio.to_thread.run_sync(write_json, json_path, result_json(outcome, details))
    ctx.bank.count_decisions(outcome.bank["repo_hit_num"], outcome.bank["total_num"])
    await resume.forget(ctx)
    return outcome


async def _work(ctx: JobContext, request: Request, what: str) -> Any:
    """One request to the compile pool about the job's model (`pool.model_step`)."""
    return await model_step(ctx.pool, request, ctx.ledger, ctx.run.shown_model, what)


def _device_info(ctx: JobContext, openvino: dict[str, Any]) -> dict[str, Any]:
    """What the job measured on, for the result: the device and its provider, the
    providers the runner's onnxruntime offers, the hardware (a GPU's facts) and the
    library versions, the fingerprint its bank entries are keyed by, and the OpenVINO
    that competed (`openvino`: its version, devices and the CPU's capabilities)."""
    from aoe.accelerators import runtime_versions

    fp = ctx.fingerprint
    return {
        "device": str(ctx.device.device),
        "provider": ctx.device.device.provider,
        "providers": list(ctx.device.providers),
        "hardware": fp.hardware,
        "accelerator": dict(fp.accelerator),
        "versions": runtime_versions(),
        "fingerprint": fp.digest,
        **({"openvino": dict(openvino)} if openvino else {}),
    }


async def _restore(ctx: JobContext, tasks: list[Task]) -> dict[str, TaskDecision]:
    """The decisions an interrupted run of this job committed (resume.py), by task id,
    for the tasks whose strategy this registry still has; sets `ctx.attempt` to follow
    the latest run they came from."""
    keys = {ctx.key(t.signature): t for t in tasks}
    out: dict[str, TaskDecision] = {}
    for key, doc in (await resume.records(ctx, keys)).items():
        t = keys[key]
        try:
            d = TaskDecision.from_doc(t, doc)
            for name in {d.strategy, d.fallback}:
                ctx.registry.get(t.family, name)
        except (KeyError, TypeError, ValueError) as exc:
            log.info(
                "%s: the interrupted run's decision is not usable here (%s); tuned again", t.id, exc
            )
            continue
        out[t.id] = d
        ctx.attempt = max(ctx.attempt, d.result.attempt + 1)
    if out:
        ctx.notes.append(
            f"resumed: {len(out)} task(s) an interrupted run of this job decided were taken from the "
            f"bank, not measured again ({', '.join(sorted(out))})"
        )
    return out


def _attempts(
    ctx: JobContext, decided: list[TaskDecision], session_trials: int
) -> list[dict[str, int]]:
    """Per run of this job that measured something: the tasks it decided, its trials."""
    runs: dict[int, dict[str, int]] = {
        ctx.attempt: {"attempt": ctx.attempt, "tasks": 0, "trials": session_trials}
    }
    for d in decided:
        n = d.result.attempt or ctx.attempt
        run = runs.setdefault(n, {"attempt": n, "tasks": 0, "trials": 0})
        run["tasks"] += 1
        run["trials"] += d.trials
    return [runs[n] for n in sorted(runs)]


def _check_text(c: PointCheck) -> str:
    where = " ".join(f"{n}:{','.join(map(str, d))}" for n, d in c.shapes.items())
    if c.error:
        return f"{where} failed ({c.error})"
    return (
        f"{where} max relative error {c.accuracy['max_rel_error']:.2g}, "
        f"cosine {c.accuracy['cosine']:.6f}" + (" (checked only)" if c.checked_only else "")
    )


def _shapes(ctx: JobContext, ship: Path) -> dict[str, Any]:
    """The shape profile of a dynamic model and the shipped model at each of its points
    (the input itself, when it ships, is not checked against itself)."""
    assert ctx.prep is not None
    profile = ctx.prep.profile
    if profile is None:
        return {}
    checks = ctx.point_checks.get(str(ship), ())
    return {
        **profile.report(),
        "tuned_at_points": [
            {
                "shapes": {k: list(v) for k, v in c.shapes.items()},
                **({"accuracy": dict(c.accuracy)} if c.accuracy else {}),
                **({"error": c.error} if c.error else {}),
                "checked_only": c.checked_only,
            }
            for c in checks
        ],
    }


def _decision(v: Verified) -> dict[str, Any]:
    """The verification rounds that chose the proposal: decision figures, not results."""
    out: dict[str, Any] = {"outcome": v.outcome, "variants_measured": v.variants_measured}
    if v.baseline is not None and v.final is not None:
        out.update(baseline_ms=v.baseline.median_us / 1000, proposal_ms=v.final.median_us / 1000)
    return out


async def _ship(
    ctx: JobContext, ship: Path, out: Path, choices: dict[str, str], options: dict[str, Any]
) -> None:
    """Put the measured file that ships at `out` (a rename; a model with external data
    is written again, since its data file is named after it)."""
    if not ship.with_name(ship.name + ".data").exists():
        await trio.to_thread.run_sync(safefs.move_path, ship, out)
        return
    assert ctx.prep is not None
    meta = tuned_metadata(options, ctx.spec.precision, ctx.fingerprint.digest, ctx.device.device)
    source = ctx.run.model if not choices and ship.name == "input_copy.onnx" else ctx.prep.prepared
    await ctx.assemble([Build(out, dict(choices), meta)], source=source)


def _ship_ir(xml: Path, out: Path, options: dict[str, Any]) -> None:
    """Put the OpenVINO IR that ships (`xml`, its .bin) at `out` with its compile config
    beside it (aoe.ovartifact), each written in the workspace and moved into place."""
    from aoe.ovartifact import CompileConfig, check_properties, config_path, write_config

    staged = xml.with_name(f"ship{xml.suffix}")
    cfg = write_config(staged, CompileConfig("CPU", check_properties(options)))
    safefs.move_path(xml.with_suffix(".bin"), out.with_suffix(".bin"))
    safefs.move_path(xml, out)
    safefs.move_path(cfg, config_path(out))


def _timeline(decided: list[TaskDecision]) -> list[tuple[float, float]]:
    """(seconds into the job, estimated model gain in us) after each task decision."""
    gain, out = 0.0, []
    for d in decided:
        r = d.result
        gain += max(0.0, r.before_us - r.after_us) * r.instances
        out.append((round(d.decided_at, 3), round(gain, 3)))
    return out

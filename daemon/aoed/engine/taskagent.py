"""The task agent: one task's search, from candidates to a decision in the bank.

    compile every strategy of the task's family (concurrently, in the compile pool)
    -> measure the ones that built, interleaved on the task's real input activations
    -> decide: the best exact candidate that clearly beats the default; under a lossy
       policy, a lossy one that passes the task's accuracy gate and clearly beats that
    -> AOE's bank rules (add, update, reserved, unsatisfied), committed with the trials
       as soon as the task is decided, so a killed job resumes from the bank; a lossy
       choice is committed only once the model as a whole has met its accuracy budget
       (the pipeline writes `pending` then, or `fallback_write` if it was backed off)
    -> the whole decision, committed in that same transaction as this run's record
       (resume.py): what a resumed run takes instead of measuring the task again

An agent owns its task's search state and returns a `TaskDecision`, with the notes it
has for the job's report (the pipeline adds them); it writes nothing that other
agents read. A failed candidate costs that candidate; a task whose default
cannot be built or measured keeps what the model (or the bank) has, marked failed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aoe.bank import CUSTOM
from aoe.bankrecord import BankRecord
from aoe.errors import AoedError, DeviceError
from aoe.partition import Task
from aoed.bank.writer import BankWrite
from aoed.engine import bankrules, decisions, incontext, resume
from aoed.engine.budget import Budget
from aoed.engine.context import JobContext
from aoed.engine.job import TaskResult
from aoed.engine.messages import (
    Accuracy,
    Candidate,
    CheckReply,
    CompileReply,
    CompileRequest,
    DescribeReply,
    DescribeRequest,
    Measurement,
    VariantsReply,
    VariantsRequest,
)
from aoed.engine.registry import DEFAULT

__all__ = ["TaskAgent", "TaskDecision"]

log = logging.getLogger(__name__)


@dataclass
class TaskDecision:
    task: Task
    result: TaskResult
    strategy: str  # what the task runs now
    fallback: str = DEFAULT  # the best exact strategy, where a lossy one was chosen
    #: (gain in us over the fallback, error as 1 - cosine) of a lossy choice
    lossy_cost: tuple[float, float] | None = None
    failed_candidates: int = 0
    trials: int = 0
    decided_at: float = 0.0  # seconds into the job
    #: what the search found worth a line in the job's notes (not kept for a resumed run)
    notes: list[str] = field(default_factory=list)
    #: a lossy choice's bank write, held until the end-to-end accuracy gate passed it
    pending: BankWrite | None = None
    #: what to write instead when the gate backs the lossy choice off
    fallback_write: BankWrite | None = None
    fallback_us: float = 0.0  # the fallback's measured time
    fallback_mode: str = ""  # AOE's update mode had the fallback been chosen
    #: the other lossy candidates within the gate that beat the fallback, as (strategy,
    #: median us, 1 - cosine), fastest first: what a backed-off lossy choice steps to
    alternates: tuple[tuple[str, float, float], ...] = ()

    def to_doc(self) -> dict[str, Any]:
        """The decision as JSON, for resume.py (the task itself is the record's key)."""
        return {
            "result": dataclasses.asdict(self.result),
            "strategy": self.strategy,
            "fallback": self.fallback,
            "lossy_cost": list(self.lossy_cost) if self.lossy_cost is not None else None,
            "failed_candidates": self.failed_candidates,
            "trials": self.trials,
            "pending": resume.write_to_doc(self.pending),
            "fallback_write": resume.write_to_doc(self.fallback_write),
            "fallback_us": self.fallback_us,
            "fallback_mode": self.fallback_mode,
            "alternates": [list(a) for a in self.alternates],
        }

    @classmethod
    def from_doc(cls, task: Task, doc: Mapping[str, Any]) -> TaskDecision:
        """The decision `to_doc` wrote for `task`, as a resumed run takes it: answered
        from the bank, decided at the run's start. KeyError or ValueError on a document
        that is not one."""
        names = {f.name for f in dataclasses.fields(TaskResult)}
        result = TaskResult(**{k: v for k, v in doc["result"].items() if k in names})
        result.update_mode, result.bank_layer = "hit", CUSTOM
        cost = doc.get("lossy_cost")
        return cls(
            task,
            result,
            str(doc["strategy"]),
            fallback=str(doc["fallback"]),
            lossy_cost=(float(cost[0]), float(cost[1])) if cost is not None else None,
            failed_candidates=int(doc["failed_candidates"]),
            trials=int(doc["trials"]),
            pending=resume.write_from_doc(doc.get("pending")),
            fallback_write=resume.write_from_doc(doc.get("fallback_write")),
            fallback_us=float(doc["fallback_us"]),
            fallback_mode=str(doc["fallback_mode"]),
            alternates=tuple(
                (str(a[0]), float(a[1]), float(a[2])) for a in doc.get("alternates", ())
            ),
        )


class TaskAgent:
    def __init__(
        self,
        ctx: JobContext,
        task: Task,
        result: TaskResult,
        hit: BankRecord | None,
        budget_s: float,
        budget: Budget | None = None,
    ):
        self.ctx = ctx
        self.task = task
        self.result = result
        self.hit = hit  # the bank's entry (REPEAT_TUNE), if any
        self.budget_s = budget_s  # this task's share of the job's budget
        self.budget = budget  # the job's, for the cost of loading the candidates' sessions
        self.notes: list[str] = []

    async def run(self) -> TaskDecision:
        """The task's decision, its notes with it."""
        decision = await self._search()
        decision.notes.extend(self.notes)
        return decision

    async def _described(self, taskdir: Path) -> dict[str, str]:
        """The params that describe the task's inputs (DescribeRequest); none when the
        worker could not say (the decision is kept without them: verify then says its
        inputs are not drawn like the task's)."""
        req = DescribeRequest(taskdir / "task.onnx", taskdir / "inputs.npz", self.task.inputs)
        try:
            got: DescribeReply = await self.ctx.pool.call(req, self.ctx.ledger)
        except AoedError as exc:
            log.warning("%s: its inputs are not described in its entry: %s", self.task.id, exc)
            return {}
        return got.params

    async def _search(self) -> TaskDecision:
        ctx, task, res = self.ctx, self.task, self.result
        taskdir = ctx.workspace.task_dir(task.id)
        strategies = list(
            ctx.registry.strategies_for(task.family, ctx.spec.precision, ctx.device.device.kind)
        )
        if self.budget is not None:
            # Each candidate is about the task model's size: when loading them alone would
            # spend the task's share, building them would be wasted too.
            seconds, load = self.budget.measurable(
                self.budget_s, [taskdir / "task.onnx"] * len(strategies)
            )
            if not seconds:
                return self._skipped(len(strategies), load, 0)
        precision_of = {s.name: s.precision for s in strategies}
        for s in strategies:  # parametric variants, proposed from the task's real inputs
            if s.propose is not None:
                req = VariantsRequest(
                    taskdir / "task.onnx",
                    task.family,
                    s.name,
                    f"aoe/{task.id}",
                    taskdir / "inputs.npz",
                    ctx.ranges,
                )
                try:
                    got: VariantsReply = await ctx.pool.call(req, ctx.ledger)
                except AoedError as exc:  # no variants: the strategy's other candidates go on
                    log.warning("%s: no variants of %s: %s", task.id, s.name, exc)
                    continue
                precision_of.update({name: s.precision for name in got.names})
                self.notes.extend(f"{task.id}: {note}" for note in got.notes)
        compiled: dict[str, CompileReply | AoedError] = {}

        async def compile_one(name: str) -> None:
            req = CompileRequest(
                taskdir / "task.onnx",
                task.family,
                name,
                f"aoe/{task.id}",
                taskdir / f"{name}.onnx",
                ctx.ranges,
            )
            try:
                compiled[name] = await ctx.pool.call(req, ctx.ledger)
            except AoedError as exc:  # whatever failed the build is this candidate's failure
                compiled[name] = exc

        async with trio.open_nursery() as nursery:
            for name in precision_of:
                nursery.start_soon(compile_one, name)
        if any(isinstance(c, AoedError) for c in compiled.values()):
            # a vanished workspace fails every candidate: the job's failure
            await ctx.check_workspace()
        cands, failed = [], 0
        for name in precision_of:
            c = compiled[name]
            if isinstance(c, AoedError):
                failed += 1
                res.candidates.append({"strategy": name, "ok": False, "error": str(c)})
            elif c.applicable:
                cands.append(Candidate(name, taskdir / f"{name}.onnx"))
        if ctx.prep is not None and ctx.prep.profile is not None:
            cands = await self._hold_at_every_shape(cands)
        fallback = self.hit.strategy if self.hit else DEFAULT
        if isinstance(default := compiled[DEFAULT], AoedError) or not default.applicable:
            why = default if isinstance(default, AoedError) else "not applicable"
            res.update_mode, res.error = "failed", f"default form did not compile: {why}"
            return TaskDecision(task, res, fallback, failed_candidates=failed)
        seconds, load = (
            self.budget.measurable(self.budget_s, [c.model for c in cands])
            if self.budget is not None
            else (self.budget_s, 0.0)
        )
        if not seconds:  # loading the sessions alone would spend the task's share, or more
            await trio.to_thread.run_sync(_remove, [c.model for c in cands])
            return self._skipped(len(cands), load, failed)
        try:
            # One request: every candidate's time is taken on the same device (devices.py)
            measured = await ctx.measure(
                cands, DEFAULT, seconds, taskdir / "inputs.npz", category="search", spread=True
            )
        except DeviceError as exc:
            res.update_mode, res.error = "failed", str(exc)
            return TaskDecision(task, res, fallback, failed_candidates=failed)
        finally:
            await trio.to_thread.run_sync(_remove, [c.model for c in cands])
        # In the registry's order: on a tie the earlier (simpler) form wins (decisions.py).
        measured = {name: measured[name] for name in precision_of if name in measured}
        failed += sum(not r.ok for r in measured.values())
        for name, r in measured.items():
            res.candidates.append({"strategy": name, **r.summary()})

        in_context: dict[str, Accuracy] = {}  # lossy candidates that passed in the model

        def gate(m: Measurement) -> bool:
            return ctx.policy.task_ok(m.accuracy()) or any(m is measured.get(k) for k in in_context)

        exact = {k: r for k, r in measured.items() if precision_of.get(k) == "exact"}
        try:
            best = best_exact = decisions.best(exact, DEFAULT, gate)
        except ValueError as exc:
            res.update_mode, res.error = "failed", str(exc)
            return TaskDecision(task, res, fallback, failed_candidates=failed)
        lossy_cost = None
        alternates: list[tuple[str, float, float]] = []
        if ctx.policy.lossy:
            lossy = {k for k in measured if precision_of.get(k) != "exact"}
            best, reasons = decisions.best_lossy(measured, best_exact, lossy, gate)
            # Faster than what passed, but outside the gate on the task's own outputs: the
            # model may absorb that error (incontext.py).
            faster = [
                k
                for k in decisions.faster_outside_gate(measured, best_exact, lossy, gate)
                if best == best_exact or decisions.clearly_faster(measured[k], measured[best])
            ]
            best = await self._judge_in_context(faster, in_context, reasons) or best
            res.rejected.extend(reasons)
            if best != best_exact:
                gain = (measured[best_exact].median_us - measured[best].median_us) * task.instances
                error = 1.0 - (
                    in_context[best].cosine if best in in_context else measured[best].cosine
                )
                lossy_cost = (gain, error)
                alternates = decisions.lossy_alternates(measured, best_exact, lossy, gate, best)

        outcome = bankrules.after_tuning(self.hit, best, measured, gate)
        base = measured[DEFAULT]
        win = measured[outcome.strategy] if outcome.strategy in measured else base
        key = ctx.key(task.signature)
        trials = tuple(
            (key, {"task": task.id, "strategy": name, "job": ctx.job_id, **r.summary()})
            for name, r in measured.items()
        )

        # What the task was decided on, kept in its entry so that `aoe bank verify`
        # draws inputs alike (engine/taskinputs.py).
        described = (
            await self._described(taskdir) if outcome.write_entry or ctx.policy.lossy else {}
        )

        def write_for(o: bankrules.Outcome) -> BankWrite:
            m = measured[o.strategy] if o.strategy in measured else base
            if o.write_entry:
                rec = bankrules.make_record(
                    key,
                    task.signature,
                    ctx.fingerprint,
                    o.strategy,
                    task.family,
                    ctx.spec.precision,
                    m,
                    base,
                    ctx.job_id,
                    ctx.run.model.name,
                    described,
                )
                return BankWrite(entries=(rec,))
            if o.write_default:
                return BankWrite(
                    defaults=((key, {"default_us": base.median_us, "job": ctx.job_id}),)
                )
            return BankWrite()

        lossy_choice = ctx.policy.lossy and precision_of.get(outcome.strategy) != "exact"
        pending = fallback_write = None
        fallback_mode = outcome.mode
        if lossy_choice:
            now = BankWrite(trials=trials)
            pending = write_for(outcome)
            exact_outcome = bankrules.after_tuning(self.hit, best_exact, measured, gate)
            fallback_write, fallback_mode = write_for(exact_outcome), exact_outcome.mode
        else:
            w = write_for(outcome)
            now = BankWrite(entries=w.entries, defaults=w.defaults, trials=trials)
        res.update_mode = outcome.mode
        res.strategy = outcome.strategy
        res.before_us = base.median_us
        res.after_us = win.median_us
        res.accuracy = win.accuracy()
        res.attempt = ctx.attempt
        if outcome.strategy in in_context:
            acc = in_context[outcome.strategy]
            res.accuracy.update(model_cosine=acc.cosine, model_max_rel_error=acc.max_rel_error)
        decision = TaskDecision(
            task,
            res,
            outcome.strategy,
            fallback=best_exact if lossy_choice else DEFAULT,
            lossy_cost=lossy_cost if outcome.strategy == best else None,
            failed_candidates=failed,
            trials=len(trials),
            pending=pending,
            fallback_write=fallback_write,
            fallback_us=measured[best_exact].median_us,
            fallback_mode=fallback_mode,
            alternates=tuple(alternates) if outcome.strategy == best else (),
        )
        record = {**decision.to_doc(), "job": ctx.job_id, "attempt": ctx.attempt}
        # The decision's record goes in the same commit as its trials and entries: all
        # of them or none. None: the decision holds for this job's model, but the bank
        # (and a resumed run) has nothing of it.
        if not await ctx.write_bank(
            dataclasses.replace(now, decisions=((resume.key_of(ctx, key), record),))
        ):
            res.update_mode, res.error = (
                "failed",
                f"{outcome.strategy} chosen, but not kept in the bank: {ctx.bank_unkept}",
            )
        ctx.emit("task", f"{task.id}: {outcome.strategy} ({outcome.mode})")
        log.info(
            "%s: %s (%s), %.1f -> %.1f us",
            task.id,
            outcome.strategy,
            outcome.mode,
            res.before_us,
            res.after_us,
        )
        return decision

    async def _hold_at_every_shape(self, cands: list[Candidate]) -> list[Candidate]:
        """The candidates whose whole model, this task's choice alone applied, runs at
        every point of the job's shape profile as the input does (messages.CheckRequest):
        a rewrite that writes the searched shape into the graph is no candidate of a
        dynamic model. Each one left out is in the task's candidates, with why."""
        ctx, task = self.ctx, self.task
        failures: dict[str, str] = {}

        async def check(name: str) -> None:
            reply: CheckReply = await ctx.pool.call(
                ctx.check_request((task,), {task.id: name}), ctx.ledger
            )
            if task.id in reply.failures:
                failures[name] = reply.failures[task.id]

        async with trio.open_nursery() as nursery:
            for c in cands:
                if c.id != DEFAULT:
                    nursery.start_soon(check, c.id)
        for name, why in failures.items():
            self.result.candidates.append({"strategy": name, "ok": False, "error": why})
        await trio.to_thread.run_sync(_remove, [c.model for c in cands if c.id in failures])
        return [c for c in cands if c.id not in failures]

    def _skipped(self, candidates: int, load_s: float, failed: int) -> TaskDecision:
        """The decision for a task whose candidates cost more to load than its share."""
        res = self.result
        res.update_mode = "skipped"
        res.error = (
            f"not tuned: loading its {candidates} candidates would take about {load_s:.2f} s of its "
            f"{self.budget_s:.2f} s share of the budget"
        )
        log.info("%s: %s", self.task.id, res.error)
        return TaskDecision(
            self.task, res, self.hit.strategy if self.hit else DEFAULT, failed_candidates=failed
        )

    async def _judge_in_context(
        self, names: list[str], passed: dict[str, Accuracy], reasons: list[str]
    ) -> str | None:
        """The first of `names` (fastest first) whose error the model absorbs
        (incontext.py), recorded in `passed`; at most IN_CONTEXT_TRIES are built. Each one
        judged replaces its reason in `reasons` with the model's figures."""
        for name in names[:IN_CONTEXT_TRIES]:
            got = await incontext.model_accuracy(self.ctx, self.task, name)
            ok, detail = incontext.verdict(self.ctx, got)
            why = f"{name}: {detail}"
            reasons[:] = [r for r in reasons if not r.startswith(f"{name}: ")]
            log.info("%s: %s", self.task.id, why)
            if ok:
                assert isinstance(got, Accuracy)
                passed[name] = got
                self.notes.append(f"{self.task.id}: {why}: kept")
                return name
            reasons.append(why)
        return None


#: lossy candidates judged in the model's context per task, at most (each costs a model
#: build and a comparison over the held-back samples)
IN_CONTEXT_TRIES = 2


def _remove(paths: list[Path]) -> None:
    """Candidate files are only needed while measured; the winner is rebuilt on assembly."""
    for p in paths:
        if p.name != "task.onnx":
            p.unlink(missing_ok=True)

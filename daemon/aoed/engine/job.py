"""The job supervisor: one job's pipeline from model file to tuned model and report.

    prep -> partition -> bank lookups -> profile -> task agents (compile pool, device)
         -> session options (in context) -> assemble -> verify -> outputs

Task agents run concurrently, most expensive task first; they share the compile pool
and queue on the device agent, which measures one request at a time. Decisions follow
AOE's bank semantics (see `_decide`). The supervisor never measures or compiles itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import trio

from aoe.errors import AoedError, BankError, DeviceError
from aoe.signature import (
    DeviceFingerprint,
    TaskSignature,
    bank_key,
    canonical_json,
    device_fingerprint,
)
from aoed import __version__
from aoed.backends.ort import strategies
from aoed.bank._codec import BankRecord, Measured
from aoed.bank.writer import BankWrite, BankWriter
from aoed.engine.assemble import model_signature, task_rewrites, tunable_tasks, tuned_metadata
from aoed.engine.calibration import Samples, activation_ranges, capture, load_samples
from aoed.engine.device import DeviceAgent
from aoed.engine.policy import PrecisionPolicy, policy
from aoed.engine.pool import CompilePool
from aoed.engine.prep import Prepared, make_inputs, prepare
from aoed.engine.tasks import Rewrite, Task, apply_rewrites, constant_values, task_model

__all__ = ["JobEvent", "JobOptions", "JobResult", "TaskResult", "run_job"]

#: A gain below this fraction is never called a gain, whatever the measured spread.
MIN_GAIN = 0.02
#: How a task result's error starts when verification reverted it in the model's context.
REVERTED = "reverted in context"

# Model-wide session options searched one dimension at a time (coordinate descent),
# each value measured in context on the assembled model.
def _session_dimensions(cores: int) -> list[tuple[str, list[dict[str, Any]]]]:
    threads = sorted({1, max(1, cores // 2), cores})
    return [
        ("intra_op_num_threads", [{"intra_op_num_threads": t} for t in threads]),
        ("allow_spinning", [{"config": {"session.intra_op.allow_spinning": "0"}}]),
        ("graph_optimization_level", [{"graph_optimization_level": lv} for lv in ("basic", "extended")]),
        ("execution_mode", [{"execution_mode": "parallel"}]),
    ]


@dataclass(frozen=True)
class JobOptions:
    model: Path
    output: Path
    precision: str = "exact"
    job_type: str = "opat"
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    repeat_tune: bool = False
    keep_initializer_inputs: bool = False
    device: str = "cpu"
    calibration: Path | None = None
    min_cosine: float | None = None  # end-to-end budget of a lossy policy
    max_rel_error: float | None = None
    #: device seconds spent on per-task measurement, split by share of latency
    budget_s: float = 20.0
    job_id: str = ""


@dataclass
class TaskResult:
    task_id: str
    op_name: str
    op_type: str
    instances: int
    share: float
    strategy: str = strategies.DEFAULT
    before_us: float = 0.0
    after_us: float = 0.0
    update_mode: str = ""  # add | update | reserved | hit | unsatisfied | failed
    bank_layer: str = ""
    accuracy: dict[str, float] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    rejected: list[str] = field(default_factory=list)  # lossy candidates not taken, and why
    applied: bool = True  # False when end-to-end verification reverted the choice

    @property
    def improvement(self) -> float:
        return (self.before_us / self.after_us - 1.0) if self.after_us > 0 and self.before_us > 0 else 0.0


@dataclass
class JobResult:
    job_id: str
    model: str
    tuned_model: str
    result_json: str
    workspace: str
    baseline_ms: float
    tuned_ms: float
    tuning_time_s: float
    precision: str
    session_options: dict[str, Any]
    tasks: list[TaskResult]
    repo: dict[str, int]
    accuracy: dict[str, float]
    duty_cycle: float
    trials: int
    failed_candidates: int
    verified: str
    notes: list[str]
    calibration: str = ""
    budget: dict[str, float] = field(default_factory=dict)
    timeline: list[tuple[float, float]] = field(default_factory=list)

    @property
    def improvement(self) -> float:
        return self.baseline_ms / self.tuned_ms - 1.0 if self.tuned_ms > 0 else 0.0


@dataclass(frozen=True)
class JobEvent:
    kind: str  # stage | progress | task | log
    message: str = ""
    done: int = 0
    total: int = 0


class _Job:
    def __init__(
        self,
        opts: JobOptions,
        pool: CompilePool,
        device: DeviceAgent,
        bank: BankWriter,
        emit: Callable[[JobEvent], None],
    ):
        self.opts = opts
        self.pool = pool
        self.device = device
        self.bank = bank
        self.emit = emit
        self.policy: PrecisionPolicy = policy(opts.precision, opts.min_cosine, opts.max_rel_error)
        self.fp: DeviceFingerprint = device_fingerprint("CPUExecutionProvider")
        self.trials: list[tuple[bytes, dict[str, Any]]] = []
        self.failed = 0
        self.notes: list[str] = []
        self.ranges: dict[str, tuple[float, float]] = {}
        # For lossy choices: the best exact strategy to fall back to, and the choice's
        # (gain in us, error as 1 - cosine), which orders the end-to-end back-off.
        self.fallback: dict[str, str] = {}
        self.lossy_cost: dict[str, tuple[float, float]] = {}
        # (seconds since the job started, estimated model gain in us) after each task
        # decision: how fast the tuning converges.
        self.timeline: list[tuple[float, float]] = []
        self.model_write: BankRecord | dict[str, Any] | None = None
        self._gain_us = 0.0
        self.t_start = time.monotonic()

    # ------------------------------------------------------------------ helpers

    def key(self, sig: TaskSignature) -> bytes:
        return bank_key(sig.digest, self.fp.digest, self.opts.precision)

    async def measure(
        self, candidates: list[dict[str, Any]], reference: str, budget_s: float, inputs: Path | None = None
    ) -> dict[str, dict]:
        reply = await self.device.submit(
            {
                "op": "measure",
                "candidates": candidates,
                "inputs": str(inputs or self.inputs_path),
                "reference": reference,
                "budget_s": budget_s,
                "min_rounds": 8,
                "max_rounds": 25,
                "samples": 5,
            }
        )
        return reply["results"]

    def _record_trials(self, key: bytes, task_id: str, results: dict[str, dict]) -> None:
        for name, r in results.items():
            self.trials.append((key, {"task": task_id, "strategy": name, "job": self.opts.job_id, **r}))

    def _best(self, results: dict[str, dict], default: str, gate: Callable[[dict], bool]) -> str:
        """The fastest candidate that clearly beats `default` (see `clearly_faster`)."""
        base = results.get(default)
        if not base or not base.get("ok"):
            raise DeviceError("the default candidate could not be measured")
        valid = {
            k: r for k, r in results.items()
            if k != default and r.get("ok") and not r.get("dropped") and gate(r)
        }  # fmt: skip
        winners = [k for k, r in valid.items() if clearly_faster(r, base)]
        if not winners:
            return default
        return min(winners, key=lambda k: paired_ratio(valid[k], base)[0])

    def rewrites_for(self, task: Task, strategy_name: str) -> dict[tuple[str, ...], Rewrite]:
        """The rewrite of `task` and of each of its twins under one strategy."""
        return task_rewrites(self.prep, self.consts, task, strategy_name, self.ranges)

    def record(self, sig: TaskSignature, family: str, strategy: str, res: dict, base: dict) -> BankRecord:
        """The bank entry for `strategy` winning on task `sig` (res: its measurement)."""
        return BankRecord(
            key=self.key(sig),
            signature=sig,
            device=self.fp,
            strategy=strategy,
            family=family,
            precision=self.opts.precision,
            winner=Measured(res["median_us"], res["spread"], res["repeats"], res["min_us"]),
            baseline=Measured(base["median_us"], base["spread"], base["repeats"], base["min_us"]),
            max_abs_error=res.get("max_abs_error", 0.0),
            max_rel_error=res.get("max_rel_error", 0.0),
            cosine=res.get("cosine", 1.0),
            host=socket.gethostname(),
            aoed_version=__version__,
            created_unix=time.time(),
            job_id=self.opts.job_id,
            model=self.prep.source.name,
        )

    # ------------------------------------------------------------------ stages

    async def run(self) -> JobResult:
        opts = self.opts
        t_start = self.t_start = time.monotonic()
        busy0 = self.device.busy_s
        ts = time.strftime("%Y%m%d%H%M%S")
        stem = opts.model.stem
        self.workspace = opts.output / "aoe_workspace" / f"{stem}_{ts}"
        tunespace = self.workspace / "tunespace"
        self.emit(JobEvent("stage", f"preparing {opts.model.name}"))
        self.prep: Prepared = await trio.to_thread.run_sync(
            prepare, opts.model, tunespace, opts.input_shapes, opts.keep_initializer_inputs
        )
        self.notes.extend(self.prep.notes)
        self.nodes_by_name = {n.name: n for n in self.prep.model.graph.node}
        self.consts = constant_values(self.prep.model.graph)
        # Only tasks with a choice under this policy (exact jobs leave matmul_act alone).
        tasks = tunable_tasks(self.prep, opts.precision)
        if self.policy.lossy:
            self.samples = await trio.to_thread.run_sync(
                load_samples, self.prep.model, self.prep.inputs, opts.calibration
            )
        else:
            self.samples = Samples.single(make_inputs(self.prep.inputs), "synthetic (1 sample)")
        self.held_paths = []
        for i, sample in enumerate(self.samples.held_back):
            self.held_paths.append(tunespace / f"held_back_{i}.npz")
            np.savez(self.held_paths[-1], **sample)
        self.inputs_path = self.held_paths[0]
        feeds = self.samples.held_back[0]
        if self.policy.lossy:
            self.emit(JobEvent("stage", "calibrating"))
            self.ranges = await trio.to_thread.run_sync(activation_ranges, self.prep, self.samples.calibrate)

        await self.load_context()
        # Bank lookups first: what the bank answers costs no measurement.
        results: dict[str, TaskResult] = {}
        chosen: dict[str, str] = {}
        to_tune: list[Task] = []
        hits: dict[str, BankRecord] = {}
        layers: dict[str, str] = {}
        for t in tasks:
            anchor = t.node_names[0]
            results[t.id] = TaskResult(t.id, anchor, t.op_type, 1 + len(t.twins), 0.0)
            rec, layer = await self.bank.lookup_layered(self.key(t.signature))
            known_default, dlayer = (None, "") if rec else await self.bank.known_default_layered(self.key(t.signature))
            if rec is not None and rec.device.digest == self.fp.digest:
                try:
                    self.rewrites_for(t, rec.strategy)
                except (KeyError, AoedError) as exc:
                    self.notes.append(f"bank entry for {t.id} ignored: {exc}")
                    rec = None
                else:
                    hits[t.id] = rec
                    layers[t.id] = layer
            if rec is not None and not opts.repeat_tune:
                r = results[t.id]
                r.strategy, r.update_mode, r.bank_layer = rec.strategy, "hit", layer
                r.before_us, r.after_us = rec.baseline.median_us, rec.winner.median_us
                r.accuracy = {"max_abs_error": rec.max_abs_error, "max_rel_error": rec.max_rel_error, "cosine": rec.cosine}
                chosen[t.id] = rec.strategy
                if t.signature.digest in self.context_reverted:
                    chosen[t.id] = strategies.DEFAULT
                    r.applied = False
                    r.error = f"{REVERTED} (a verification of this model, remembered in the bank)"
                if rec.precision != "exact":
                    self.lossy_cost[t.id] = (
                        (rec.baseline.median_us - rec.winner.median_us) * r.instances, 1.0 - rec.cosine
                    )
            elif known_default is not None and not opts.repeat_tune:
                r = results[t.id]
                r.update_mode, r.bank_layer = "hit", f"{dlayer} (default stays best)"
                r.before_us = r.after_us = float(known_default.get("default_us", 0.0))
                chosen[t.id] = strategies.DEFAULT
            else:
                to_tune.append(t)

        # Profile only when something is to be measured: it ranks the tasks by share.
        total = len(tasks) + 1
        self.emit(JobEvent("progress", "bank", total - len(to_tune) - 1, total))
        if to_tune:
            self.emit(JobEvent("stage", "profiling baseline"))
            prof = await self.device.submit(
                {
                    "op": "profile",
                    "model": str(self.prep.path),
                    "inputs": str(self.inputs_path),
                    "options": {"graph_optimization_level": "basic"},
                    "workdir": str(tunespace),
                    "runs": 10,
                }
            )
            node_us = prof["nodes"]
            model_us = sum(node_us.values()) or 1.0
            for t in tasks:
                t.time_us = sum(node_us.get(n, 0.0) for tt in (t, *t.twins) for n in tt.node_names)
                t.share = t.time_us / model_us
                results[t.id].share = t.share
            to_tune.sort(key=lambda t: -t.share)
            await trio.to_thread.run_sync(self.capture_task_inputs, to_tune, feeds)
            self.emit(JobEvent("stage", f"tuning {len(to_tune)} tasks"))
            share_sum = sum(t.share for t in to_tune) or 1.0
            async with trio.open_nursery() as nursery:
                for t in to_tune:
                    budget = min(5.0, max(0.5, opts.budget_s * t.share / share_sum))
                    results[t.id].bank_layer = layers.get(t.id, "")
                    nursery.start_soon(self.tune_task, t, results[t.id], hits.get(t.id), chosen, budget)
            self.emit(JobEvent("progress", "tasks", total - 1, total))

        rewritten_path = tunespace / "assembled.onnx"
        rewritten = await self.assemble(tasks, chosen, rewritten_path)
        e2e_gate: dict[str, float] | None = None
        if self.policy.lossy:
            self.emit(JobEvent("stage", "checking accuracy end to end"))
            rewritten, e2e_gate = await self.back_off(tasks, chosen, results, rewritten, rewritten_path)

        session_opts, session_mode = await self.tune_session(rewritten_path)
        self.emit(JobEvent("progress", "session options", total, total))

        # Verify end to end, interleaved against the untouched input model.
        self.emit(JobEvent("stage", "verifying end to end"))
        final_model, final_opts, verified, e2e = await self.verify(
            tasks, chosen, results, rewritten, rewritten_path, session_opts,
            from_bank=not to_tune and session_mode == "hit",
        )
        await self.remember_context(tasks, results)
        if verified != "tuned":
            for r in results.values():
                if r.strategy != strategies.DEFAULT and r.applied:
                    r.applied = False
                    r.error = r.error or f"not applied: end-to-end verification kept {verified}"
        out = await self.write_outputs(final_model, final_opts, ts)

        elapsed = time.monotonic() - t_start
        repo = _repo_summary(results.values(), session_mode)
        busy = self.device.busy_s - busy0
        result = JobResult(
            job_id=opts.job_id,
            model=str(opts.model),
            tuned_model=str(out),
            result_json="",
            workspace=str(self.workspace),
            baseline_ms=e2e["baseline"]["median_us"] / 1000.0,
            tuned_ms=e2e["final"]["median_us"] / 1000.0,
            tuning_time_s=elapsed,
            precision=opts.precision,
            session_options=final_opts,
            tasks=sorted(results.values(), key=lambda r: -r.share),
            repo=repo,
            accuracy=e2e_gate if e2e_gate is not None and verified == "tuned" else {
                k: e2e["final"].get(k, 0.0) for k in ("max_abs_error", "max_rel_error", "cosine")
            },
            duty_cycle=busy / elapsed if elapsed > 0 else 0.0,
            trials=len(self.trials),
            failed_candidates=self.failed,
            verified=verified,
            notes=self.notes,
            calibration=self.samples.source,
            timeline=[(round(t, 3), round(g, 3)) for t, g in self.timeline],
            budget={
                "task_min_cosine": self.policy.task_min_cosine,
                "task_max_rel_error": self.policy.task_max_rel_error,
                "min_cosine": self.policy.e2e_min_cosine,
                "max_rel_error": self.policy.e2e_max_rel_error,
            },
        )
        await self.bank.write(BankWrite(trials=tuple(self.trials)))
        json_path = opts.output / f"aoe_result_{opts.job_type}_{ts}_{os.getpid()}.json"
        result.result_json = str(json_path)
        doc = json.dumps(_json_safe(result_json(result)), indent=2, allow_nan=False)
        await trio.to_thread.run_sync(json_path.write_text, doc + "\n")
        return result

    def task_dir(self, task: Task) -> Path:
        return self.workspace / "tunespace" / "tasks" / task.id

    async def assemble(self, tasks: list[Task], chosen: dict[str, str], path: Path) -> onnx.ModelProto:
        """The prepared model with every chosen strategy applied, saved at `path`."""
        rewrites: dict[tuple[str, ...], Rewrite] = {}
        for t in tasks:
            rewrites.update(self.rewrites_for(t, chosen.get(t.id, strategies.DEFAULT)))
        model = apply_rewrites(self.prep.model, rewrites)
        await trio.to_thread.run_sync(onnx.save, model, str(path))
        return model

    async def back_off(
        self, tasks: list[Task], chosen: dict[str, str], results: dict[str, TaskResult],
        model: onnx.ModelProto, path: Path,
    ) -> tuple[onnx.ModelProto, dict[str, float]]:
        """Hold the assembled model to the end-to-end budget on the held-back samples.

        While it fails, revert the lossy choice with the least gain per unit of error to
        its best exact strategy. Returns the final model and its accuracy."""
        by_id = {t.id: t for t in tasks}
        while True:
            acc = await self.device.submit(
                {"op": "compare", "reference": str(self.opts.model), "candidate": str(path),
                 "inputs": [str(p) for p in self.held_paths]}
            )
            acc = {k: acc[k] for k in ("max_abs_error", "max_rel_error", "cosine")}
            lossy = [
                tid for tid, name in chosen.items()
                if strategies.get(by_id[tid].family, name).precision != "exact"
            ]  # fmt: skip
            if self.policy.e2e_ok(acc) or not lossy:
                return model, acc

            def gain_per_error(tid: str) -> float:
                gain, err = self.lossy_cost.get(tid, (0.0, 1.0))
                return gain / max(err, 1e-12)

            victim = min(lossy, key=gain_per_error)
            r = results[victim]
            r.rejected.append(
                f"{chosen[victim]}: backed off, the model together reached cosine {acc['cosine']:.5f} and "
                f"max rel error {acc['max_rel_error']:.3g} against the budget "
                f"{self.policy.e2e_min_cosine} / {self.policy.e2e_max_rel_error}"
            )
            chosen[victim] = r.strategy = self.fallback.get(victim, strategies.DEFAULT)
            model = await self.assemble(tasks, chosen, path)

    def capture_task_inputs(self, tasks: list[Task], feeds: dict[str, np.ndarray]) -> None:
        """Save each task's real input activations (one run of the prepared model), so
        candidates are measured and compared on the data they will see in the model."""
        wanted = {n for t in tasks for n in t.inputs if n not in self.consts}
        values = capture(self.prep, wanted, feeds)
        for t in tasks:
            d = self.task_dir(t)
            d.mkdir(parents=True, exist_ok=True)
            np.savez(d / "inputs.npz", **{n: values[n] for n in t.inputs if n not in self.consts})

    async def tune_task(
        self, task: Task, res: TaskResult, hit: BankRecord | None, chosen: dict[str, str], budget_s: float
    ) -> None:
        """Compile every strategy of the task's family, measure them, decide, record."""
        taskdir = self.task_dir(task)
        tm_path = taskdir / "task.onnx"
        tm = task_model(self.prep.model, task, self.consts, self.prep.ctx.tensors)
        await trio.to_thread.run_sync(onnx.save, tm, str(tm_path))
        precision_of = {s.name: s.precision for s in strategies.strategies_for(task.family, self.opts.precision)}
        names = list(precision_of)
        touched = {*task.inputs, *task.outputs, *(o for n in task.node_names for o in self.nodes_by_name[n].output)}
        ranges = {k: v for k, v in self.ranges.items() if k in touched}
        compiled: dict[str, dict] = {}

        async def compile_one(name: str) -> None:
            compiled[name] = await self.pool.compile(
                {
                    "task_model": str(tm_path),
                    "family": task.family,
                    "strategy": name,
                    "prefix": f"aoe/{task.id}",
                    "out": str(taskdir / f"{name}.onnx"),
                    "ranges": ranges,
                }
            )

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(compile_one, name)
        cands = []
        for name in names:
            c = compiled[name]
            if c.get("ok"):
                cands.append({"id": name, "model": str(taskdir / f"{name}.onnx")})
            elif c.get("applicable", True):
                self.failed += 1
                res.candidates.append({"strategy": name, "ok": False, "error": c.get("error", "")})
        key = self.key(task.signature)
        if strategies.DEFAULT not in compiled or not compiled[strategies.DEFAULT].get("ok"):
            res.update_mode, res.error = "failed", f"default form did not compile: {compiled.get(strategies.DEFAULT, {}).get('error')}"
            chosen[task.id] = hit.strategy if hit else strategies.DEFAULT
            return
        try:
            measured = await self.measure(cands, strategies.DEFAULT, budget_s, taskdir / "inputs.npz")
        except DeviceError as exc:
            res.update_mode, res.error = "failed", str(exc)
            chosen[task.id] = hit.strategy if hit else strategies.DEFAULT
            return
        self._record_trials(key, task.id, measured)
        for name, r in measured.items():
            if not r.get("ok"):
                self.failed += 1
            res.candidates.append({"strategy": name, **r})
        gate = self.policy.task_ok
        exact = {k: r for k, r in measured.items() if precision_of.get(k) == "exact"}
        best = best_exact = self._best(exact, strategies.DEFAULT, gate)
        if self.policy.lossy:
            best = self._best_lossy(measured, best_exact, precision_of, res)
            self.fallback[task.id] = best_exact
        base = measured[strategies.DEFAULT]
        res.before_us = base["median_us"]
        win = measured[best]
        if best != best_exact:
            gain = (measured[best_exact]["median_us"] - win["median_us"]) * res.instances
            self.lossy_cost[task.id] = (gain, 1.0 - win.get("cosine", 1.0))
        # AOE's bank semantics, per task.
        if hit is None:
            if best != strategies.DEFAULT:
                await self.bank.write(BankWrite(entries=(self.record(task.signature, task.family, best, win, base),)))
                res.update_mode = "add"
            else:
                await self.bank.write(
                    BankWrite(defaults=((key, {"default_us": base["median_us"], "job": self.opts.job_id}),))
                )
                res.update_mode = "unsatisfied"
        else:
            old = measured.get(hit.strategy)
            better = (
                best != hit.strategy and old is not None and old.get("ok") and clearly_faster(win, old)
            ) or (old is None or not old.get("ok") or not gate(old))
            if better and best != strategies.DEFAULT:
                await self.bank.write(BankWrite(entries=(self.record(task.signature, task.family, best, win, base),)))
                res.update_mode = "update"
            else:
                res.update_mode = "reserved"
                if old is not None and old.get("ok") and gate(old):
                    best, win = hit.strategy, old
        res.strategy = best
        res.after_us = win["median_us"]
        res.accuracy = {k: win.get(k, 0.0) for k in ("max_abs_error", "max_rel_error", "cosine")}
        chosen[task.id] = best
        self._gain_us += max(0.0, res.before_us - res.after_us) * res.instances
        self.timeline.append((time.monotonic() - self.t_start, self._gain_us))
        self.emit(JobEvent("task", f"{task.id}: {best} ({res.update_mode})"))

    def _best_lossy(self, measured: dict[str, dict], best_exact: str, precision_of: dict[str, str],
                    res: TaskResult) -> str:
        """The lossy candidate that passes the task gate and clearly beats the best exact
        one, in context (its quantize/dequantize boundaries measured with it); else
        `best_exact`. Says in `res.rejected` why each other lossy candidate lost."""
        incumbent = measured[best_exact]
        winners = []
        for name, r in measured.items():
            if precision_of.get(name) == "exact":
                continue
            if not r.get("ok"):
                res.rejected.append(f"{name}: failed ({r.get('error', '')})")
            elif not self.policy.task_ok(r):
                res.rejected.append(
                    f"{name}: outside the accuracy budget (cosine {r.get('cosine', 0):.5f}, "
                    f"max rel error {r.get('max_rel_error', 0):.3g})"
                )
            elif r.get("dropped") or not clearly_faster(r, incumbent):
                res.rejected.append(
                    f"{name}: not faster than {best_exact} ({r['median_us']:.1f} us vs "
                    f"{incumbent['median_us']:.1f} us)"
                )
            else:
                winners.append(name)
        if not winners:
            return best_exact
        return min(winners, key=lambda k: paired_ratio(measured[k], incumbent)[0])

    async def tune_session(self, model_path: Path) -> tuple[dict[str, Any], str]:
        """Choose model-wide session options in context; returns (options, update mode)."""
        sig, key = self.model_sig, self.model_key
        rec, known_default = self.model_rec, self.model_default
        if rec is not None and not self.opts.repeat_tune:
            return json.loads(rec.strategy), "hit"
        if known_default is not None and not self.opts.repeat_tune:
            return {}, "hit"
        self.emit(JobEvent("stage", "tuning session options"))
        current: dict[str, Any] = {}
        base_res: dict | None = None
        cur_res: dict | None = None
        cores = os.cpu_count() or 1
        for _dim, values in _session_dimensions(cores):
            cands = {"current": current}
            for v in values:
                cands[canonical_json(v)] = _merge(current, v)
            measured = await self.measure(
                [{"id": k, "model": str(model_path), "options": o} for k, o in cands.items()],
                "current",
                budget_s=2.0,
            )
            self._record_trials(key, "session", measured)
            if base_res is None:
                base_res = measured["current"]
            best = self._best(measured, "current", self.policy.task_ok)
            if best != "current":
                current = cands[best]
            cur_res = measured[best]
        assert base_res is not None and cur_res is not None
        # Gains compound across dimensions; only keep them if they beat the start.
        strategy = canonical_json(current)
        # Written after verification, together with what it reverted in context.
        if rec is None:
            if current:
                self.model_write = self.record(sig, "session", strategy, cur_res, base_res)
                return current, "add"
            self.model_write = {"default_us": base_res["median_us"]}
            return {}, "unsatisfied"
        if strategy != rec.strategy and current:
            self.model_write = self.record(sig, "session", strategy, cur_res, base_res)
            return current, "update"
        return json.loads(rec.strategy), "reserved"

    async def load_context(self) -> None:
        """What the bank remembers of this model as a whole: its session-options entry
        (or "defaults stay best" record) and the tasks a verification reverted in this
        model's context, which a bank-hit run then leaves unchanged."""
        self.model_sig = model_signature(self.prep.model)
        self.model_key = self.key(self.model_sig)
        self.model_rec, _ = await self.bank.lookup_layered(self.model_key)
        self.model_default = None
        if self.model_rec is None:
            self.model_default, _ = await self.bank.known_default_layered(self.model_key)
        self.context_reverted = set() if self.opts.repeat_tune else stored_reverted(self.model_rec, self.model_default)

    async def remember_context(self, tasks: list[Task], results: dict[str, TaskResult]) -> None:
        """Store the model-level record with the set of tasks reverted in context."""
        by_id = {t.id: t for t in tasks}
        reverted = sorted(
            by_id[tid].signature.digest for tid, r in results.items() if r.error.startswith(REVERTED)
        )
        write = self.model_write
        if write is None:  # nothing newly measured: rewrite only if the set changed
            if reverted == sorted(stored_reverted(self.model_rec, self.model_default)):
                return
            write = self.model_rec if self.model_rec is not None else dict(self.model_default or {})
        if isinstance(write, BankRecord):
            params = {k: v for k, v in write.params.items() if k != "reverted"}
            if reverted:
                params["reverted"] = ",".join(reverted)
            await self.bank.write(BankWrite(entries=(dataclasses.replace(write, params=params),)))
        else:
            await self.bank.write(BankWrite(defaults=((self.model_key, {**write, "reverted": reverted}),)))

    def _revert_target(self, tid: str, current: str) -> str:
        fallback = self.fallback.get(tid, strategies.DEFAULT)
        return fallback if fallback != current else strategies.DEFAULT

    async def verify(
        self, tasks: list[Task], chosen: dict[str, str], results: dict[str, TaskResult],
        rewritten: onnx.ModelProto, rewritten_path: Path, options: dict[str, Any],
        from_bank: bool = False,
    ) -> tuple[onnx.ModelProto, dict[str, Any], str, dict[str, dict]]:
        """A/B the tuned model against the input model, in context; revert what does not pay.

        Each round measures, interleaved: the input model, the tuned model, and the tuned
        model with each changed task reverted. A task whose reversal is clearly faster
        than keeping it (or the best reversal, while the tuned model is slower than the
        input) is reverted, and the round repeats. When nothing is left to revert and the
        model is still slower, session options alone and then the input model itself are
        the fallbacks, so the result is never slower than the input.

        With `from_bank` (every choice came from the bank) the first round is a plain A/B,
        the one end-to-end check of a bank-hit run; reversals are measured only if it fails.

        Returns (model, session options, what survived, the last measurements)."""
        original = str(self.opts.model)
        tunespace = self.workspace / "tunespace"
        model, path = rewritten, rewritten_path

        def acceptable(fin: dict, base: dict) -> bool:
            return (
                fin.get("ok", False)
                and self.policy.e2e_ok(fin)
                and not clearly_slower(fin, base)
                and fin["median_us"] <= base["median_us"] * (1.0 + MIN_GAIN)
            )

        explore = not from_bank
        while True:
            changed = [tid for tid, name in chosen.items() if name != strategies.DEFAULT] if explore else []
            cands = [
                {"id": "baseline", "model": original, "options": {}},
                {"id": "final", "model": str(path), "options": options},
            ]
            variants: dict[str, dict[str, str]] = {}
            for tid in changed:
                alt = {**chosen, tid: self._revert_target(tid, chosen[tid])}
                alt_path = tunespace / f"verify_without_{tid}.onnx"
                await self.assemble(tasks, alt, alt_path)
                variants[f"without:{tid}"] = alt
                cands.append({"id": f"without:{tid}", "model": str(alt_path), "options": options})
            measured = await self.measure(cands, "baseline", budget_s=3.0 if explore else 1.5)
            base, fin = measured["baseline"], measured["final"]
            if not explore and not acceptable(fin, base):
                explore = True  # the bank's choices do not hold here: find which
                continue
            better = [
                k for k in variants
                if measured[k].get("ok") and self.policy.e2e_ok(measured[k])
                and (clearly_faster(measured[k], fin) or not acceptable(fin, base))
            ]  # fmt: skip
            if acceptable(fin, base) and not better:
                return model, options, "tuned", measured
            if not better:
                break
            pick = min(better, key=lambda k: measured[k]["median_us"])
            tid = pick.split(":", 1)[1]
            r = results[tid]
            r.applied = False
            r.error = (
                f"{REVERTED}: model {measured[pick]['median_us']:.1f} us without {chosen[tid]}, "
                f"{fin['median_us']:.1f} us with it"
            )
            chosen.update(variants[pick])
            model = await self.assemble(tasks, chosen, path)
        self.notes.append(
            f"verification: tuned model measured {fin.get('median_us', 0):.1f} us against "
            f"baseline {base['median_us']:.1f} us (max rel error {fin.get('max_rel_error')}); falling back"
        )
        if options:
            measured = await self.measure(
                [{"id": "baseline", "model": original, "options": {}},
                 {"id": "final", "model": str(self.prep.path), "options": options}],
                "baseline", budget_s=3.0,
            )  # fmt: skip
            if acceptable(measured["final"], measured["baseline"]):
                return self.prep.model, options, "options only", measured
            base = measured["baseline"]
        same = {"baseline": base, "final": dict(base)}
        return onnx.load(original), {}, "reverted to input", same

    async def write_outputs(self, model: onnx.ModelProto, options: dict[str, Any], ts: str) -> Path:
        stem = self.opts.model.stem
        out_dir = self.workspace / "tunespace" / "result"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stem}_{ts}_tune.onnx"
        tuned = onnx.ModelProto()
        tuned.CopyFrom(model)
        tuned_metadata(tuned, options, self.opts.precision, self.fp.digest)
        await trio.to_thread.run_sync(onnx.save, tuned, str(path))
        return path


def stored_reverted(rec: BankRecord | None, default: dict[str, Any] | None) -> set[str]:
    """Signature digests a model-level bank record says were reverted in context."""
    if rec is not None:
        return {d for d in rec.params.get("reverted", "").split(",") if d}
    return set((default or {}).get("reverted", []))


def paired_ratio(a: dict, b: dict) -> tuple[float, float, float]:
    """Round-by-round ratios of a's to b's medians: (median, lower quartile, upper quartile).

    Candidates are measured interleaved, so a ratio within one round is free of the
    machine's drift; the quartiles over rounds say how sure the median ratio is."""
    pairs = [x / y for x, y in zip(a.get("rounds_us", []), b.get("rounds_us", [])) if x and y]
    if not pairs:
        r = a["median_us"] / b["median_us"]
        return r, r, r
    q25, med, q75 = np.percentile(pairs, [25, 50, 75])
    return float(med), float(q25), float(q75)


def clearly_faster(a: dict, b: dict) -> bool:
    """a beats b by more than MIN_GAIN in the median round, in at least 3 of 4 rounds, and
    in the overall median (the number reports show)."""
    med, _q25, q75 = paired_ratio(a, b)
    return med < 1.0 - MIN_GAIN and q75 < 1.0 and a["median_us"] < b["median_us"]


def clearly_slower(a: dict, b: dict) -> bool:
    """a is slower than b by more than MIN_GAIN in the median round and in 3 of 4 rounds."""
    med, q25, _q75 = paired_ratio(a, b)
    return med > 1.0 + MIN_GAIN and q25 > 1.0


def _json_safe(obj: object) -> object:
    """`obj` with non-finite floats as None (JSON has no inf/nan)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if "config" in a or "config" in b:
        out["config"] = {**a.get("config", {}), **b.get("config", {})}
    return out


def _repo_summary(results, session_mode: str) -> dict[str, int]:
    modes = [r.update_mode for r in results] + [session_mode]
    hit = sum(m in ("hit", "reserved", "update") for m in modes)
    return {
        "repo_add_num": modes.count("add"),
        "repo_hit_num": hit,
        "repo_reserved_num": modes.count("reserved"),
        "repo_unsatisfied_num": modes.count("unsatisfied"),
        "repo_update_num": modes.count("update"),
        "total_num": len(modes),
    }


async def run_job(
    opts: JobOptions,
    pool: CompilePool,
    device: DeviceAgent,
    bank: BankWriter,
    emit: Callable[[JobEvent], None] = lambda e: None,
) -> JobResult:
    """Run one job to completion; raises AoedError subclasses (ModelError, OptionError,
    BankError, DeviceError) with a one-line message. Cancellation stops it where it is."""
    job = _Job(opts, pool, device, bank, emit)
    try:
        return await job.run()
    except BankError:
        raise
    except OSError as exc:
        raise AoedError(f"{exc.filename or opts.output}: {exc.strerror or exc}") from None


def result_json(result: JobResult) -> dict[str, Any]:
    """The AOE-shaped result document (`aoe_result_opat_{ts}_{pid}.json`)."""
    tasks = []
    for t in result.tasks:
        tasks.append(
            {
                "task_id": t.task_id,
                "op_name": t.op_name,
                "op_type": t.op_type,
                "instances": t.instances,
                "latency_share": round(t.share, 4),
                "strategy": t.strategy,
                "applied": t.applied,
                "performance_before_tune(us)": round(t.before_us, 3),
                "performance_after_tune(us)": round(t.after_us, 3),
                "performance_improvement": round(t.improvement, 4),
                "update_mode": t.update_mode,
                "bank_layer": t.bank_layer,
                "accuracy": t.accuracy,
                "candidates": t.candidates,
                "error": t.error,
                "rejected": t.rejected,
            }
        )
    added = [{"op_name": t.op_name, "op_type": t.op_type} for t in result.tasks if t.update_mode == "add"]
    updated = [{"op_name": t.op_name, "op_type": t.op_type} for t in result.tasks if t.update_mode == "update"]
    return {
        "basic": {
            "tuning_name": Path(result.model).stem,
            "tuning_time(s)": round(result.tuning_time_s, 3),
            "job_id": result.job_id,
            "precision": result.precision,
        },
        "OPAT": {
            "model_baseline_performance(ms)": round(result.baseline_ms, 6),
            "model_result_performance(ms)": round(result.tuned_ms, 6),
            "model_performance_improvement": round(result.improvement, 4),
            "opat_tuning_result": "tuning successful",
            "repo_modified_operators": {"add_repo_operators": added, "update_repo_operators": updated},
            "repo_summary": result.repo,
        },
        "tuned_model": result.tuned_model,
        "session_options": result.session_options,
        "verification": result.verified,
        "accuracy": result.accuracy,
        "accuracy_budget": result.budget,
        "calibration": result.calibration,
        "device": {"duty_cycle": round(result.duty_cycle, 4), "trials": result.trials,
                   "failed_candidates": result.failed_candidates,
                   # [seconds into the job, estimated gain in us] after each task decision
                   "gain_timeline": result.timeline},
        "notes": result.notes,
        "tasks": tasks,
    }

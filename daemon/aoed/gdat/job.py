"""A GDAT job from its options to its outputs: `run_gdat()`, which the GDAT job kind
(kind.py) calls behind `Engine.run_job`, the door every job enters by.

  options    derived from the job's JobSpec once (`GdatOptions.from_run`), whose fields
             were checked where it was built; `GdatOptions.check` asks only what this
             machine can run; torch missing is one line naming the extra
  archive    a .pt2 is read as data before any process loads it
             (backends/torch/archive.py): one that holds anything torch would unpickle,
             evaluate or import fails the job here, naming the member
  inspect    one rank process loads the model and says its gradient layout: the bank key
             (it, and every rank, is confined: aoed.sandbox)
  bank       a record for the key (or "DDP's defaults stayed fastest") and no REPEAT_TUNE:
             the outputs come from it, and no world starts
  search     the main world, the stages and the confirming A/B (search.py); each stage
             finished is kept in the bank under the run's key (engine/resume.py, as
             an ONNX job's task decisions are: the program's digest and the search's
             options), so a run again after an interruption, the daemon's resumed job
             or `aoe tune` again, takes it unmeasured; forgotten once outputs are written
  bank       AOE's rules (engine/bankrules.py): add, update, reserved, unsatisfied; every
             configuration measured goes into the history
  outputs    ddp_config.json and aoe_result_gdat_{ts}_{pid}.json (outcome.py)

The job holds a bank writer of its own (one writer per bank, across processes: a
daemon's bank waits for it) and closes every world it started, whatever happens;
cancellation through `JobHandle` kills every rank and raises JobCancelledError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from aoe.config import Config
from aoe.errors import AoedError, JobCancelledError, OptionError
from aoe.gdat import DDPConfig, plugin_hook_names
from aoe.gradlayout import GradientLayout, host_fingerprint
from aoe.recordcheck import Vocabulary
from aoe.spec import JobType, check_model_kind
from aoed.backends.torch.archive import check_pt2
from aoed.bank.writer import BankWrite, BankWriter
from aoed.engine import bankrules, resume
from aoed.engine.budget import Budget
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.ledger import JobLedger, new_job_id
from aoed.engine.messages import JobEvent
from aoed.engine.outputs import write_json
from aoed.engine.workspace import Workspace
from aoed.engine.world import World, WorldSpec, inspect_model
from aoed.engine.worldsize import WorldLimits
from aoed.gdat import space
from aoed.gdat.outcome import GdatResult, configurations, ddp_config_doc, result_doc
from aoed.gdat.race import Meter
from aoed.gdat.search import CONFIRM_ROUNDS, DEFAULT, RACE_ROUNDS, ConfirmingAB, Search
from aoed.logs import job_log

__all__ = ["MISSING_TORCH", "GdatOptions", "have_torch", "run_gdat"]

log = logging.getLogger(__name__)


def _digest(path: Path) -> str:
    """The sha256 of the program's file (what a resumed search's stages were measured on)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


MISSING_TORCH = "GDAT jobs need torch: install the extra with pip install 'aoed[gdat]'"
#: The budget derived when none is given: the planned rounds at the measured cost of a
#: configuration's turn, within these bounds (device seconds).
MIN_BUDGET_S = 10.0
MAX_BUDGET_S = 900.0
#: The most rounds, warm-up and measured steps of a turn: far past what a search needs.
MAX_ROUNDS = 1000


@dataclass(frozen=True)
class GdatOptions:
    #: the torch.export program (.pt2), or with `entry` the Python file that defines it
    model: Path
    output: Path
    #: a function in `model` (a .py file) returning (model, batch, loss_fn): user code,
    #: so embedded runs only
    entry: str = ""
    #: ranks; None: 2 on gloo, one per device on nccl and hccl
    world_size: int | None = None
    backend: str = "gloo"
    precision: str = "exact"
    repeat_tune: bool = False
    #: device seconds for the search (the confirming A/B is counted apart); None: fitted
    budget_s: float | None = None
    job_id: str = ""
    keep_workspace: bool = False
    #: the backend knob settings to try (each a world's environment); None: the backend's
    world_knobs: tuple[tuple[tuple[str, str], ...], ...] | None = None
    #: rounds of each search stage and of the confirming A/B; steps per turn
    rounds: int = RACE_ROUNDS
    confirm_rounds: int = CONFIRM_ROUNDS
    warmup: int = 2
    steps: int = 5
    #: load the program unconfined where the kernel cannot confine the processes that
    #: load it (`[daemon] allow_unconfined_gdat`); else such a job fails saying why
    allow_unconfined: bool = False
    #: how large a world may be (a daemon's [limits]); None: this machine's defaults
    limits: WorldLimits | None = None
    #: the program as its submitter knows it, for messages (JobRun.shown); empty: `model`
    shown: str = ""
    #: the id of an interrupted run of this job (JobRun.resumes): with repeat_tune, the
    #: only run whose stages this one takes
    resumes: str = ""

    @classmethod
    def from_run(
        cls, run: JobRun, *, limits: WorldLimits | None = None, allow_unconfined: bool = False
    ) -> GdatOptions:
        """The options of the GDAT job `run`: the one place a `JobSpec` becomes GDAT's
        options. Its fields were checked where the spec was built (JobSpec), so they are
        taken as they are; `limits` and `allow_unconfined` are the host's (a daemon's
        [limits] and [daemon] allow_unconfined_gdat)."""
        spec = run.spec
        return cls(
            model=run.model,
            output=run.output,
            entry=spec.entry or "",
            world_size=spec.world_size,
            backend=spec.backend or "gloo",
            precision=spec.gradient_precision or "exact",
            repeat_tune=spec.repeat_tune,
            budget_s=spec.budget_s,
            job_id=run.job_id,
            keep_workspace=run.keep_workspace,
            allow_unconfined=allow_unconfined,
            limits=limits,
            shown=run.shown,
            resumes=run.resumes,
        )

    def check(self) -> None:
        """OptionError where this machine cannot run these options: a model that is not
        GDAT's (aoe.spec.check_model_kind) or not there, a world over the limits, the
        search's own counts out of bounds. The options a spec gives were checked where it
        was built (JobSpec)."""
        check_model_kind(self.model, JobType.GDAT, self.entry or None)
        limits = self.limits or WorldLimits.of_machine()
        limits.check(
            self.world_size, self.backend, "--world-size" if self.limits is None else "world_size"
        )
        counts = (self.rounds, self.confirm_rounds, self.steps, self.warmup)
        if self.rounds < 3 or self.confirm_rounds < 3 or self.steps < 1 or self.warmup < 1:
            raise OptionError(
                "GDAT rounds: at least 3 per stage and per confirmation, 1 warm-up and 1 measured step"
            )
        if max(counts) > MAX_ROUNDS:
            raise OptionError(
                f"GDAT rounds, warm-up and measured steps {counts}: at most {MAX_ROUNDS} each"
            )
        if not self.model.is_file():
            raise OptionError(f"{self.shown or self.model}: no such file")

    @property
    def source(self) -> dict[str, str]:
        path = str(self.model.resolve())
        return (
            {"kind": "entry", "path": path, "function": self.entry}
            if self.entry
            else {"kind": "pt2", "path": path, "shown": self.shown or path}
        )


def have_torch() -> bool:
    """Whether torch can be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _planned_turns(layout: GradientLayout, precision: str, knobs: int, rounds: int) -> int:
    """Configuration turns the search plans (what a derived budget pays for)."""
    hooks = 0 if precision == "exact" else 4
    return rounds * (len(space.ladder(layout)) + 5 + 3 + hooks + 2 * knobs)


class _Job:
    def __init__(
        self,
        opts: GdatOptions,
        config: Config,
        emit: Callable[[JobEvent], None],
        job_id: str,
        ws: Workspace,
        bank: BankWriter,
    ):
        self.opts = opts
        self.config = config
        self.job_id = job_id
        self.ws = ws
        self.bank = bank
        self.ledger = JobLedger(job_id, emit)
        self.budget = Budget(
            opts.budget_s or MAX_BUDGET_S, self.ledger, given=opts.budget_s is not None
        )
        self.fitted = opts.budget_s is not None
        self.worlds: dict[str, World] = {}
        self.started = time.monotonic()
        #: the key this run's stages are kept under in the bank (engine/resume.py)
        self._run_key = b""
        #: what the result says besides the search's own notes
        self.notes: list[str] = []

    @property
    def world_size(self) -> int:
        """The world's size, settled when the program is inspected (given, or the devices
        there are)."""
        n = self.opts.world_size
        assert n is not None, "the world size is settled when the program is inspected"
        return n

    # ------------------------------------------------------------------ resume

    async def load_checkpoint(self, depends: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The stages a run of this program with the same options finished, by stage,
        as kept in the bank (engine/resume.py, the records ONNX jobs resume from): the
        daemon's resumed job, or `aoe tune` run again after ^C; with REPEAT_TUNE only
        the job this run resumes. `depends`: what the search's results depend on."""
        self._run_key = resume.key_for({"gdat": depends})
        try:
            found = await self.bank.decisions(self._run_key)
        except AoedError as exc:
            log.warning("job %s: no interrupted run's stages are read (%s)", self.job_id, exc)
            return {}
        stages: dict[str, dict[str, Any]] = {}
        for key, doc in found:
            record = doc.get("stage")
            if isinstance(record, dict) and resume.takes(
                doc, self.opts.repeat_tune, self.opts.resumes
            ):
                stages[key[len(self._run_key) :].decode("utf-8", "replace")] = record
        return stages

    async def checkpoint(self, stage: str, record: dict[str, Any]) -> None:
        """Keep what `stage` found in the bank, committed before the next stage starts,
        for a run that resumes this job."""
        doc = {"job": self.job_id, "stage": record}
        try:
            await self.bank.write(BankWrite(decisions=((self._run_key + stage.encode(), doc),)))
        except AoedError as exc:
            log.warning("job %s: %s not kept for a resume (%s)", self.job_id, stage, exc)

    async def drop_checkpoint(self) -> None:
        """Forget this run's stages: its outputs are written. Never raises: stages left
        only make a later run of the same program and options take them."""
        try:
            await self.bank.write(BankWrite(forget=(self._run_key,)))
        except AoedError as exc:
            log.warning("job %s: its search's stages stay in the bank (%s)", self.job_id, exc)

    def emit(self, kind: str, message: str = "", done: int = 0, total: int = 0) -> None:
        self.ledger.emit(JobEvent(kind, message, done, total))

    def open_world(self, key: str, env: tuple[tuple[str, str], ...]) -> World:
        spec = WorldSpec(
            self.opts.source,
            self.world_size,
            self.opts.backend,
            env,
            unconfined_ok=self.opts.allow_unconfined,
        )
        world = World(
            spec,
            self.ws.root / "worlds",
            self.config.runtime_dir,
            name=f"world{len(self.worlds)}",
            on_wait=self.ledger.waiting,
        )
        self.worlds[key] = world
        return world

    async def close_worlds(self) -> None:
        for world in self.worlds.values():
            await world.aclose()
            world.close_locks()
        for store in (self.ws.root / "worlds").glob("*.store"):
            store.unlink(missing_ok=True)

    def remaining_s(self, meter: Meter, layout: GradientLayout, knobs: int) -> float:
        if not self.fitted and meter.turn_s > 0:
            planned = (
                _planned_turns(layout, self.opts.precision, knobs, self.opts.rounds)
                * meter.turn_s
                * 1.3
            )
            self.budget.total_s = min(MAX_BUDGET_S, max(MIN_BUDGET_S, planned))
            self.fitted = True
        return self.budget.remaining_s

    # ------------------------------------------------------------------ stages

    async def run(self) -> GdatResult:
        opts = self.opts
        self.emit("stage", f"loading {opts.model.name}")
        t0 = time.monotonic()
        info = await inspect_model(
            opts.source,
            opts.backend,
            opts.world_size or 0,
            self.ws.root / "worlds",
            unconfined_ok=opts.allow_unconfined,
        )
        self.ledger.charge_device(time.monotonic() - t0, "profile")
        said = str(info.get("sandbox") or "")
        if not opts.entry and not said.startswith("confined"):
            log.warning("job %s: the program is loaded %s", self.job_id, said)
            self.notes.append(f"the program was loaded {said}, as the configuration allows")
        if opts.world_size is None:
            n = 2 if opts.backend == "gloo" else int(info.get("devices") or 0)
            self.opts = opts = dataclasses.replace(opts, world_size=n)
        assert opts.world_size is not None
        layout = GradientLayout.of(info["params"], opts.world_size, opts.backend)
        host = host_fingerprint(opts.backend, str(info.get("accelerator") or ""))
        sig = layout.signature()
        key = bankrules.key_for(sig, host, opts.precision)
        log.info(
            "job %s: %d gradients, %.3f MiB, key %s",
            self.job_id,
            len(layout.params),
            layout.grad_bytes / (1 << 20),
            key.decode(),
        )
        rec, layer = await self.bank.lookup_layered(key)
        default, default_layer = await self.bank.known_default_layered(key)
        knobs = (
            opts.world_knobs if opts.world_knobs is not None else space.world_knobs(opts.backend)
        )
        # A banked configuration may set only the knobs this job's search sets itself.
        known: dict[str, set[str]] = {}
        for world in knobs:
            for name, value in world:
                known.setdefault(name, set()).add(value)
        vocabulary = Vocabulary(knobs={k: frozenset(v) for k, v in known.items()})
        ans = bankrules.answer(rec, layer, default, default_layer, host, vocabulary)
        if ans.usable(opts.repeat_tune):
            return self._from_bank(ans, layout, key)
        banked = (
            DDPConfig.from_params(ans.record.params)
            if ans.kind == "hit" and ans.record is not None
            else None
        )
        main = self.open_world("", ())
        meter = Meter(
            self.worlds,
            self.ledger.charge_device,
            lambda: self.remaining_s(meter, layout, len(knobs)),
            self.emit,
            warmup=opts.warmup,
            steps=opts.steps,
        )
        self.emit("stage", f"starting a world of {opts.world_size} on {opts.backend}")
        t0 = time.monotonic()
        await main.start()
        # starting a world is not searching
        self.ledger.charge_device(time.monotonic() - t0, "profile")
        self.ws.started = True
        done = await self.load_checkpoint(
            {
                "program": await trio.to_thread.run_sync(_digest, opts.model),
                "key": key.decode(),
                "backend": opts.backend,
                "world_size": opts.world_size,
                "rounds": opts.rounds,
                "warmup": opts.warmup,
                "steps": opts.steps,
                "world_knobs": [list(map(list, k)) for k in knobs],
                "banked": banked.label if banked is not None else "",
            }
        )
        search = Search(
            layout,
            opts.precision,
            main.spec,
            meter,
            self.open_world,
            first_bucket=bool(main.layout.get("first_bucket")),
            plugins=plugin_hook_names(),
            banked=banked,
            world_knobs=tuple(knobs),
            rounds=opts.rounds,
            confirm_rounds=opts.confirm_rounds,
            done=done,
            checkpoint=self.checkpoint,
        )
        if done:
            log.info(
                "job %s: resumed: %s from the interrupted run, not measured again",
                self.job_id,
                ", ".join(done),
            )
        proposal = await search.run()
        confirmed = await search.confirm(proposal, banked)
        mode, shipped = await self._write_bank(ans, key, sig, host, search, confirmed)
        return self._result(layout, key, search, confirmed, meter, shipped, mode)

    async def _write_bank(
        self,
        ans: bankrules.BankAnswer,
        key: bytes,
        sig: Any,
        host: Any,
        search: Search,
        confirmed: ConfirmingAB,
    ) -> tuple[str, DDPConfig]:
        """AOE's rules for the layout just tuned; (update mode, what ships)."""
        figs = confirmed.figures
        measured = {name: f.measurement() for name, f in figs.items()}
        best_name = DEFAULT if confirmed.shipped.is_default else confirmed.shipped.label
        hit = ans.record if ans.kind == "hit" else None
        outcome = bankrules.after_tuning(hit, best_name, measured, lambda m: True)
        shipped = confirmed.shipped
        if outcome.mode == "reserved" and hit is not None and outcome.strategy != best_name:
            shipped = DDPConfig.from_params(hit.params)
        params_confirmed = json.dumps({**confirmed.to_json(), "job": self.job_id}, sort_keys=True)
        write = BankWrite()
        if outcome.write_entry:
            gate_err = next(
                (
                    float(g.get("max_rel_error", 0.0))
                    for g in search.gates
                    if g["config"] == shipped.label and "max_rel_error" in g
                ),
                0.0,
            )
            winner = msgspec.structs.replace(measured[shipped.label], max_rel_error=gate_err)
            params = {
                **shipped.to_params(),
                "confirmed": params_confirmed,
                "tail_before_ms": f"{confirmed.baseline_tail_ms:.4f}",
                "tail_after_ms": f"{confirmed.result_tail_ms:.4f}",
            }
            record = bankrules.make_record(
                key,
                sig,
                host,
                shipped.label,
                "gdat",
                self.opts.precision,
                winner,
                measured[DEFAULT],
                self.job_id,
                self.opts.model.name,
                params,
            )
            write = dataclasses.replace(write, entries=(record,))
        if outcome.write_default:
            doc = {
                "default_us": measured[DEFAULT].median_us,
                "job": self.job_id,
                "confirmed": params_confirmed,
            }
            write = dataclasses.replace(write, defaults=((key, doc),))
        now = time.time()
        trials = tuple(
            (
                key,
                {
                    "stage": f.stage,
                    "strategy": f.name,
                    "params": f.config.to_params(),
                    "job": self.job_id,
                    "time": now,
                    "rounds_us": f.rounds_us,
                    "tails_us": f.tails_us,
                    "error": f.error,
                    "dropped": f.dropped,
                    **f.measurement().summary(),
                },
            )
            for f in [*search.figures, *figs.values()]
        )
        write = dataclasses.replace(write, trials=trials)
        self.emit("stage", f"recording {outcome.mode} in the bank")
        await self.bank.write(write)
        return outcome.mode, shipped

    def _from_bank(
        self, ans: bankrules.BankAnswer, layout: GradientLayout, key: bytes
    ) -> GdatResult:
        conf = bankrules.confirmed(ans) or {}
        if ans.kind == "hit" and ans.record is not None:
            config = DDPConfig.from_params(ans.record.params)
            base_ms, res_ms = ans.record.baseline.median_us / 1e3, ans.record.winner.median_us / 1e3
        else:
            config, base_ms = DDPConfig(), ans.default_us / 1e3
            res_ms = base_ms
        imp = float(conf.get("improvement", base_ms / res_ms - 1 if res_ms > 0 else 0.0))
        lo, hi = conf.get("improvement_ci95", (imp, imp))
        result = GdatResult(
            job_id=self.job_id,
            model=str(self.opts.model),
            precision=self.opts.precision,
            backend=self.opts.backend,
            world_size=self.world_size,
            layout=layout,
            key=key.decode(),
            shipped=config,
            verdict=str(conf.get("verdict", "from the bank")),
            baseline_ms=base_ms,
            result_ms=res_ms,
            baseline_tail_ms=float(conf.get("baseline_tail_ms", 0.0)),
            result_tail_ms=float(conf.get("result_tail_ms", 0.0)),
            improvement=imp,
            improvement_ci95=(lo, hi),
            tuning_time_s=time.monotonic() - self.started,
            update_mode="hit",
            bank_layer=ans.layer,
            from_bank=ans.job_id or "?",
            confirmation={**conf, "from_bank": ans.job_id},
            notes=[
                f"answered from the bank (layer {ans.layer}, job {ans.job_id}): no world started; "
                "--repeat-tune measures again",
                *self.notes,
            ],
        )
        result.budget = self.budget.report_doc()
        return result

    def _result(
        self,
        layout: GradientLayout,
        key: bytes,
        search: Search,
        confirmed: ConfirmingAB,
        meter: Meter,
        shipped: DDPConfig,
        mode: str,
    ) -> GdatResult:
        chosen = dict(search.kept)
        chosen["confirm"] = shipped.label if not shipped.is_default else DEFAULT
        figs = [*search.figures, *confirmed.figures.values()]
        ledger = self.ledger
        return GdatResult(
            job_id=self.job_id,
            model=str(self.opts.model),
            precision=self.opts.precision,
            backend=self.opts.backend,
            world_size=self.world_size,
            layout=layout,
            key=key.decode(),
            shipped=shipped,
            verdict=confirmed.verdict,
            baseline_ms=confirmed.baseline_ms,
            result_ms=confirmed.result_ms,
            baseline_tail_ms=confirmed.baseline_tail_ms,
            result_tail_ms=confirmed.result_tail_ms,
            improvement=confirmed.improvement,
            improvement_ci95=confirmed.improvement_ci95,
            tuning_time_s=time.monotonic() - self.started,
            update_mode=mode,
            confirmation=confirmed.to_json(),
            configurations=configurations(figs, chosen, search.gates),
            gates=search.gates,
            broken_turns=list(meter.failures),
            budget=self.budget.report_doc(),
            resources={
                "device_s": round(ledger.device_s, 3),
                "worlds": len(self.worlds),
                "world_restarts": sum(w.restarts for w in self.worlds.values()),
                "configurations_measured": len({f.name for f in search.figures}),
                "turn_s": round(meter.turn_s, 4),
                "resumed_stages": list(search.resumed),
            },
            notes=[
                *self.notes,
                *confirmed.notes,
                *search.notes,
                *meter.notes,
                *(
                    [
                        f"resumed: {', '.join(search.resumed)} taken from the interrupted run "
                        "(its figures are in the configurations; not measured again)"
                    ]
                    if search.resumed
                    else []
                ),
            ],
        )


async def run_gdat(
    opts: GdatOptions,
    config: Config,
    emit: Callable[[JobEvent], None] = lambda event: None,
    handle: JobHandle | None = None,
    bank: BankWriter | None = None,
) -> GdatResult:
    """Run one GDAT job to its outputs (see the module doc) and return its result.
    `bank`: a running writer of `config.bank` to use (a daemon's); None: one of the
    job's own, for its duration.

    Raises OptionError (options, a missing backend or torch), ModelError (the model),
    BankError, DeviceError (worlds that keep breaking), and JobCancelledError when
    `handle` cancelled it: every rank is killed before it returns."""
    opts.check()
    if not have_torch():
        raise OptionError(MISSING_TORCH)
    if not opts.entry:
        # Before any process loads it: refused here, it fails the job naming the member.
        await trio.to_thread.run_sync(check_pt2, opts.model)
    job_id = opts.job_id or new_job_id()
    # As an ONNX job's (engine.py): the daemon's job id is the same in each run of a job,
    # an embedded run's is new, so there the model alone names the interrupted workspace.
    owner = {"model": str(opts.model.absolute()), "job": opts.job_id, "job_type": "gdat"}
    ws = await trio.to_thread.run_sync(Workspace.create, opts.output, opts.model.stem, owner)
    handle = handle or JobHandle()
    own_bank = bank is None
    if bank is None:
        bank = BankWriter(config.bank, layers=list(config.bank_layers), on_wait=log.warning)
    job = _Job(opts, config, emit, job_id, ws, bank)
    failed = True
    outcome = "interrupted"  # ^C, or anything else that is not the job's own end
    try:
        with job_log(ws.log_path, job_id):
            log.info(
                "job %s: gdat %s (%s, world of %s on %s)",
                job_id,
                opts.model,
                opts.precision,
                opts.world_size or "default size",
                opts.backend,
            )
            async with trio.open_nursery() as nursery:
                if own_bank:
                    await nursery.start(bank.run)
                try:
                    with trio.CancelScope() as scope:
                        handle.attach(scope)
                        result = await job.run()
                finally:
                    await job.close_worlds()
                if not scope.cancelled_caught:
                    # Written while the bank's writer runs: the run's stages are forgotten
                    # once its outputs are written, never before.
                    result.workspace = str(ws.root)
                    ddp_path = ws.result_dir / "ddp_config.json"
                    write_json(ddp_path, ddp_config_doc(result))
                    result.ddp_config = str(ddp_path)
                    result_path = ws.reserve_result("gdat")
                    result.result_json = str(result_path)
                    write_json(result_path, result_doc(result))
                    bank.count_decisions(result.bank["repo_hit_num"], result.bank["total_num"])
                    await job.drop_checkpoint()
                nursery.cancel_scope.cancel()
            if scope.cancelled_caught:
                failed = False
                outcome = "interrupted" if handle.resumable else "done"
                log.info("job %s: cancelled", job_id)
                raise JobCancelledError(
                    f"job {job_id} cancelled" + (f": {handle.reason}" if handle.reason else "")
                )
            failed = False
            outcome = "done"
            log.info("job %s: %s, %s ships", job_id, result.verdict, result.shipped.label)
            return result
    except AoedError as exc:
        if not isinstance(exc, JobCancelledError):
            outcome = "failed"
            log.info("job %s: failed: %s", job_id, exc)
        raise
    except Exception:
        outcome = "failed"
        raise
    finally:
        if own_bank:
            bank.close()
        if not failed and not opts.keep_workspace:
            ws.clean()
        ws.release(outcome)

"""What every stage of one job shares: the engine's agents and config, the job's options,
policy, device, ledger and workspace, and the prepared model's description.

Stages return what they find (pipeline.py), and task agents return their decisions
and notes; neither writes its results here. What the context holds is set once: the
agents, options and policy when the job starts, the prepared part (`prep`, `held_back`,
`ranges`, `run_key`) by the prepare stage, and read-only after it. The exception is
the job's running record, written where it is learnt, in the order it happens (one
trio thread: no two writes interleave): `notes` (stages, and `write_bank`), `attempt`
(the bank stage, restoring a run), `model_us` (the profile), `accuracy` (the last
end-to-end check) and `bank_unkept` (`write_bank`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio

from aoe.config import Config
from aoe.errors import AoedError, BankWriteError
from aoe.keys import DeviceFingerprint, TaskSignature
from aoe.partition import Task
from aoe.sessionopts import trt_files
from aoe.spec import JobSpec, Stage
from aoed.bank.writer import BankWrite, BankWriter
from aoed.engine import bankrules
from aoed.engine.device import DeviceAgent
from aoed.engine.devices import DeviceSet
from aoed.engine.job import JobRun
from aoed.engine.ledger import JobLedger
from aoed.engine.messages import (
    Accuracy,
    AssembleReply,
    AssembleRequest,
    Build,
    Candidate,
    CheckRequest,
    JobEvent,
    Measurement,
    MeasurePlan,
    MeasureReply,
    MeasureRequest,
    PointCheck,
    PrepareReply,
    RuntimeBuildReply,
)
from aoed.engine.policy import PrecisionPolicy
from aoed.engine.pool import CompilePool
from aoed.engine.registry import StrategyRegistry
from aoed.engine.workspace import Workspace

__all__ = ["JobContext"]

log = logging.getLogger(__name__)


@dataclass
class JobContext:
    #: what the user asked for; its device is the one `device` measures on
    spec: JobSpec
    run: JobRun
    job_id: str
    pool: CompilePool
    #: the job's home device: every stage that compares requests' times measures here
    device: DeviceAgent
    bank: BankWriter
    registry: StrategyRegistry
    policy: PrecisionPolicy
    fingerprint: DeviceFingerprint
    ledger: JobLedger
    workspace: Workspace
    #: the engine's configuration (its model limits apply to each job)
    config: Config
    prep: PrepareReply | None = None
    held_back: tuple[Path, ...] = ()
    ranges: Path | None = None
    notes: list[str] = field(default_factory=list)
    #: the last end-to-end accuracy measured on the held-back samples (lossy policies)
    accuracy: Accuracy | None = None
    #: the model's latency as profiled, us (0: not profiled)
    model_us: float = 0.0
    #: why the bank did not take the job's last write that failed ("" while none did)
    bank_unkept: str = ""
    #: what this run's task decisions are kept under until it ends (resume.py)
    run_key: bytes = b""
    #: this run's attempt at the job: 1, or one more than the interrupted run it resumes
    attempt: int = 1
    #: every device of the engine: a task's search may go to any with the job's fingerprint
    devices: DeviceSet | None = None
    #: a dynamic model's assembled files at each point of its profile, by path
    point_checks: dict[str, tuple[PointCheck, ...]] = field(default_factory=dict)
    #: what OpenVINO is where the workers run, once asked (runtimestage.offer)
    runtime_offer: RuntimeBuildReply | None = None

    def emit(self, kind: str, message: str = "", done: int = 0, total: int = 0) -> None:
        self.ledger.emit(JobEvent(kind, message, done, total))

    async def stage(self, stage: Stage, message: str) -> None:
        """Announce the next stage (`message` says it to people; watchers go by `stage`),
        once the workspace is still there (`check_workspace`)."""
        await self.check_workspace()
        self.ledger.emit(JobEvent("stage", message, stage=stage))

    async def check_workspace(self) -> None:
        """AoedError naming the output directory when the job's workspace was removed:
        what failed there failed for that reason, not the model's or a candidate's."""
        why = await trio.to_thread.run_sync(self.workspace.gone)
        if why is not None:
            raise AoedError(why)

    def provider_files(self) -> dict[str, dict[str, str]]:
        """The engine's own provider options that name files, for the job's sessions: on
        an NVIDIA GPU, TensorRT's engines and timing cache kept beside the bank under
        the device's fingerprint (so builds happen once per model and options); none
        elsewhere. They never travel in options, which a bank or a model may supply."""
        if self.device.device.kind not in ("cuda", "tensorrt"):
            return {}
        bank = Path(self.config.bank)
        return trt_files(bank.parent / f"{bank.name}-trt-cache" / self.fingerprint.digest[:32])

    def key(self, sig: TaskSignature) -> bytes:
        return bankrules.key_for(sig, self.fingerprint, self.spec.precision)

    async def lookup(self, sig: TaskSignature) -> bankrules.BankAnswer:
        """What the bank (custom, then layers) says about `sig` on this device."""
        key = self.key(sig)
        rec, layer = await self.bank.lookup_layered(key)
        default, dlayer = (
            (None, "") if rec is not None else await self.bank.known_default_layered(key)
        )
        return bankrules.answer(
            rec, layer, default, dlayer, self.fingerprint, self.registry.vocabulary()
        )

    async def measure(
        self,
        candidates: list[Candidate],
        reference: str | None,
        budget_s: float,
        inputs: Path | None = None,
        plan: MeasurePlan | None = None,
        category: str = "search",
        spread: bool = False,
        limit_s: float | None = None,
    ) -> dict[str, Measurement]:
        """Measure `candidates` interleaved on the device (DeviceError if it cannot);
        `plan` (default: racing until stable) within `budget_s`, charged to the job's
        ledger under `category` (see budget.py). `spread`: on whichever device of the
        job's fingerprint is least busy, for a request whose times are compared with no
        other request's (one task's search); else on the job's home device. `limit_s`:
        the wall-clock limit of the request (default: the device agent's, from its
        budget); past it the runner is killed and DeviceError raised."""
        plan = msgspec.structs.replace(plan or MeasurePlan(), budget_s=budget_s)
        files = self.provider_files()
        if files:
            candidates = [
                c if c.files else msgspec.structs.replace(c, files=files) for c in candidates
            ]
        req = MeasureRequest(
            tuple(candidates), inputs or self.held_back[0], reference, self.device.device, plan
        )
        reply: MeasureReply
        if spread and self.devices is not None:
            reply = await self.devices.call(self.device, req, self.ledger, category=category)
        else:
            reply = await self.device.call(req, self.ledger, limit_s, category=category)
        return reply.results

    async def assemble(self, builds: list[Build], source: Path | None = None) -> dict[str, str]:
        """Write whole models with the builds' choices applied (in a worker); raises what
        the pool raises (CandidateError when a build fails). A dynamic model's builds
        (from the prepared model) keep its dynamic axes and are checked at every point
        of its profile, within the policy's end-to-end budget: returns the choices left
        out because a point failed (task id -> why); `point_checks` keeps each file's
        checks."""
        assert self.prep is not None
        source = source or self.prep.prepared
        # the input model itself (source) keeps its own axes and needs no check
        profile = self.prep.profile if source == self.prep.prepared else None
        req = AssembleRequest(
            source,
            self.prep.tasks,
            tuple(builds),
            self.ranges,
            profile,
            (self.policy.e2e_max_rel_error, self.policy.e2e_min_cosine),
            dict(self.prep.int_high),
        )
        reply: AssembleReply = await self.pool.call(req, self.ledger)
        self.point_checks.update(reply.points)
        return dict(reply.refused)

    def check_request(self, tasks: tuple[Task, ...], choices: dict[str, str]) -> CheckRequest:
        """Whether `choices` apply to `tasks` (and their twins) of the prepared model; for
        a dynamic model also whether each, applied alone, holds at every point of its
        profile within the policy's end-to-end budget (messages.CheckRequest)."""
        assert self.prep is not None
        return CheckRequest(
            self.prep.prepared,
            tasks,
            choices,
            self.ranges,
            self.prep.profile,
            (self.policy.e2e_max_rel_error, self.policy.e2e_min_cosine),
            dict(self.prep.int_high),
        )

    async def write_bank(self, write: BankWrite) -> bool:
        """Commit `write`, unless the workspace is gone (AoedError): what was measured
        since may have failed for that reason, and must not reach the bank as a finding.
        True once committed. False when the bank had no room for it or its disk failed
        the write (BankWriteError): that write is lost, which is logged and said in the
        job's notes (`bank_unkept` holds why), and the job goes on with what it decided.
        Other BankErrors raise."""
        await self.check_workspace()
        try:
            await self.bank.write(write)
        except BankWriteError as exc:
            log.warning("%s", exc)
            if str(exc) != self.bank_unkept:
                self.notes.append(f"not kept in the bank: {exc}")
            self.bank_unkept = str(exc)
            return False
        return True

"""What a kind of job is to the engine: `JobKind`, the one thing `Engine.run_job` calls.

Every job, whatever it tunes, enters through `Engine.run_job`, which picks the kind its
spec's job type names and awaits `kind.run(engine, run, emit, handle)`. A kind takes what
it needs from the engine's shared agents (the bank writer; the ONNX kind also the compile
pool and the device agents), derives its own options from the run's `JobSpec` in one
place, and returns the job's `JobOutcome`, its outputs written. Its contract is
`run_job`'s: AoedError subclasses with one-line messages, JobCancelledError once `handle`
cancelled it (its child processes killed), the workspace left for a resumable cancel.

The kinds: the ONNX pipeline (onnxjob.py: opat, sgat, sgat+opat), the engine's own, and
GDAT (aoed.gdat.GdatKind), which whoever opens the engine adds (the engine never imports
it: GDAT's worlds are a backend's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aoe.config import Config
from aoe.outcome import JobOutcome
from aoed.bank.writer import BankWriter
from aoed.engine.device import DeviceAgent
from aoed.engine.devices import DeviceSet
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.messages import JobEvent
from aoed.engine.pool import CompilePool
from aoed.engine.registry import StrategyRegistry

__all__ = ["Agents", "Emit", "JobKind"]

#: Where a job's events go (a progress bar, the daemon's event log).
Emit = Callable[[JobEvent], None]


class Agents(Protocol):
    """The engine's shared parts, as a job kind sees them (engine.Engine has them): named
    here so that a kind does not import the engine that imports it."""

    config: Config
    registry: StrategyRegistry
    bank: BankWriter
    pool: CompilePool
    #: the first configured device's agent
    device: DeviceAgent

    @property
    def device_set(self) -> DeviceSet: ...


class JobKind(Protocol):
    """One kind of job behind `Engine.run_job`."""

    async def run(self, engine: Agents, run: JobRun, emit: Emit, handle: JobHandle) -> JobOutcome:
        """Run `run` to its outputs on `engine`'s agents and return its outcome."""
        ...

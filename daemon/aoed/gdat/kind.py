"""The GDAT job kind: what `Engine.run_job` runs for a job of type gdat.

Its options come from the run's `JobSpec` in one place (`GdatOptions.from_run`); the
host's own settings (a daemon's world limits and whether it may load a program
unconfined) are the kind's, given where the engine is opened: the daemon from its
configuration, an embedded run from its environment. The job uses the engine's bank
writer, so a daemon's jobs and its GDAT jobs write the bank through one writer.
"""

from __future__ import annotations

from dataclasses import dataclass

from aoe.outcome import JobOutcome
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.kind import Agents, Emit
from aoed.engine.worldsize import WorldLimits
from aoed.gdat.job import GdatOptions, run_gdat
from aoed.gdat.outcome import to_outcome

__all__ = ["GdatKind"]


@dataclass(frozen=True)
class GdatKind:
    """GDAT behind the engine's door (aoed.engine.kind.JobKind)."""

    #: how large a world may be (a daemon's [limits]); None: this machine's defaults
    limits: WorldLimits | None = None
    #: load the program unconfined where the kernel cannot confine the processes that
    #: load it (a daemon's [daemon] allow_unconfined_gdat; AOE_GDAT_UNCONFINED=1 for a
    #: run of one's own)
    allow_unconfined: bool = False

    async def run(self, engine: Agents, run: JobRun, emit: Emit, handle: JobHandle) -> JobOutcome:
        opts = GdatOptions.from_run(run, limits=self.limits, allow_unconfined=self.allow_unconfined)
        return to_outcome(await run_gdat(opts, engine.config, emit, handle, bank=engine.bank))

"""The engine: the long-lived agents one or many jobs share.

`open_engine()` starts them in dependency order (bank writer, compile pool, device
agent), each reporting ready through `nursery.start()`, and stops them all when the
block exits. The daemon keeps one engine for its lifetime; `aoe tune` opens one for a
single job.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from aoed.bank.writer import BankWriter
from aoed.engine.device import DeviceAgent
from aoed.engine.job import JobEvent, JobOptions, JobResult, run_job
from aoed.engine.pool import CompilePool

__all__ = ["Engine", "default_parallel", "open_engine"]


def default_parallel() -> int:
    """Compile workers by default: cores - 1, at least 1."""
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass
class Engine:
    bank: BankWriter
    pool: CompilePool
    device: DeviceAgent

    async def run_job(self, opts: JobOptions, emit: Callable[[JobEvent], None] = lambda e: None) -> JobResult:
        return await run_job(opts, self.pool, self.device, self.bank, emit)


@contextlib.asynccontextmanager
async def open_engine(
    bank_path: str | os.PathLike[str],
    logdir: str | os.PathLike[str],
    parallel: int | None = None,
    device: str = "cpu",
    bank_layers: list[Path] | None = None,
) -> AsyncIterator[Engine]:
    """Start the engine's agents; yields the Engine; stops and reaps everything on exit.

    `bank_layers`: read-only banks under the custom one, in lookup order (None: those
    named in AOED_BANK_LAYERS)."""
    logs = Path(logdir)
    bank = BankWriter(bank_path, layers=bank_layers)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(bank.run)
            pool = CompilePool(parallel or default_parallel(), logs)
            await nursery.start(pool.run)
            agent = DeviceAgent(device, pool, logs)
            await nursery.start(agent.run)
            try:
                yield Engine(bank, pool, agent)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        bank.close()

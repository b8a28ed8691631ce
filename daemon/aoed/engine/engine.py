"""The engine: the long-lived agents many jobs share, and how a job runs on them.

`open_engine()` starts the agents in dependency order (bank writer, compile pool, device
agent), each reporting ready through `nursery.start()`, and stops them all when the
block exits. The daemon keeps one engine for its lifetime; `aoe tune` opens one for a
single job. `Engine.run_job()` is the one door for every job: it runs the kind of job
(kind.py) the spec's job type names: the ONNX pipeline (onnxjob.py), or a kind whoever
opens the engine adds (GDAT: aoed.gdat.GdatKind).

Devices: one device agent per configured device (`Config.all_devices`), chosen between
by the device set (`devices.py`). Cores: on a CPU device with dedicated cores (4 or more,
or as configured) the runner is pinned to half of them and the compile workers to the
rest, and nothing is paused; otherwise the compile workers are stopped while the device
measures. A CPU device that is a set of cores (`cpu:0-7`) has its runner pinned to those;
the compile workers get the cores no device has (with dedicated cores) and are paused
while any device measures when they share a core with one (the pool's pause nests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from aoe.config import Config
from aoe.device import Device
from aoe.errors import DeviceError, OptionError
from aoe.outcome import JobOutcome
from aoe.spec import JobType
from aoed.bank.writer import BankWriter
from aoed.engine.device import DeviceAgent
from aoed.engine.devices import DeviceSet
from aoed.engine.executor import open_executor
from aoed.engine.job import JobHandle, JobRun
from aoed.engine.kind import Emit, JobKind
from aoed.engine.memory import MemoryPlan, plan_memory
from aoed.engine.onnxjob import ONNX_JOB_TYPES, OnnxKind
from aoed.engine.pool import CompilePool
from aoed.engine.registry import StrategyRegistry
from aoed.engine.runtime import Runtime
from aoed.logs import current_job

__all__ = ["Engine", "current_job", "open_engine", "place_cores", "split_cores"]

log = logging.getLogger(__name__)

#: The kinds every engine runs: its own ONNX pipeline.
ONNX_KINDS: Mapping[JobType, JobKind] = dict.fromkeys(ONNX_JOB_TYPES, OnnxKind())


def split_cores(cpus: list[int], dedicated: bool | None) -> tuple[list[int], list[int]]:
    """(runner cores, worker cores) for a CPU device; two empty lists when the machine is
    too small to dedicate cores (4 by default) or `dedicated` is False."""
    if dedicated is None:
        dedicated = len(cpus) >= 4
    if not dedicated or len(cpus) < 2:
        return [], []
    half = (len(cpus) + 1) // 2
    return cpus[:half], cpus[half:]


def place_cores(
    devices: tuple[Device, ...], cpus: list[int], dedicated: bool | None
) -> tuple[list[list[int]], list[int], bool]:
    """(each device's runner cores, the compile workers' cores, whether the workers are
    paused while a CPU device measures). DeviceError naming a device whose cores this
    process may not use.

    One plain `cpu` device: `split_cores`. CPU core sets: each runner on its own set; the
    workers on the cores left over, with dedicated cores and where some are left, else
    on every core and paused while any CPU device measures (they share its cores)."""
    sets = [d for d in devices if d.is_cpu and d.cores]
    for d in sets:
        if missing := sorted(set(d.cores) - set(cpus)):
            raise DeviceError(
                f"device {d}: core(s) {', '.join(map(str, missing))} are not this process's "
                f"to use (it may run on {cpus}); see [tuning] devices"
            )
    if not sets:
        runner, workers = split_cores(cpus, dedicated)
        pinned = [runner if d.is_cpu else [] for d in devices]
        return pinned, workers, not runner and any(d.is_cpu for d in devices)
    left = [c for c in cpus if not any(c in d.cores for d in sets)]
    workers = left if dedicated is not False and left else []
    plain_cpu = any(d.is_cpu and not d.cores for d in devices)
    return [list(d.cores) if d.is_cpu else [] for d in devices], workers, not workers or plain_cpu


@dataclass
class Engine:
    config: Config
    #: the runtime every child runs (runtime.py): its worker, its runner, its devices
    runtime: Runtime
    #: the runtime's strategy registry, with the config's plugins
    registry: StrategyRegistry
    bank: BankWriter
    pool: CompilePool
    #: the first configured device's agent (the only one on a one-device engine)
    device: DeviceAgent
    logdir: Path
    #: what each child may use, and so which jobs fit (memory.py)
    memory: MemoryPlan
    #: every device agent (devices.py); a job's home is one of them
    devices: DeviceSet | None = None
    #: when the engine started (time.monotonic), for the devices' duty cycles
    started: float = field(default_factory=time.monotonic)
    #: the kind of job (kind.py) each job type runs as
    kinds: Mapping[JobType, JobKind] = field(default_factory=lambda: dict(ONNX_KINDS))

    @property
    def device_set(self) -> DeviceSet:
        return self.devices if self.devices is not None else DeviceSet([self.device])

    async def run_job(
        self,
        run: JobRun,
        emit: Emit = lambda event: None,
        handle: JobHandle | None = None,
    ) -> JobOutcome:
        """Run one job to completion and return its result: the one door for every job
        kind (kind.py), chosen by the spec's job type.

        Raises AoedError subclasses with one-line messages (OptionError, ModelError,
        BankError, DeviceError), and JobCancelledError when `handle` cancelled it; a
        cancelled job stops at once, its queued requests dropped and those in flight
        abandoned. The workspace's scratch is removed unless the job failed or
        `run.keep_workspace`; a job that fails before tuning started leaves no workspace,
        and one interrupted (a resumable cancel, ^C) leaves it to its next run."""
        job_type = run.spec.job_type
        kind = self.kinds.get(job_type)
        if kind is None:
            raise OptionError(f"job_type {job_type}: this engine runs no such jobs")
        return await kind.run(self, run, emit, handle or JobHandle())


@contextlib.asynccontextmanager
async def open_engine(
    config: Config,
    runtime: Runtime,
    logdir: Path,
    *,
    lock_group: int | None = None,
    kinds: Mapping[JobType, JobKind] | None = None,
) -> AsyncIterator[Engine]:
    """Start the engine's agents for `config`'s device, bank and limits (memory; time:
    compile_timeout_s for candidates and bank rebuilds, stage_timeout_s for the other
    worker requests); yields the Engine; stops and reaps everything on exit.
    `lock_group` (a gid) may hold the device lock too (the daemon's service group).
    `kinds`: the job kinds it runs besides its own ONNX pipeline (GDAT's, as
    {JobType.GDAT: aoed.gdat.GdatKind(...)}); a job of a type it has no kind for fails
    with OptionError.

    `runtime` (runtime.py; aoed.backends.runtimes.load_runtime names one) runs the
    children and gives the strategy registry, with the config's plugins (its workers
    build the same one): OptionError for a broken plugin. Raises DeviceError when the
    device is unusable (e.g. the runtime lacks its provider). The children's
    stderr goes to `logdir`, which keeps, once they are stopped, only the logs that
    hold something (a crash, a warning): the rest are removed, and so is `logdir`
    itself if nothing is left in it.
    """
    # Another process writing this bank (a second tune, an import) makes the first write
    # wait; say so, or it looks like a hang.
    registry = runtime.registry(config.plugins)
    bank = BankWriter(config.bank, layers=list(config.bank_layers), on_wait=log.warning)
    plan = plan_memory(config)
    config = plan.apply(config)  # the children's limit and count, as derived
    try:
        async with open_executor(config, logdir) as executor, trio.open_nursery() as nursery:
            runner_cpus: list[list[int]]
            worker_cpus: list[int]
            if executor.remote:  # the cores are the nodes': an actor pins itself there (rayexec.py)
                runner_cpus, worker_cpus, pause = [[] for _ in config.all_devices], [], False
            else:
                runner_cpus, worker_cpus, pause = place_cores(
                    config.all_devices, sorted(os.sched_getaffinity(0)), config.dedicated_cores
                )
            await nursery.start(bank.run)
            compile_s = config.compile_timeout_s
            pool = CompilePool(
                config.parallel,
                logdir,
                runtime=runtime,
                cpus=worker_cpus,
                memory_mb=plan.child_mb,
                plugins=config.plugins,
                timeouts={"compile": compile_s, "rebuild": compile_s},
                default_timeout=config.stage_timeout_s,
                executor=executor,
            )
            await nursery.start(pool.run)
            agents = []
            for device, cpus in zip(config.all_devices, runner_cpus, strict=True):
                agent = DeviceAgent(
                    device,
                    pool,
                    logdir,
                    config.runtime_dir,
                    cpus=cpus,
                    memory_mb=plan.child_mb,
                    pause_pool=pause,
                    lock_group=lock_group,
                    runtime=runtime,
                    executor=executor,
                )
                await nursery.start(agent.run)
                agents.append(agent)
                log.info(
                    "engine: device %s%s%s",
                    device,
                    f" on cores {cpus}" if cpus else "",
                    f" ({executor.name} executor)" if executor.remote else "",
                )
            log.info("engine: memory: %s", plan.describe())
            log.info(
                "engine: %d compile workers%s%s",
                pool.size,
                f" on cores {worker_cpus}" if worker_cpus else "",
                " (paused while a device on their cores measures)" if pause else "",
            )
            try:
                yield Engine(
                    config,
                    runtime,
                    registry,
                    bank,
                    pool,
                    agents[0],
                    logdir,
                    plan,
                    DeviceSet(agents),
                    kinds={**ONNX_KINDS, **(kinds or {})},
                )
            finally:
                nursery.cancel_scope.cancel()
    finally:
        bank.close()
        _drop_empty_logs(logdir)


def _drop_empty_logs(logdir: Path) -> None:
    """Remove the children's empty logs from `logdir`, and `logdir` if that empties it."""
    with contextlib.suppress(OSError):
        for p in logdir.glob("*.log"):
            if p.is_file() and not p.is_symlink() and p.stat().st_size == 0:
                p.unlink()
        logdir.rmdir()

"""Device agent: owns one device's measurement runner and serves it one request at a time.

Serialization inside this process is by construction: only this agent's task talks to
the runner, and it takes the next request only when the previous one is answered.
Across processes the device lock (`devlock.py`) does the same. On a CPU device without
dedicated cores the agent pauses the compile pool around each measurement; with
dedicated cores (`cpus`), the runner runs on its own cores and nothing is paused.

`call()` returns the request's reply or raises DeviceError (or the class the runner
raised, when it is one of ours): the runner could not answer, crashed, or overran the
request's time. Each request is charged to its job (`JobLedger`): device seconds and the
runner's peak memory. A request whose job was cancelled is dropped from the queue, and one in flight
is abandoned: the runner is killed and restarted for the next request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import outcome
import trio

from aoe.device import Device
from aoe.errors import DeviceError
from aoed.engine import _pending
from aoed.engine._child import ChildDiedError
from aoed.engine.devlock import DeviceLock
from aoed.engine.executor import LOCAL, Executor
from aoed.engine.ledger import JobLedger
from aoed.engine.messages import MeasureRequest, PingReply, PingRequest, Request, error_of, op_of
from aoed.engine.pool import CompilePool
from aoed.engine.runtime import Runtime

__all__ = ["DeviceAgent"]

log = logging.getLogger(__name__)


def _default_limit(request: Request) -> float:
    """A safety net, not a schedule: the runner keeps to a measurement's budget itself
    (within a round); this only catches a runner that stopped answering. The job's time
    scale multiplies it (loading a big model's sessions takes longer)."""
    budget = request.plan.budget_s if isinstance(request, MeasureRequest) else 10.0
    return budget * 3 + 60


class DeviceAgent:
    def __init__(
        self,
        device: Device,
        pool: CompilePool | None,
        logdir: Path,
        runtime_dir: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        pause_pool: bool = True,
        lock_group: int | None = None,
        runtime: Runtime,
        executor: Executor = LOCAL,
    ):
        """The runner runs `runtime`'s runner module (runtime.py; a stand-in runtime for
        hardware this machine lacks has its own). `executor` makes the runner: a local
        child, or a Ray actor (executor.py)."""
        self.device = device
        self._pool = pool if pause_pool and device.is_cpu and not executor.remote else None
        self._runner = executor.runner(
            device,
            runtime.runner_module,
            f"runner for {device}",
            logdir / f"runner-{device.name.replace(':', '-')}.log",
            cpus=cpus,
            memory_mb=memory_mb if device.is_cpu else 0,  # GPU runtimes reserve huge address ranges
            lock_group=lock_group,
        )
        # One lock per physical device; a remote one's actor holds the device's own on its node.
        self.lock = DeviceLock(runtime_dir, executor.lock_name(device), lock_group)
        self._queue: _pending.RequestQueue[tuple[Request, float | None, str]] = (
            _pending.RequestQueue(4)
        )
        self.cores = 1
        self.providers: tuple[str, ...] = ()
        self.busy_s = 0.0
        self.requests = 0
        #: candidates measured (a measure request's trials)
        self.trials = 0
        #: requests queued or in flight: what the device set balances on (devices.py)
        self.outstanding = 0

    @property
    def pausing(self) -> bool:
        """True when the compile pool is stopped during each measurement."""
        return self._pool is not None

    @property
    def runner_pid(self) -> int | None:
        return self._runner.pid

    @property
    def unusable(self) -> str:
        """Why no runner could be started for this device (a remote one whose node is
        gone), or empty: the device set sends work elsewhere while it is not empty."""
        return getattr(self._runner, "unusable", "")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the runner, check the device answers, then serve requests until cancelled.
        Raises DeviceError (before reporting started) when the device is unusable."""
        try:
            try:
                answer = await self._runner.call(PingRequest(self.device))
            except ChildDiedError as exc:
                raise DeviceError(
                    f"{self.device}: the measurement runner did not start ({exc})"
                ) from None
            if not answer.ok:
                raise error_of(answer, DeviceError)
            ping: PingReply = answer.reply
            self.cores, self.providers = ping.cores, ping.providers
            task_status.started()
            async with self._queue.receiver() as requests:
                async for pending in requests:
                    if await _pending.serve(pending, self._serve):
                        await self._restart()
        finally:
            await self._runner.aclose()
            self.lock.close()

    async def _restart(self) -> None:
        """Start a fresh runner at once after one was killed for an abandoned request, so
        the next job does not wait for it (a failure here shows on the next request)."""
        with contextlib.suppress(ChildDiedError):
            await self._runner.call(PingRequest(self.device))

    async def _serve(
        self, call: tuple[Request, float | None, str], job: JobLedger | None
    ) -> outcome.Outcome[Any]:
        request, given, category = call
        op = op_of(request)
        if given:
            limit, why = given, "the request's own limit"
        else:
            base = _default_limit(request)
            why = f"3 x its budget + 60 s = {base:g}s"
            limit, why = job.scaled(base, why) if job is not None else (base, why)
        pause = self._pool.paused() if self._pool is not None else contextlib.nullcontext()
        async with self.lock.hold(job.waiting if job is not None else None):
            t0, wall0 = trio.current_time(), time.time()
            try:
                async with pause:
                    with trio.fail_after(limit):
                        answer = await self._runner.call(request)
            except trio.TooSlowError:
                return outcome.Error(
                    DeviceError(
                        f"{self.device}: {op} on {self.device} timed out after {limit:g}s ({why})"
                    )
                )
            except ChildDiedError as exc:
                log.warning("%s on %s: the measurement runner crashed: %s", op, self.device, exc)
                return outcome.Error(
                    DeviceError(f"{self.device}: measurement runner crashed: {exc}")
                )
            finally:
                busy = trio.current_time() - t0
                trials = len(request.candidates) if isinstance(request, MeasureRequest) else 0
                self.busy_s += busy
                self.requests += 1
                self.trials += trials
                if job is not None:
                    job.charge_device(
                        busy, category, self.device.name, trials, (wall0, time.time())
                    )
        if job is not None:
            job.note_rss(answer.maxrss_kb)
        if not answer.ok:
            return outcome.Error(error_of(answer, DeviceError, f"{self.device}: "))
        return outcome.Value(answer.reply)

    async def call(
        self,
        request: Request,
        job: JobLedger | None = None,
        limit_s: float | None = None,
        category: str = "other",
    ) -> Any:
        """Queue `request` (a messages.*Request) for the device and return its reply (of
        the request's `reply` type); its device time is charged to `job` under
        `category`. Raises DeviceError (or the class the runner raised, when it is one of
        ours) when the runner could not answer it. Cancellation drops the request, or
        abandons it in flight (the runner is killed and restarted)."""
        self.outstanding += 1
        try:
            result: outcome.Outcome[Any] = await self._queue.submit(
                (request, limit_s, category), job
            )
        finally:
            self.outstanding -= 1
        return result.unwrap()

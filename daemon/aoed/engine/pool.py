"""Compile pool agent: N worker processes doing a job's graph work concurrently.

Workers build candidates (compile), and do every other piece of graph work a job needs
(prepare a model, write samples, calibrate, extract task models, assemble models, rebuild
bank entries), so the engine's own process never loads onnxruntime and its event loop
never runs anything heavy. Requests wait in one bounded queue; each worker slot takes
the next when it is free, so a slow request never holds up the others.

`call()` returns the request's reply or raises: the error class the worker raised
(ModelError for a model it cannot read, ...), CandidateError for any other failure of
the request, WorkerCrashedError or WorkerTimeoutError (both CandidateErrors) when the
worker died or overran its time. A worker that crashes or overruns its time costs the
request it was serving: the slot starts a fresh worker for the next one. A request whose job
was cancelled is dropped from the queue, and the worker serving one is killed. The time
limits are the config's (`compile_timeout_s` for a candidate or a bank rebuild,
`stage_timeout_s` for any other request) times the job's time scale (bigger models take
longer: `JobLedger.scaled`), unless the caller gives a request its own.

On a CPU device without dedicated cores, `paused()` stops every worker (SIGSTOP) while
the device measures, so compile work never runs on the measuring cores; the time a
request spends paused does not count against its time limit.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import outcome
import trio

from aoe.device import CPU
from aoe.errors import CandidateError, ModelError
from aoed.engine import _pending
from aoed.engine._child import ChildDiedError
from aoed.engine.executor import LOCAL, ChildLike, Executor
from aoed.engine.ledger import JobLedger
from aoed.engine.messages import PingRequest, Request, error_of, op_of
from aoed.engine.runtime import Runtime

__all__ = ["CompilePool", "WorkerCrashedError", "WorkerTimeoutError", "model_step"]

log = logging.getLogger(__name__)

#: Default time limits per request kind, seconds (paused time excluded); the config's
#: [engine] compile_timeout_s and stage_timeout_s replace them.
TIMEOUTS = {"compile": 120.0, "rebuild": 120.0}
DEFAULT_TIMEOUT = 900.0
#: The setting that sets each kind's limit, for messages.
_SETTINGS = {"compile": "compile_timeout_s", "rebuild": "compile_timeout_s"}


class WorkerCrashedError(CandidateError):
    """The worker serving the request exited (it crashed, or was killed) or broke the
    protocol."""


class WorkerTimeoutError(CandidateError):
    """The request overran its time limit; the worker serving it was killed."""


class _Deadline:
    """A cancel scope's deadline that stands still while the pool is paused."""

    def __init__(self, scope: trio.CancelScope, seconds: float, paused: bool):
        self.scope = scope
        self.remaining = seconds
        if not paused:
            scope.deadline = trio.current_time() + seconds

    def pause(self) -> None:
        if self.scope.deadline != math.inf:
            self.remaining = max(0.0, self.scope.deadline - trio.current_time())
            self.scope.deadline = math.inf

    def resume(self) -> None:
        self.scope.deadline = trio.current_time() + self.remaining


class CompilePool:
    def __init__(
        self,
        workers: int,
        logdir: Path,
        *,
        runtime: Runtime,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        plugins: Sequence[str] = (),
        timeouts: dict[str, float] | None = None,
        default_timeout: float = DEFAULT_TIMEOUT,
        executor: Executor = LOCAL,
    ):
        """The workers run `runtime`'s worker module (runtime.py); `executor` makes them:
        local children, or Ray actors (executor.py)."""
        if workers < 1:
            raise ValueError("a compile pool needs at least one worker")
        self._children: list[ChildLike] = [
            executor.worker(
                runtime.worker_module,
                f"compile worker {i}",
                logdir / f"worker-{i}.log",
                cpus=cpus,
                memory_mb=memory_mb,
                plugins=plugins,
            )
            for i in range(workers)
        ]
        self._queue: _pending.RequestQueue[tuple[Request, float | None]] = _pending.RequestQueue(
            workers
        )
        self._timeouts = {**TIMEOUTS, **(timeouts or {})}
        self._default_timeout = default_timeout
        self._deadlines: set[_Deadline] = set()
        self._pauses = 0
        self.crashes = 0

    @property
    def size(self) -> int:
        return len(self._children)

    @property
    def busy(self) -> int:
        """Workers serving a request now."""
        return len(self._deadlines)

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._children if c.pid is not None]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for child in self._children:
                    nursery.start_soon(self._slot, child, self._queue.receiver())
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                for child in self._children:
                    await child.aclose()

    async def _slot(
        self, child: ChildLike, requests: _pending._Receiver[tuple[Request, float | None]]
    ) -> None:
        async def handle(
            call: tuple[Request, float | None], job: JobLedger | None
        ) -> outcome.Outcome[Any]:
            request, given = call
            op = op_of(request)
            if given:
                seconds, why = given, "the request's own limit"
            else:
                base = self._timeouts.get(op, self._default_timeout)
                why = f"{_SETTINGS.get(op, 'stage_timeout_s')}={base:g}"
                seconds, why = job.scaled(base, why) if job is not None else (base, why)
            t0 = trio.current_time()
            with trio.CancelScope() as limit:
                deadline = _Deadline(limit, seconds, self._pauses > 0)
                self._deadlines.add(deadline)
                try:
                    answer = await child.call(request)
                except ChildDiedError as exc:
                    self.crashes += 1
                    log.warning("%s: %s", op, exc)
                    return outcome.Error(WorkerCrashedError(f"worker crashed: {exc}"))
                finally:
                    self._deadlines.discard(deadline)
                    if job is not None:
                        job.charge_compile(trio.current_time() - t0)
                if job is not None:
                    job.note_rss(answer.maxrss_kb)
                return (
                    outcome.Value(answer.reply)
                    if answer.ok
                    else outcome.Error(error_of(answer, CandidateError))
                )
            self.crashes += 1
            log.warning("%s: timed out after %gs (%s); worker restarted", op, seconds, why)
            return outcome.Error(WorkerTimeoutError(f"{op} timed out after {seconds:g}s ({why})"))

        async with requests:
            async for pending in requests:
                if await _pending.serve(pending, handle):
                    # The worker was killed with its abandoned request: start the next one now.
                    with contextlib.suppress(ChildDiedError):
                        await child.call(PingRequest(CPU))

    async def call(
        self, request: Request, job: JobLedger | None = None, timeout_s: float | None = None
    ) -> Any:
        """Run one request (a messages.*Request) on a worker; returns its reply (of the
        request's `reply` type). Raises the error class the worker raised when it is one
        of ours, else CandidateError; WorkerCrashedError or WorkerTimeoutError when the
        worker died or overran its limit (`timeout_s`, else the request kind's).
        Cancellation drops the request, or kills the worker serving it."""
        result: outcome.Outcome[Any] = await self._queue.submit((request, timeout_s), job)
        return result.unwrap()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Stop every worker process for the duration of the block (nestable)."""
        self._pauses += 1
        if self._pauses == 1:
            for d in self._deadlines:
                d.pause()
            for child in self._children:
                child.pause()
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                for child in self._children:
                    child.resume()
                for d in self._deadlines:
                    d.resume()


async def model_step(
    pool: CompilePool, request: Request, job: JobLedger | None, model: Path | str, what: str
) -> Any:
    """`pool.call` for work on a job's whole model (preparing it, its samples, its
    tasks): a failure the worker did not name (CandidateError: it raised, crashed or
    overran its time) is the model's, raised as ModelError naming `model` and `what`."""
    try:
        return await pool.call(request, job)
    except CandidateError as exc:
        raise ModelError(f"{model}: {what} failed: {exc}") from None

"""Device agent: owns one measurement runner process and drains its queue one at a time.

Serialization is by construction: only this agent's task talks to the runner, and it
takes the next request only when the previous one is answered. On a CPU device it pauses
the compile pool around each measurement. It keeps the time spent measuring, so the
engine can report the device's duty cycle.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import trio

from aoe.errors import DeviceError
from aoed.engine._child import Child, ChildDiedError
from aoed.engine.pool import CompilePool

__all__ = ["DeviceAgent"]


class DeviceAgent:
    def __init__(self, device_id: str, pool: CompilePool | None, logdir: Path):
        self.device_id = device_id
        self._pool = pool
        self._runner = Child("aoed.backends.ort.runner", f"runner for {device_id}", logdir / "runner.log")
        self._send, self._recv = trio.open_memory_channel[tuple[dict, trio.MemorySendChannel]](4)
        self.busy_s = 0.0
        self.requests = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._runner.call({"op": "ping"})
            task_status.started()
            async with self._recv:
                async for request, reply in self._recv:
                    result = await self._serve(request)
                    with contextlib.suppress(trio.BrokenResourceError):
                        reply.send_nowait(result)
        finally:
            await self._runner.aclose()

    async def _serve(self, request: dict[str, Any]) -> dict[str, Any]:
        limit = float(request.get("budget_s", 10.0)) * 3 + 60
        pause = self._pool.paused() if self._pool is not None else contextlib.nullcontext()
        t0 = trio.current_time()
        try:
            async with pause:
                with trio.fail_after(limit):
                    return await self._runner.call(request)
        except trio.TooSlowError:
            return {"ok": False, "error": f"measurement on {self.device_id} timed out after {limit:g}s"}
        except ChildDiedError as exc:
            return {"ok": False, "error": f"measurement runner crashed: {exc}"}
        finally:
            self.busy_s += trio.current_time() - t0
            self.requests += 1

    async def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        """Queue `request` for the device and return the runner's reply.

        Raises DeviceError when the runner could not answer it."""
        reply_send, reply_recv = trio.open_memory_channel[dict](1)
        await self._send.send((request, reply_send))
        async with reply_recv:
            result = await reply_recv.receive()
        if not result.get("ok"):
            raise DeviceError(f"{self.device_id}: {result.get('error', 'measurement failed')}")
        return result

"""A BankService over a real engine, in this trio run, on a temporary unix socket."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import trio

from aoe.config import load_config
from aoe.v1 import bank_pb2_grpc
from aoed.api._bridge import Bridge
from aoed.api.bank import add_to_server
from aoed.backends.ort.runtime import ORT
from aoed.engine.engine import open_engine

__all__ = ["Daemon", "serving"]


@dataclass
class Daemon:
    stub: bank_pb2_grpc.BankServiceStub
    bridge_tasks: trio.Nursery  # where the bridge runs stream producers
    bank: Path

    async def __call__(self, method: str, request, **kw):
        """Call a unary (or client-streaming) method from a thread; returns its answer."""
        return await trio.to_thread.run_sync(lambda: getattr(self.stub, method)(request, **kw))

    async def stream(self, method: str, request) -> list:
        return await trio.to_thread.run_sync(lambda: list(getattr(self.stub, method)(request)))


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, name: str = "a") -> AsyncIterator[Daemon]:
    """A BankService on a temporary unix socket over a real engine whose bank is
    `tmp_path/name/bank` (fill it before)."""
    root = tmp_path / name
    config = load_config(env={}).replace(bank=root / "bank", runtime_dir=root / "run", parallel=1)
    # Unix socket paths are limited to 107 bytes; pytest's tmp paths can be longer.
    sockdir = Path(tempfile.mkdtemp(prefix="aoe-api-"))
    socket = f"unix:{sockdir / 's.sock'}"
    async with (
        open_engine(config, ORT, root / "logs") as engine,
        trio.open_nursery() as nursery,
    ):
        executor = ThreadPoolExecutor(8)
        server = grpc.server(executor)
        add_to_server(server, Bridge(nursery), engine)
        assert server.add_insecure_port(socket)
        server.start()
        channel = grpc.insecure_channel(socket)
        try:
            yield Daemon(bank_pb2_grpc.BankServiceStub(channel), nursery, root / "bank")
        finally:
            channel.close()
            await trio.to_thread.run_sync(lambda: server.stop(None).wait())
            executor.shutdown(wait=False)
            shutil.rmtree(sockdir, ignore_errors=True)
            nursery.cancel_scope.cancel()

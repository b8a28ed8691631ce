"""DeviceService and DaemonService: what the daemon measures on, and the daemon itself."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from google.protobuf.timestamp_pb2 import Timestamp

from aoe.v1 import bank_pb2, daemon_pb2, daemon_pb2_grpc, devices_pb2, devices_pb2_grpc
from aoed import __version__
from aoed.api._bridge import Bridge
from aoed.config import DaemonConfig
from aoed.jobs import store as st
from aoed.jobs.manager import JobManager

__all__ = ["DaemonServicer", "DeviceServicer"]


class DeviceServicer(devices_pb2_grpc.DeviceServiceServicer):
    def __init__(self, bridge: Bridge, jobs: JobManager):
        self._bridge, self._jobs = bridge, jobs

    def ListDevices(self, request, context):
        return self._bridge.call(context, self._list)

    async def _list(self) -> devices_pb2.ListDevicesResponse:
        agent = self._jobs.engine.device
        fp = agent.device.fingerprint()
        running = self._jobs.store.jobs(st.RUNNING, limit=1)
        queued, n_running = self._jobs.counts()
        return devices_pb2.ListDevicesResponse(devices=[devices_pb2.Device(
            id=agent.device.name, execution_provider=agent.device.provider,
            description=f"{fp.hardware} ({agent.cores} cores), onnxruntime {fp.runtime_version}",
            fingerprint=bank_pb2.DeviceFingerprint(
                execution_provider=fp.execution_provider, hardware=fp.hardware, isa_flags=fp.isa_flags,
                runtime_version=fp.runtime_version, canonical_json=fp.canonical_json, digest=fp.digest),
            busy=n_running > 0, queued_jobs=queued, running_job_id=running[0].id if running else "",
        )])  # fmt: skip


class DaemonServicer(daemon_pb2_grpc.DaemonServiceServicer):
    def __init__(self, bridge: Bridge, jobs: JobManager, cfg: DaemonConfig, started: float | None = None,
                 listen: Callable[[], list[str]] | None = None):  # fmt: skip
        self._bridge, self._jobs, self._cfg = bridge, jobs, cfg
        self._started = started or time.time()
        self._listen = listen or cfg.listen_addresses

    def GetDaemonInfo(self, request, context):
        return self._bridge.call(context, self._info)

    async def _info(self) -> daemon_pb2.GetDaemonInfoResponse:
        cfg = self._jobs.cfg  # reloaded on SIGHUP
        queued, running = self._jobs.counts()
        started = Timestamp()
        started.FromNanoseconds(int(self._started * 1e9))
        return daemon_pb2.GetDaemonInfoResponse(
            version=__version__, pid=os.getpid(), started=started, listen=self._listen(),
            bank_path=str(cfg.engine.bank), bank_layers=[str(p) for p in cfg.engine.bank_layers],
            state_dir=str(cfg.state_dir),
            inboxes=[daemon_pb2.Inbox(path=str(i.path), outbox=str(i.outbox), failed=str(i.failed))
                     for i in cfg.inboxes],
            queued_jobs=queued, running_jobs=running, max_running_jobs=cfg.max_running_jobs,
            max_queued_jobs=cfg.max_queued_jobs, max_upload_bytes=cfg.max_upload_bytes,
            allowed_dirs=[str(p) for p in cfg.allowed_dirs], compile_workers=self._jobs.engine.pool.size,
        )  # fmt: skip

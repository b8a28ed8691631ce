"""DeviceService and DaemonService: what the daemon measures on, and the daemon itself.

A CPU device also names the OpenVINO that jobs on it may ship on (aoe.ovdevices): in its
description and as `versions["openvino"]`. This process never imports openvino: the
import forks (aoe.ovdevices), and a process that has started gRPC must not fork. A fresh
interpreter looks for it instead (`python -m aoe.ovdevices`, started through exec), on
the first listing, never at start-up; its answer holds until what is installed changes
(`OpenVinoWatch`: an install, an upgrade or a removal of the openvino distribution, read
from its metadata on each listing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import msgspec
import trio
from google.protobuf.timestamp_pb2 import Timestamp

from aoe import ovdevices
from aoe.accelerators import LocalDevice
from aoe.errors import DeviceError
from aoe.plain import from_plain
from aoe.v1 import bank_pb2, daemon_pb2, daemon_pb2_grpc, devices_pb2, devices_pb2_grpc
from aoed import __version__
from aoed.api._bridge import Bridge
from aoed.config import DaemonConfig
from aoed.jobs.manager import JobManager

__all__ = ["DaemonServicer", "DeviceServicer", "OpenVinoWatch"]

#: Seconds the interpreter that looks for OpenVINO may take: an import and its plugins,
#: seconds at most on a busy machine; beyond this the listing says so.
OPENVINO_LIMIT_S = 60.0


async def find_openvino() -> ovdevices.Offer:
    """OpenVINO on this machine as a fresh interpreter finds it (module doc). Never
    raises: a child that fails, overruns OPENVINO_LIMIT_S or answers what is not an
    offer gives an offer that says so. Cancellation kills the child."""
    if not ovdevices.installed():  # says so without importing anything
        return ovdevices.find()
    what = "looking for openvino (python -m aoe.ovdevices)"
    with trio.move_on_after(OPENVINO_LIMIT_S):
        done = await trio.run_process(
            [sys.executable, "-m", "aoe.ovdevices"],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            why = lines[-1] if lines else "no message"
            return ovdevices.Offer(why_not=f"{what} failed (exit {done.returncode}): {why}")
        try:
            last = done.stdout.decode("utf-8", "replace").strip().splitlines()[-1]
            offer: ovdevices.Offer = from_plain(ovdevices.Offer, json.loads(last))
        except (IndexError, ValueError, msgspec.ValidationError) as exc:
            return ovdevices.Offer(why_not=f"{what} answered what is not an offer: {exc}")
        return offer
    return ovdevices.Offer(why_not=f"{what} took over {OPENVINO_LIMIT_S:g} s")


class OpenVinoWatch:
    """The OpenVINO a listing names: found by `find_openvino` on the first listing, and
    again on a listing that finds another openvino distribution installed than the last
    answer was found with (or one where there was none, or none where there was one)."""

    def __init__(self) -> None:
        self._offer: ovdevices.Offer | None = None
        self._version: str | None = None

    async def offer(self) -> ovdevices.Offer:
        version = ovdevices.installed_version()
        if self._offer is None or version != self._version:
            self._offer, self._version = await find_openvino(), version
        return self._offer


class DeviceServicer(devices_pb2_grpc.DeviceServiceServicer):
    def __init__(self, bridge: Bridge, jobs: JobManager):
        self._bridge, self._jobs = bridge, jobs
        self._openvino = OpenVinoWatch()

    def ListDevices(
        self, request: devices_pb2.ListDevicesRequest, context: grpc.ServicerContext
    ) -> devices_pb2.ListDevicesResponse:
        return self._bridge.call(context, self._list)

    async def _list(self) -> devices_pb2.ListDevicesResponse:
        devset = self._jobs.engine.device_set
        first = devset.first
        running = self._jobs.running()
        queued, n_running = self._jobs.counts()
        runtime = self._jobs.engine.runtime
        # nvidia-smi and the provider list: a subprocess and an import, off the event loop
        local = await trio.to_thread.run_sync(runtime.devices, first.providers or None)
        names = {a.device.name for a in devset}
        versions = runtime.versions()
        openvino = await self._openvino.offer()
        devices = [
            _device(d, False, 0, versions, openvino) for d in local if d.device.name not in names
        ]
        uptime = max(time.monotonic() - self._jobs.engine.started, 1e-9)
        for agent in reversed(devset.agents):  # the configured ones first, in their order
            known = next((d for d in local if d.device == agent.device), None)
            mine = _device(
                known or LocalDevice(agent.device), True, agent.cores, versions, openvino
            )
            mine.busy, mine.queued_jobs = (
                agent.outstanding > 0 or (n_running > 0 and len(devset) == 1),
                queued,
            )
            mine.running_job_id = running[0].id if running and mine.busy else ""
            mine.device_seconds, mine.requests, mine.trials = (
                agent.busy_s,
                agent.requests,
                agent.trials,
            )
            mine.duty_cycle = min(1.0, agent.busy_s / uptime)
            devices.insert(0, mine)
        return devices_pb2.ListDevicesResponse(devices=devices)


def _device(
    local: LocalDevice,
    configured: bool,
    cores: int,
    versions: dict[str, str],
    openvino: ovdevices.Offer,
) -> devices_pb2.Device:
    """The Device message for `local` (its fingerprint left empty where this machine
    cannot describe it); a configured CPU counts the runner's `cores`; `versions` are
    the runtime's (aoed.engine.runtime.Runtime.versions), and a CPU's add `openvino`'s
    where jobs on it may ship on it."""
    dev = local.device
    described = local.describe(cores if configured else None)
    if dev.is_cpu and openvino.usable:
        described += f", OpenVINO {openvino.version}"
        versions = {**versions, "openvino": openvino.version}
    msg = devices_pb2.Device(
        id=dev.name,
        execution_provider=dev.provider,
        description=described,
        configured=configured,
        unusable=local.unusable,
        versions=versions,
    )
    try:
        fp = dev.fingerprint()
    except DeviceError:
        pass
    else:
        msg.fingerprint.CopyFrom(
            bank_pb2.DeviceFingerprint(
                execution_provider=fp.execution_provider,
                hardware=fp.hardware,
                isa_flags=fp.isa_flags,
                runtime_version=fp.runtime_version,
                canonical_json=fp.canonical_json,
                digest=fp.digest,
            )
        )
    if local.gpu is not None:
        g = local.gpu
        msg.accelerator.CopyFrom(
            devices_pb2.Accelerator(
                index=g.index,
                name=g.name,
                compute_capability=g.compute_capability,
                memory_mib=g.memory_mib,
                driver_version=g.driver_version,
                uuid=g.uuid,
            )
        )
    return msg


class DaemonServicer(daemon_pb2_grpc.DaemonServiceServicer):
    def __init__(
        self,
        bridge: Bridge,
        jobs: JobManager,
        cfg: DaemonConfig,
        started: float | None = None,
        listen: Callable[[], list[str]] | None = None,
    ):
        self._bridge, self._jobs, self._cfg = bridge, jobs, cfg
        self._started = started or time.time()
        self._listen = listen or cfg.listen_addresses

    def GetDaemonInfo(
        self, request: daemon_pb2.GetDaemonInfoRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.GetDaemonInfoResponse:
        return self._bridge.call(context, self._info)

    async def _info(self) -> daemon_pb2.GetDaemonInfoResponse:
        cfg = self._jobs.cfg  # reloaded on SIGHUP
        queued, running = self._jobs.counts()
        started = Timestamp()
        started.FromNanoseconds(int(self._started * 1e9))
        return daemon_pb2.GetDaemonInfoResponse(
            version=__version__,
            pid=os.getpid(),
            started=started,
            listen=self._listen(),
            bank_path=str(cfg.engine.bank),
            bank_layers=[str(p) for p in cfg.engine.bank_layers],
            state_dir=str(cfg.state_dir),
            inboxes=[
                daemon_pb2.Inbox(path=str(i.path), outbox=str(i.outbox), failed=str(i.failed))
                for i in cfg.inboxes
            ],
            queued_jobs=queued,
            running_jobs=running,
            max_running_jobs=cfg.max_running_jobs,
            max_queued_jobs=cfg.max_queued_jobs,
            max_upload_bytes=cfg.max_upload_bytes,
            allowed_dirs=[str(p) for p in cfg.allowed_dirs],
            compile_workers=self._jobs.engine.pool.size,
        )

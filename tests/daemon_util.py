"""A real `aoed` process on a temporary unix socket, for integration tests.

    d = DaemonProcess(tmp_path)            # writes aoed.toml; nothing runs yet
    d.start()                              # returns once health says SERVING
    stub = d.tuning()                      # aoe.v1 stubs over the socket
    d.stop() / d.kill()                    # SIGTERM (graceful) / SIGKILL

Each daemon has its own state dir, bank, runtime dir (device locks) and inbox under
`root`; the socket lives in a short /tmp folder because unix socket paths are limited to
107 bytes and pytest's tmp paths can be longer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aoe.v1 import (
    bank_pb2,
    bank_pb2_grpc,
    daemon_pb2,
    daemon_pb2_grpc,
    devices_pb2_grpc,
    tuning_pb2,
    tuning_pb2_grpc,
)
from tests.helpers import wait_for

__all__ = ["DaemonProcess", "follow", "log_state", "mixed_calls", "upload"]


class DaemonProcess:
    def __init__(
        self,
        root: Path,
        extra_toml: str = "",
        *,
        parallel: int = 1,
        max_running_jobs: int = 2,
        listen_toml: str = "",
        nofile: tuple[int, int] | None = None,
    ):
        """`nofile`: the (soft, hard) RLIMIT_NOFILE the daemon starts with."""
        self.root = root
        self.nofile = nofile
        root.mkdir(parents=True, exist_ok=True)
        self._short = Path(tempfile.mkdtemp(prefix="aoed-t-", dir="/tmp"))
        self.socket = self._short / "aoed.sock"
        self.state = root / "state"
        self.bank = root / "bank"
        self.models = root / "models"
        self.inbox = root / "inbox"
        self.models.mkdir(exist_ok=True)
        self.runtime = self._short / "run"
        self.config = root / "aoed.toml"
        self.log_path = root / f"aoed-{id(self)}.log"
        self.config.write_text(
            f'[daemon]\nstate_dir = "{self.state}"\nallowed_dirs = ["{self.models}"]\n'
            f"max_running_jobs = {max_running_jobs}\nshutdown_grace_s = 5\n"
            f'[listen]\nsocket = "{self.socket}"\n{listen_toml}'
            f'[bank]\npath = "{self.bank}"\n'
            f'[engine]\nruntime_dir = "{self.runtime}"\n'
            f"[tuning]\nparallel = {parallel}\n"
            f'[[inbox]]\npath = "{self.inbox}"\nstable_s = 1.0\n' + extra_toml
        )
        self.proc: subprocess.Popen | None = None
        self._channel: grpc.Channel | None = None
        #: a command that runs the daemon's command (e.g. setpriv, for fewer capabilities)
        self.argv_prefix: list[str] = []

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TUNE_BANK_PATH", "REPEAT_TUNE", "AOED_CONFIG")
        }
        env["AOED_SOCKET"] = str(self.socket)
        return env

    def start(self, timeout: float = 90) -> None:
        log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "aoed", "--config", str(self.config), "--log-level", "info"]
        if self.nofile is not None:  # set in the process that then becomes the daemon
            argv = [
                sys.executable,
                "-c",
                "import os, resource, sys; "
                "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
                "os.execv(sys.argv[3], sys.argv[3:])",
                *map(str, self.nofile),
                *argv,
            ]
        self.proc = subprocess.Popen(
            [*self.argv_prefix, *argv],
            stdout=log,
            stderr=log,
            env=self.env(),
        )
        log.close()
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"aoed exited with {proc.returncode}:\n{self.log()}")
            return self.socket.exists() and self.serving()

        wait_for(up, timeout, "aoed serving", detail=self.log)

    def serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.target) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        """The log's last `chars` characters: what a failure message shows."""
        return self.log()[-chars:]

    def deliver(self, name: str, data: bytes, timeout: float = 240) -> Path:
        """Drop `data` in the inbox as `name`; the report its outbox gets, once there."""
        (self.inbox / name).write_bytes(data)
        report = f"{Path(name).stem}_report.txt"
        outbox = self.inbox.parent / "outbox"
        return wait_for(
            lambda: next(outbox.glob(report), None),
            timeout,
            f"{report} in the outbox",
            detail=self.log_tail,
        )

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return self._channel

    def tuning(self) -> tuning_pb2_grpc.TuningServiceStub:
        return tuning_pb2_grpc.TuningServiceStub(self.channel())

    def bank_stub(self) -> bank_pb2_grpc.BankServiceStub:
        return bank_pb2_grpc.BankServiceStub(self.channel())

    def devices(self) -> devices_pb2_grpc.DeviceServiceStub:
        return devices_pb2_grpc.DeviceServiceStub(self.channel())

    def daemon(self) -> daemon_pb2_grpc.DaemonServiceStub:
        return daemon_pb2_grpc.DaemonServiceStub(self.channel())

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit status."""
        self._close_channel()
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(
                f"aoed did not stop within {timeout} s after SIGTERM:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL, as a crash would; its children die with it (PR_SET_PDEATHSIG)."""
        self._close_channel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self._short, ignore_errors=True)

    def wait_job(self, job_id: str, timeout: float = 300) -> tuning_pb2.Job:
        """Poll until the job is final; returns it. A GetJob costs the daemon little, and
        every test that waits for a job waits here: a short interval, not a long one."""
        final = (
            tuning_pb2.JOB_STATE_SUCCEEDED,
            tuning_pb2.JOB_STATE_FAILED,
            tuning_pb2.JOB_STATE_CANCELLED,
        )

        def done() -> tuning_pb2.Job | None:
            job = self.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id), timeout=10).job
            return job if job.state in final else None

        return wait_for(done, timeout, f"job {job_id} final", detail=self.log)


def _chunks(path: Path, name: str, chunk: int) -> Iterator[tuning_pb2.UploadModelRequest]:
    data = path.read_bytes()
    yield tuning_pb2.UploadModelRequest(
        header=tuning_pb2.ModelUploadHeader(
            file_name=name, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)
        )
    )
    for i in range(0, len(data), chunk):
        yield tuning_pb2.UploadModelRequest(chunk=data[i : i + chunk])


def upload(
    stub: tuning_pb2_grpc.TuningServiceStub,
    path: Path,
    name: str | None = None,
    chunk: int = 256 << 10,
) -> str:
    """Upload `path` in chunks; returns the model id."""
    return stub.UploadModel(_chunks(path, name or path.name, chunk), timeout=60).model_id


def submit_sample(d: DaemonProcess, name: str, budget: float, timeout: float = 30, **opts) -> str:
    """Upload the sample model `name` (saved in `d.models` once) and submit it with
    `budget` seconds and the JobOptions fields `opts`; returns the job's id."""
    path = d.models / f"{name}.onnx"
    if not path.exists():
        from aoed import samples

        samples.save(samples.build(name), path)
    reply = d.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_id=upload(d.tuning(), path),
            options=tuning_pb2.JobOptions(budget_s=budget, **opts),
        ),
        timeout=timeout,
    )
    return reply.job_id


def mixed_calls(
    ch: grpc.Channel,
    pid: int,
    job_id: str,
    hits: Sequence[str],
    misses: Sequence[str],
    rng: random.Random,
    timeout: float = 60,
) -> dict[str, Callable[[], bool]]:
    """Each kind of call of a load mix over `ch` (GetJob, ListJobs, LookupEntry hit and
    miss, GetDaemonInfo, a short WatchJob), returning whether its answer is the right one."""
    tuning = tuning_pb2_grpc.TuningServiceStub(ch)
    bank = bank_pb2_grpc.BankServiceStub(ch)
    daemon = daemon_pb2_grpc.DaemonServiceStub(ch)

    def watch() -> bool:  # a short watch: a few events, then the client goes away
        stream = tuning.WatchJob(
            tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=timeout
        )
        seqs = [m.event.sequence for m in itertools.islice(stream, 3)]
        stream.cancel()
        return len(seqs) > 0 and seqs == list(range(1, len(seqs) + 1))

    return {
        "GetJob": lambda: (
            tuning.GetJob(tuning_pb2.GetJobRequest(job_id=job_id), timeout=timeout).job.job_id
            == job_id
        ),
        "ListJobs": lambda: (
            job_id
            in [
                j.job_id
                for j in tuning.ListJobs(tuning_pb2.ListJobsRequest(), timeout=timeout).jobs
            ]
        ),
        "LookupEntry hit": lambda: (
            bank.LookupEntry(
                bank_pb2.LookupEntryRequest(key=rng.choice(hits)), timeout=timeout
            ).found
        ),
        "LookupEntry miss": lambda: (
            not bank.LookupEntry(
                bank_pb2.LookupEntryRequest(key=rng.choice(misses)), timeout=timeout
            ).found
        ),
        "GetDaemonInfo": lambda: (
            daemon.GetDaemonInfo(daemon_pb2.GetDaemonInfoRequest(), timeout=timeout).pid == pid
        ),
        "WatchJob": watch,
    }


def follow(d: DaemonProcess, peers: list[DaemonProcess]) -> None:
    """Make `d` follow `peers` (its config gains [bank] follow)."""
    targets = ", ".join(f'"unix://{p.socket}"' for p in peers)
    d.config.write_text(
        d.config.read_text().replace("[bank]\n", f"[bank]\nfollow = [{targets}]\n", 1)
    )


def log_state(d: DaemonProcess) -> tuple[int, dict[str, int]]:
    """(the bank's last sequence number, each followed peer's position), read from the
    daemon's bank while it runs (LMDB readers never block its writer)."""
    import lmdb

    env = lmdb.open(str(d.bank), readonly=True, max_dbs=16, create=False)
    try:
        with env.begin() as txn:
            head = int(txn.get(b"seq", db=env.open_db(b"meta", txn=txn, create=False)) or 0)
            peers = {
                k.decode(): json.loads(v)["seq"]
                for k, v in txn.cursor(db=env.open_db(b"peers", txn=txn, create=False))
            }
    finally:
        env.close()
    return head, peers

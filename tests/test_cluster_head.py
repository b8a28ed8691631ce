"""A daemon on the Ray executor whose cluster's head goes away mid-job: its jobs end
(failing clearly), it keeps serving past Ray's own limit for a lost head, and it stops
cleanly. A cluster of its own, started with deploy/README.md's commands and a token
(tests/ray_util.py; tests/test_cluster.py's is shared by its tests)."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from aoe.v1 import devices_pb2, tuning_pb2
from tests.daemon_util import DaemonProcess, submit_sample
from tests.helpers import wait_for
from tests.ray_util import RayCluster

#: Ray ends a driver's process this long after it lost the head, unless told otherwise
#: (RAY_gcs_rpc_server_reconnect_timeout_s, aoed.engine.rayexec._GCS_RECONNECT)
_RAY_DRIVER_LIMIT_S = 60


@pytest.mark.cluster
def test_a_lost_head_fails_jobs_clearly_and_the_daemon_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs the cluster extra (make test-cluster)")
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets live there
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    cluster = RayCluster(root, token)
    try:
        cluster.start_head(num_cpus=1)
        cluster.add_node(resources='{"aoe_device_cpu0": 1}')
        cluster.wait_for_nodes(2)
        d = DaemonProcess(
            tmp_path / "d",
            f'[cluster]\nexecutor = "ray"\naddress = "{cluster.address}"\ntoken_file = "{token}"\n',
        )
        d.config.write_text(
            d.config.read_text().replace("[tuning]\n", '[tuning]\ndevices = ["cpu:0"]\n', 1)
        )
        d.start(timeout=240)
    except BaseException:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        job_id = submit_sample(d, "cnn", 60.0, timeout=60)

        def trials() -> int:
            return sum(
                x.trials for x in d.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
            )

        wait_for(lambda: trials() > 0, 300, "the first trials")
        cluster.kill()
        down = time.monotonic()
        job = d.wait_job(job_id, timeout=300)  # it ends, whatever its measurements were doing
        assert job.state in (tuning_pb2.JOB_STATE_SUCCEEDED, tuning_pb2.JOB_STATE_FAILED), job
        wait_for(lambda: "does not answer" in d.log(), 120, "the head called lost")
        job = d.wait_job(submit_sample(d, "mlp", 4.0, timeout=60), timeout=120)
        assert job.state == tuning_pb2.JOB_STATE_FAILED
        assert "does not answer" in job.error or "died" in job.error, job.error
        # Past the time Ray would have ended the daemon's process, it still serves.
        assert wait_for(
            lambda: time.monotonic() - down > _RAY_DRIVER_LIMIT_S + 15 and d.serving(),
            150,
            "the daemon serving after Ray's limit",
        )
        assert d.proc.poll() is None
        assert d.stop() == 0, d.log()
    finally:
        d.close()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)

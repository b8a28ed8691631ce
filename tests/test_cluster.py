"""Many servers on Ray: the `[cluster]` settings (fast, no Ray needed), and a real daemon
measuring on a Ray cluster of three nodes on this machine, each node a device by a custom
resource, started with deploy/README.md's commands and the cluster's token, the daemon
holding the token too (`make test-cluster` runs those: they need the cluster extra, and
start Ray). Who else may use such a cluster: tests/test_cluster_auth.py."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aoe.config import load_config
from aoe.errors import DeviceError, OptionError
from aoe.v1 import bank_pb2, devices_pb2, tuning_pb2
from aoed import samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess, submit_sample
from tests.helpers import wait_for
from tests.ray_util import RayCluster


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "aoed.toml"
    path.write_text(body)
    return path


def test_cluster_settings_are_checked(tmp_path: Path) -> None:
    assert load_config(env={}).executor == "local"
    with pytest.raises(
        OptionError,
        match=r"\[cluster\] executor = 'spark': expected one of local, ray",
    ):
        load_config(_config(tmp_path, '[cluster]\nexecutor = "spark"\n'), env={})
    with pytest.raises(OptionError, match=r'executor="ray" .* needs \[cluster\] address'):
        load_config(_config(tmp_path, '[cluster]\nexecutor = "ray"\n'), env={})
    with pytest.raises(
        OptionError, match=r"\[cluster\] address = 6379: expected the Ray head's address"
    ):
        load_config(_config(tmp_path, "[cluster]\naddress = 6379\n"), env={})
    with pytest.raises(OptionError, match=r"\[cluster\] nodes: unknown setting"):
        load_config(_config(tmp_path, "[cluster]\nnodes = 3\n"), env={})


def test_check_config_reports_cluster_problems(tmp_path: Path) -> None:
    path = _config(
        tmp_path, f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[cluster]\nexecutor = "ray"\n'
    )

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "aoed", "--config", str(path), "--check-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )

    run = check()
    assert run.returncode != 0
    assert "needs [cluster] address" in run.stderr, run.stderr
    assert "needs [cluster] token_file" in run.stderr, run.stderr
    if importlib.util.find_spec("ray") is not None:
        token = tmp_path / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        cluster = f'address = "10.0.0.1:6379"\ntoken_file = "{token}"\n'
        path.write_text(path.read_text() + cluster)
        run = check()
        assert run.returncode == 0, run.stderr
        assert f"executor    ray at 10.0.0.1:6379, token in {token}" in run.stdout
        token.chmod(0o640)
        run = check()
        assert run.returncode == OptionError.exit_code, run.stderr
        assert f"token_file {token}: mode 0640 lets other users at it" in run.stderr
        path.write_text(
            path.read_text().replace(f'token_file = "{token}"', "allow_unauthenticated = true")
        )
        run = check()
        assert run.returncode == 0, run.stderr
        assert "executor    ray at 10.0.0.1:6379, NO TOKEN (allow_unauthenticated)" in run.stdout


def test_ray_without_the_extra_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aoed.engine.rayexec import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # how Python spells "not installed" to importers
    path = _config(
        tmp_path,
        '[cluster]\nexecutor = "ray"\naddress = "127.0.0.1:6379"\nallow_unauthenticated = true\n',
    )
    with pytest.raises(OptionError) as info:
        load_config(path, env={})
    assert len(info.value.problems) == 1 and "\n" not in str(info.value)
    assert 'pip install "aoed[cluster]"' in str(info.value) and "[cluster] executor" in str(
        info.value
    )
    with pytest.raises(OptionError, match=r'pip install "aoed\[cluster\]"'):
        require_ray()


# -- a Ray cluster of three nodes on this machine --------------------------------------

DEVICES = ("cpu:0", "cpu:1", "cpu:2")


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="needs the cluster extra (make test-cluster)")
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets live there
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    c = RayCluster(root, token)
    try:
        # The head holds the compile workers' CPU; each other node is one device, by its
        # resource.
        c.start_head(num_cpus=1)
        c.device_nodes = {
            device: c.add_node(resources=f'{{"aoe_device_{device.replace(":", "")}": 1}}')
            for device in DEVICES
        }
        c.wait_for_nodes(1 + len(DEVICES))
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _cluster_toml(cluster: RayCluster) -> str:
    """The `[cluster]` settings of an engine that uses `cluster` with its token."""
    return (
        f'[cluster]\nexecutor = "ray"\naddress = "{cluster.address}"\n'
        f'token_file = "{cluster.token_file}"\n'
    )


@pytest.fixture
def on_ray(tmp_path: Path, cluster):
    d = DaemonProcess(tmp_path / "d", _cluster_toml(cluster))
    devices = ", ".join(f'"{x}"' for x in DEVICES)
    d.config.write_text(
        d.config.read_text().replace("[tuning]\n", f"[tuning]\ndevices = [{devices}]\n", 1)
    )
    d.start(timeout=240)
    yield d
    d.close()


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids.update(int(k) for k in (task / "children").read_text().split())
    return kids


def _actors(title: str) -> list[int]:
    """Pids of this machine's processes whose title starts with `title` (Ray names an
    actor's process `ray::Class` and, while it serves a call, `ray::Class.method`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(title.encode()):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@pytest.mark.cluster
def test_one_job_measures_on_all_three_nodes(on_ray: DaemonProcess) -> None:
    # Fork rule: the daemon connected to Ray as a driver and started nothing itself; its
    # runners and workers are the cluster's actors.
    assert _children(on_ray.proc.pid) == set()
    job = on_ray.wait_job(submit_sample(on_ray, "mlp", 9.0), timeout=600)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    per = json.loads(Path(job.result.result_json_path).read_text())["resources"]["devices"]
    assert set(per) == set(DEVICES), per
    assert all(per[d]["trials"] > 0 for d in DEVICES), per
    assert Path(job.result.tuned_model_path).is_file()
    assert _children(on_ray.proc.pid) == set()
    # SIGTERM is still the daemon's own (ray.init, off the main thread, took no handler).
    assert on_ray.stop() == 0, on_ray.log()


@pytest.mark.cluster
def test_an_actor_killed_mid_job_loses_no_decided_task(on_ray: DaemonProcess) -> None:
    job_id = submit_sample(on_ray, "cnn", 12.0)

    def measuring() -> list[int]:
        trials = {
            d.id: d.trials
            for d in on_ray.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
        }
        return _actors("ray::DeviceActor.call") if sum(trials.values()) > 0 else []

    victim = wait_for(measuring, 300, "a device actor measuring, after the first trials")[0]
    os.kill(victim, signal.SIGKILL)
    job = on_ray.wait_job(job_id, timeout=600)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    assert Path(job.result.tuned_model_path).is_file()
    result = json.loads(Path(job.result.result_json_path).read_text())
    tasks = result["tasks"]
    # Every task has its decision; at most the one measured by the killed actor failed, and
    # every other was decided (kept in the bank) as it would have been.
    failed = [t for t in tasks if t["update_mode"] == "failed"]
    assert len(failed) <= 1, failed
    assert all("died" in t["error"] for t in failed), failed
    decided = [t for t in tasks if t["update_mode"] != "failed"]
    assert decided and all(t["update_mode"] for t in decided), tasks
    # A decided task's trials are committed with its decision: the bank kept them all.
    measured = [t for t in decided if t["candidates"]]
    stats = on_ray.bank_stub().GetBankStats(bank_pb2.GetBankStatsRequest(), timeout=30)
    assert stats.history_trials >= len(measured) > 0
    assert stats.entries >= sum(t["update_mode"] in ("add", "update") for t in tasks)
    # The device whose actor was killed measures again (a fresh actor on its node).
    assert victim not in _actors("ray::DeviceActor")


def _tune_on_ray(tmp_path: Path, address: str, token: Path, *args: str, timeout: float):
    """`aoe tune` of the mlp sample, embedded, its trials on the Ray cluster at `address`,
    with the token in `token`."""
    model = tmp_path / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    config = _config(tmp_path, f'[cluster]\ntoken_file = "{token}"\n')
    return run_aoe(
        "tune",
        str(model),
        *("--executor", "ray", "--ray-address", address, *args),
        *("--bank", str(tmp_path / "bank"), "--output", str(tmp_path / "out"), "--no-progress"),
        env={"AOED_RUNTIME_DIR": str(tmp_path / "run"), "AOED_CONFIG": str(config)},
        timeout=timeout,
    )


@pytest.mark.cluster
def test_aoe_tune_runs_embedded_on_the_cluster(tmp_path: Path, cluster) -> None:
    run = _tune_on_ray(
        tmp_path,
        cluster.address,
        cluster.token_file,
        *("--device", "cpu:0", "--device", "cpu:1", "--budget", "6", "--parallel", "1"),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    (result,) = (tmp_path / "out").glob("aoe_result_*.json")
    per = json.loads(result.read_text())["resources"]["devices"]
    assert per["cpu:0"]["trials"] > 0 and per["cpu:1"]["trials"] > 0, per


@pytest.mark.cluster
def test_a_node_lost_mid_job_leaves_its_device_and_jobs_go_on(
    on_ray: DaemonProcess, cluster
) -> None:
    # Last of the tests on the shared cluster: it takes a node away for good.
    job_id = submit_sample(on_ray, "cnn", 12.0)

    def trials() -> dict[str, int]:
        return {
            d.id: d.trials
            for d in on_ray.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
        }

    wait_for(lambda: sum(trials().values()) > 0, 300, "the first trials")
    cluster.remove_node(cluster.device_nodes["cpu:2"])
    job = on_ray.wait_job(job_id, timeout=600)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    assert Path(job.result.tuned_model_path).is_file()
    assert "no live node offers aoe_device_cpu2" in on_ray.log()
    # The device is passed over from then on: the next job measures on the two left, and
    # none of its tasks fails for the device that went away.
    job = on_ray.wait_job(submit_sample(on_ray, "mlp", 6.0), timeout=600)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    result = json.loads(Path(job.result.result_json_path).read_text())
    per = result["resources"]["devices"]
    assert per["cpu:0"]["trials"] + per["cpu:1"]["trials"] > 0 and "cpu:2" not in per, per
    assert not [t for t in result["tasks"] if t["update_mode"] == "failed"], result["tasks"]


@pytest.mark.cluster
def test_an_unreachable_head_is_one_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs the cluster extra (make test-cluster)")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    run = _tune_on_ray(tmp_path, f"127.0.0.1:{port}", token, timeout=120)
    assert run.returncode == DeviceError.exit_code, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert (
        len(errors) == 1
        and f"[cluster] address 127.0.0.1:{port}: cannot reach the Ray cluster" in errors[0]
    ), run.stderr

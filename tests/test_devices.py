"""Every device of a server: core-set devices, the `devices` setting, and a real daemon
with two one-core CPU devices (`cpu:0`, `cpu:1`) running jobs across both."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
from pathlib import Path

import pytest

from aoe.config import load_config
from aoe.device import Device
from aoe.errors import DeviceError, OptionError
from aoe.v1 import devices_pb2, tuning_pb2
from aoed.engine.engine import place_cores
from tests.daemon_util import DaemonProcess, submit_sample
from tests.helpers import wait_for


def test_a_cpu_device_may_be_a_set_of_cores_with_its_own_fingerprint() -> None:
    d = Device.parse("cpu:3,0-1")
    assert d.cores == (0, 1, 3) and d.name == "cpu:0-1,3" and Device.parse(d.name) == d
    assert d.lock_name == "cpu:0-1,3"
    # Identical core sets share what was learned; plain `cpu` keeps its fingerprint.
    assert Device.parse("cpu:0").fingerprint() == Device.parse("cpu:1").fingerprint()
    assert Device.parse("cpu:0-1").fingerprint() != Device.parse("cpu:0").fingerprint()
    assert "cores" not in Device.parse("cpu").fingerprint().options
    assert Device.parse("cpu:0-3").overlaps(Device.parse("cpu:3")) and not Device.parse(
        "cpu:0"
    ).overlaps(Device.parse("cpu:1"))
    with pytest.raises(OptionError, match="cpu:FIRST-LAST"):
        Device.parse("cpu:3-1")


def test_devices_setting_lists_every_device_and_refuses_shared_hardware(tmp_path: Path) -> None:
    cfg = tmp_path / "aoed.toml"
    cfg.write_text('[tuning]\ndevices = ["cpu:0", "cpu:1"]\n')
    c = load_config(cfg, env={})
    assert [d.name for d in c.all_devices] == ["cpu:0", "cpu:1"] and c.device.name == "cpu:0"
    assert [d.name for d in c.replace(device=Device.parse("cpu:1")).all_devices] == ["cpu:1"]
    cfg.write_text('[tuning]\ndevices = ["cpu:0-1", "cpu:1"]\n')
    with pytest.raises(OptionError, match=r"devices .*cpu:1 and cpu:0-1 share hardware"):
        load_config(cfg, env={})
    cfg.write_text('[tuning]\ndevices = "cpu:0"\n')
    with pytest.raises(OptionError, match=r"\[tuning\] devices = 'cpu:0': expected a list"):
        load_config(cfg, env={})


def test_core_sets_pin_each_runner_and_give_workers_the_rest() -> None:
    sets = (Device.parse("cpu:0"), Device.parse("cpu:1"))
    assert place_cores(sets, [0, 1, 2, 3], None) == ([[0], [1]], [2, 3], False)
    # No core left over: the workers share the devices' cores and pause while one measures.
    assert place_cores(sets, [0, 1], None) == ([[0], [1]], [], True)
    assert place_cores((Device(),), [0, 1], None) == ([[]], [], True)
    with pytest.raises(DeviceError, match="device cpu:5: core"):
        place_cores((Device.parse("cpu:5"),), [0, 1], None)


def test_the_memory_plan_counts_one_runner_per_device() -> None:
    from aoed.engine.memory import DAEMON_RESERVE_MB, plan_memory

    base = load_config(env={}).replace(parallel=2, memory_mb=16384)
    one = plan_memory(base)
    four = plan_memory(base.replace(devices=tuple(Device.parse(f"cpu:{i}") for i in range(4))))
    assert (one.children, four.children) == (3, 6)
    assert four.child_mb == (16384 - DAEMON_RESERVE_MB) // 6
    assert four.child_mb * four.children + DAEMON_RESERVE_MB <= 16384


# -- a real daemon with two one-core devices ------------------------------------------

needs_two_cores = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1 for two one-core devices"
)


@pytest.fixture
def two_devices(tmp_path: Path):
    d = DaemonProcess(tmp_path / "d")
    d.config.write_text(
        d.config.read_text().replace("[tuning]\n", '[tuning]\ndevices = ["cpu:0", "cpu:1"]\n', 1)
    )
    d.start()
    yield d
    d.close()


def _resources(job: tuning_pb2.Job) -> dict:
    return json.loads(Path(job.result.result_json_path).read_text())["resources"]


def _no_overlap(spans: list[tuple[float, float]]) -> list:
    spans = sorted(spans)
    return [(p, n) for p, n in itertools.pairwise(spans) if n[0] < p[1]]


@pytest.mark.slow
@needs_two_cores
@pytest.mark.long
def test_one_job_measures_on_both_devices(two_devices: DaemonProcess) -> None:
    listed = two_devices.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
    assert [d.id for d in listed if d.configured] == ["cpu:0", "cpu:1"]
    job = two_devices.wait_job(submit_sample(two_devices, "mlp", 6.0))
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    res = _resources(job)
    per = res["devices"]
    assert set(per) == {"cpu:0", "cpu:1"}, per
    assert per["cpu:0"]["trials"] > 0 and per["cpu:1"]["trials"] > 0, per
    assert sum(p["trials"] for p in per.values()) >= res["trials"] > 0
    listed = {
        d.id: d for d in two_devices.devices().ListDevices(devices_pb2.ListDevicesRequest()).devices
    }
    assert listed["cpu:0"].trials > 0 and listed["cpu:1"].trials > 0
    assert 0 < listed["cpu:1"].duty_cycle <= 1 and listed["cpu:1"].device_seconds > 0


@pytest.mark.slow
@needs_two_cores
def test_two_jobs_at_once_one_at_home_on_each_device(two_devices: DaemonProcess) -> None:
    a = submit_sample(two_devices, "mlp", 3.0)
    b = submit_sample(two_devices, "cnn", 3.0)
    ja, jb = two_devices.wait_job(a), two_devices.wait_job(b)
    assert ja.state == jb.state == tuning_pb2.JOB_STATE_SUCCEEDED, (ja.error, jb.error)
    wa = (ja.started.ToNanoseconds(), ja.finished.ToNanoseconds())
    wb = (jb.started.ToNanoseconds(), jb.finished.ToNanoseconds())
    assert wa[0] < wb[1] and wb[0] < wa[1], "the two jobs ran at the same time"
    ra, rb = _resources(ja), _resources(jb)
    assert {ra["home_device"], rb["home_device"]} == {"cpu:0", "cpu:1"}
    # Each device measured one request at a time, whichever job it was for.
    for name in ("cpu:0", "cpu:1"):
        spans = [
            tuple(s) for r in (ra, rb) for s in r["devices"].get(name, {}).get("intervals", [])
        ]
        assert spans, f"{name} measured nothing"
        assert not _no_overlap(spans), f"{name}: measurements overlapped"


@pytest.mark.slow
@needs_two_cores
def test_a_device_held_by_another_process_waits_while_the_other_measures(
    two_devices: DaemonProcess,
) -> None:
    # the environment wins
    runtime = Path(os.environ.get("AOED_RUNTIME_DIR") or two_devices.runtime)
    runtime.mkdir(mode=0o750, parents=True, exist_ok=True)
    lock = runtime / "device-cpu-1.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # as the daemon makes it (devlock.py)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        job_id = submit_sample(two_devices, "mlp", 6.0)
        stream = two_devices.tuning().WatchJob(
            tuning_pb2.WatchJobRequest(job_id=job_id, include_logs=True), timeout=120
        )
        for msg in stream:
            if "waiting for cpu-1" in msg.event.log.message:
                stream.cancel()
                break
        else:
            raise AssertionError("the job never waited for cpu:1")
        # While cpu:1 is held elsewhere, cpu:0 goes on measuring for the job.
        wait_for(
            lambda: (
                {
                    d.id: d
                    for d in two_devices.devices()
                    .ListDevices(devices_pb2.ListDevicesRequest())
                    .devices
                }["cpu:0"].trials
                > 0
            ),
            120,
            "cpu:0 measuring",
        )
        released = time.time()
    finally:
        os.close(fd)  # lets the lock go
    job = two_devices.wait_job(job_id)
    assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
    per = _resources(job)["devices"]
    assert per["cpu:1"]["intervals"] and min(s for s, _ in per["cpu:1"]["intervals"]) >= released
    assert min(s for s, _ in per["cpu:0"]["intervals"]) < released

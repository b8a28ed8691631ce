"""Shared fixtures: sample models on disk and a way to run the real `aoe` command."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aoed import samples

from .suite_time import SuiteTime

# Jobs in the suite ship on onnxruntime unless a test asks for OpenVINO (by name, or with
# this variable set to auto, as tests/test_openvino.py does): its build and comparison
# take seconds that a job about something else need not spend, and a bf16 build that
# wins would hand such a test an IR where it reads an ONNX model.
os.environ.setdefault("AOED_TUNING_RUNTIME", "onnxruntime")

# Each pytest-xdist worker is a machine of its own: its embedded jobs take the device lock
# in a runtime dir of their own (under AOED_RUNTIME_DIR, else the temp folder), as each
# test's daemon does, instead of queueing for the other workers' measurements. A test
# whose outcome needs one candidate clearly faster than another holds every worker's
# device alone while it runs (the `machine_alone` fixture).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_LOCKS = Path(
    os.environ.get("AOED_RUNTIME_DIR")
    or os.path.join(tempfile.gettempdir(), f"aoed-tests-{os.getuid()}")
)
if _WORKER:
    os.environ["AOED_RUNTIME_DIR"] = str(_LOCKS / _WORKER)


def pytest_configure(config: pytest.Config) -> None:
    """Print the selected tests' estimated time before they run (tests/suite_time.py)."""
    config.pluginmanager.register(SuiteTime(config), "aoed-suite-time")


@contextlib.contextmanager
def held_alone() -> Iterator[None]:
    """No other xdist worker's embedded job measures inside the block: it takes the device
    lock of every other worker (in order, one such block at a time), as a measurement of
    theirs would, and holds them to its end. Jobs of this worker measure under its lock
    as usual. Daemons started by tests lock in their own runtime dirs and are not held."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not _WORKER or count < 2:
        yield
        return
    import fcntl

    from aoe.device import Device
    from aoed.engine.devlock import DeviceLock

    _LOCKS.mkdir(parents=True, exist_ok=True)
    name = Device.parse("cpu").lock_name
    with contextlib.ExitStack() as held, open(_LOCKS / "alone.lock", "w") as alone:
        fcntl.flock(alone, fcntl.LOCK_EX)
        for i in range(count):
            if f"gw{i}" != _WORKER:
                lock = DeviceLock(_LOCKS / f"gw{i}", name)
                held.callback(lock.close)
                held.enter_context(lock.hold_sync())
        yield


@pytest.fixture
def machine_alone() -> Iterator[None]:
    """The test runs `held_alone`: for a test whose outcome needs one candidate clearly
    faster than another, which another worker's measurements could blur."""
    with held_alone():
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with every sample model saved as NAME.onnx."""
    d = tmp_path_factory.mktemp("models")
    for name in samples.SAMPLES:
        samples.save(samples.build(name), d / f"{name}.onnx")
    samples.save(samples.mlp(dynamic_batch=True), d / "mlp_dynamic.onnx")
    return d


def run_aoe(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
):
    """Run the installed `aoe` command line in a fresh process; returns CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("TUNE_BANK_PATH", "REPEAT_TUNE")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "aoe.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )

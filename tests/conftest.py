"""Shared fixtures: sample models on disk and a way to run the real `aoe` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aoed import samples

from .suite_time import SuiteTime

# Jobs in the suite ship on onnxruntime unless a test asks for OpenVINO (by name, or with
# this variable set to auto, as tests/test_openvino.py does): its build and comparison
# take seconds that a job about something else need not spend, and a bf16 build that
# wins would hand such a test an IR where it reads an ONNX model.
os.environ.setdefault("AOED_TUNING_RUNTIME", "onnxruntime")


def pytest_configure(config: pytest.Config) -> None:
    """Print the selected tests' estimated time before they run (tests/suite_time.py)."""
    config.pluginmanager.register(SuiteTime(config), "aoed-suite-time")


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

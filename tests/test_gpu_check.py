"""bench/gpu_check.sh, the prepared check for a lent GPU: its syntax, and its steps run
on the CPU (--dry-run: tiny models, every row the CPU provider)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_gpu_check_script_parses() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.long
def test_gpu_check_dry_run_writes_the_table(tmp_path: Path) -> None:
    import sys

    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "AOED_RUNTIME_DIR": str(tmp_path / "run"),
    }
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=480
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = (tmp_path / "gpu_results.md").read_text()
    assert "DRY RUN" in table and table.count("| aoe tuned |") == 2 and "bank-hit re-tune" in table
    assert (
        "| bert_tiny | ORT CUDA EP default |" in table
        and "| resnet_tiny | ORT TensorRT EP default |" in table
    )

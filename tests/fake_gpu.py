"""Fakes at the hardware seam, for machines without the hardware: an `nvidia-smi` that
answers from a recorded fixture (tests/fixtures/nvidia-smi). Nothing of aoed is faked:
the code under test runs the executable it finds on PATH, as on a GPU machine."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"

QUERY = "--query-gpu=index,name,compute_cap,memory.total,driver_version,uuid,pci.bus_id"
OLD_QUERY = "--query-gpu=index,name,memory.total,driver_version,uuid,pci.bus_id"


def install_nvidia_smi(bindir: Path, fixture: str) -> Path:
    """Write `bindir/nvidia-smi`, which answers the query aoe.accelerators asks with the
    fixture's lines (or, for old-driver.txt, refuses `compute_cap` as such drivers do)
    and fails like nvidia-smi on anything else. Returns its path."""
    bindir.mkdir(parents=True, exist_ok=True)
    text = (FIXTURES / fixture).read_text()
    if fixture == "old-driver.txt":
        refusal, _, answer = text.partition("\n\n")
        body = (
            f"if [ \"$1\" = {shlex.quote(QUERY)} ]; then printf '%s\\n' {shlex.quote(refusal)}; exit 2; fi\n"
            f"if [ \"$1\" = {shlex.quote(OLD_QUERY)} ]; then printf '%s' {shlex.quote(answer)}; exit 0; fi\n"
        )
    else:
        body = f"if [ \"$1\" = {shlex.quote(QUERY)} ]; then printf '%s' {shlex.quote(text)}; exit 0; fi\n"
    exe = bindir / "nvidia-smi"
    exe.write_text(
        "#!/bin/sh\n" + body + 'echo "Invalid combination of input arguments: $*" >&2\nexit 2\n'
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def path_with(bindir: Path) -> str:
    """PATH with `bindir` first (and this interpreter's folder, for child processes)."""
    return os.pathsep.join(
        [str(bindir), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )

"""The shape of the code: the layering import-linter holds (the contracts in
pyproject.toml: the client never imports the daemon but through aoed.embedded, backends
and the engine never import the service's parts, private modules stay private, protobuf
stops at the edges, no cycles between the daemon's packages), ruff's lint, mypy's types,
and names spelled in one place."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"aoe": ROOT / "client" / "aoe", "aoed": ROOT / "daemon" / "aoed"}
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: it is in the test extra (pip install -e '.[test]')")
    return str(path)


def _modules() -> dict[str, Path]:
    out = {}
    for base in SOURCES.values():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base.parent).with_suffix("")
            parts = list(rel.parts)
            if "v1" in parts[:2]:  # generated protobuf code
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def test_the_import_contracts_hold() -> None:
    """lint-imports checks every contract in pyproject.toml's [tool.importlinter]."""
    done = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout, done.stdout[-2000:]


def test_the_import_contracts_see_a_broken_layer(tmp_path: Path) -> None:
    """The contracts catch what they are for: a copy of the tree where the light client
    imports the engine breaks the first one."""
    copy = tmp_path / "tree"
    for name in ("client", "daemon"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    figures = copy / "client" / "aoe" / "figures.py"
    figures.write_text(
        figures.read_text() + "\n\ndef _leak():\n    import aoed.engine.engine  # noqa: F401\n"
    )
    env = {"PYTHONPATH": f"{copy / 'client'}:{copy / 'daemon'}", "PATH": str(BIN)}
    done = subprocess.run(
        [_tool("lint-imports"), "--no-cache"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    assert "aoe.figures -> aoed.engine.engine" in done.stdout, done.stdout[-4000:]


def test_ruff_finds_nothing() -> None:
    """ruff check over the tree, with the rules pyproject.toml selects."""
    done = subprocess.run(
        [_tool("ruff"), "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    """mypy over the packages, with pyproject.toml's [tool.mypy] settings. Incremental,
    in the tree's .mypy_cache as `make lint` leaves it: mypy checks again what changed
    since (by each file's hash), and a run after `make lint` takes seconds, not half a
    minute."""
    done = subprocess.run(
        [_tool("mypy")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_provider_names_live_in_one_place() -> None:
    """Execution provider names are spelled in aoe.device (and the backends' docs)."""
    spelled = []
    for name, path in _modules().items():
        if name in ("aoe.device",) or name.startswith("aoed.backends"):
            continue
        text = path.read_text()
        if 'ExecutionProvider"' in text or "ExecutionProvider'" in text:
            spelled.append(name)
    assert not spelled, spelled


#: The runtime seam (aoed.engine.runtime): only backends import a runtime or name a
#: backend's modules, and aoed.backends.runtimes picks one by name. The light client's
#: own side of ONNX Runtime stays: opening a tuned model for users (`aoe.session`, with
#: the session options aoe.sessionopts rebuilds) and listing the providers a machine's
#: devices can use (aoe.accelerators, which `aoe devices` shows and the runtime's
#: `devices()` returns); OpenVINO's side is opening an IR with its checked compile config
#: (aoe.ovartifact) and finding its devices (aoe.ovdevices, which `aoe devices`, the
#: daemon's listing and the backend read). Each is imported lazily, inside the function
#: that needs it.
RUNTIME_CLIENT_SIDE = frozenset(
    {"aoe", "aoe.sessionopts", "aoe.accelerators", "aoe.ovartifact", "aoe.ovdevices"}
)
RUNTIME_PACKAGES = ("onnxruntime", "openvino", "nncf")
BACKEND_MODULES = ("aoed.backends.ort", "aoed.backends.openvino")


def _runtime_names(source: str) -> list[str]:
    """Where `source` imports a runtime or a backend's module, or names a backend's module
    in a string (a module a child runs, a docstring's dotted name): `line: what` each."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [m for m in BACKEND_MODULES if m in node.value]
        for name in names:
            if name.split(".")[0] in RUNTIME_PACKAGES or name.startswith(BACKEND_MODULES):
                found.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_only_backends_name_a_runtime() -> None:
    """Outside aoed.backends (which holds aoed.backends.runtimes), no module imports
    onnxruntime or names the ONNX Runtime backend's modules: the engine reaches its
    runtime through aoed.engine.runtime.Runtime. The light client's side is listed."""
    leaks = {}
    for name, path in _modules().items():
        if name.startswith("aoed.backends") or name in RUNTIME_CLIENT_SIDE:
            continue
        if found := _runtime_names(path.read_text()):
            leaks[name] = found
    assert not leaks, leaks


def test_the_runtime_check_sees_a_leak() -> None:
    """The check catches each way in: a module a child runs, an import, a lazy import."""
    planted = (
        'RUNNER = "aoed.backends.ort.runner"\n'
        "from aoed.backends.ort import catalog\n"
        "def f():\n    import onnxruntime as ort\n"
        "from aoed.backends.openvino.build import build\n"
    )
    assert _runtime_names(planted) == [
        "1: aoed.backends.ort",
        "2: aoed.backends.ort",
        "2: aoed.backends.ort.catalog",
        "4: onnxruntime",
        "5: aoed.backends.openvino.build",
        "5: aoed.backends.openvino.build.build",
    ]


def test_the_tree_is_formatted_as_ruff_formats_it() -> None:
    """ruff format --check: one layout everywhere, so a diff shows what changed."""
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

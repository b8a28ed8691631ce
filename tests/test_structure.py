"""The shape of the code: imports between packages form no cycles, the light client never
reaches into the daemon, and protobuf stays at the edges."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"aoe": ROOT / "client" / "aoe", "aoed": ROOT / "daemon" / "aoed"}
#: Entry points of the `aoe` command and the whole-model compile: allowed to load aoed.
CLIENT_APPS = {"aoe.cli", "aoe.bankcli", "aoe.compile"}


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


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere (functions included, TYPE_CHECKING not)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def resolve(mod: str) -> str | None:
        while mod and mod not in known:
            mod = mod.rsplit(".", 1)[0] if "." in mod else ""
        return mod or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (m := resolve(alias.name)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                if (m := resolve(target)) is not None:
                    found.add(m)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def _package(module: str, modules: dict[str, Path]) -> str:
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(p, m, known) for m, p in modules.items()}, modules


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_walk_sees_the_imports() -> None:
    graph, _ = _graph()
    assert "aoed.engine.registry" in graph["aoed.backends.ort.strategies"]
    assert "aoed.engine.pipeline" in graph["aoed.engine.engine"]
    assert "aoed.compile" in graph["aoe.compile"]  # an import inside a function counts


def test_no_import_cycle_spans_two_packages() -> None:
    graph, modules = _graph()
    bad = []
    for comp in _strongly_connected(graph):
        packages = {_package(m, modules) for m in comp}
        if len(packages) > 1:
            bad.append(sorted(comp))
    assert not bad, f"import cycles across packages: {bad}"


def test_the_daemon_packages_form_a_layered_whole() -> None:
    """Between aoed's packages imports go one way: bank <- engine <- backends <- apps."""
    graph, modules = _graph()
    pkg_graph: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if not m.startswith("aoed"):
            continue
        src = _package(m, modules)
        for d in deps:
            if d.startswith("aoed"):
                dst = _package(d, modules)
                if dst != src and dst != "aoed" and src != "aoed":
                    pkg_graph.setdefault(src, set()).add(dst)
    cycles = [sorted(c) for c in _strongly_connected(pkg_graph) if len(c) > 1]
    assert not cycles, f"package cycles: {cycles}"
    assert "aoed.backends.ort" not in pkg_graph.get("aoed.engine", set())
    assert "aoed.engine" not in pkg_graph.get("aoed.bank", set())


def test_the_light_client_never_imports_the_daemon() -> None:
    graph, _ = _graph()
    light = [m for m in graph if m.split(".")[0] == "aoe" and m not in CLIENT_APPS]
    leaks = {m: sorted(d for d in graph[m] if d.startswith("aoed")) for m in light}
    assert not {m: d for m, d in leaks.items() if d}


def test_protobuf_stops_at_the_codec() -> None:
    """The daemon's engine speaks its own dataclasses: generated protobuf code is imported
    only by the bank codec (and, later, the api package)."""
    graph, _ = _graph()
    users = sorted(m for m, deps in graph.items() if m.startswith("aoed") and any(d.startswith("aoe.v1") for d in deps))
    assert set(users) <= {"aoed.bank._codec", "aoed.bank.exchange"} | {m for m in users if m.startswith("aoed.api")}


def test_provider_names_live_in_one_place() -> None:
    """Execution provider names are spelled in aoe.device (and the backends' docs)."""
    spelled = []
    for name, path in _modules().items():
        if name in ("aoe.device",) or name.startswith("aoed.backends"):
            continue
        text = path.read_text()
        if "ExecutionProvider\"" in text or "ExecutionProvider'" in text:
            spelled.append(name)
    assert not spelled, spelled

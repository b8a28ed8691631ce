"""Who may use the Ray cluster the engine drives (aoed.engine.rayauth; deploy/README.md,
"Measuring on a Ray cluster"): the settings and the token file, and the README's `ray`
commands (fast, no Ray needed); then, on a head started with those commands (`make
test-cluster`), that a caller without the token runs nothing, and that the engine
refuses a head that asks no token or refuses its own. tests/test_cluster.py tunes on such
a cluster with the token."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aoe.config import CLUSTER_EXTRA, load_config
from aoe.errors import OptionError, PermissionDeniedError
from aoed import samples
from aoed.config import load_daemon_config
from aoed.engine.rayauth import MIN_TOKEN_CHARS, read_token
from tests.conftest import run_aoe
from tests.ray_util import AUTH_VARS, RayCluster, readme_commands, readme_section


def _token(path: Path, mode: int = 0o600, text: str | None = None) -> Path:
    path.write_text((secrets.token_hex(32) if text is None else text) + "\n")
    path.chmod(mode)
    return path


def _problems(load, path: Path) -> list[str]:
    """The problems loading `path` finds, but for the cluster extra's absence (`make
    test` runs without ray)."""
    try:
        load(path, env={})
    except OptionError as exc:
        return [p for p in exc.problems if CLUSTER_EXTRA not in p]
    return []


def _ray_config(tmp_path: Path, cluster: str) -> Path:
    path = tmp_path / "aoed.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[cluster]\nexecutor = "ray"\naddress = "10.0.0.1:6379"\n{cluster}'
    )
    return path


def test_the_ray_executor_needs_a_token_file_or_an_explicit_opt_out(tmp_path: Path) -> None:
    token = _token(tmp_path / "token")
    (problem,) = _problems(load_config, _ray_config(tmp_path, ""))
    assert "needs [cluster] token_file" in problem and "allow_unauthenticated" in problem
    assert _problems(load_config, _ray_config(tmp_path, f'token_file = "{token}"\n')) == []
    assert _problems(load_config, _ray_config(tmp_path, "allow_unauthenticated = true\n")) == []
    problems = _problems(load_config, _ray_config(tmp_path, 'token_file = "token"\n'))
    assert any(
        "[cluster] token_file = 'token': expected the token file's absolute path" in p
        for p in problems
    )
    # "auto" reads the head's address from a file under /tmp/ray that anyone may write.
    path = _ray_config(tmp_path, f'token_file = "{token}"\n')
    path.write_text(path.read_text().replace('"10.0.0.1:6379"', '"auto"'))
    (problem,) = _problems(load_config, path)
    assert 'address="auto"' in problem and "name the head's HOST:PORT" in problem


def _token_config(tmp_path: Path, token: Path) -> Path:
    """A daemon's configuration that names `token` (checked whenever it is named: so
    with the local executor too, which needs no ray)."""
    path = tmp_path / "aoed.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[cluster]\ntoken_file = "{token}"\n'
    )
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_anyone_else_may_use_is_refused(tmp_path: Path, mode: int) -> None:
    token = _token(tmp_path / "token", mode)
    with pytest.raises(OptionError) as info:
        load_daemon_config(_token_config(tmp_path, token), env={})
    (problem,) = info.value.problems
    assert f"[cluster] token_file {token}: mode {mode:04o} lets other users at it" in problem
    assert f"chmod 600 {token}" in problem
    token.chmod(0o600)
    load_daemon_config(_token_config(tmp_path, token), env={})


def test_a_token_file_is_read_whole_and_only_if_it_holds_one_long_word(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    assert read_token(_token(tmp_path / "good", text=f"  {token}\n\n")) == token
    cases = {
        "missing": (tmp_path / "missing", "cannot read it: No such file or directory"),
        "empty": (_token(tmp_path / "empty", text=""), "empty; write the cluster's token"),
        "short": (_token(tmp_path / "short", text="hunter2"), "a token of 7 characters"),
        "words": (_token(tmp_path / "words", text=f"{token} {token}"), "expected one word"),
        "dir": (tmp_path, "not a regular file"),
    }
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    cases["fifo"] = (fifo, "not a regular file")  # opened without blocking, then refused
    for name, (path, why) in cases.items():
        with pytest.raises(OptionError) as info:
            read_token(path)
        assert str(info.value).startswith(f"[cluster] token_file {path}: "), name
        assert why in str(info.value), (name, str(info.value))
    assert MIN_TOKEN_CHARS >= 32


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    token = _token(tmp_path / "token")
    os.chown(token, 65534, 65534)
    with pytest.raises(OptionError) as info:
        load_daemon_config(_token_config(tmp_path, token), env={})
    (problem,) = info.value.problems
    assert f"token_file {token}: belongs to uid 65534, not to the user reading it" in problem


def test_the_readme_starts_every_node_with_the_token_on_a_named_address() -> None:
    """deploy/README.md's `ray` commands, as a reader would copy them: the cluster tests
    start their clusters with these (tests/ray_util.py), so this and they cannot drift."""
    section = readme_section()
    commands = readme_commands()
    starts = [c for c in commands if c.verb == "start"]
    (head,) = [c for c in starts if "--head" in c.flags]
    nodes = [c for c in starts if "--head" not in c.flags]
    assert nodes and any(c.verb == "status" for c in commands), commands
    (token_path,) = re.findall(r'token_file = "([^"]+)"', section)
    # The token's file: made 0600 for aoed before the token goes in, written by aoed.
    assert f"install -o aoed -g aoed -m 0600 /dev/null {token_path}" in section
    assert f"sudo -u aoed tee {token_path}" in section
    (sessions,) = re.findall(r"install -d -o aoed -g aoed -m 0700 (\S+)", section)
    for cmd in commands:
        assert cmd.user == "aoed", cmd
        # The token's path, never the token, and token mode on every node.
        assert cmd.env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}, cmd
    for cmd in starts:
        address = cmd.flags.get("--node-ip-address")
        assert address and not ipaddress.ip_address(address).is_unspecified, cmd
        temp = cmd.flags.get("--temp-dir") or ""
        assert temp.startswith(sessions + "/"), cmd  # Ray's 0777 folders, in a 0700 one
        assert cmd.flags.get("--dashboard-host") in (None, "127.0.0.1", "localhost", "::1"), cmd
    assert head.flags.get("--include-dashboard") == "false", head
    for cmd in nodes:
        assert cmd.flags["--address"] == f"{head.flags['--node-ip-address']}:{head.flags['--port']}"


# -- on a head started as the README says ------------------------------------------------


@pytest.fixture(scope="module")
def secured():
    """A head started with the README's command and a token, one device on it."""
    pytest.importorskip("ray", reason="needs the cluster extra (make test-cluster)")
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets live there
    cluster = RayCluster(root, _token(root / "token"))
    try:
        cluster.start_head(num_cpus=2, resources='{"aoe_device_cpu0": 1}')
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


#: A caller's code: a task that writes a file, as a local user outside every group would.
_CALLER = """
import sys
import ray

ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote
def write(path):
    with open(path, "w") as f:
        f.write("ran")

ray.get(write.remote(sys.argv[2]), timeout=120)
"""


def _call(cluster: RayCluster, marker: Path, home: Path, **auth: str):
    """Run _CALLER against `cluster`, with only the RAY_AUTH_* variables in `auth` and a
    home without Ray's default token file."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env |= {"HOME": str(home), **auth}
    env["RAY_gcs_rpc_server_connect_timeout_s"] = "5"  # a refused caller gives up sooner
    return subprocess.run(
        [sys.executable, "-c", _CALLER, cluster.address, str(marker)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.cluster
def test_a_caller_without_the_token_runs_nothing(secured: RayCluster, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    marker = tmp_path / "marker"
    other = _token(tmp_path / "other")
    for auth in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(other)}):
        run = _call(secured, marker, home, **auth)
        assert run.returncode != 0, (auth, run.stderr[-2000:])
        assert "Unauthenticated" in run.stderr, run.stderr[-2000:]
        assert not marker.exists(), auth
    # The same code with the cluster's token runs: the token alone made the difference.
    assert secured.token_file is not None
    run = _call(
        secured,
        marker,
        home,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(secured.token_file),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert marker.read_text() == "ran"


def _tune(tmp_path: Path, address: str, cluster: str, *args: str):
    """`aoe tune` of the mlp sample, embedded, on the Ray cluster at `address`, with the
    `[cluster]` settings in `cluster`."""
    model = tmp_path / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    config = tmp_path / "aoe.toml"
    config.write_text(f"[cluster]\n{cluster}")
    return run_aoe(
        "tune",
        str(model),
        *("--executor", "ray", "--ray-address", address, "--device", "cpu:0", *args),
        *("--bank", str(tmp_path / "bank"), "--output", str(tmp_path / "out"), "--no-progress"),
        env={"AOED_RUNTIME_DIR": str(tmp_path / "run"), "AOED_CONFIG": str(config)},
        timeout=600,
    )


def _error(run) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("aoe: error:")]
    assert len(errors) == 1, run.stderr
    return errors[0]


@pytest.mark.cluster
def test_the_engine_refuses_a_head_that_refuses_its_token(
    secured: RayCluster, tmp_path: Path
) -> None:
    other = _token(tmp_path / "other")
    run = _tune(tmp_path, secured.address, f'token_file = "{other}"\n')
    assert run.returncode == PermissionDeniedError.exit_code, run.stderr
    assert f"the Ray head refuses the token in [cluster] token_file {other}" in _error(run)


@pytest.mark.cluster
def test_a_head_that_asks_no_token_is_used_only_when_the_config_says_so(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs the cluster extra (make test-cluster)")
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cluster = RayCluster(root, None)  # RAY_AUTH_MODE=disabled
    try:
        cluster.start_head(num_cpus=2, resources='{"aoe_device_cpu0": 1}')
        token = _token(tmp_path / "token")
        run = _tune(tmp_path, cluster.address, f'token_file = "{token}"\n')
        assert run.returncode == PermissionDeniedError.exit_code, run.stderr
        assert "the Ray head there asks no token, so anyone who can reach" in _error(run)
        # Said in the configuration: used, and said at the start of the run.
        run = _tune(
            tmp_path,
            cluster.address,
            "allow_unauthenticated = true\n",
            *("--budget", "4", "--parallel", "1"),
        )
        assert run.returncode == 0, run.stderr
        assert "asks no token ([cluster] allow_unauthenticated = true)" in run.stderr
        assert list((tmp_path / "out").glob("aoe_result_*.json"))
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)

"""Which unix socket a client talks to (aoe.sockets) and where the daemon makes its own:
a socket another user planted where a user's own daemon would be gets nothing; a socket
this user may not reach is one line naming the group to ask for; the daemon makes its
temp runtime folder 0700 and refuses one someone else made.

The real attacker and victim are other uids (65534 nobody, and 65533), run from here
through setpriv, so most tests need root. Where /run/aoed exists on this machine (a
system daemon, or a root run of the engine), the victim runs in a mount namespace of its
own with an empty /run, as on a machine without the service, so that it falls back to
the temp folder.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from aoe.errors import DaemonUnavailableError, OptionError, PermissionDeniedError
from aoe.sockets import check_socket
from aoed import samples
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = 65534  # nobody / nogroup
VICTIM = 65533  # a user of no group but its own (it need not have a name)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other users needs root")


def _pythonpath() -> str:
    return os.pathsep.join(
        [str(Path(grpc.__file__).parents[1]), str(ROOT / "client"), str(ROOT / "daemon")]
    )


_PYTHON: list[str] = []


def _python() -> str:
    """An interpreter another user may run with our packages: ours, or, when ours sits
    where other users cannot reach it, the system's of the same minor version."""
    if _PYTHON:
        return _PYTHON[0]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        probe = subprocess.run(
            ["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups"]
            + [python, "-c", "import aoe.cli, grpc"],
            env={"PATH": os.defpath, "PYTHONPATH": _pythonpath()},
            cwd="/",
            capture_output=True,
            timeout=120,
        )
        if probe.returncode == 0:
            _PYTHON.append(python)
            return python
    pytest.skip(f"no python that uid {VICTIM} may run and import aoe with")


def _as(uid: int, argv: list[str], env: dict[str, str], gid: int | None = None) -> list[str]:
    """The command line that runs `argv` as `uid`:`gid` (no other groups), with an
    empty /run where /run/aoed exists here."""
    gid = uid if gid is None else gid
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
    if Path("/run/aoed").exists():
        cmd = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /run && exec "$@"',
            "sh",
            *cmd,
        ]
    return cmd


def _aoe(uid: int, args: list[str], env: dict[str, str], gid: int | None = None):
    r = subprocess.run(
        _as(uid, [_python(), "-m", "aoe.cli", *args], env, gid),
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "unshare failed" in r.stderr or "mount: " in r.stderr:
        pytest.skip(
            f"a private mount namespace, to hide /run/aoed, is not allowed here: {r.stderr}"
        )
    return r


@pytest.fixture
def tmpdir_like_tmp() -> Iterator[Path]:
    """A folder made like /tmp (root's, 1777), standing for the temp folder of the users
    run from here (TMPDIR), with a home for the victim in it."""
    base = Path(tempfile.mkdtemp(prefix="aoed-tmp-", dir="/tmp"))
    os.chmod(base, 0o1777)
    home = base / "home"
    home.mkdir()
    os.chown(home, VICTIM, VICTIM)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _env(base: Path) -> dict[str, str]:
    return {
        "PATH": os.defpath,
        "PYTHONPATH": _pythonpath(),
        "HOME": str(base / "home"),
        "TMPDIR": str(base),
    }


def _listen(path: Path) -> socket.socket:
    """A plain listening unix socket at `path`: whoever connects is seen by accept()."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def _nobody_connected(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


# ------------------------------------------------------------ a socket another user planted


@needs_root
def test_a_socket_another_user_made_in_the_temp_folder_gets_nothing(
    tmpdir_like_tmp: Path,
) -> None:
    base = tmpdir_like_tmp
    env = _env(base)
    model = base / "home" / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    os.chown(model, VICTIM, VICTIM)
    # The attacker makes the victim's fallback folder first, with a socket that listens.
    planted = base / f"aoed-{VICTIM}"
    planted.mkdir()
    sock = planted / "aoed.sock"
    listener = _listen(sock)
    try:
        os.chmod(sock, 0o666)
        os.chown(sock, ATTACKER, ATTACKER)
        os.chown(planted, ATTACKER, ATTACKER)
        os.chmod(planted, 0o755)
        why = (
            f"refusing the daemon socket {sock}: {planted} belongs to uid {ATTACKER} (nobody) "
            f"and is in {base}, where anyone may make it."
        )
        for args in (
            ["tune", str(model), "--output", str(base / "home" / "out")],
            ["jobs"],
            ["daemon"],
            ["jobs", "--socket", str(sock)],
        ):
            r = _aoe(VICTIM, args, env)
            assert r.returncode == PermissionDeniedError.exit_code, (args, r.stderr)
            assert r.stderr.startswith(f"aoe: error: {why}"), (args, r.stderr)
            assert len(r.stderr.splitlines()) == 1, r.stderr
            assert _nobody_connected(listener), f"aoe {' '.join(args)} reached the planted socket"
        assert not list(base.glob("home/out/**/*.onnx")), (
            "nothing tuned from the attacker's answers"
        )

        # The same folder and socket, the victim's own: the client dials it (the plain
        # listener then drops it, so the client says no daemon answers).
        os.chown(planted, VICTIM, VICTIM)
        os.chmod(planted, 0o700)
        os.chown(sock, VICTIM, VICTIM)
        listener.setblocking(True)
        listener.settimeout(120)
        client = subprocess.Popen(
            _as(VICTIM, [_python(), "-m", "aoe.cli", "jobs"], env),
            env=env,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = listener.accept()
            conn.close()
            listener.close()
            _, err = client.communicate(timeout=120)
        finally:
            if client.poll() is None:
                client.kill()
                client.communicate()
        assert client.returncode == DaemonUnavailableError.exit_code, err
    finally:
        listener.close()


# ------------------------------------------------------------ a socket this user may not reach


@needs_root
def test_a_socket_behind_a_group_this_user_is_not_in_is_one_line_naming_the_group(
    tmpdir_like_tmp: Path,
) -> None:
    base = tmpdir_like_tmp
    model = base / "home" / "mlp.onnx"
    samples.save(samples.build("mlp"), model)
    os.chown(model, VICTIM, VICTIM)
    # As deploy/ makes /run/aoed: root's (here), 0750, of the service's group.
    run = base / "run-aoed"
    run.mkdir()
    os.chown(run, 0, ATTACKER)
    os.chmod(run, 0o750)
    sock = run / "aoed.sock"
    listener = _listen(sock)
    try:
        os.chown(sock, 0, ATTACKER)
        os.chmod(sock, 0o660)
        # Found by default (AOED_SOCKET, as /run/aoed/aoed.sock is) or named.
        env = {**_env(base), "AOED_SOCKET": str(sock)}
        denied = f"aoe: error: cannot reach the daemon at {sock}: permission denied"
        ask, out = "ask to be added to group nogroup", str(base / "home" / "out")
        for args, hint in (
            (["tune", str(model), "--output", out], f"({ask}, or use --local)"),
            (
                ["tune", str(model), "--output", out, "--socket", str(sock)],
                f"({ask}, or use --local)",
            ),
            (["jobs"], f"({ask})"),
            (["daemon", "--socket", str(sock)], f"({ask})"),
        ):
            r = _aoe(VICTIM, args, env)
            assert r.returncode == PermissionDeniedError.exit_code, (args, r.stderr)
            assert r.stderr == f"{denied} {hint}\n", (args, r.stderr)
        # The folder open to all, the socket still the group's: the same, for the socket.
        os.chmod(run, 0o755)
        r = _aoe(VICTIM, ["jobs"], env)
        assert r.stderr == f"{denied} (ask to be added to group nogroup)\n", r.stderr
        assert _nobody_connected(listener)
    finally:
        listener.close()


# ------------------------------------------------------------ the daemon's temp runtime folder


def _aoed(env: dict[str, str]) -> list[str]:
    return _as(VICTIM, [_python(), "-m", "aoed", "--log-level", "info"], env)


@needs_root
def test_the_daemon_refuses_a_temp_runtime_folder_someone_else_made(
    tmpdir_like_tmp: Path,
) -> None:
    base = tmpdir_like_tmp
    env = _env(base)
    folder = base / f"aoed-{VICTIM}"
    folder.mkdir()
    for owner, mode, why in (
        (ATTACKER, 0o700, f"belongs to uid {ATTACKER}, not to this daemon's user (uid {VICTIM})"),
        (VICTIM, 0o777, "mode 0777 lets others write in it"),
    ):
        os.chown(folder, owner, owner)
        os.chmod(folder, mode)
        r = subprocess.run(
            _aoed(env), env=env, cwd="/", capture_output=True, text=True, timeout=300
        )
        assert r.returncode == PermissionDeniedError.exit_code, r.stderr
        assert f"aoed: error: runtime folder {folder}: {why}" in r.stderr, r.stderr
        assert not (folder / "aoed.sock").exists()


@needs_root
def test_the_daemon_makes_its_temp_runtime_folder_0700(tmpdir_like_tmp: Path) -> None:
    base = tmpdir_like_tmp
    env = _env(base)
    folder = base / f"aoed-{VICTIM}"
    log = open(base / "aoed.log", "w")
    daemon = subprocess.Popen(_aoed(env), env=env, cwd="/", stdout=log, stderr=log)
    log.close()
    try:
        # Made before anything else of the daemon's starts (whether the rest can start
        # as this user on this machine does not matter here).
        wait_for(
            lambda: folder.exists() or daemon.poll() is not None,
            180,
            "the daemon making its temp runtime folder",
        )
        st = folder.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (VICTIM, 0o700), (
            base / "aoed.log"
        ).read_text()
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


# ------------------------------------------------------------ the rule, path by path


@needs_root
def test_the_rule_walks_every_folder_and_link_on_the_way(tmp_path: Path) -> None:
    # A folder of another user, in a folder only root writes, is that user's daemon's:
    # trusted, as /run/aoed made by root for the aoed user.
    service = tmp_path / "service"
    service.mkdir()
    good = service / "aoed.sock"
    listeners = [_listen(good)]
    try:
        os.chown(good, ATTACKER, ATTACKER)
        os.chown(service, ATTACKER, ATTACKER)
        os.chmod(service, 0o750)
        assert check_socket(good) is True
        # Nothing there: no daemon, and nothing refused.
        assert check_socket(service / "none.sock") is False
        # A folder anyone may write (not sticky): whoever made the socket is not known.
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)
        listeners.append(_listen(shared / "aoed.sock"))
        with pytest.raises(
            PermissionDeniedError, match=r"shared may be written by others \(mode 0777\)"
        ):
            check_socket(shared / "aoed.sock")
        # A link to the good socket, planted by another user in a sticky folder.
        sticky = tmp_path / "sticky"
        sticky.mkdir()
        os.chmod(sticky, 0o1777)
        link = sticky / "aoed.sock"
        link.symlink_to(good)
        os.lchown(link, ATTACKER, ATTACKER)
        with pytest.raises(PermissionDeniedError, match=r"sticky/aoed.sock belongs to uid 65534"):
            check_socket(link)
        os.lchown(link, 0, 0)  # the same link, root's: followed, to the good socket
        assert check_socket(link) is True
        # A socket of another user in a folder of root's: not the folder owner's daemon.
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o700)
        listeners.append(_listen(mine / "aoed.sock"))
        os.chown(mine / "aoed.sock", ATTACKER, ATTACKER)
        with pytest.raises(PermissionDeniedError, match="it belongs to uid 65534"):
            check_socket(mine / "aoed.sock")
        # Not a socket at all.
        (mine / "file").write_text("")
        with pytest.raises(DaemonUnavailableError, match="is not a socket"):
            check_socket(mine / "file")
    finally:
        for s in listeners:
            s.close()


def test_the_daemon_will_not_listen_where_its_clients_would_refuse_the_socket(
    tmp_path: Path,
) -> None:
    from aoed.api.server import build_server
    from aoed.config import load_daemon_config

    shared = Path(tempfile.mkdtemp(prefix="aoed-sh-", dir="/tmp"))
    try:
        os.chmod(shared, 0o777)
        config = tmp_path / "aoed.toml"
        config.write_text(f'[listen]\nsocket = "{shared}/aoed.sock"\n')
        with pytest.raises(
            OptionError, match=r"its folder .* may be written by others \(mode 0777\)"
        ):
            build_server(load_daemon_config(config, env={}), lambda server: None)
        assert not (shared / "aoed.sock").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)

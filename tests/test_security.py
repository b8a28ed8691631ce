"""What SECURITY.md promises, each checked against the real thing: who can reach the
daemon (the socket's group; TLS and mutual TLS on TCP), what a client can make it read or
write (paths confined to the allowed directories, symlinks and `..` included), that
nothing a client sends is unpickled or evaluated, and that a bank import is checked whole
before anything is written.

The daemon tests run a real `aoed` (tests/daemon_util.py); the socket test switches to
uid/gid 65534 (nobody/nogroup) and so needs root; the TLS tests need the openssl command.
"""

from __future__ import annotations

import ast
import grp
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from aoe.bank import open_bank
from aoe.errors import OptionError
from aoe.exchange import record_to_json
from aoe.signature import TensorInfo
from aoe.v1 import bank_pb2, daemon_pb2, daemon_pb2_grpc, tuning_pb2
from aoed import samples
from aoed.engine.calibration import load_samples
from tests.conftest import run_aoe
from tests.daemon_util import DaemonProcess, upload
from tests.helpers import wait_for
from tests.inotify import Inotify

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534  # nobody / nogroup
OTHER_GID = 65533  # a group nobody is not in (it need not have a name)

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the unix socket

# Runs as another user: a health check on the socket, printing SERVING or the error.
_HEALTH_CLIENT = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
        print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
"""


def _run_as(
    python: str,
    argv: list[str],
    uid: int = NOBODY,
    gid: int = NOBODY,
    groups: tuple[int, ...] = (),
    pythonpath: str = "",
):
    """Run `python argv` as `uid`:`gid` with supplementary `groups`, seeing our grpc
    (and `pythonpath`)."""
    env = {"PATH": os.defpath, "PYTHONPATH": pythonpath or str(Path(grpc.__file__).parents[1])}
    return subprocess.run(
        [python, *argv],
        user=uid,
        group=gid,
        extra_groups=list(groups),
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def _python_for_nobody() -> str | None:
    """An interpreter that uid 65534 can run and import grpc with: ours, or, when ours
    sits where that user cannot reach (a venv over a python under /root), the system's
    python of the same version, given our site-packages."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if not os.access(python, os.F_OK):
            continue
        try:
            probe = _run_as(
                python, ["-c", "import sys, grpc, grpc_health; print(sys.version_info[:2])"]
            )
        except PermissionError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            return python
    return None


def _health_as(target: str, python: str, uid: int, gid: int, groups: tuple[int, ...] = ()) -> str:
    """What the health client prints when run as `uid`:`gid` with supplementary `groups`."""
    r = _run_as(python, ["-c", _HEALTH_CLIENT, target], uid, gid, groups)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another user needs root")
def test_only_the_socket_group_can_connect(tmp_path: Path) -> None:
    try:
        group = grp.getgrgid(NOBODY).gr_name
    except KeyError:
        pytest.skip(f"no group with gid {NOBODY} on this machine")
    python = _python_for_nobody()
    if python is None:
        pytest.skip(f"no python that uid {NOBODY} may run and import grpc with")
    d = DaemonProcess(
        tmp_path / "d", listen_toml=f'socket_mode = "0660"\nsocket_group = "{group}"\n'
    )
    os.chmod(d.socket.parent, 0o755)  # mkdtemp made it 0700: let the other users reach the socket
    try:
        d.start()
        st = os.stat(d.socket)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, NOBODY)
        # In the socket's group (as primary or supplementary group): served.
        assert _health_as(d.target, python, NOBODY, NOBODY) == "SERVING"
        assert _health_as(d.target, python, OTHER_GID, OTHER_GID, (NOBODY,)) == "SERVING"
        # The same user outside the group is refused by the kernel, before gRPC.
        refused = _health_as(d.target, python, NOBODY, OTHER_GID)
        assert refused.startswith("UNAVAILABLE") and "permission denied" in refused.lower(), refused
        # Regrouped by hand, the socket shuts out the user it served a moment ago.
        os.chown(d.socket, -1, 0)
        refused = _health_as(d.target, python, NOBODY, NOBODY)
        assert refused.startswith("UNAVAILABLE") and "permission denied" in refused.lower(), refused
        assert d.serving(), "the owner still gets in"
    finally:
        d.close()


_BIND_AS_NOBODY = """
import sys
from aoe.errors import OptionError
from aoed.api.server import build_server
from aoed.config import load_daemon_config
try:
    build_server(load_daemon_config(sys.argv[1], env={}), lambda server: None)
    print("bound")
except OptionError as exc:
    print(exc)
"""


@pytest.mark.skipif(
    os.geteuid() != 0, reason="running the daemon's bind as another user needs root"
)
def test_a_socket_group_the_daemon_is_not_in_is_a_clear_error(tmp_path: Path) -> None:
    python = _python_for_nobody()
    if python is None:
        pytest.skip(f"no python that uid {NOBODY} may run and import grpc with")
    home = Path(tempfile.mkdtemp(prefix="aoed-sg-", dir="/tmp"))
    try:
        os.chown(home, NOBODY, NOBODY)
        config = home / "aoed.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{home}/state"\n[engine]\nruntime_dir = "{home}/run"\n'
            f'[listen]\nsocket = "{home}/aoed.sock"\nsocket_group = "root"\n'
        )
        path = os.pathsep.join(
            [str(Path(grpc.__file__).parents[1]), str(ROOT / "client"), str(ROOT / "daemon")]
        )
        r = _run_as(python, ["-c", _BIND_AS_NOBODY, str(config)], pythonpath=path)
        assert r.returncode == 0, r.stderr
        assert (
            "socket_group 'root': cannot give the socket" in r.stdout
            and "must be a member" in r.stdout
        ), r.stdout
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------- the device lock

# Runs as another user: opens the lock file read-only and tries to hold it, then tries to
# create a file beside it; prints what each attempt met.
_HOLD_THE_DEVICE = """
import errno, fcntl, os, sys
lock = sys.argv[1]
try:
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("held")
except OSError as exc:
    print(errno.errorcode[exc.errno])
try:
    os.close(os.open(os.path.join(os.path.dirname(lock), "planted"), os.O_WRONLY | os.O_CREAT, 0o666))
    print("planted")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


def _plain_python_for_nobody() -> str | None:
    """Any python uid 65534 can run (the script needs nothing but the standard library)."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if (
                subprocess.run(
                    [python, "-c", "pass"],
                    user=NOBODY,
                    group=NOBODY,
                    extra_groups=[],
                    cwd="/",
                    capture_output=True,
                    timeout=60,
                ).returncode
                == 0
            ):
                return python
        except OSError:
            continue
    return None


def _hold_as_nobody(python: str, lock: Path) -> list[str]:
    r = _as_nobody(python, _HOLD_THE_DEVICE, lock)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
async def test_another_user_can_neither_hold_the_device_lock_nor_write_beside_it() -> None:
    from aoed.engine.devlock import DeviceLock

    python = _plain_python_for_nobody()
    if python is None:
        pytest.skip(f"no python that uid {NOBODY} may run")
    base = Path(tempfile.mkdtemp(prefix="aoed-lock-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # like /run: everyone may pass through it
        runtime = base / "aoed"
        lock = DeviceLock(runtime, "cpu")
        async with lock.hold():
            pass
        assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(runtime).st_mode) & 0o022 == 0
        assert _hold_as_nobody(python, lock.path) == ["EACCES", "EACCES"]
        # Even with the folder opened for passing through (as for a socket beside the
        # locks), the file itself is not openable by them.
        os.chmod(runtime, 0o755)
        assert _hold_as_nobody(python, lock.path) == ["EACCES", "EACCES"]
        assert not (runtime / "planted").exists()
        lock.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_cannot_hold_the_bank_writer_lock(tmp_path: Path) -> None:
    """flock takes a read-only descriptor: a writer.lock others may read is one any local
    user could hold, stopping every bank write."""
    from aoed.bank.lock import WriterLock

    python = _plain_python_for_nobody()
    if python is None:
        pytest.skip(f"no python that uid {NOBODY} may run")
    os.chmod(tmp_path, 0o755)
    bank = tmp_path / "bank"
    bank.mkdir(mode=0o755)
    os.chmod(bank, 0o755)  # as a bank made under umask 022 by an earlier version
    (bank / "writer.lock").write_text("")
    os.chmod(bank / "writer.lock", 0o644)
    old = os.umask(0)
    try:
        lock = WriterLock(bank)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(lock.path).st_mode) & 0o007 == 0
        assert _hold_as_nobody(python, lock.path)[0] == "EACCES"
        assert lock.try_acquire()
    finally:
        lock.release()
    fresh = tmp_path / "fresh"
    old = os.umask(0)
    try:
        WriterLock(fresh).release()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(fresh / "writer.lock").st_mode) == 0o640


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
async def test_a_device_lock_open_to_others_is_narrowed_when_ours_and_refused_when_not(
    tmp_path: Path,
) -> None:
    from aoe.errors import DeviceError
    from aoed.engine.devlock import DeviceLock

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o777)
    os.chmod(runtime, 0o777)
    path = runtime / "device-cpu.lock"
    path.write_text("")
    os.chmod(path, 0o644)  # as earlier versions left it
    lock = DeviceLock(runtime, "cpu")
    async with lock.hold():
        pass
    lock.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o755, "nobody else may write beside the locks"
    # Another user's file that anyone may open: not ours to narrow, and not safe to use.
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o666)
    with pytest.raises(DeviceError, match=f"belongs to uid {NOBODY} and any user may open it"):
        async with DeviceLock(runtime, "cpu").hold():
            pass
    # A link planted at the lock's name is not followed.
    path.unlink()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path.symlink_to(victim)
    with pytest.raises(DeviceError, match="symbolic link"):
        async with DeviceLock(runtime, "cpu").hold():
            pass
    assert victim.read_text() == "keep"
    # A folder another user owns could have its locks swapped under us.
    other = tmp_path / "theirs"
    other.mkdir()
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(DeviceError, match=f"belongs to uid {NOBODY}"):
        async with DeviceLock(other, "cpu").hold():
            pass


# ---------------------------------------------------------------- files and folders: who can read what


def _open_to_others(*roots: Path) -> list[str]:
    """Every file or folder under `roots` (themselves included) that users other than
    its owner and group may read, write or enter, with its mode."""
    found = []
    for root in roots:
        for p in [root, *root.rglob("*")]:
            try:
                st = os.lstat(p)
            except FileNotFoundError:  # a claim or scratch file the daemon just removed
                continue
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o007:
                found.append(f"{p} {stat.S_IMODE(st.st_mode):04o}")
    return found


@pytest.mark.slow
def test_a_daemon_started_under_umask_000_leaves_nothing_open_to_other_users(
    tmp_path: Path,
) -> None:
    d = DaemonProcess(tmp_path / "d")
    d.bank.mkdir()
    os.chmod(d.bank, 0o755)  # as a run under umask 022 left it: closed to others at start
    old = os.umask(0)  # the daemon inherits it, as from a careless shell
    try:
        d.start()
    finally:
        os.umask(old)
    try:
        model = d.models / "mlp.onnx"
        samples.save(samples.build("mlp"), model)
        job_id = (
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_id=upload(d.tuning(), model), options=tuning_pb2.JobOptions(budget_s=1.0)
                ),
                timeout=60,
            )
            .job_id
        )
        job = d.wait_job(job_id)
        assert job.state == tuning_pb2.JOB_STATE_SUCCEEDED, job.error
        # One drop too: a claim, then the outbox.
        samples.save(samples.build("mlp"), d.inbox / "dropped.onnx")
        wait_for(
            (d.inbox.parent / "outbox" / "dropped_report.txt").exists,
            240,
            "the drop's report in the outbox (written last)",
            detail=d.log_tail,
        )
        assert (d.inbox.parent / "outbox" / "dropped_tuned.onnx").exists(), d.log_tail()
        state = d.state

        # A claimed drop is the dropper's file, moved (not copied) with its own mode:
        # wait until its delivery removed it.
        def delivered() -> bool:
            try:
                return not any((state / "claimed").rglob("*.onnx"))
            except FileNotFoundError:  # a claim's folder removed while it was listed
                return False  # look again

        wait_for(
            delivered,
            60,
            "the claimed drop removed by its delivery",
            detail=d.log_tail,
        )
        for name in ("jobs.sqlite3", "uploads", "claimed", "jobs"):
            assert (state / name).exists(), name
        assert (d.bank / "data.mdb").exists() and (d.bank / "lock.mdb").exists()
        assert (
            Path(job.result.tuned_model_path).is_file()
            and Path(job.result.result_json_path).is_file()
        )
        assert _open_to_others(state, d.bank, d.inbox.parent / "outbox") == []
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o750
        assert (
            stat.S_IMODE(os.stat(d.bank).st_mode) == 0o750
            and f"{d.bank} was open to other users" in d.log()
        )
        # The runtime folder may be one others pass through (to a socket beside the
        # locks), but they write nothing there and open no lock.
        runtime = Path(d.env().get("AOED_RUNTIME_DIR") or d.runtime)
        assert stat.S_IMODE(os.stat(runtime).st_mode) & 0o022 == 0
        assert stat.S_IMODE(os.stat(runtime / "device-cpu.lock").st_mode) == 0o600
    finally:
        d.close()


# ---------------------------------------------------------------- TCP, TLS and mutual TLS


@pytest.mark.slow
def test_the_daemon_will_not_start_on_plain_tcp_on_a_public_address(tmp_path: Path) -> None:
    port = _free_port()
    d = DaemonProcess(
        tmp_path / "d", listen_toml=f'tcp = "0.0.0.0:{port}"\ninsecure_loopback = true\n'
    )
    try:
        with pytest.raises(RuntimeError, match="aoed exited with 2"):
            d.start(timeout=60)
        assert f"tcp = '0.0.0.0:{port}': TCP on a non-loopback address needs TLS" in d.log(), (
            d.log()
        )
        assert not d.socket.exists(), "it stopped before listening anywhere"
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", port), timeout=5),
        ):
            pass
    finally:
        d.close()


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout",
        key,
        "-out",
        cert,
    )
    return cert, key


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    cert, key, csr, extfile = (
        d / f"{name}.pem",
        d / f"{name}.key",
        d / f"{name}.csr",
        d / f"{name}.ext",
    )
    extfile.write_text(ext)
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        key,
        "-out",
        csr,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca[0],
        "-CAkey",
        ca[1],
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        extfile,
        "-out",
        cert,
    )
    return cert, key


def _info_over_tls(
    port: int, ca: Path, client: tuple[Path, Path] | None
) -> daemon_pb2.GetDaemonInfoResponse:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None,
    )
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        return daemon_pb2_grpc.DaemonServiceStub(ch).GetDaemonInfo(
            daemon_pb2.GetDaemonInfoRequest(), timeout=15
        )


@pytest.mark.slow
@needs_openssl
def test_mutual_tls_serves_only_clients_with_a_certificate_from_the_ca(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = _ca(pki, "clients-ca")
    server = _signed(
        pki,
        "server",
        ca,
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    good = _signed(pki, "good-client", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _signed(pki, "rogue-client", _ca(pki, "other-ca"), "extendedKeyUsage=clientAuth\n")
    port = _free_port()
    d = DaemonProcess(
        tmp_path / "d",
        listen_toml=(
            f'tcp = "127.0.0.1:{port}"\ntls_cert = "{server[0]}"\ntls_key = "{server[1]}"\ntls_client_ca = "{ca[0]}"\n'
        ),
    )
    try:
        d.start()
        info = _info_over_tls(port, ca[0], good)
        assert f"127.0.0.1:{port} (mtls)" in info.listen
        for who, client in (("a certificate from another CA", rogue), ("no certificate", None)):
            with pytest.raises(grpc.RpcError) as err:
                _info_over_tls(port, ca[0], client)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (
                who,
                err.value.code(),
                err.value.details(),
            )
        assert _info_over_tls(port, ca[0], good).pid == d.proc.pid, (
            "refusing others left the good client served"
        )
    finally:
        d.close()


# ---------------------------------------------------------------- daemon-side paths


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """A daemon whose allowed dir is `models/`, holding mlp.onnx, calib/ and out/, and
    `escape`: a symlink to the folder `outside` beside it, which holds the same."""
    d = DaemonProcess(tmp_path_factory.mktemp("security"))
    outside = d.root / "outside"
    for base in (d.models, outside):
        samples.save(samples.build("mlp"), base / "mlp.onnx")
        (base / "calib").mkdir(parents=True)
        np.save(base / "calib" / "s0.npy", np.zeros((1, 256), np.float32))
        (base / "out").mkdir()
    (d.models / "escape").symlink_to(outside, target_is_directory=True)
    d.start()
    yield d
    d.close()


def _tree(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.lstat().st_mtime_ns) for p in folder.rglob("*"))


M, O = "{models}", "{outside}"  # noqa: E741  (placeholders in the cases below)
INVALID, DENIED, NOT_FOUND = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
)

# (model_path, calibration_dir, output_dir, expected status, words of the message)
PATH_CASES = {
    "dotdot-to-etc-passwd": (
        f"{M}/../../../../../../../../etc/passwd",
        "",
        "",
        DENIED,
        "outside the allowed",
    ),
    "dotdot-to-a-model-outside": (
        f"{M}/../outside/mlp.onnx",
        "",
        "",
        DENIED,
        "outside the allowed",
    ),
    # Refused the same way whether or not it exists: no probing of what is outside.
    "dotdot-to-nothing-outside": (
        f"{M}/../outside/nope.onnx",
        "",
        "",
        DENIED,
        "outside the allowed",
    ),
    "symlinked-dir-to-outside": (f"{M}/escape/mlp.onnx", "", "", DENIED, "outside the allowed"),
    "model-outside": (f"{O}/mlp.onnx", "", "", DENIED, "outside the allowed"),
    "model-relative": ("models/mlp.onnx", "", "", INVALID, "must be an absolute path"),
    "model-nul": (f"{M}/mlp.onnx\x00.txt", "", "", INVALID, "NUL byte"),
    "model-a-directory": (f"{M}/calib", "", "", INVALID, "(no saved_model.pb in it)"),
    "model-missing-inside": (f"{M}/nope.onnx", "", "", NOT_FOUND, "no such file"),
    "calibration-outside": (f"{M}/mlp.onnx", f"{O}/calib", "", DENIED, "calibration_dir"),
    "calibration-symlinked": (f"{M}/mlp.onnx", f"{M}/escape/calib", "", DENIED, "calibration_dir"),
    "calibration-dotdot": (
        f"{M}/mlp.onnx",
        f"{M}/calib/../../outside/calib",
        "",
        DENIED,
        "calibration_dir",
    ),
    "calibration-relative": (f"{M}/mlp.onnx", "calib", "", INVALID, "must be an absolute path"),
    "calibration-nul": (f"{M}/mlp.onnx", f"{M}/calib\x00", "", INVALID, "NUL byte"),
    "calibration-a-file": (f"{M}/mlp.onnx", f"{M}/mlp.onnx", "", INVALID, "not a directory"),
    "output-outside": (f"{M}/mlp.onnx", "", f"{O}/out", DENIED, "output_dir"),
    "output-symlinked": (f"{M}/mlp.onnx", "", f"{M}/escape/out", DENIED, "output_dir"),
    "output-dotdot-new": (f"{M}/mlp.onnx", "", f"{M}/out/../../outside/new", DENIED, "output_dir"),
    "output-missing-outside": (
        f"{M}/mlp.onnx",
        "",
        "/var/lib/aoed-test-nowhere",
        DENIED,
        "output_dir",
    ),
    "output-relative": (f"{M}/mlp.onnx", "", "out", INVALID, "must be an absolute path"),
    "output-nul": (f"{M}/mlp.onnx", "", f"{M}/out\x00/x", INVALID, "NUL byte"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PATH_CASES)
def test_daemon_side_paths_are_confined(daemon: DaemonProcess, case: str) -> None:
    outside = daemon.root / "outside"
    model, calibration, output, code, words = (
        v.format(models=daemon.models, outside=outside) if isinstance(v, str) else v
        for v in PATH_CASES[case]
    )
    before = _tree(outside)
    jobs = len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs)
    request = tuning_pb2.SubmitJobRequest(
        model_path=model,
        options=tuning_pb2.JobOptions(budget_s=1.0, calibration_dir=calibration, output_dir=output),
    )
    with pytest.raises(grpc.RpcError) as err:
        daemon.tuning().SubmitJob(request, timeout=30)
    assert err.value.code() == code and words in err.value.details(), (
        err.value.code(),
        err.value.details(),
    )
    assert _tree(outside) == before, "nothing created or changed outside the allowed dirs"
    assert not Path("/var/lib/aoed-test-nowhere").exists() and not (outside / "new").exists()
    assert len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs) == jobs, (
        "no job was created"
    )


@pytest.mark.slow
def test_confined_paths_inside_are_accepted(daemon: DaemonProcess) -> None:
    """The control for the refusals above: the same fields, inside, make a job."""
    request = tuning_pb2.SubmitJobRequest(
        model_path=f"{daemon.models}/calib/../mlp.onnx",
        options=tuning_pb2.JobOptions(
            budget_s=30.0,
            calibration_dir=str(daemon.models / "calib"),
            output_dir=str(daemon.models / "out"),
        ),
    )
    reply = daemon.tuning().SubmitJob(request, timeout=30)
    try:
        assert reply.job.model_path == str(daemon.models.resolve() / "mlp.onnx")
        assert reply.job.options.calibration_dir == str((daemon.models / "calib").resolve())
    finally:
        daemon.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=reply.job_id), timeout=60)
        daemon.wait_job(reply.job_id)


@pytest.mark.slow
def test_an_upload_cannot_name_a_path(daemon: DaemonProcess) -> None:
    outside = daemon.root / "outside"
    before = _tree(outside)
    model_id = upload(
        daemon.tuning(), daemon.models / "mlp.onnx", name="../../../outside/evil.onnx"
    )
    stored = list((daemon.state / "uploads" / model_id).iterdir())
    assert [p.name for p in stored] == ["evil.onnx"], (
        "only the base name is kept, inside the upload's folder"
    )
    assert _tree(outside) == before
    with pytest.raises(grpc.RpcError) as err:
        upload(daemon.tuning(), daemon.models / "mlp.onnx", name="..")
    assert err.value.code() == INVALID and "bad file name" in err.value.details()


@pytest.mark.slow
def test_an_upload_never_joins_a_job_on_a_file_named_by_path(daemon: DaemonProcess) -> None:
    """A file named by path stays its owner's to rewrite after SubmitJob hashed it (in
    place: the same inode, one link), so an upload of the bytes it held then must not
    join that job and get the result of the bytes written since: it gets a job of its
    own, tuning the bytes it sent."""
    original, rewritten = samples.mlp(hidden=33), samples.mlp(hidden=57)
    shared = daemon.models / "shared.onnx"
    samples.save(original, shared)
    sent = daemon.root / "sent.onnx"
    shutil.copyfile(shared, sent)
    stub = daemon.tuning()
    jobs = [
        stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(shared), options=tuning_pb2.JobOptions(budget_s=60.0)
            ),
            timeout=30,
        ).job_id
    ]
    try:
        with open(shared, "r+b") as f:  # rewritten in place, through the same inode
            f.truncate(0)
            f.write(rewritten.SerializeToString())
        uploaded = stub.SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_id=upload(stub, sent), options=tuning_pb2.JobOptions(budget_s=60.0)
            ),
            timeout=30,
        )
        jobs.append(uploaded.job_id)
        assert uploaded.job_id != jobs[0] and uploaded.job.joined == 0
        assert stub.GetJob(tuning_pb2.GetJobRequest(job_id=jobs[0]), timeout=30).job.joined == 0
    finally:
        for job_id in set(jobs):
            stub.CancelJob(tuning_pb2.CancelJobRequest(job_id=job_id), timeout=60)
            daemon.wait_job(job_id)


def _secret(daemon: DaemonProcess, name: str) -> Path:
    """A model outside the allowed dir (a file its submitter may not read, as far as the
    daemon knows), different from every other model here."""
    secret = daemon.root / "elsewhere" / name
    secret.parent.mkdir(exist_ok=True)
    samples.save(samples.mlp(hidden=40 + len(name)), secret)
    return secret


@pytest.mark.slow
def test_a_model_hard_linked_from_outside_is_refused_before_it_is_opened(
    daemon: DaemonProcess,
) -> None:
    """A hard link is the outside file itself under a name inside: no path check sees it,
    so SubmitJob refuses a file with several links, before anything opens it."""
    secret = _secret(daemon, "secret.onnx")
    linked = daemon.models / "linked.onnx"
    os.link(secret, linked)
    jobs = len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs)
    watch = Inotify()
    try:
        watch.watch(secret)
        request = tuning_pb2.SubmitJobRequest(
            model_path=str(linked), options=tuning_pb2.JobOptions(budget_s=1.0)
        )
        with pytest.raises(grpc.RpcError) as err:
            daemon.tuning().SubmitJob(request, timeout=30)
        msg = err.value.details()
        assert err.value.code() == DENIED, (err.value.code(), msg)
        assert (
            str(linked) in msg
            and "2 hard links" in msg
            and "copy the file" in msg
            and "upload it" in msg
        ), msg
        assert watch.events() == [], "the daemon opened the file behind the link"
        assert len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs) == jobs, (
            "no job was created"
        )
        linked.read_bytes()  # the control: the watch sees an open through the link
        assert any(m & Inotify.IN_OPEN for _, m in watch.events())
    finally:
        watch.close()


@pytest.mark.slow
def test_a_model_hard_linked_into_the_inbox_goes_to_failed_saying_why(
    daemon: DaemonProcess,
) -> None:
    secret = _secret(daemon, "inbox-secret.onnx")
    failed = daemon.inbox.parent / "failed"
    jobs = len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs)
    watch = Inotify()
    try:
        watch.watch(secret)
        os.link(secret, daemon.inbox / "linked.onnx")

        def moved() -> bool:  # the report is written first, then the file leaves the inbox
            return (failed / "linked.onnx.error.txt").exists() and (failed / "linked.onnx").exists()

        wait_for(moved, 30, f"linked.onnx and its report in {failed}", detail=daemon.log)
        text = (failed / "linked.onnx.error.txt").read_text()
        assert "state: rejected" in text and "2 hard links" in text and "upload it" in text, text
        assert not (daemon.inbox / "linked.onnx").exists()
        assert watch.events() == [], "the daemon opened the file behind the link"
        assert len(daemon.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs) == jobs, (
            "no job was created"
        )
    finally:
        watch.close()


# ---------------------------------------------------------------- no pickle, no eval


class _Trap:
    """Unpickling it creates the file `marker`: proof that a loader unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


INPUTS = {"input": TensorInfo("float32", (1, 4))}


def _calibration_dir(tmp_path: Path) -> Path:
    d = tmp_path / "calib"
    d.mkdir()
    return d


def test_a_pickled_npy_is_refused_naming_the_file(tmp_path: Path) -> None:
    d, marker = _calibration_dir(tmp_path), tmp_path / "unpickled"
    np.save(d / "a.npy", np.zeros((1, 4), np.float32))
    np.save(d / "b.npy", np.array([_Trap(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(OptionError, match="pickled") as err:
        load_samples(INPUTS, d)
    assert str(d / "b.npy") in str(err.value)
    assert not marker.exists(), "the object array was never unpickled"
    # Plain pickle bytes under an .npy name: refused the same way.
    (d / "b.npy").write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.raises(OptionError, match="pickled") as err:
        load_samples(INPUTS, d)
    assert str(d / "b.npy") in str(err.value) and not marker.exists()


def test_an_npz_with_a_pickled_member_is_refused_naming_the_file(tmp_path: Path) -> None:
    d, marker = _calibration_dir(tmp_path), tmp_path / "unpickled"
    np.savez(d / "a.npz", input=np.zeros((1, 4), np.float32))
    np.savez(d / "b.npz", input=np.array([_Trap(marker)], dtype=object))
    with pytest.raises(OptionError, match="pickled") as err:
        load_samples(INPUTS, d)
    assert str(d / "b.npz") in str(err.value)
    assert not marker.exists()
    (d / "b.npz").unlink()
    assert len(load_samples(INPUTS, d).held_back) == 1, "the control: a plain .npz loads"


def test_a_calibration_file_linked_from_outside_is_refused(tmp_path: Path) -> None:
    d = _calibration_dir(tmp_path)
    secret = tmp_path / "elsewhere" / "secret.npy"
    secret.parent.mkdir()
    np.save(secret, np.ones((1, 4), np.float32))
    (d / "a.npy").symlink_to(secret)
    with pytest.raises(OptionError, match="outside the calibration folder") as err:
        load_samples(INPUTS, d)
    assert str(d / "a.npy") in str(err.value)
    # One folder per input, the folder itself a link out: refused too.
    (d / "a.npy").unlink()
    (d / "input").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(OptionError, match="outside the calibration folder"):
        load_samples(INPUTS, d)


@pytest.mark.parametrize("layout", ["a.npy", "a.npz", "input/0.npy"])
def test_a_calibration_file_hard_linked_from_outside_is_refused_unopened(
    tmp_path: Path, layout: str
) -> None:
    d = _calibration_dir(tmp_path)
    secret = tmp_path / "elsewhere" / Path(layout).name
    secret.parent.mkdir()
    if layout.endswith(".npz"):
        np.savez(secret, input=np.ones((1, 4), np.float32))
    else:
        np.save(secret, np.ones((1, 4), np.float32))
    (d / layout).parent.mkdir(exist_ok=True)
    os.link(secret, d / layout)
    watch = Inotify()
    try:
        watch.watch(secret)
        with pytest.raises(OptionError, match="2 hard links") as err:
            load_samples(INPUTS, d)
        assert str(d / layout) in str(err.value)
        assert watch.events() == [], "the sample behind the link was opened"
    finally:
        watch.close()
    shutil.copy(secret, tmp_path / "copy")  # the control: a copy in its place loads
    os.replace(tmp_path / "copy", d / layout)
    assert len(load_samples(INPUTS, d).held_back) == 1


_NUMPY_LOADS = {("np", "load"), ("numpy", "load")}
_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _unsafe_calls(source: str, name: str) -> list[str]:
    """Calls in `source` that could unpickle or evaluate their input, as `name:line: what`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            found += [f"{where}: imports {n}" for n in names if n.split(".")[0] in _PICKLERS]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("eval", "exec", "__import__"):
            found.append(f"{where}: {func.id}()")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in _NUMPY_LOADS:
                flag = next((k.value for k in node.keywords if k.arg == "allow_pickle"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    found.append(f"{where}: np.load without allow_pickle=False")
            if func.value.id == "yaml" and func.attr in ("load", "unsafe_load", "full_load"):
                found.append(f"{where}: yaml.{func.attr}")
    return found


def test_no_code_path_unpickles_or_evaluates_input() -> None:
    # The control: the checker sees each thing it looks for.
    bad = (
        "import pickle\nnp.load(f)\nnp.load(f, allow_pickle=True)\n"
        "numpy.load(f, allow_pickle=False)\neval(s)\nexec(s)\nyaml.load(s)\n"
    )
    assert [h.split(": ", 1)[1] for h in _unsafe_calls(bad, "x.py")] == [
        "imports pickle",
        "np.load without allow_pickle=False",
        "np.load without allow_pickle=False",
        "eval()",
        "exec()",
        "yaml.load",
    ]
    files = [p for top in ("client", "daemon") for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 50, "the source tree is where this test expects it"
    sources = {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8") for f in files}
    found = [hit for name, text in sources.items() for hit in _unsafe_calls(text, name)]
    for name, text in sources.items():
        found += [
            f"{name}: the text {n!r}"
            for n in ("allow_pickle=True", "pickle.load", " eval(")
            if n in text
        ]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- bank imports


def _export_lines(tmp_path: Path) -> list[str]:
    """A small bank's records as exchange lines (entries, a default record, trials)."""
    from tests.bank_util import fill_bank

    fill_bank(tmp_path / "src")
    reader = open_bank(tmp_path / "src", use_env=False)
    try:
        return [record_to_json(rec) + "\n" for _, rec in reader.records()]
    finally:
        reader.close()


@pytest.mark.slow
def test_an_import_whose_last_line_is_malformed_writes_nothing(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """(tests/test_api_bank.py checks the same on the daemon's side of ImportEntries: bad
    records refused with their reasons, a broken stream writing nothing.)"""
    lines = _export_lines(tmp_path)
    assert len(lines) >= 5
    stats = daemon.bank_stub().GetBankStats(bank_pb2.GetBankStatsRequest(), timeout=30)
    # Cut short mid-record; whole JSON that is no record.
    for last in ('{"entry": {"key": "v1/trunc\n', '{"entry": {"no_such_field": 1}}\n'):
        bad = tmp_path / "bank.jsonl"
        bad.write_text("".join(lines) + last)
        r = run_aoe("bank", "import", str(bad), "--socket", str(daemon.socket), "--allow-foreign")
        assert r.returncode != 0 and f"{bad}:{len(lines) + 1}: not a bank record" in r.stderr, (
            r.stderr
        )
        assert daemon.bank_stub().GetBankStats(bank_pb2.GetBankStatsRequest(), timeout=30) == stats
    # The control: without the broken line, the same file is imported.
    good = tmp_path / "good.jsonl"
    good.write_text("".join(lines))
    r = run_aoe("bank", "import", str(good), "--socket", str(daemon.socket), "--allow-foreign")
    assert r.returncode == 0, r.stderr
    after = daemon.bank_stub().GetBankStats(bank_pb2.GetBankStatsRequest(), timeout=30)
    assert after.entries > stats.entries


# ---------------------------------------------------------------- folders others can write


@pytest.fixture(scope="module")
def drop(tmp_path_factory: pytest.TempPathFactory):
    """A daemon whose inbox, outbox and failed folders (under its root) stand for the
    group-writable drop folders of the deploy files; models dropped there are tuned with
    a 2 s budget. `targets/` holds files that links planted by "another user" point at."""
    d = DaemonProcess(tmp_path_factory.mktemp("drop"))
    d.inbox.mkdir()
    (d.inbox / "aoed.toml").write_text("budget_s = 2.0\n")
    (d.root / "targets").mkdir()
    d.start()
    yield d
    d.close()


def _small_model(hidden: int) -> bytes:
    """A small model, different for each `hidden`: identical drops would join one job."""
    return samples.mlp(features=64, hidden=hidden, classes=8, layers=2).SerializeToString()


def _drop(d: DaemonProcess, name: str, data: bytes) -> None:
    """Put `data` in the inbox as `name`, whole at once (written under a hidden name, then
    renamed, as docs/daemon.md tells writers to)."""
    tmp = d.inbox / ".dropping.part"
    tmp.write_bytes(data)
    tmp.rename(d.inbox / name)


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_links_planted_in_the_outbox_and_failed_are_never_written_through(
    drop: DaemonProcess,
) -> None:
    outbox, failed, targets = drop.root / "outbox", drop.root / "failed", drop.root / "targets"
    for n in ("a", "b", "c", "d", "e"):
        (targets / n).write_bytes(b"precious " + n.encode())
    before = _contents(targets)
    plants = {
        # the temporary names deliveries used to write through
        outbox / ".victim_tuned.onnx.part": targets / "a",
        outbox / ".victim_result.json.part": targets / "b",
        outbox / ".victim_report.txt.part": targets / "c",
        failed / ".broken.onnx.error.txt.part": targets / "d",
        failed / ".broken.onnx.part": targets / "e",
        # final names: a link to a file, and a dangling one (a file the daemon would create)
        outbox / "victim2_tuned.onnx": targets / "a",
        outbox / "victim2_report.txt": targets / "new-by-report",
        failed / "broken2.onnx": targets / "e",
        failed / "broken2.onnx.error.txt": targets / "new-by-error",
    }
    for link, target in plants.items():
        link.symlink_to(target)
    _drop(drop, "victim.onnx", _small_model(71))
    _drop(drop, "victim2.onnx", _small_model(72))
    _drop(drop, "broken.onnx", b"not a model at all")
    _drop(drop, "broken2.onnx", b"not a model either")
    for done in (
        outbox / "victim_report.txt",
        outbox / "victim2_2_report.txt",
        failed / "broken.onnx.error.txt",
        failed / "broken2_2.onnx.error.txt",
    ):
        wait_for(done.exists, 180, str(done), detail=drop.log_tail)
    assert _contents(targets) == before, "a file behind a planted link changed, or one was created"
    for link, target in plants.items():
        assert link.is_symlink() and os.readlink(link) == str(target), (
            f"{link}: the planted link was replaced"
        )
    for name in ("victim_tuned.onnx", "victim2_2_tuned.onnx"):
        assert not (outbox / name).is_symlink()
        onnx.checker.check_model(onnx.load(outbox / name))
    assert (failed / "broken.onnx").read_bytes() == b"not a model at all"
    assert (failed / "broken2_2.onnx").read_bytes() == b"not a model either"
    assert "not a readable ONNX model" in (failed / "broken.onnx.error.txt").read_text()


@pytest.mark.slow
def test_a_link_planted_in_a_named_output_dir_is_never_followed(drop: DaemonProcess) -> None:
    out, elsewhere = drop.models / "shared-out", drop.root / "elsewhere-ws"
    out.mkdir()
    elsewhere.mkdir()
    (out / "aoe_workspace").symlink_to(elsewhere, target_is_directory=True)
    model = drop.models / "named.onnx"
    model.write_bytes(_small_model(73))
    reply = drop.tuning().SubmitJob(
        tuning_pb2.SubmitJobRequest(
            model_path=str(model), options=tuning_pb2.JobOptions(budget_s=2.0, output_dir=str(out))
        ),
        timeout=30,
    )
    job = drop.wait_job(reply.job_id)
    assert list(elsewhere.iterdir()) == [], "the job wrote through the planted link"
    assert job.state == tuning_pb2.JOB_STATE_FAILED, job
    assert f"{out}/aoe_workspace" in job.error and "symbolic link" in job.error, job.error
    assert (out / "aoe_workspace").is_symlink()


@pytest.mark.slow
def test_a_long_inbox_name_is_delivered_under_a_shortened_name(drop: DaemonProcess) -> None:
    outbox, failed = drop.root / "outbox", drop.root / "failed"
    long = "m" * 240 + ".onnx"  # 245 bytes
    wide = "模型" * 40 + ".onnx"  # 85 characters, 245 bytes
    _drop(drop, long, _small_model(74))
    _drop(drop, wide, b"not a model")

    def delivered(folder: Path, head: str, tail: str) -> list[str]:
        return sorted(n for n in os.listdir(folder) if n.startswith(head) and n.endswith(tail))

    wait_for(
        lambda: delivered(outbox, "m" * 100, "_report.txt"),
        180,
        "the long name's outputs",
        detail=drop.log_tail,
    )
    wait_for(
        lambda: delivered(failed, "模型" * 10, ".error.txt"),
        180,
        "the wide name's failure",
        detail=drop.log_tail,
    )
    outs = delivered(outbox, "m" * 100, "")
    assert len(outs) == 3 and all(len(n.encode()) <= 255 and "~" in n for n in outs), outs
    stem = outs[0][: outs[0].index("~") + 11]
    assert sorted(outs) == sorted(stem + s for s in ("_tuned.onnx", "_result.json", "_report.txt"))
    assert f"aoed tuned {long}" in (outbox / f"{stem}_report.txt").read_text()
    fails = delivered(failed, "模型" * 10, "")
    assert len(fails) == 2 and all(len(n.encode()) <= 255 for n in fails), fails
    error = next(n for n in fails if n.endswith(".error.txt"))
    assert f"model: {wide}" in (failed / error).read_text()
    assert not (drop.inbox / long).exists() and not (drop.inbox / wide).exists()


# Writes half the model, pauses (argv[2] seconds, longer than stable_s), then the rest.
_PAUSING_WRITER = """
import sys, time
data = open(sys.argv[3], "rb").read()
with open(sys.argv[1], "wb") as f:
    f.write(data[: len(data) // 2])
    f.flush()
    time.sleep(float(sys.argv[2]))
    f.write(data[len(data) // 2 :])
"""


@pytest.mark.slow
def test_a_writer_that_pauses_longer_than_stable_s_gets_its_model_tuned_once(
    drop: DaemonProcess,
) -> None:
    outbox, failed = drop.root / "outbox", drop.root / "failed"
    whole = drop.root / "paused-source.onnx"
    whole.write_bytes(_small_model(75))
    # stable_s is 1 s here: a pause of 3 s is three times it.
    writer = subprocess.run(
        [sys.executable, "-c", _PAUSING_WRITER, str(drop.inbox / "paused.onnx"), "3", str(whole)],
        timeout=60,
    )
    assert writer.returncode == 0
    wait_for(
        lambda: (
            (outbox / "paused_report.txt").exists() or (failed / "paused.onnx.error.txt").exists()
        ),
        180,
        "the paused model's delivery",
        detail=drop.log_tail,
    )
    assert not (failed / "paused.onnx.error.txt").exists(), (
        failed / "paused.onnx.error.txt"
    ).read_text()
    jobs = [
        j
        for j in drop.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
        if j.model_name == "paused.onnx"
    ]
    assert [j.state for j in jobs] == [tuning_pb2.JOB_STATE_SUCCEEDED], jobs
    assert (outbox / "paused_tuned.onnx").exists()


@pytest.mark.slow
def test_a_file_name_cannot_forge_a_log_line(drop: DaemonProcess) -> None:
    failed = drop.root / "failed"
    forged = "2099-01-01 00:00:00,000 ERROR aoed.watch: inbox gone"
    name = f"evil\n{forged}\x1b[2K.onnx"
    _drop(drop, name, b"not a model")
    wait_for(
        (failed / f"{name}.error.txt").exists,
        180,
        "the forged name's failure",
        detail=drop.log_tail,
    )
    lines = drop.log().splitlines()
    assert not [line for line in lines if line.startswith("2099-01-01")], (
        "a file name started a log line"
    )
    assert any("evil\\n2099-01-01" in line and "\\x1b[2K.onnx" in line for line in lines)
    text = (failed / f"{name}.error.txt").read_text().splitlines()
    assert len(text) == 4 and text[0] == f"model: evil\\n{forged}\\x1b[2K.onnx", text


@pytest.mark.slow
def test_entries_that_are_not_models_are_logged_and_left(drop: DaemonProcess) -> None:
    outside = drop.root / "targets" / "outside.onnx"
    outside.write_bytes(_small_model(76))
    kinds = {
        "link.onnx": "a symbolic link",
        "dir.onnx": "a folder",
        "fifo.onnx": "a FIFO",
        "sock.onnx": "a socket",
        "notes.txt": "not an .onnx model (nor a .pt2 or a .tar)",
    }
    (drop.inbox / "link.onnx").symlink_to(outside)
    (drop.inbox / "dir.onnx").mkdir()
    os.mkfifo(drop.inbox / "fifo.onnx")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(drop.inbox / "sock.onnx"))
        (drop.inbox / "notes.txt").write_text("hello\n")

        def logged(name: str) -> int:
            return drop.log().count(f": {name} is {kinds[name]}; left where it is")

        wait_for(lambda: all(logged(n) for n in kinds), 60, "a line for each", detail=drop.log_tail)
        assert {n: logged(n) for n in kinds} == {n: 1 for n in kinds}
        assert all(os.path.lexists(drop.inbox / n) for n in kinds)
    jobs = drop.tuning().ListJobs(tuning_pb2.ListJobsRequest()).jobs
    assert not [j for j in jobs if j.model_name in kinds], "none of them became a job"


@pytest.mark.slow
def test_a_model_swapped_for_a_hard_link_after_submit_is_not_read(drop: DaemonProcess) -> None:
    """SubmitJob checks the file (one link) and the job reads it later: a hard link to a
    file from elsewhere put at its name in between is refused when the job opens it."""
    models = [drop.models / f"busy{i}.onnx" for i in range(2)]
    for i, m in enumerate(models):
        m.write_bytes(_small_model(80 + i))
    busy = [
        drop.tuning()
        .SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(m), options=tuning_pb2.JobOptions(budget_s=120.0)
            ),
            timeout=30,
        )
        .job_id
        for m in models
    ]
    victim = drop.models / "victim-by-path.onnx"
    victim.write_bytes(_small_model(82))
    job_id = (
        drop.tuning()
        .SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_path=str(victim), options=tuning_pb2.JobOptions(budget_s=2.0)
            ),
            timeout=30,
        )
        .job_id
    )
    watch = Inotify()
    try:
        assert (
            drop.tuning().GetJob(tuning_pb2.GetJobRequest(job_id=job_id)).job.state
            == tuning_pb2.JOB_STATE_QUEUED
        )
        secret = _secret(drop, "swapped-secret.onnx")
        watch.watch(secret)
        os.link(secret, drop.models / ".swap")
        os.replace(drop.models / ".swap", victim)  # now the secret's second name
        for b in busy:
            drop.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=b), timeout=60)
        job = drop.wait_job(job_id)
        assert job.state == tuning_pb2.JOB_STATE_FAILED, job
        assert "not the file that was submitted" in job.error and "2 hard links" in job.error, (
            job.error
        )
        assert not [m for _, m in watch.events() if m & Inotify.IN_ACCESS], (
            "the daemon read the file behind the link"
        )
    finally:
        watch.close()


@pytest.mark.slow
def test_a_huge_path_or_name_is_cut_in_the_error(daemon: DaemonProcess) -> None:
    # A path over the submission's size limit is refused naming the field and the limit; one
    # under it but long (3,000 characters, each folder name within NAME_MAX) is repeated cut.
    huge = f"{daemon.models}/" + "a" * 100_000
    long = f"{daemon.models}/" + "/".join(["a" * 200] * 15)
    model = f"{daemon.models}/mlp.onnx"
    for path, says in ((huge, "over the limit of 4096 bytes"), (long, "characters)")):
        requests = {
            "model_path": tuning_pb2.SubmitJobRequest(model_path=path),
            "output_dir": tuning_pb2.SubmitJobRequest(
                model_path=model, options=tuning_pb2.JobOptions(output_dir=path)
            ),
            "calibration_dir": tuning_pb2.SubmitJobRequest(
                model_path=model, options=tuning_pb2.JobOptions(calibration_dir=path)
            ),
            "outside": tuning_pb2.SubmitJobRequest(
                model_path="/" + path.replace(str(daemon.models), "b")
            ),
        }
        for field, request in requests.items():
            with pytest.raises(grpc.RpcError) as err:
                daemon.tuning().SubmitJob(request, timeout=30)
            msg = err.value.details()
            assert err.value.code() in (INVALID, DENIED, grpc.StatusCode.NOT_FOUND), (
                field,
                err.value.code(),
                msg[:300],
            )
            assert len(msg) < 1000 and says in msg, (field, len(msg), msg[:300])
    with pytest.raises(grpc.RpcError) as err:
        upload(daemon.tuning(), daemon.models / "mlp.onnx", name="c" * 100_000 + ".onnx")
    assert err.value.code() == INVALID and len(err.value.details()) < 1000, err.value.details()[
        :300
    ]


# ---------------------------------------------------------------- a drop folder a group shares


@pytest.fixture(scope="module")
def group_drop():
    """A daemon whose drop folders are shared with a group as deploy/ shares them: nobody's
    group (65534) in `[[inbox]] group`, the folders made by the daemon (missing at its
    first start), and no CAP_LEASE (as the unit has none), so whether a writer still has
    a dropped file open is told by stable_s alone. Its root is one other users can reach.
    Yields the daemon, nobody's group name and a python nobody can run."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    try:
        group = grp.getgrgid(NOBODY).gr_name
    except KeyError:
        pytest.skip(f"no group with gid {NOBODY} on this machine")
    python = _plain_python_for_nobody()
    if python is None:
        pytest.skip(f"no python that uid {NOBODY} may run")
    setpriv = shutil.which("setpriv")
    without_lease = [setpriv or "setpriv", "--inh-caps=-lease", "--bounding-set=-lease", "--"]
    if setpriv is None or subprocess.run([*without_lease, "true"], check=False).returncode:
        pytest.skip("cannot start a process without CAP_LEASE here (setpriv, util-linux)")
    home = Path(tempfile.mkdtemp(prefix="aoed-gd-", dir="/tmp"))
    os.chmod(home, 0o755)
    d = DaemonProcess(home / "d", f'group = "{group}"\n')  # (in the [[inbox]] table)
    d.argv_prefix = without_lease
    try:
        d.start()
        (d.inbox / "aoed.toml").write_text("budget_s = 2.0\n")
        yield d, group, python
    finally:
        d.close()
        shutil.rmtree(home, ignore_errors=True)


def _as_nobody(python: str, script: str, *args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", script, *map(str, args)],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        env={"PATH": os.defpath},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


# As a member of the group: copy argv[1] into the inbox as argv[2] (a temporary name,
# then a rename), or read argv[1] when argv[2] is "-".
_MEMBER = """
import os, shutil, sys
if sys.argv[2] == "-":
    print(len(open(sys.argv[1], "rb").read()))
else:
    shutil.copyfile(sys.argv[1], sys.argv[2] + ".part")
    os.rename(sys.argv[2] + ".part", sys.argv[2])
"""


@pytest.mark.slow
def test_drop_folders_removed_while_the_daemon_is_down_are_made_again_for_the_group(
    group_drop,
) -> None:
    d, group, python = group_drop
    folders = [d.inbox, d.inbox.parent / "outbox", d.inbox.parent / "failed"]
    d.stop()
    for folder in folders:
        shutil.rmtree(folder)
    d.start()
    for folder in folders:
        st = os.stat(folder)
        assert (oct(stat.S_IMODE(st.st_mode)), st.st_gid) == (oct(0o2770), NOBODY), folder
        assert f"{folder} was missing; made it with mode 2770, group {group}" in d.log()
    (d.inbox / "aoed.toml").write_text("budget_s = 2.0\n")
    source = d.inbox.parent / "member-source.onnx"
    source.write_bytes(_small_model(94))
    dropped = _as_nobody(python, _MEMBER, source, d.inbox / "member.onnx")
    assert dropped.returncode == 0, dropped.stderr
    report = folders[1] / "member_report.txt"
    wait_for(
        lambda: report.exists() or (folders[2] / "member.onnx.error.txt").exists(),
        180,
        "delivery",
        detail=d.log_tail,
    )
    assert report.exists(), (folders[2] / "member.onnx.error.txt").read_text()
    tuned = folders[1] / "member_tuned.onnx"
    assert os.stat(tuned).st_gid == NOBODY, "the outputs belong to the group (setgid)"
    read = _as_nobody(python, _MEMBER, tuned, "-")
    assert read.returncode == 0 and int(read.stdout) == tuned.stat().st_size, read.stderr


# As a member of the group: writes argv[2] into the inbox file argv[1] and keeps it open
# for writing; on a line from stdin rewrites it, through the same descriptor, with
# argv[3]; closes it on another line.
_HOLDING_WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
os.write(fd, open(sys.argv[2], "rb").read())
print("written", flush=True)
sys.stdin.readline()
data = open(sys.argv[3], "rb").read()
os.ftruncate(fd, 0)
os.pwrite(fd, data, 0)
os.fsync(fd)
print("rewritten", flush=True)
sys.stdin.readline()
os.close(fd)
"""


def _hidden(model: Path) -> set[int]:
    """The sizes of the weights of `model`: an mlp's hidden width is among them."""
    return {dim for init in onnx.load(model).graph.initializer for dim in init.dims}


def _hold_and_rewrite(
    d: DaemonProcess, writer: subprocess.Popen, original: Path, busy: list[str]
) -> None:
    """The rest of the test below, with `writer` running _HOLDING_WRITER."""
    outbox = d.inbox.parent / "outbox"
    assert writer.stdout.readline().strip() == "written"

    def held() -> list[tuning_pb2.Job]:
        jobs = d.tuning().ListJobs(tuning_pb2.ListJobsRequest(), timeout=30).jobs
        return [j for j in jobs if j.model_name == "held.onnx"]

    wait_for(held, 180, "the held model's claim and job", detail=d.log_tail)
    [job] = held()
    assert job.state == tuning_pb2.JOB_STATE_QUEUED, job
    writer.stdin.write("rewrite\n")
    writer.stdin.flush()
    assert writer.stdout.readline().strip() == "rewritten"
    # The victim submits the original bytes: the same content and options join the job.
    joined = (
        d.tuning()
        .SubmitJob(
            tuning_pb2.SubmitJobRequest(
                model_id=upload(d.tuning(), original, name="victim.onnx"),
                options=tuning_pb2.JobOptions(budget_s=2.0),
            ),
            timeout=30,
        )
        .job_id
    )
    assert joined == job.job_id
    for b in busy:
        d.tuning().CancelJob(tuning_pb2.CancelJobRequest(job_id=b), timeout=60)
    done = d.wait_job(job.job_id)
    assert done.state == tuning_pb2.JOB_STATE_SUCCEEDED, done
    assert done.joined == 1
    wait_for(
        (outbox / "held_tuned.onnx").exists, 180, "the held model's delivery", detail=d.log_tail
    )
    for tuned in (outbox / "held_tuned.onnx", Path(done.result.tuned_model_path)):
        sizes = _hidden(tuned)
        assert 90 in sizes and 91 not in sizes, (tuned, sorted(sizes))
    writer.stdin.write("close\n")
    writer.stdin.flush()
    assert writer.wait(timeout=60) == 0
    assert not (d.inbox / "held.onnx").exists() and len(held()) == 1


@pytest.mark.slow
def test_a_model_rewritten_through_a_descriptor_kept_open_is_not_what_its_job_runs(
    group_drop,
) -> None:
    """A member drops a model, keeps it open for writing and pauses past stable_s, so it
    is claimed; once its job is queued it rewrites the file with another model through
    that descriptor. The job (and a submission of the original bytes over the socket,
    which joins it) tunes the original: the daemon hashed, and runs, its own copy."""
    d, _, python = group_drop
    original, other = d.inbox.parent / "original.onnx", d.inbox.parent / "other.onnx"
    original.write_bytes(_small_model(90))
    other.write_bytes(_small_model(91))
    # Two long jobs hold both of the daemon's places, so the dropped model's job waits
    # in the queue (reading nothing yet) until the rewrite is done.
    busy = []
    for hidden in (92, 93):
        m = d.models / f"busy{hidden}.onnx"
        m.write_bytes(_small_model(hidden))
        busy.append(
            d.tuning()
            .SubmitJob(
                tuning_pb2.SubmitJobRequest(
                    model_path=str(m), options=tuning_pb2.JobOptions(budget_s=120.0)
                ),
                timeout=30,
            )
            .job_id
        )
    with subprocess.Popen(
        [python, "-c", _HOLDING_WRITER, str(d.inbox / "held.onnx"), str(original), str(other)],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        env={"PATH": os.defpath},
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        try:
            _hold_and_rewrite(d, writer, original, busy)
        finally:
            if writer.poll() is None:
                writer.kill()

"""The gRPC server: where it listens, how it is secured, and which services it serves.

Listening: a unix socket by default (a path, mode 0660 and a group from the config).
grpcio cannot tell which uid is on the other end of a unix socket, so the socket's
owner, group and mode are the access control: anyone who can connect can submit jobs
and manage the bank. The socket is created under a umask that leaves it closed to
everybody until its mode and group are set. TCP is served only when configured, and
then with TLS (optionally mutual), except an explicit `insecure_loopback` bind.

Besides the aoe.v1 services the server registers standard health checking (NOT_SERVING
while shutting down) and server reflection, so grpcurl and load balancers work.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket as socketlib
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aoe.errors import OptionError
from aoe.v1 import (
    bank_pb2,
    bank_pb2_grpc,
    daemon_pb2,
    daemon_pb2_grpc,
    devices_pb2,
    devices_pb2_grpc,
    tuning_pb2,
    tuning_pb2_grpc,
)
from aoed.config import DaemonConfig

__all__ = ["Server", "build_server"]

log = logging.getLogger(__name__)

#: Largest single message (an upload chunk is 1 MiB; a bank import record is small).
MAX_MESSAGE = 8 << 20

SERVICE_NAMES = (
    tuning_pb2.DESCRIPTOR.services_by_name["TuningService"].full_name,
    bank_pb2.DESCRIPTOR.services_by_name["BankService"].full_name,
    devices_pb2.DESCRIPTOR.services_by_name["DeviceService"].full_name,
    daemon_pb2.DESCRIPTOR.services_by_name["DaemonService"].full_name,
)


class Server:
    def __init__(
        self,
        server: grpc.Server,
        health_servicer: health.HealthServicer,
        addresses: list[str],
        socket: Path | None,
    ):
        self.grpc = server
        self.health = health_servicer
        self.addresses = addresses
        self.socket = socket

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICE_NAMES):
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        """Refuse new RPCs, give running ones `grace_s`, then cancel them (blocking)."""
        self.set_serving(False)
        self.grpc.stop(grace_s).wait()
        if self.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket.unlink()


def _stale_socket(path: Path) -> None:
    """Remove a socket file nobody listens on (left by a killed daemon); refuse to start
    when another daemon answers on it."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise OptionError(
            f"[listen] socket {path}: exists and is not a socket; remove it or choose another path"
        )
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            path.unlink(missing_ok=True)
            return
        raise OptionError(f"[listen] socket {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise OptionError(f"[listen] socket {path}: another daemon is listening there")


def _trusted_folder(path: Path) -> None:
    """Refuse a socket folder where clients would refuse the socket (aoe.sockets): one
    that belongs to a user other than this one or root, or that others may write (but
    for a sticky folder of root's, such as /tmp, where nobody else can touch ours)."""
    st = path.parent.stat()
    mode = stat.S_IMODE(st.st_mode)
    why = ""
    if st.st_uid not in (0, os.geteuid()):
        why = f"belongs to uid {st.st_uid}, who could replace the socket"
    elif mode & 0o022 and not (mode & stat.S_ISVTX and st.st_uid == 0):
        why = f"may be written by others (mode {mode:04o}), who could replace the socket"
    if why:
        raise OptionError(
            f"[listen] socket {path}: its folder {path.parent} {why}, so clients would refuse "
            "it; choose a folder that only the daemon's user (or root) may write"
        )


def _bind_unix(server: grpc.Server, cfg: DaemonConfig) -> Path:
    path = cfg.socket
    assert path is not None
    if len(str(path).encode()) > 107:
        raise OptionError(
            f"[listen] socket {path}: the path is longer than a unix socket allows (107 bytes)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptionError(
            f"[listen] socket {path}: cannot create its folder ({exc.strerror or exc})"
        ) from None
    _trusted_folder(path)
    _stale_socket(path)
    gid = cfg.socket_gid()
    gid = -1 if gid is None else gid
    old = os.umask(0o177)  # the socket appears owner-only; its real mode is set below
    try:
        port = server.add_insecure_port(f"unix:{path}")
    finally:
        os.umask(old)
    if port == 0:
        raise OptionError(f"[listen] socket {path}: cannot bind")
    try:
        os.chown(path, -1, gid)
    except OSError as exc:  # a daemon that is not root can only give it to its own groups
        raise OptionError(
            f"[listen] socket_group {cfg.socket_group!r}: cannot give the socket {path} to it "
            f"({exc.strerror or exc}); the daemon's user must be a member of that group"
        ) from None
    os.chmod(path, cfg.socket_mode)
    return path


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


def build_server(
    cfg: DaemonConfig,
    add_services: Callable[[grpc.Server], None],
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> Server:
    """A started-to-be gRPC server bound as `cfg` says, with `add_services(server)`
    having registered the aoe.v1 servicers, and `interceptors` (aoed.metrics counts
    RPCs with one) around every RPC. Raises OptionError when it cannot listen."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=cfg.max_rpcs, thread_name_prefix="grpc"),
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=cfg.max_rpcs,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_services(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            *SERVICE_NAMES,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    addresses: list[str] = []
    socket = None
    if cfg.socket is not None:
        socket = _bind_unix(server, cfg)
        addresses.append(f"unix://{socket}")
    if cfg.tcp:
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            creds = grpc.ssl_server_credentials(
                [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())],
                root_certificates=_read(cfg.tls_client_ca),
                require_client_auth=cfg.tls_client_ca is not None,
            )
            port = server.add_secure_port(cfg.tcp, creds)
            scheme = "mtls" if cfg.tls_client_ca is not None else "tls"
        else:  # the config allows this only on loopback with insecure_loopback = true
            port = server.add_insecure_port(cfg.tcp)
            scheme = "insecure"
        if port == 0:
            raise OptionError(f"[listen] tcp = {cfg.tcp!r}: cannot bind")
        host = cfg.tcp.rsplit(":", 1)[0]
        addresses.append(f"{host}:{port} ({scheme})")
    return Server(server, health_servicer, addresses, socket)


def register(
    server: grpc.Server,
    tuning: tuning_pb2_grpc.TuningServiceServicer,
    bank: bank_pb2_grpc.BankServiceServicer | None,
    devices: devices_pb2_grpc.DeviceServiceServicer,
    daemon: daemon_pb2_grpc.DaemonServiceServicer,
) -> None:
    """Serve the aoe.v1 services on `server` (BankService only when `bank` is given)."""
    tuning_pb2_grpc.add_TuningServiceServicer_to_server(tuning, server)
    if bank is not None:
        bank_pb2_grpc.add_BankServiceServicer_to_server(bank, server)
    devices_pb2_grpc.add_DeviceServiceServicer_to_server(devices, server)
    daemon_pb2_grpc.add_DaemonServiceServicer_to_server(daemon, server)

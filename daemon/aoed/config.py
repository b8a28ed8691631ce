"""The daemon's configuration: the engine's `aoe.config.Config` plus what only a service
needs (where it listens, where it keeps state, which folders it watches, its limits).

One TOML file holds both; `aoe.config` reads the engine's sections and this module the
daemon's. Defaults need no file at all: state under the user's state dir (platformdirs),
or /var/lib/aoed as root; the socket in the runtime dir (/run/aoed as root).

  [daemon]
  state_dir = "/var/lib/aoed"        # job store, uploads, inputs, job outputs
  max_running_jobs = 2               # jobs tuning at once (they share workers and devices)
  max_queued_jobs = 64               # beyond this, SubmitJob answers RESOURCE_EXHAUSTED
  max_jobs_per_client = 16           # queued + running per client (a TLS subject, a TCP
                                     # address, an inbox; the unix socket is one client)
  retention_days = 30                # finished jobs (and their outputs) are kept this long
  shutdown_grace_s = 20              # SIGTERM: how long running measurements may finish;
                                     # the process exits 15 s after that whatever happens
  max_job_attempts = 3               # a job interrupted this many times while it ran (the
                                     # daemon stopped, crashed or was killed) is failed,
                                     # not started again
  allowed_dirs = ["/srv/models"]     # what SubmitJob may name by path (symlinks resolved)
  allow_unconfined_gdat = false      # GDAT loads a .pt2 only in processes the kernel confines
                                     #   (Landlock and seccomp: aoed.sandbox); true lets it
                                     #   load one unconfined where the kernel cannot (the
                                     #   job's log and result say so)
  [listen]
  socket = "/run/aoed/aoed.sock"     # "" = no unix socket
  socket_mode = "0660"               # the socket's permissions are the access control
  socket_group = "aoed"              # group of the socket; "" = the daemon's own
  tcp = "0.0.0.0:7461"               # optional; needs tls_cert and tls_key ...
  tls_cert = "/etc/aoed/server.pem"
  tls_key = "/etc/aoed/server.key"
  tls_client_ca = "/etc/aoed/clients.pem"   # optional: mutual TLS
  insecure_loopback = false          # ... unless tcp is a loopback address and this is true
  max_rpcs = 256                     # concurrent RPCs; beyond, RESOURCE_EXHAUSTED
  [engine]                           # read by aoe.config, like [bank], [tuning] and [log];
  max_model_mb = 8192                # what a model may hold: SubmitJob refuses a bigger file
  max_nodes = 200000                 #   and a job fails naming the setting
  max_tensor_mb = 4096
  compile_timeout_s = 120            # a worker's time per candidate (and bank rebuild), and
  stage_timeout_s = 900              #   per other stage; x (1 + model MiB/256) for each job
  [bank]                             # path and layers are read by aoe.config
  follow = ["unix:///run/aoed-b/aoed.sock", "dns:///gpu-02:7461"]   # peers whose banks
                                     # this one follows (aoed.bank.follow); TCP needs TLS:
  follow_ca = "/etc/aoed/peers-ca.pem"      # CA of the peers' server certificates
  follow_cert = "/etc/aoed/client.pem"      # optional: this daemon's client certificate
  follow_key = "/etc/aoed/client.key"       #   and key, for peers that want mutual TLS
  follow_insecure_loopback = false   # plain TCP to a loopback peer only when true
  [metrics]
  listen = "127.0.0.1:9464"          # Prometheus endpoint; "" (default) = off
  allow_remote = false               # a non-loopback address needs this set to true
  max_connections = 16               # open at once; one more is closed at once
  timeout_s = 10                     # a connection's time in all: request, scrape, answer
  [limits]
  max_upload_mb = 2048               # one upload
  upload_ttl_h = 24                  # an upload not submitted by then is deleted
  max_uploads_mb = 8192              # uploads not yet submitted, all clients together:
  max_uploads = 64                   #   their bytes and their number
  max_client_uploads_mb = 4096       # the same per client (a TLS subject, a TCP address;
  max_client_uploads = 16            #   every caller on the unix socket is one client)
  min_free_mb = 512                  # below this free in the state dir, new jobs and
                                     # uploads are refused and queued jobs wait
  max_world_size = 16                # ranks of one GDAT world (default: the cores, at least 2)
  max_ranks_per_device = 2           # ranks sharing a device (a core on gloo, else a GPU/NPU)
  [[inbox]]                          # repeat for more folders
  path = "/var/lib/aoed/inbox"
  outbox = "/var/lib/aoed/outbox"    # default: "outbox" beside the inbox
  failed = "/var/lib/aoed/failed"    # default: "failed" beside the inbox
  stable_s = 2.0                     # size and mtime unchanged this long = complete
  mode = "2770"                      # a missing inbox, outbox or failed folder is made
  group = "aoed"                     #   with this mode and group ("" = the daemon's own)

Without an `[[inbox]]`, the daemon watches `inbox/` in its state dir. Errors are
OptionErrors naming the key and the file; the file is checked whole, and one OptionError
lists every problem (`OptionError.problems`), so `aoed --check-config` shows them all.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from aoe.config import (
    DAEMON_KEYS,
    Config,
    Problems,
    Section,
    given,
    load_config,
    read_section,
    section,
)
from aoe.errors import OptionError
from aoed.engine.worldsize import DEFAULT_RANKS_PER_DEVICE, WorldLimits, default_max_world_size

__all__ = ["KEYS", "DaemonConfig", "Inbox", "load_daemon_config"]

DEFAULT_PORT = 7461


def _default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/aoed")
    import platformdirs

    return Path(platformdirs.user_state_dir("aoed"))


@dataclass(frozen=True)
class Inbox:
    path: Path
    outbox: Path
    failed: Path
    stable_s: float = 2.0
    #: mode of a drop folder (the inbox, its outbox, its failed folder) that the daemon
    #: makes because it is missing: deploy/'s, group-writable and setgid, so that what a
    #: member of the group drops belongs to the group. A folder that exists is left as is.
    mode: int = 0o2770
    #: group of a folder made so; "" = the group it gets when made (the daemon's own, or
    #: its parent's when that is setgid)
    group: str = ""

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class DaemonConfig:
    engine: Config
    state_dir: Path
    socket: Path | None
    socket_mode: int = 0o660
    socket_group: str = ""
    tcp: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    insecure_loopback: bool = False
    max_rpcs: int = 256
    max_running_jobs: int = 2
    max_queued_jobs: int = 64
    max_jobs_per_client: int = 16
    retention_s: float = 30 * 86400.0
    shutdown_grace_s: float = 20.0
    #: starts of a job that ended no way (the daemon stopped or died under it) before it
    #: is failed instead of started again
    max_job_attempts: int = 3
    allowed_dirs: tuple[Path, ...] = ()
    allow_unconfined_gdat: bool = False
    max_upload_bytes: int = 2048 << 20
    upload_ttl_s: float = 24 * 3600.0
    max_uploads_bytes: int = 8192 << 20
    max_uploads: int = 64
    max_client_uploads_bytes: int = 4096 << 20
    max_client_uploads: int = 16
    min_free_bytes: int = 512 << 20
    #: a GDAT world's ranks (aoed.engine.worldsize)
    max_world_size: int = field(default_factory=default_max_world_size)
    max_ranks_per_device: int = DEFAULT_RANKS_PER_DEVICE
    inboxes: tuple[Inbox, ...] = ()
    follow: tuple[str, ...] = ()
    follow_ca: Path | None = None
    follow_cert: Path | None = None
    follow_key: Path | None = None
    follow_insecure_loopback: bool = False
    metrics_listen: str = ""
    metrics_allow_remote: bool = False
    metrics_max_connections: int = 16
    metrics_timeout_s: float = 10.0
    source: str = "defaults"
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def store_path(self) -> Path:
        return self.state_dir / "jobs.sqlite3"

    @property
    def uploads_dir(self) -> Path:
        return self.state_dir / "uploads"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def inputs_dir(self) -> Path:
        """Uploaded models, kept once per content and name (`inputs/<sha256>/<name>`)
        while jobs refer to them."""
        return self.state_dir / "inputs"

    @property
    def claims_dir(self) -> Path:
        """Where inbox files are moved when claimed (same file system as the state dir)."""
        return self.state_dir / "claimed"

    def socket_gid(self) -> int | None:
        """The gid of `socket_group` (None when unset); OptionError when no such group."""
        if not self.socket_group:
            return None
        import grp

        try:
            return grp.getgrnam(self.socket_group).gr_gid
        except KeyError:
            raise OptionError(
                f"[listen] socket_group {self.socket_group!r}: no such group"
            ) from None

    def listen_addresses(self) -> list[str]:
        out = [f"unix://{self.socket}"] if self.socket else []
        if self.tcp:
            out.append(self.tcp)
        return out

    def tcp_is_loopback(self) -> bool:
        return _loopback(_host(self.tcp))

    @property
    def world_limits(self) -> WorldLimits:
        return WorldLimits(self.max_world_size, self.max_ranks_per_device, "[limits] ")


def _host(hostport: str) -> str:
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return host.strip("[]")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostport(target: str) -> str:
    """HOST:PORT of a TCP gRPC target ("dns:///h:1", "dns:h:1", "ipv4:h:1", "h:1")."""
    for prefix in ("dns://", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target.removeprefix(prefix)
            break
    return target.rsplit("/", 1)[-1] if target.startswith("/") or "/" in target else target


# The daemon's sections of the TOML file: each attribute is the DaemonConfig field it
# sets (the Inbox field, for [[inbox]]), renamed to its key in the file where they
# differ; its type and Meta the bounds and the words of its errors; the defaults are
# DaemonConfig's. A path is a string until it is resolved against the file's folder.

#: An octal mode, as the file spells it ("0660", "2770").
_MODE = r"^[0-7]{3,4}$"
_Daemon = section(
    "_Daemon",
    {"retention_s": "retention_days"},
    state_dir=str,
    max_running_jobs=Annotated[int, Meta(ge=1, le=64)],
    max_queued_jobs=Annotated[int, Meta(ge=1, le=100_000)],
    max_jobs_per_client=Annotated[int, Meta(ge=1, le=100_000)],
    retention_s=Annotated[float, Meta(ge=0, le=36_500)],
    shutdown_grace_s=Annotated[float, Meta(ge=0, le=3600)],
    max_job_attempts=Annotated[int, Meta(ge=1, le=1000)],
    allowed_dirs=Annotated[
        tuple[Annotated[str, Meta(min_length=1)], ...], Meta(description="a list of directories")
    ],
    allow_unconfined_gdat=bool,
)
_Listen = section(
    "_Listen",
    socket=str,
    socket_mode=Annotated[str, Meta(pattern=_MODE, description='an octal mode like "0660"')],
    socket_group=str,
    tcp=str,
    tls_cert=str,
    tls_key=str,
    tls_client_ca=str,
    insecure_loopback=bool,
    max_rpcs=Annotated[int, Meta(ge=4, le=100_000)],
)
_Limits = section(
    "_Limits",
    {
        "max_upload_bytes": "max_upload_mb",
        "upload_ttl_s": "upload_ttl_h",
        "max_uploads_bytes": "max_uploads_mb",
        "max_client_uploads_bytes": "max_client_uploads_mb",
        "min_free_bytes": "min_free_mb",
    },
    max_upload_bytes=Annotated[float, Meta(ge=1, le=1 << 20)],
    upload_ttl_s=Annotated[float, Meta(ge=0.0001, le=24 * 365)],
    max_uploads_bytes=Annotated[float, Meta(ge=1, le=1 << 30)],
    max_uploads=Annotated[int, Meta(ge=1, le=1 << 20)],
    max_client_uploads_bytes=Annotated[float, Meta(ge=1, le=1 << 30)],
    max_client_uploads=Annotated[int, Meta(ge=1, le=1 << 20)],
    min_free_bytes=Annotated[float, Meta(ge=0, le=1 << 30)],
    max_world_size=Annotated[int, Meta(ge=1, le=1 << 20)],
    max_ranks_per_device=Annotated[int, Meta(ge=1, le=1 << 20)],
)
_Metrics = section(
    "_Metrics",
    {
        "metrics_listen": "listen",
        "metrics_allow_remote": "allow_remote",
        "metrics_max_connections": "max_connections",
        "metrics_timeout_s": "timeout_s",
    },
    metrics_listen=str,
    metrics_allow_remote=bool,
    metrics_max_connections=Annotated[int, Meta(ge=1, le=4096)],
    metrics_timeout_s=Annotated[float, Meta(ge=0.1, le=300)],
)
#: The keys of [bank] the daemon reads (aoe.config's DAEMON_KEYS).
_Follow = section(
    "_Follow",
    follow=Annotated[
        tuple[Annotated[str, Meta(pattern=r"\S")], ...],
        Meta(description='a list of gRPC targets ("unix:///path.sock", "dns:///host:7461")'),
    ],
    follow_ca=str,
    follow_cert=str,
    follow_key=str,
    follow_insecure_loopback=bool,
)
_Inbox = section(
    "_Inbox",
    path=str,
    outbox=str,
    failed=str,
    stable_s=Annotated[float, Meta(ge=0, le=3600)],
    mode=Annotated[str, Meta(pattern=_MODE, description='an octal mode like "2770"')],
    group=str,
)

_SECTIONS: Mapping[str, type[Section]] = {
    "daemon": _Daemon,
    "listen": _Listen,
    "limits": _Limits,
    "metrics": _Metrics,
}
#: The daemon's keys in the TOML file, by section ([[inbox]] is "inbox"); the keys of
#: [bank] it reads are aoe.config's DAEMON_KEYS.
KEYS: Mapping[str, frozenset[str]] = {
    section: frozenset(f.encode_name for f in msgspec.structs.fields(cls))
    for section, cls in {**_SECTIONS, "inbox": _Inbox}.items()
}
_MIB = 1 << 20
#: The fields a file gives in other units than DaemonConfig's: days, hours, MiB.
_PER = {
    "retention_s": 86400.0,
    "upload_ttl_s": 3600.0,
    "max_upload_bytes": _MIB,
    "max_uploads_bytes": _MIB,
    "max_client_uploads_bytes": _MIB,
    "min_free_bytes": _MIB,
}
_PATHS = (
    *("state_dir", "socket", "tls_cert", "tls_key", "tls_client_ca"),
    *("follow_ca", "follow_cert", "follow_key"),
)


def _resolve(raw: str, base: Path) -> Path | None:
    """A path of the file: relative to its folder; "": none."""
    if not raw:
        return None
    p = Path(raw).expanduser()
    return p if p.is_absolute() else base / p


def _value(name: str, raw: Any, base: Path) -> Any:
    """The file's value for DaemonConfig's field `name` in that field's terms."""
    if name in _PATHS:
        return _resolve(raw, base)
    if name in _PER:
        value = raw * _PER[name]
        return int(value) if name.endswith("_bytes") else float(value)
    if name == "allowed_dirs":
        return tuple(base / Path(x).expanduser() for x in raw)
    if name == "follow":
        return tuple(x.strip() for x in raw)
    if name == "socket_mode":
        return int(raw, 8)
    return raw


def _table(doc: Mapping[str, Any], name: str, path: str, problems: Problems) -> Mapping[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        problems.add(f"{path}: {name!r} must be a [section]")
        return {}
    return table


def _inbox(table: Mapping[str, Any], where: str, base: Path, problems: Problems) -> Inbox | None:
    """One [[inbox]]; None when it has no path (recorded in `problems`)."""
    values = given(read_section(table, _Inbox, where, problems))
    p = _resolve(values.get("path", ""), base)
    if p is None:
        problems.add(f"{where}: path is required")
        return None
    return Inbox(
        p,
        _resolve(values.get("outbox", ""), base) or p.parent / "outbox",
        _resolve(values.get("failed", ""), base) or p.parent / "failed",
        float(values.get("stable_s", Inbox.stable_s)),
        _folder_mode(values.get("mode"), where, problems),
        _folder_group(values.get("group", ""), where, problems),
    )


def _folder_mode(raw: str | None, where: str, problems: Problems) -> int:
    """[[inbox]] mode (octal): the daemon's own bits whole, none for others."""
    if raw is None:
        return Inbox.mode
    mode = int(raw, 8)
    if mode & ~0o3777 or mode & 0o700 != 0o700 or mode & 0o007:
        problems.add(
            f"{where} mode = {raw!r}: a drop folder needs 0700 for the daemon and nothing for "
            'others (who may drop models is a group: set group and a mode like "2770")'
        )
        return Inbox.mode
    return mode


def _folder_group(name: str, where: str, problems: Problems) -> str:
    """[[inbox]] group: a group that exists here, or "" (the daemon's own)."""
    if name:
        import grp

        try:
            grp.getgrnam(name)
        except KeyError:
            problems.add(f"{where} group = {name!r}: no such group")
            return ""
    return name


def load_daemon_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The daemon's configuration from defaults, the TOML file at `path` (else
    AOED_CONFIG, else none) and the environment. Raises OptionError naming the key."""
    env = os.environ if env is None else env
    if path is None and env.get("AOED_CONFIG", "").strip():
        path = env["AOED_CONFIG"]
    problems = Problems()
    engine = Config()  # the defaults, while the engine's own sections have problems
    try:
        engine = load_config(path, env)
    except OptionError as exc:
        problems.found.extend(exc.problems)
    if engine.ray_token_file is not None:  # checked whenever named, used or not yet
        from aoed.engine.rayauth import read_token  # its owner and mode, as the daemon's user

        with problems.check():
            read_token(engine.ray_token_file, engine.sources.get("ray_token_file", "token_file"))
    doc: Mapping[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        p = Path(path)
        base = p.resolve().parent
        try:
            with open(p, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError):
            problems.raise_any()  # load_config could not read it either, and said why
            raise
    where = str(path) if path is not None else "defaults"
    values: dict[str, Any] = {}
    bank = _table(doc, "bank", where, problems)
    tables = {name: _table(doc, name, where, problems) for name in _SECTIONS}
    for name, cls, table in (
        *((name, cls, tables[name]) for name, cls in _SECTIONS.items()),
        # aoe.config reads the rest of [bank], and reports its unknown keys
        ("bank", _Follow, {k: v for k, v in bank.items() if ("bank", k) in DAEMON_KEYS}),
    ):
        section = read_section(table, cls, f"{where} [{name}]", problems)
        values.update((k, _value(k, v, base)) for k, v in given(section).items())
    state_dir = values.pop("state_dir", None) or _default_state_dir()
    # The socket lives in the runtime dir beside the device locks unless placed elsewhere.
    socket = values.pop("socket", engine.runtime_dir / "aoed.sock")
    if env_socket := env.get("AOED_SOCKET", "").strip():
        socket = Path(env_socket).expanduser()
    inboxes: list[Inbox] = []
    raw_inboxes = doc.get("inbox", None)
    if raw_inboxes is None:
        inboxes.append(Inbox(state_dir / "inbox", state_dir / "outbox", state_dir / "failed"))
    elif not isinstance(raw_inboxes, list) or not all(isinstance(t, dict) for t in raw_inboxes):
        problems.add(f"{where}: inbox must be an array of tables ([[inbox]])")
    else:
        for i, table in enumerate(raw_inboxes):
            if inbox := _inbox(table, f"{where} [[inbox]] #{i + 1}", base, problems):
                inboxes.append(inbox)
    paths = [i.path for i in inboxes]
    if len(set(paths)) != len(paths):
        problems.add(f"{where}: the same folder is listed as an inbox twice")
    cfg = DaemonConfig(
        engine=engine,
        state_dir=state_dir,
        socket=socket,
        inboxes=tuple(inboxes),
        source=where,
        **values,
    )
    if cfg.socket_mode & ~0o777 or cfg.socket_mode & 0o007:
        mode = f"{cfg.socket_mode:04o}"
        problems.add(
            f"{where} [listen] socket_mode = {mode!r}: the socket must not be open to others"
        )
    problems.found.extend(_check_listen(cfg, where))
    problems.found.extend(_check_follow(cfg, where))
    problems.found.extend(_check_metrics(cfg, where))
    problems.raise_any()
    return cfg


def _check_follow(cfg: DaemonConfig, where: str) -> list[str]:
    """Every problem with the peers `cfg` follows: TCP needs TLS, as for listening."""
    out = []
    w = f"{where} [bank]"
    if len(set(cfg.follow)) != len(cfg.follow):
        out.append(f"{w} follow: a peer is listed twice")
    for target in cfg.follow:
        if target.startswith("unix:"):
            if not target.removeprefix("unix:").lstrip("/"):
                out.append(f"{w} follow: {target!r}: expected unix:///path/to/aoed.sock")
            continue
        hostport = _hostport(target)
        host, port = _host(hostport), hostport.rsplit(":", 1)[1] if ":" in hostport else ""
        if not host or not port.isdigit():
            out.append(f"{w} follow: {target!r}: expected unix:///PATH or dns:///HOST:PORT")
        elif cfg.follow_ca is None and not _loopback(host):
            out.append(
                f"{w} follow: {target!r}: a peer over TCP needs TLS (set follow_ca to the CA of its "
                "server certificate)"
            )
        elif cfg.follow_ca is None and not cfg.follow_insecure_loopback:
            out.append(
                f"{w} follow: {target!r}: plain TCP needs follow_insecure_loopback = true "
                "(or set follow_ca)"
            )
    if (cfg.follow_cert is None) != (cfg.follow_key is None):
        out.append(f"{w}: follow_cert and follow_key go together")
    if cfg.follow_cert is not None and cfg.follow_ca is None:
        out.append(f"{w}: follow_cert needs follow_ca")
    for name in ("follow_ca", "follow_cert", "follow_key"):
        p = getattr(cfg, name)
        if p is not None and not p.is_file():
            out.append(f"{w} {name} = {str(p)!r}: no such file")
    return out


def _check_metrics(cfg: DaemonConfig, where: str) -> list[str]:
    """Every problem with where `cfg` serves metrics: loopback unless allowed."""
    if not cfg.metrics_listen:
        return []
    host = _host(cfg.metrics_listen)
    port = cfg.metrics_listen.rsplit(":", 1)[1] if ":" in cfg.metrics_listen else ""
    w = f"{where} [metrics] listen = {cfg.metrics_listen!r}"
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return [f'{w}: expected HOST:PORT, e.g. "127.0.0.1:9464"']
    if not _loopback(host) and not cfg.metrics_allow_remote:
        return [
            (
                f"{w}: not a loopback address; anyone who reaches it reads the daemon's metrics, so say "
                "allow_remote = true to serve it there"
            )
        ]
    return []


def _check_listen(cfg: DaemonConfig, where: str) -> list[str]:
    """Every problem with where `cfg` listens."""
    if not cfg.socket and not cfg.tcp:
        return [f"{where} [listen]: neither a socket nor tcp is configured: nothing to listen on"]
    if not cfg.tcp:
        return []
    out = []
    host = _host(cfg.tcp)
    port = cfg.tcp.rsplit(":", 1)[1] if ":" in cfg.tcp else ""
    if not host or not port.isdigit():
        out.append(f"{where} [listen] tcp = {cfg.tcp!r}: expected HOST:PORT")
    has_tls = cfg.tls_cert is not None and cfg.tls_key is not None
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        out.append(f"{where} [listen]: tls_cert and tls_key go together")
    if not has_tls:
        if not cfg.tcp_is_loopback():
            out.append(
                f"{where} [listen] tcp = {cfg.tcp!r}: TCP on a non-loopback address needs TLS "
                "(set tls_cert and tls_key)"
            )
        elif not cfg.insecure_loopback:
            out.append(
                f"{where} [listen] tcp = {cfg.tcp!r}: plain TCP needs insecure_loopback = true "
                "(or set tls_cert and tls_key)"
            )
    if cfg.tls_client_ca is not None and not has_tls:
        out.append(f"{where} [listen] tls_client_ca needs tls_cert and tls_key")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        p = getattr(cfg, name)
        if p is not None and not p.is_file():
            out.append(f"{where} [listen] {name} = {str(p)!r}: no such file")
    return out

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aoe.config import Config, Problems, load_config
from aoe.errors import OptionError
from aoed.engine.worldsize import DEFAULT_RANKS_PER_DEVICE, WorldLimits, default_max_world_size

__all__ = ["KEYS", "DaemonConfig", "Inbox", "load_daemon_config"]

DEFAULT_PORT = 7461

#: The daemon's keys in the TOML file, by section ([[inbox]] is "inbox"); the keys of
#: [bank] it reads are aoe.config's DAEMON_KEYS.
KEYS: Mapping[str, frozenset[str]] = {
    "daemon": frozenset(
        {
            "state_dir",
            "max_running_jobs",
            "max_queued_jobs",
            "max_jobs_per_client",
            "retention_days",
            "shutdown_grace_s",
            "max_job_attempts",
            "allowed_dirs",
            "allow_unconfined_gdat",
        }
    ),
    "listen": frozenset(
        {
            "socket",
            "socket_mode",
            "socket_group",
            "tcp",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "insecure_loopback",
            "max_rpcs",
        }
    ),
    "limits": frozenset(
        {
            "max_upload_mb",
            "upload_ttl_h",
            "max_uploads_mb",
            "max_uploads",
            "max_client_uploads_mb",
            "max_client_uploads",
            "min_free_mb",
            "max_world_size",
            "max_ranks_per_device",
        }
    ),
    "inbox": frozenset({"path", "outbox", "failed", "stable_s", "mode", "group"}),
    "metrics": frozenset({"listen", "allow_remote", "max_connections", "timeout_s"}),
}


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


def _mib(n: float) -> int:
    return int(float(n) * (1 << 20))


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


def _table(doc: Mapping[str, Any], name: str, path: Path, problems: Problems) -> Mapping[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        problems.add(f"{path}: {name!r} must be a [section]")
        return {}
    return table


class _Reader:
    """Reads typed values out of one section, naming file, section and key in errors.
    A bad value is recorded in `problems` and its default returned, so that reading
    goes on and every problem is reported."""

    def __init__(
        self,
        table: Mapping[str, Any],
        where: str,
        known: frozenset[str] | set[str],
        problems: Problems,
    ):
        self.table, self.where, self.problems = table, where, problems
        for key in sorted(set(table) - known):
            problems.add(f"{where} {key}: unknown setting (known: {', '.join(sorted(known))})")

    def _w(self, key: str) -> str:
        return f"{self.where} {key}"

    def number(self, key: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
        raw = self.table.get(key, default)
        if (
            isinstance(raw, bool)
            or not isinstance(raw, int | float)
            or (integer and not isinstance(raw, int))
        ):
            self.problems.add(
                f"{self._w(key)} = {raw!r}: expected {'an integer' if integer else 'a number'}"
            )
            return default
        if not lo <= raw <= hi:
            self.problems.add(f"{self._w(key)} = {raw}: must be between {lo:g} and {hi:g}")
            return default
        return raw

    def text(self, key: str, default: str) -> str:
        raw = self.table.get(key, default)
        if not isinstance(raw, str):
            self.problems.add(f"{self._w(key)} = {raw!r}: expected a string")
            return default
        return raw

    def path(self, key: str, default: Path | None, base: Path) -> Path | None:
        raw = self.table.get(key)
        if raw is None:
            return default
        if not isinstance(raw, str):
            self.problems.add(f"{self._w(key)} = {raw!r}: expected a path")
            return default
        if not raw:
            return None
        p = Path(raw).expanduser()
        return p if p.is_absolute() else base / p

    def flag(self, key: str, default: bool) -> bool:
        raw = self.table.get(key, default)
        if not isinstance(raw, bool):
            self.problems.add(f"{self._w(key)} = {raw!r}: expected true or false")
            return default
        return raw


def _folder_mode(r: _Reader) -> int:
    """[[inbox]] mode: octal; the daemon's own bits whole, none for others."""
    raw = r.text("mode", "2770")
    try:
        mode = int(raw, 8)
    except ValueError:
        r.problems.add(f'{r.where} mode = {raw!r}: expected an octal mode like "2770"')
        return Inbox.mode
    if mode & ~0o3777 or mode & 0o700 != 0o700 or mode & 0o007:
        r.problems.add(
            f"{r.where} mode = {raw!r}: a drop folder needs 0700 for the daemon and nothing for "
            'others (who may drop models is a group: set group and a mode like "2770")'
        )
        return Inbox.mode
    return mode


def _folder_group(r: _Reader) -> str:
    """[[inbox]] group: a group that exists here, or "" (the daemon's own)."""
    name = r.text("group", "")
    if name:
        import grp

        try:
            grp.getgrnam(name)
        except KeyError:
            r.problems.add(f"{r.where} group = {name!r}: no such group")
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
    d = _Reader(
        _table(doc, "daemon", Path(where), problems),
        f"{where} [daemon]",
        KEYS["daemon"],
        problems,
    )
    state_dir = d.path("state_dir", None, base) or _default_state_dir()
    raw_allowed = d.table.get("allowed_dirs", [])
    if not isinstance(raw_allowed, list) or not all(isinstance(x, str) and x for x in raw_allowed):
        problems.add(f"{where} [daemon] allowed_dirs: expected a list of directories")
        raw_allowed = []
    allowed = tuple((base / Path(x).expanduser()) for x in raw_allowed)
    lis = _Reader(
        _table(doc, "listen", Path(where), problems),
        f"{where} [listen]",
        KEYS["listen"],
        problems,
    )
    env_socket = env.get("AOED_SOCKET", "").strip()
    # The socket lives in the runtime dir beside the device locks unless placed elsewhere.
    socket = (
        Path(env_socket).expanduser()
        if env_socket
        else lis.path("socket", engine.runtime_dir / "aoed.sock", base)
    )
    mode_raw = lis.text("socket_mode", "0660")
    socket_mode = 0o660
    try:
        socket_mode = int(mode_raw, 8)
    except ValueError:
        problems.add(
            f'{where} [listen] socket_mode = {mode_raw!r}: expected an octal mode like "0660"'
        )
    if socket_mode & ~0o777 or socket_mode & 0o007:
        problems.add(
            f"{where} [listen] socket_mode = {mode_raw!r}: the socket must not be open to others"
        )
    lim = _Reader(
        _table(doc, "limits", Path(where), problems),
        f"{where} [limits]",
        KEYS["limits"],
        problems,
    )
    inboxes = []
    raw_inboxes = doc.get("inbox", None)
    if raw_inboxes is None:
        inboxes.append(Inbox(state_dir / "inbox", state_dir / "outbox", state_dir / "failed"))
    elif not isinstance(raw_inboxes, list) or not all(isinstance(t, dict) for t in raw_inboxes):
        problems.add(f"{where}: inbox must be an array of tables ([[inbox]])")
    else:
        for i, table in enumerate(raw_inboxes):
            r = _Reader(
                table,
                f"{where} [[inbox]] #{i + 1}",
                KEYS["inbox"],
                problems,
            )
            p = r.path("path", None, base)
            if p is None:
                problems.add(f"{where} [[inbox]] #{i + 1}: path is required")
                continue
            inboxes.append(
                Inbox(
                    p,
                    r.path("outbox", p.parent / "outbox", base),
                    r.path("failed", p.parent / "failed", base),
                    float(r.number("stable_s", 2.0, 0.0, 3600.0)),
                    _folder_mode(r),
                    _folder_group(r),
                )
            )
    paths = [i.path for i in inboxes]
    if len(set(paths)) != len(paths):
        problems.add(f"{where}: the same folder is listed as an inbox twice")
    cfg = DaemonConfig(
        engine=engine,
        state_dir=state_dir,
        socket=socket,
        socket_mode=socket_mode,
        socket_group=lis.text("socket_group", ""),
        tcp=lis.text("tcp", ""),
        tls_cert=lis.path("tls_cert", None, base),
        tls_key=lis.path("tls_key", None, base),
        tls_client_ca=lis.path("tls_client_ca", None, base),
        insecure_loopback=lis.flag("insecure_loopback", False),
        max_rpcs=int(lis.number("max_rpcs", 256, 4, 100000, integer=True)),
        max_running_jobs=int(d.number("max_running_jobs", 2, 1, 64, integer=True)),
        max_queued_jobs=int(d.number("max_queued_jobs", 64, 1, 100000, integer=True)),
        max_jobs_per_client=int(d.number("max_jobs_per_client", 16, 1, 100000, integer=True)),
        retention_s=float(d.number("retention_days", 30, 0, 36500)) * 86400.0,
        shutdown_grace_s=float(d.number("shutdown_grace_s", 20, 0, 3600)),
        max_job_attempts=int(d.number("max_job_attempts", 3, 1, 1000, integer=True)),
        allowed_dirs=allowed,
        allow_unconfined_gdat=d.flag("allow_unconfined_gdat", False),
        max_upload_bytes=int(float(lim.number("max_upload_mb", 2048, 1, 1 << 20)) * (1 << 20)),
        upload_ttl_s=float(lim.number("upload_ttl_h", 24, 0.0001, 24 * 365)) * 3600.0,
        max_uploads_bytes=_mib(lim.number("max_uploads_mb", 8192, 1, 1 << 30)),
        max_uploads=int(lim.number("max_uploads", 64, 1, 1 << 20, integer=True)),
        max_client_uploads_bytes=_mib(lim.number("max_client_uploads_mb", 4096, 1, 1 << 30)),
        max_client_uploads=int(lim.number("max_client_uploads", 16, 1, 1 << 20, integer=True)),
        min_free_bytes=_mib(lim.number("min_free_mb", 512, 0, 1 << 30)),
        max_world_size=int(
            lim.number("max_world_size", default_max_world_size(), 1, 1 << 20, integer=True)
        ),
        max_ranks_per_device=int(
            lim.number("max_ranks_per_device", DEFAULT_RANKS_PER_DEVICE, 1, 1 << 20, integer=True)
        ),
        inboxes=tuple(inboxes),
        source=where,
    )
    bank = _table(doc, "bank", Path(where), problems)
    b = _Reader(bank, f"{where} [bank]", set(bank), problems)  # aoe.config reports unknown keys
    met = _Reader(
        _table(doc, "metrics", Path(where), problems),
        f"{where} [metrics]",
        KEYS["metrics"],
        problems,
    )
    raw_follow = bank.get("follow", [])
    if not isinstance(raw_follow, list) or not all(
        isinstance(x, str) and x.strip() for x in raw_follow
    ):
        problems.add(
            f'{where} [bank] follow: expected a list of gRPC targets ("unix:///path.sock", "dns:///host:7461")'
        )
        raw_follow = []
    cfg = replace(
        cfg,
        follow=tuple(x.strip() for x in raw_follow),
        follow_ca=b.path("follow_ca", None, base),
        follow_cert=b.path("follow_cert", None, base),
        follow_key=b.path("follow_key", None, base),
        follow_insecure_loopback=b.flag("follow_insecure_loopback", False),
        metrics_listen=met.text("listen", ""),
        metrics_allow_remote=met.flag("allow_remote", False),
        metrics_max_connections=int(met.number("max_connections", 16, 1, 4096, integer=True)),
        metrics_timeout_s=float(met.number("timeout_s", 10, 0.1, 300)),
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

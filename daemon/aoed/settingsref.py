"""Every setting of the TOML file, as the reference in docs/configuration.md shows it.

One row per key: its section, what it sets, and its default, read from the
configuration the loaders build from no file at all (`aoe.config.load_config` and
`aoed.config.load_daemon_config`), converted to the file's units. Where the default
depends on the machine (a path, the number of cores) the row says how it is derived
instead. `aoed.docgen` renders the rows into the docs, and tests/test_docs_reference.py
checks that the rows name exactly the keys the loaders read and that
deploy/aoed.toml shows each default it does not deliberately change.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aoe.config import DAEMON_KEYS, ENV_KEYS, TOML_KEYS
from aoed.config import KEYS, DaemonConfig, load_daemon_config

__all__ = ["DAEMON", "ENGINE", "Setting", "defaults", "read_keys", "toml_value"]


@dataclass(frozen=True)
class Setting:
    section: str  #: "inbox" for [[inbox]]
    key: str
    what: str  #: what it sets, in the docs' words (markdown)
    #: the default in the file's units, from the configuration built from no file
    value: Callable[[DaemonConfig], Any] | None = None
    #: how the default is shown when it depends on the machine (or is not one value)
    shown: str = ""
    #: a deployment's own choice (a path, a group, a level): deploy/aoed.toml may set
    #: another value than the default without saying so
    site: bool = False

    @property
    def heading(self) -> str:
        return f"[[{self.section}]]" if self.section == "inbox" else f"[{self.section}]"

    def default(self, cfg: DaemonConfig) -> str:
        """The default as the reference shows it: `shown`, else the TOML value."""
        if self.shown:
            return self.shown
        assert self.value is not None, self.key
        return f"`{toml_value(self.value(cfg))}`"

    def env(self) -> str:
        """The environment variables that set it (engine settings only), or ""."""
        field = TOML_KEYS.get((self.section, self.key))
        names = [var for var, f in ENV_KEYS.items() if f == field]
        if field == "device":
            names.append("ASCEND_DEVICE_ID")
        return ", ".join(f"`{n}`" for n in names)


def toml_value(value: Any) -> str:
    """`value` as the TOML file spells it (a whole float as an integer, as the file may
    give it; a mode as its octal string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _engine(name: str, per: float = 1) -> Callable[[DaemonConfig], Any]:
    return lambda c: _per(getattr(c.engine, name), per)


def _daemon(name: str, per: float = 1) -> Callable[[DaemonConfig], Any]:
    return lambda c: _per(getattr(c, name), per)


def _inbox(name: str) -> Callable[[DaemonConfig], Any]:
    return lambda c: getattr(c.inboxes[0], name)  # the default inbox: no [[inbox]] given


def _per(value: Any, per: float) -> Any:
    return value / per if per != 1 else value


def _mode(name: str, inbox: bool = False) -> Callable[[DaemonConfig], Any]:
    def get(c: DaemonConfig) -> str:
        mode = getattr(c.inboxes[0] if inbox else c, name)
        return f"{mode:04o}"

    return get


_MIB = 1 << 20
_DAY = 86400.0
_HOUR = 3600.0

#: The engine's settings (aoe.config), which every command and the daemon read.
ENGINE = (
    Setting(
        "bank",
        "path",
        "the custom bank ([bank.md](bank.md))",
        shown="`~/.local/share/aoed/bank` (the user data dir); `/var/lib/aoed/bank` as root",
        site=True,
    ),
    Setting(
        "bank",
        "layers",
        "read-only banks under the custom one, in lookup order",
        shown="none",
        site=True,
    ),
    Setting(
        "tuning",
        "repeat_tune",
        "re-tune tasks the bank already knows",
        _engine("repeat_tune"),
    ),
    Setting("tuning", "parallel", "compile processes, 1-32", shown="cores - 1"),
    Setting(
        "tuning",
        "device",
        "`cpu`, `cpu:FIRST-LAST` (a set of cores), `cuda:N`, `tensorrt:N`, `cann:N`",
        lambda c: str(c.engine.device),
        site=True,
    ),
    Setting(
        "tuning",
        "devices",
        'several devices, one measuring agent each (e.g. `["cann:0", "cann:1"]`, or core '
        "sets); `device` is the one-device spelling",
        shown="`device` alone",
        site=True,
    ),
    Setting(
        "tuning",
        "plugins",
        "modules that register extra strategies",
        shown="none",
        site=True,
    ),
    Setting(
        "tuning",
        "runtime",
        "what a job that says `--runtime auto` may ship on: `auto` (OpenVINO competes with "
        "onnxruntime where it is installed), `onnxruntime` (OpenVINO is never started), "
        "`openvino`",
        lambda c: c.engine.runtime,
    ),
    Setting(
        "engine",
        "runtime_dir",
        "where per-device measurement locks live (and the daemon's socket, unless placed "
        "elsewhere)",
        shown="`/run/aoed` as root (or where it is writable), else `$XDG_RUNTIME_DIR/aoed`, "
        "else a per-user temp dir",
        site=True,
    ),
    Setting(
        "engine",
        "dedicated_cores",
        "measurement cores of their own: `auto` (4+ cores), `true`, `false`",
        lambda c: "auto" if c.engine.dedicated_cores is None else c.engine.dedicated_cores,
    ),
    Setting(
        "engine",
        "memory_mb",
        "what the engine's processes may use; `0`: MemAvailable / cgroup; else at least 2048. "
        "Jobs share it, less 256 MiB: a job starts only while its estimate fits beside the "
        "running jobs', and waits in the queue until it does",
        _engine("memory_mb"),
    ),
    Setting(
        "engine",
        "worker_memory_mb",
        "address-space limit of each child process, >= 1024; `0`: none; `auto`: (memory - "
        "256 MiB) / (workers + 1 runner)",
        lambda c: "auto" if c.engine.worker_memory_mb is None else c.engine.worker_memory_mb,
    ),
    Setting(
        "engine", "max_model_mb", "a model file and its external data", _engine("max_model_mb")
    ),
    Setting("engine", "max_nodes", "nodes in all of a model's graphs", _engine("max_nodes")),
    Setting("engine", "max_tensor_mb", "one declared or inferred tensor", _engine("max_tensor_mb")),
    Setting(
        "engine",
        "compile_timeout_s",
        "a worker's time per candidate (and per bank rebuild), x (1 + model MiB/256)",
        _engine("compile_timeout_s"),
    ),
    Setting(
        "engine",
        "stage_timeout_s",
        "a worker's time per other stage (prepare, extract, assemble), likewise scaled",
        _engine("stage_timeout_s"),
    ),
    Setting(
        "cluster",
        "executor",
        "`local`: children on this machine; `ray`: actors of a Ray cluster (the `aoed[cluster]` "
        "extra; [daemon.md](daemon.md#devices-on-other-servers-ray))",
        _engine("executor"),
    ),
    Setting(
        "cluster",
        "address",
        'the Ray head, `HOST:PORT` (or `"auto"`: a cluster `ray start` began on this machine, '
        "only without `token_file`); needed with `ray`",
        shown="none",
        site=True,
    ),
    Setting(
        "cluster",
        "token_file",
        "absolute path of the file holding the token the cluster's nodes were started with "
        "(`RAY_AUTH_MODE=token`); needed with `ray`. It must belong to the user reading it and "
        "be closed to everyone else (mode 0600), and hold one word of 32 characters or more. "
        "Ray gets its path, never the token. Before connecting, the head must refuse a call "
        "without the token and take one with it "
        "([daemon.md](daemon.md#devices-on-other-servers-ray))",
        shown="none",
        site=True,
    ),
    Setting(
        "cluster",
        "allow_unauthenticated",
        "`true`: use a Ray cluster that asks no token (no `token_file` needed). Anyone who can "
        "reach such a cluster runs code as its nodes' user and in the daemon; the daemon says "
        "so in its log at every start",
        _engine("ray_allow_unauthenticated"),
    ),
    Setting(
        "log",
        "level",
        "`debug`, `info`, `warning`, `error`",
        _engine("log_level"),
        shown='`"warning"` for `aoe`; `"info"` for `aoed` (its `--log-level` wins)',
        site=True,
    ),
)

#: The daemon's own settings (aoed.config); `aoe` ignores them.
DAEMON = (
    Setting(
        "daemon",
        "state_dir",
        "job store, uploads, inputs, job outputs, claimed inbox files",
        shown="`~/.local/state/aoed`; `/var/lib/aoed` as root",
        site=True,
    ),
    Setting(
        "daemon",
        "max_running_jobs",
        "jobs tuning at once (they share the workers and the devices)",
        _daemon("max_running_jobs"),
    ),
    Setting(
        "daemon",
        "max_queued_jobs",
        "beyond this, SubmitJob answers RESOURCE_EXHAUSTED",
        _daemon("max_queued_jobs"),
    ),
    Setting(
        "daemon",
        "max_jobs_per_client",
        "queued + running per client (a TLS subject, a TCP address, an inbox; the unix socket "
        "is one client)",
        _daemon("max_jobs_per_client"),
    ),
    Setting(
        "daemon",
        "retention_days",
        "how long finished jobs and their outputs are kept",
        _daemon("retention_s", _DAY),
    ),
    Setting(
        "daemon",
        "shutdown_grace_s",
        "on SIGTERM, how long running measurements may finish before their jobs are requeued; "
        "15 s after it the process ends whatever it is doing, killing its children (the reason "
        "is logged)",
        _daemon("shutdown_grace_s"),
    ),
    Setting(
        "daemon",
        "max_job_attempts",
        "a job that was running when the daemon stopped, crashed or was killed this many times "
        "is failed, not started again",
        _daemon("max_job_attempts"),
    ),
    Setting(
        "daemon",
        "allowed_dirs",
        "folders clients may name by path (symlinks resolved); none: clients upload",
        _daemon("allowed_dirs"),
        site=True,
    ),
    Setting(
        "daemon",
        "allow_unconfined_gdat",
        "load a `.pt2` (a GDAT program, or one exported to ONNX for inference) or convert a "
        "TensorFlow SavedModel in processes the kernel does not confine, where it cannot "
        "(no Landlock, or a seccomp filter refusing its calls); the job's log and result say "
        "so. Without it such a job fails naming this setting "
        "([gdat.md](gdat.md#what-a-program-may-hold)). `aoe tune` without a daemon reads "
        "`AOE_GDAT_UNCONFINED=1` instead",
        _daemon("allow_unconfined_gdat"),
    ),
    Setting(
        "listen",
        "socket",
        'the unix socket; `""`: none',
        shown="`aoed.sock` in the runtime dir (`AOED_SOCKET` wins)",
        site=True,
    ),
    Setting(
        "listen",
        "socket_mode",
        "the socket's mode: its permissions are the access control, never open to others",
        _mode("socket_mode"),
    ),
    Setting(
        "listen",
        "socket_group",
        "the socket's group; `\"\"`: the daemon's own",
        _daemon("socket_group"),
        site=True,
    ),
    Setting(
        "listen",
        "tcp",
        "`HOST:PORT`; needs `tls_cert` and `tls_key`, unless a loopback address with "
        '`insecure_loopback = true`; `""`: off',
        _daemon("tcp"),
        site=True,
    ),
    Setting("listen", "tls_cert", "the server's certificate", shown="none", site=True),
    Setting("listen", "tls_key", "the server's private key", shown="none", site=True),
    Setting(
        "listen",
        "tls_client_ca",
        "mutual TLS: the CA of client certificates",
        shown="none",
        site=True,
    ),
    Setting(
        "listen",
        "insecure_loopback",
        "plain TCP, on a loopback address only",
        _daemon("insecure_loopback"),
    ),
    Setting(
        "listen",
        "max_rpcs",
        "concurrent RPCs; beyond, RESOURCE_EXHAUSTED",
        _daemon("max_rpcs"),
    ),
    Setting("limits", "max_upload_mb", "one upload", _daemon("max_upload_bytes", _MIB)),
    Setting(
        "limits",
        "upload_ttl_h",
        "an upload not submitted by then is deleted",
        _daemon("upload_ttl_s", _HOUR),
    ),
    Setting(
        "limits",
        "max_uploads_mb",
        "bytes of the uploads not yet submitted, all clients together",
        _daemon("max_uploads_bytes", _MIB),
    ),
    Setting(
        "limits",
        "max_uploads",
        "uploads not yet submitted, all clients together",
        _daemon("max_uploads"),
    ),
    Setting(
        "limits",
        "max_client_uploads_mb",
        "bytes of one client's uploads not yet submitted",
        _daemon("max_client_uploads_bytes", _MIB),
    ),
    Setting(
        "limits",
        "max_client_uploads",
        "one client's uploads not yet submitted",
        _daemon("max_client_uploads"),
    ),
    Setting(
        "limits",
        "min_free_mb",
        "below this free in the state dir, new jobs and uploads are refused and queued jobs wait",
        _daemon("min_free_bytes", _MIB),
    ),
    Setting(
        "limits",
        "max_world_size",
        "ranks of one GDAT world (each a process and a log file); a larger `world_size` is "
        "refused at submit",
        shown="the cores, at least 2",
    ),
    Setting(
        "limits",
        "max_ranks_per_device",
        "ranks that share one device: a CPU core on gloo (so a gloo world is at most cores x "
        "this), an accelerator on nccl and hccl",
        _daemon("max_ranks_per_device"),
    ),
    Setting(
        "inbox",
        "path",
        "a watched drop folder; repeat `[[inbox]]` for more",
        shown="`inbox/` in the state dir when no `[[inbox]]` is given",
        site=True,
    ),
    Setting(
        "inbox",
        "outbox",
        "where the tuned model, the result JSON and the report go",
        shown="`outbox/` beside the inbox",
        site=True,
    ),
    Setting(
        "inbox",
        "failed",
        "where a model that failed goes, with `NAME.error.txt` beside it",
        shown="`failed/` beside the inbox",
        site=True,
    ),
    Setting(
        "inbox",
        "stable_s",
        "a file whose size and mtime have not changed this long is complete",
        _inbox("stable_s"),
    ),
    Setting(
        "inbox",
        "mode",
        "mode of an inbox, outbox or failed folder the daemon makes because it is missing (a "
        "folder that exists is left as it is): group-writable and setgid, as deploy/ makes "
        "them; 0700 for the daemon and nothing for others",
        _mode("mode", inbox=True),
    ),
    Setting(
        "inbox",
        "group",
        'group of a folder made so (`""`: the group a new folder gets, the daemon\'s); the '
        "daemon's user must be a member of it",
        _inbox("group"),
        site=True,
    ),
    Setting(
        "bank",
        "follow",
        "peers whose banks this one follows: `unix:///PATH` or `dns:///HOST:PORT` "
        "([bank.md](bank.md#following-other-servers-banks))",
        _daemon("follow"),
        site=True,
    ),
    Setting(
        "bank",
        "follow_ca",
        "the CA of the peers' server certificates (TCP peers need TLS)",
        shown="none",
        site=True,
    ),
    Setting(
        "bank",
        "follow_cert",
        "this daemon's client certificate, for peers that want mutual TLS (with `follow_key`)",
        shown="none",
        site=True,
    ),
    Setting("bank", "follow_key", "the key of `follow_cert`", shown="none", site=True),
    Setting(
        "bank",
        "follow_insecure_loopback",
        "plain TCP to a loopback peer",
        _daemon("follow_insecure_loopback"),
    ),
    Setting(
        "metrics",
        "listen",
        'the Prometheus endpoint, e.g. `"127.0.0.1:9464"`; `""`: off',
        _daemon("metrics_listen"),
        site=True,
    ),
    Setting(
        "metrics",
        "allow_remote",
        "needed for a non-loopback `listen` address",
        _daemon("metrics_allow_remote"),
    ),
    Setting(
        "metrics",
        "max_connections",
        "connections to the endpoint open at once; one more is closed at once, unanswered",
        _daemon("metrics_max_connections"),
    ),
    Setting(
        "metrics",
        "timeout_s",
        "a connection's time in all (its request, the scrape, the answer), then it is closed",
        _daemon("metrics_timeout_s"),
    ),
)


def defaults() -> DaemonConfig:
    """The configuration from no file and no environment: every default."""
    return load_daemon_config(None, env={})


def read_keys() -> Iterator[tuple[str, str]]:
    """Every (section, key) the loaders read ([[inbox]] as "inbox")."""
    yield from TOML_KEYS
    yield from DAEMON_KEYS
    for section, keys in KEYS.items():
        for key in keys:
            yield section, key

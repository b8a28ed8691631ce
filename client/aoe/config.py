"""Configuration: one frozen `Config` from defaults, a TOML file and the environment.

Precedence, lowest first: built-in defaults, the TOML file (`--config FILE` or
AOED_CONFIG), the environment, then what the caller overrides (command-line options).
Every environment variable the project honours is read here and nowhere else:

  TUNE_BANK_PATH         custom bank directory (AOE)
  REPEAT_TUNE            True/False: tune tasks the bank already knows again (AOE)
  TE_PARALLEL_COMPILER   compile processes, 1-32 (AOE)
  ASCEND_DEVICE_ID       selects Ascend NPU N (the cann provider) (AOE)
  AOED_BANK_LAYERS       read-only bank layers under the custom one (os.pathsep list)
  AOED_PLUGINS           strategy plugin modules (comma separated)
  AOED_RUNTIME_DIR       where per-device measurement locks live
  AOED_TUNING_RUNTIME    what a job that says --runtime auto may ship on
  AOED_CONFIG            the TOML file, when --config is not given
  AOED_SOCKET            the daemon's unix socket (clients and the daemon)

The TOML file:

  [bank]
  path = "/var/lib/aoed/bank"           # TUNE_BANK_PATH wins over this
  layers = ["/usr/share/aoed/bank"]
  [tuning]
  repeat_tune = false
  parallel = 4
  device = "cpu"                         # cpu, cuda:0, cann:0, tensorrt:0
  devices = ["cann:0", "cann:1"]         # several: one device agent each (cpu:0-7 is a core set)
  plugins = ["my_strategies"]
  runtime = "auto"                       # auto, onnxruntime, openvino: what a job that says
                                         # --runtime auto may ship on
  [engine]
  runtime_dir = "/run/aoed"
  dedicated_cores = "auto"               # auto (4+ cores), true, false
  memory_mb = 0                          # memory the engine's processes may use; 0: MemAvailable / cgroup
  worker_memory_mb = "auto"              # address-space limit per child process, >= 1024; 0: none;
                                         # auto: (memory_mb - 256) / (workers + 1 runner)
  max_model_mb = 8192                    # a model file and its external data together
  max_nodes = 200000                     # nodes in all of a model's graphs
  max_tensor_mb = 4096                   # one declared or inferred tensor
  compile_timeout_s = 120                # one candidate's compile (and a bank rebuild)
  stage_timeout_s = 900                  # any other worker stage (prepare, extract, assemble...)
  [cluster]
  executor = "local"                     # local: child processes here; ray: Ray actors on
                                         # the nodes that offer each device (the cluster extra)
  address = "10.0.0.1:6379"              # the Ray head (needed with ray; "auto": this machine's)
  token_file = "/etc/aoed/ray-token"     # the cluster's token (RAY_AUTH_MODE=token), needed with
                                         # ray; its reader's own, mode 0600 (checked at use)
  allow_unauthenticated = false          # true: a cluster that asks no token is used (anyone who
                                         # reaches it runs code as its nodes' user)
  [log]
  level = "warning"

The time limits are for a small model; a job's limits grow with its model file (1 +
size/256 MiB: 2x at 256 MiB, 9x at 2 GiB), since its work does.

The daemon's own sections ([daemon], [listen], [limits], [[inbox]], [metrics]) and the
keys of [bank] that say which peers' banks it follows (`follow`, `follow_*`) are read
by `aoed.config`.

The file's sections are read strictly, each into a typed struct whose fields carry
their bounds (aoe._sections): a TOML number or boolean written as a string is an error,
where the environment's strings are read leniently (REPEAT_TUNE=yes). Errors are
`OptionError`s that name the key and where it came from; a file and the environment are
checked whole, and one OptionError lists every problem found (`OptionError.problems`),
not only the first.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

from aoe._sections import Problems, Section, given, read_section, section
from aoe.device import CPU, Device
from aoe.errors import OptionError

__all__ = [
    "CLUSTER_EXTRA",
    "DAEMON_KEYS",
    "DAEMON_SECTIONS",
    "ENV_KEYS",
    "EXECUTORS",
    "MAX_PARALLEL",
    "Config",
    "Problems",
    "Section",
    "TOML_KEYS",
    "bank_from_env",
    "default_socket",
    "default_parallel",
    "given",
    "layers_from_env",
    "load_config",
    "parse_parallel",
    "read_section",
    "section",
    "temp_runtime_dir",
]

Level = Literal["debug", "info", "warning", "error"]
#: `[cluster] executor`: where the engine's devices and compile workers run
Executor = Literal["local", "ray"]
EXECUTORS: tuple[str, ...] = get_args(Executor)
#: What a job that says `--runtime auto` may ship on (aoe.spec.Runtime's values).
RuntimeName = Literal["auto", "onnxruntime", "openvino"]
RUNTIMES: tuple[str, ...] = get_args(RuntimeName)


#: The most compile processes `[tuning] parallel`, TE_PARALLEL_COMPILER and a job's
#: options (aoe.wire) may name: AOE's range for TE_PARALLEL_COMPILER.
MAX_PARALLEL = 32


def default_parallel() -> int:
    """Compile workers by default: cores - 1, at least 1 and at most MAX_PARALLEL."""
    return min(MAX_PARALLEL, max(1, len(os.sched_getaffinity(0)) - 1))


#: The smallest address-space limit a child runs ordinary models under. Unlimited, a
#: child tuning a small MLP reserved up to 1.4 GiB (64 MiB malloc arenas per thread) for
#: about 110 MiB resident; limited, it gets by as reservations are refused (at 512 MiB
#: its peak sat at the limit and the job passed), but at 300 MiB onnxruntime's session
#: set-up failed with bad_alloc on one run of the fault test.
MIN_WORKER_MEMORY_MB = 1024


def _default_runtime_dir() -> Path:
    if os.geteuid() == 0 or os.access("/run/aoed", os.W_OK):
        return Path("/run/aoed")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "aoed"
    return temp_runtime_dir()


def temp_runtime_dir() -> Path:
    """The runtime dir of last resort, `aoed-<uid>` in the temp folder, where anyone may
    make it first: aoed makes it 0700 and refuses one that someone else made, and a
    client trusts a socket there only when this user or root made the folder
    (aoe.sockets)."""
    return Path(tempfile.gettempdir()) / f"aoed-{os.getuid()}"


def _default_bank() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/aoed/bank")
    import platformdirs

    return Path(platformdirs.user_data_dir("aoed")) / "bank"


#: AOE's AOE_MODE values and the job types they select.
_AOE_MODES = {"1": "sgat", "2": "opat", "4": "gdat"}


def job_type_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The job type AOE_MODE selects as AOE does (1 SGAT, 2 OPAT, 4 GDAT); None when it
    is not set. OptionError for another value."""
    env = os.environ if env is None else env
    raw = env.get("AOE_MODE", "").strip()
    if not raw:
        return None
    if raw not in _AOE_MODES:
        raise OptionError(f"AOE_MODE={raw}: expected 1 (SGAT), 2 (OPAT) or 4 (GDAT)")
    return _AOE_MODES[raw]


#: Sections of the TOML file that only the daemon reads (aoed.config checks them).
DAEMON_SECTIONS = ("daemon", "listen", "limits", "inbox", "metrics")
#: Keys of the shared sections that only the daemon reads (aoed.config checks them).
DAEMON_KEYS = frozenset(
    ("bank", k)
    for k in ("follow", "follow_ca", "follow_cert", "follow_key", "follow_insecure_loopback")
)


def default_socket(env: Mapping[str, str] | None = None) -> Path:
    """The daemon's unix socket: AOED_SOCKET, else `aoed.sock` in AOED_RUNTIME_DIR, else
    the system service's /run/aoed/aoed.sock when it exists, else `aoed.sock` in the
    user's runtime dir ($XDG_RUNTIME_DIR/aoed, else a per-user temp dir)."""
    env = os.environ if env is None else env
    raw = env.get("AOED_SOCKET", "").strip()
    if raw:
        return Path(raw).expanduser()
    runtime = env.get("AOED_RUNTIME_DIR", "").strip()
    if runtime:
        return Path(runtime).expanduser() / "aoed.sock"
    system = Path("/run/aoed/aoed.sock")
    # The system service's, reachable by its group though /run/aoed is not writable.
    # One behind a folder this user may not search is there too: the client then says
    # who may reach it (aoe.sockets), rather than quietly picking another.
    try:
        system.stat()
        return system
    except PermissionError:
        return system
    except OSError:
        return _default_runtime_dir() / "aoed.sock"


@dataclass(frozen=True)
class Config:
    bank: Path = field(default_factory=_default_bank)
    bank_layers: tuple[Path, ...] = ()
    repeat_tune: bool = False
    parallel: int = field(default_factory=default_parallel)
    device: Device = CPU
    #: every device the engine measures on (`[tuning] devices`); empty: `device` alone.
    #: When given, `device` is its first.
    devices: tuple[Device, ...] = ()
    plugins: tuple[str, ...] = ()
    #: what a job that says `--runtime auto` may ship on (aoe.spec.Runtime): auto lets
    #: OpenVINO compete where it is installed; onnxruntime: the engine never starts it
    runtime: str = "auto"
    runtime_dir: Path = field(default_factory=_default_runtime_dir)
    #: None: dedicated measurement cores when there are 4 or more
    dedicated_cores: bool | None = None
    #: each child's address-space limit, MiB (0: none); None: derived when the engine
    #: starts from `memory_mb` and the number of children (aoed.engine.memory)
    worker_memory_mb: int | None = None
    #: MiB the engine's processes may use; 0: what the machine says (MemAvailable, cgroup)
    memory_mb: int = 0
    #: what a model may hold (aoed.engine.prep.Limits; its MAX_* constants are these)
    max_model_mb: int = 8192
    max_nodes: int = 200_000
    max_tensor_mb: int = 4096
    #: seconds a compile worker may take: one candidate (and a bank rebuild), any other stage
    compile_timeout_s: float = 120.0
    stage_timeout_s: float = 900.0
    log_level: str = "warning"
    #: where devices measure and compile workers run: "local" (child processes of this
    #: one) or "ray" (actors of the Ray cluster at `ray_address`: aoed.engine.rayexec)
    executor: str = "local"
    ray_address: str = ""
    #: the file holding the Ray cluster's token (aoed.engine.rayauth); None: no token
    ray_token_file: Path | None = None
    #: use a Ray cluster that asks no token (the operator's explicit choice, logged)
    ray_allow_unauthenticated: bool = False
    #: where each value came from, for messages ("TUNE_BANK_PATH", "aoed.toml [bank] path")
    sources: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes` (None values ignored), recorded as given on the command line."""
        changed = {k: v for k, v in changes.items() if v is not None}
        sources = {**self.sources, **{k: "command line" for k in changed}}
        if "device" in changed and "devices" not in changed and self.devices:
            changed["devices"] = ()  # one device named on the command line replaces the list
        return _checked(replace(self, **changed, sources=sources))

    @property
    def all_devices(self) -> tuple[Device, ...]:
        """The devices to measure on: `devices`, else `device` alone."""
        return self.devices or (self.device,)


def _bool(raw: str, where: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise OptionError(f"{where}={raw!r}: expected True or False")


def parse_parallel(raw: object, where: str) -> int:
    """`raw` (a command-line or environment string) as a number of compile processes."""
    try:
        n = int(str(raw))
    except ValueError:
        raise OptionError(
            f"{where}={raw!r}: expected a number of compile processes (1-{MAX_PARALLEL})"
        ) from None
    if not 1 <= n <= MAX_PARALLEL:
        raise OptionError(f"{where}={n}: compile processes must be between 1 and {MAX_PARALLEL}")
    return n


def _checked(cfg: Config) -> Config:
    """`cfg` when its values agree with each other; else OptionError listing each that
    does not. (Each value's own type and range are checked where it is read.)"""
    problems = Problems()
    if (
        cfg.worker_memory_mb is not None
        and cfg.worker_memory_mb != 0
        and cfg.worker_memory_mb < MIN_WORKER_MEMORY_MB
    ):
        problems.add(
            f"worker_memory_mb={cfg.worker_memory_mb} ({_src(cfg, 'worker_memory_mb')}): must be 0 "
            f"(no limit) or at least {MIN_WORKER_MEMORY_MB} MiB: it limits address space, and a "
            "child's allocator and threads reserve far more of it than they use, so smaller "
            "limits fail ordinary models at random"
        )
    if cfg.memory_mb != 0 and not 2 * MIN_WORKER_MEMORY_MB <= cfg.memory_mb <= 1 << 30:
        problems.add(
            f"memory_mb={cfg.memory_mb} ({_src(cfg, 'memory_mb')}): must be 0 (what the machine has) "
            f"or at least {2 * MIN_WORKER_MEMORY_MB} MiB: a compile worker and a runner"
        )
    seen: list[Device] = []
    for d in cfg.devices:
        if clash := next((o for o in seen if o.overlaps(d)), None):
            problems.add(
                f"devices ({_src(cfg, 'devices')}): {d} and {clash} share hardware; each device (or set "
                "of cores) may be listed once"
            )
        seen.append(d)
    if cfg.devices and cfg.device != cfg.devices[0] and "device" in cfg.sources:
        problems.add(
            f"device={cfg.device} ({_src(cfg, 'device')}) and devices ({_src(cfg, 'devices')}): give one "
            "of them (`device` is the one-device spelling of `devices`)"
        )
    _check_cluster(cfg, problems)
    problems.raise_any()
    return cfg


#: Where the cluster executor comes from, for the one line that says it is missing.
CLUSTER_EXTRA = (
    'the cluster extra is not installed: pip install "aoed[cluster]" (it brings ray>=2.60)'
)


def _check_cluster(cfg: Config, problems: Problems) -> None:
    if cfg.ray_token_file is not None and not cfg.ray_token_file.is_absolute():
        problems.add(
            f"{_src(cfg, 'ray_token_file')} = {str(cfg.ray_token_file)!r}: expected the token "
            'file\'s absolute path, e.g. "/etc/aoed/ray-token"'
        )
    if cfg.executor == "ray":
        if not cfg.ray_address:
            problems.add(
                f'executor="ray" ({_src(cfg, "executor")}) needs [cluster] address: the Ray head\'s '
                'HOST:PORT, or "auto" for a cluster `ray start` began on this machine (the engine '
                "connects to a cluster, it never starts one)"
            )
        if cfg.ray_token_file is None and not cfg.ray_allow_unauthenticated:
            problems.add(
                f'executor="ray" ({_src(cfg, "executor")}) needs [cluster] token_file: the file '
                "with the token the cluster's nodes were started with (RAY_AUTH_MODE=token, "
                "deploy/README.md). Anyone who reaches a cluster without one runs code as its "
                "nodes' user; allow_unauthenticated = true uses such a cluster anyway"
            )
        elif cfg.ray_token_file is not None and cfg.ray_address == "auto":
            problems.add(
                f'address="auto" ({_src(cfg, "ray_address")}) with token_file: name the head\'s '
                "HOST:PORT; auto reads it from a file under /tmp/ray that any local user may have "
                "written, and the token would go to whatever head it names"
            )
        # find_spec only looks: importing ray here would cost a second for every config read.
        if importlib.util.find_spec("ray") is None:
            problems.add(f'executor="ray" ({_src(cfg, "executor")}): {CLUSTER_EXTRA}')


def _src(cfg: Config, name: str) -> str:
    return cfg.sources.get(name, "default")


# The engine's sections of the TOML file: each attribute is the Config field it sets
# (renamed to its key in the file where they differ), its type and Meta the bounds and
# the words of its errors; the defaults are Config's.
_MiB = Annotated[int, Meta(ge=1, le=1 << 30, description="a whole number of MiB")]
#: A limit in seconds: one candidate's compile, or another stage (up to a week).
_Seconds = Annotated[float, Meta(ge=1, le=604_800, description="a number of seconds")]
# 0 or at least MIN_WORKER_MEMORY_MB (twice that for memory_mb): _checked says so
_Memory = Annotated[int, Meta(description="a whole number of MiB")]
_Bank = section(
    "_Bank", {"bank": "path", "bank_layers": "layers"}, bank=Path, bank_layers=tuple[Path, ...]
)
_Tuning = section(
    "_Tuning",
    repeat_tune=bool,
    parallel=Annotated[
        int, Meta(ge=1, le=MAX_PARALLEL, description="a number of compile processes")
    ],
    # devices by name: Device.parse reads them (a dataclass would be read as a table)
    device=str,
    devices=Annotated[
        tuple[str, ...],
        Meta(min_length=1, description='a list of devices, e.g. ["cann:0", "cann:1"]'),
    ],
    plugins=tuple[str, ...],
    runtime=RuntimeName,
)
_Engine = section(
    "_Engine",
    runtime_dir=Path,
    dedicated_cores=bool | Literal["auto"],
    worker_memory_mb=_Memory | Literal["auto"],
    memory_mb=_Memory,
    # A zero would refuse every model, and a limit past what one machine holds is none.
    max_model_mb=_MiB,
    max_nodes=Annotated[int, Meta(ge=1, le=1_000_000_000, description="a whole number of nodes")],
    max_tensor_mb=_MiB,
    compile_timeout_s=_Seconds,
    stage_timeout_s=_Seconds,
)
_Cluster = section(
    "_Cluster",
    {
        "ray_address": "address",
        "ray_token_file": "token_file",
        "ray_allow_unauthenticated": "allow_unauthenticated",
    },
    executor=Executor,
    ray_address=Annotated[str, Meta(description='the Ray head\'s address, e.g. "10.0.0.1:6379"')],
    ray_token_file=Path,
    ray_allow_unauthenticated=bool,
)
_Log = section("_Log", {"log_level": "level"}, log_level=Level)

_SECTIONS: Mapping[str, type[Section]] = {
    "bank": _Bank,
    "tuning": _Tuning,
    "engine": _Engine,
    "cluster": _Cluster,
    "log": _Log,
}
#: The engine's keys in the TOML file, by (section, key), and the Config field each sets.
TOML_KEYS = {
    (section, f.encode_name): f.name
    for section, cls in _SECTIONS.items()
    for f in msgspec.structs.fields(cls)
}
_KEY_OF = {name: key for key, name in TOML_KEYS.items()}
#: Fields where "auto" is None in Config: the engine decides when it starts.
_AUTO = ("dedicated_cores", "worker_memory_mb")


def _finish(name: str, value: Any) -> Any:
    """A section's value for Config's field `name`: devices parsed (OptionError), "auto"
    as None."""
    if name == "device":
        return Device.parse(value)
    if name == "devices":
        return tuple(map(Device.parse, value))
    return None if name in _AUTO and value == "auto" else value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise OptionError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise OptionError(f"--config {path}: not valid TOML ({exc})") from None


def _from_toml(
    path: Path, problems: Problems | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine's settings in the file at `path` and where each came from. A file that
    cannot be read or parsed raises OptionError at once; a bad setting is recorded in
    `problems` and left out (raised at once without `problems`)."""
    own = problems is None
    problems = Problems() if problems is None else problems
    doc = _read_toml(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, table in doc.items():
        if name in DAEMON_SECTIONS:
            continue
        cls = _SECTIONS.get(name)
        if cls is None:
            known = ", ".join(sorted((*_SECTIONS, *DAEMON_SECTIONS)))
            problems.add(f"{path} [{name}]: unknown section (known: {known})")
            continue
        if not isinstance(table, dict):
            problems.add(f"{path}: {name!r} must be a [section]")
            continue
        ours = {k: v for k, v in table.items() if (name, k) not in DAEMON_KEYS}
        values_given = given(read_section(ours, cls, f"{path} [{name}]", problems))
        for field_name, value in values_given.items():
            key = _KEY_OF[field_name][1]
            where = f"{path} [{name}] {key}"
            try:
                values[field_name] = _finish(field_name, value)
            except OptionError as exc:
                problems.add(f"{where} = {ours[key]!r}: {exc}")
                continue
            sources[field_name] = where
    if own:
        problems.raise_any()
    return values, sources


def _env_path(raw: str, where: str) -> Path:
    return Path(raw).expanduser()


def _env_paths(raw: str, where: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip())


def _env_names(raw: str, where: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in raw.split(",") if s.strip())


def _env_runtime(raw: str, where: str) -> str:
    value = raw.strip()
    if value not in RUNTIMES:
        raise OptionError(f"{where}={raw!r}: expected one of {', '.join(RUNTIMES)}")
    return value


#: The environment variables that set a Config field: the field, and how its text reads
#: (ASCEND_DEVICE_ID, which sets `device` to cann:N, is read on its own).
_ENV: Mapping[str, tuple[str, Callable[[str, str], Any]]] = {
    "TUNE_BANK_PATH": ("bank", _env_path),
    "AOED_BANK_LAYERS": ("bank_layers", _env_paths),
    "REPEAT_TUNE": ("repeat_tune", _bool),
    "TE_PARALLEL_COMPILER": ("parallel", parse_parallel),
    "AOED_PLUGINS": ("plugins", _env_names),
    "AOED_RUNTIME_DIR": ("runtime_dir", _env_path),
    "AOED_TUNING_RUNTIME": ("runtime", _env_runtime),
}
#: The environment variables that set a Config field, and the field each sets.
ENV_KEYS = {var: name for var, (name, _) in _ENV.items()}


def _from_env(env: Mapping[str, str], problems: Problems) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var, (name, read) in _ENV.items():
        raw = env.get(var, "")
        if raw.strip():
            with problems.check():
                values[name] = read(raw, var)
                sources[name] = var
    ascend = env.get("ASCEND_DEVICE_ID", "").strip()
    if ascend:
        if not ascend.isdigit():
            problems.add(f"ASCEND_DEVICE_ID={ascend!r}: expected a device number")
        else:
            values["device"] = Device("cann", int(ascend))
            sources["device"] = f"ASCEND_DEVICE_ID={ascend}"
    return values, sources


def bank_from_env(env: Mapping[str, str] | None = None) -> Path:
    """The custom bank as configured by the environment alone (TUNE_BANK_PATH, the file
    AOED_CONFIG names, else the default): what a compiler's lookup uses."""
    env = os.environ if env is None else env
    raw = env.get("TUNE_BANK_PATH", "").strip()
    if raw:
        return Path(raw).expanduser()
    config = env.get("AOED_CONFIG", "").strip()
    if config:
        values, _ = _from_toml(Path(config))
        if "bank" in values:
            return values["bank"]
    return _default_bank()


def layers_from_env(env: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """The read-only layers AOED_BANK_LAYERS names (empty items skipped)."""
    env = os.environ if env is None else env
    return _env_paths(env.get("AOED_BANK_LAYERS", ""), "AOED_BANK_LAYERS")


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """The configuration from defaults, the TOML file at `path` (else AOED_CONFIG, else
    none), then the environment `env` (default: os.environ). Raises OptionError."""
    env = os.environ if env is None else env
    if path is None and env.get("AOED_CONFIG", "").strip():
        path = env["AOED_CONFIG"]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    problems = Problems()
    if path is not None:
        v, s = _from_toml(Path(path), problems)
        values.update(v)
        sources.update(s)
    v, s = _from_env(env, problems)
    values.update(v)
    sources.update(s)
    if values.get("devices") and "device" not in values:
        values["device"] = values["devices"][0]
    with problems.check():
        config = _checked(Config(**values, sources=sources))
    problems.raise_any()
    return config

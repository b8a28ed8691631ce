"""Kernel-enforced least privilege for the processes that load user programs (GDAT's
rank and inspect processes), so that a bug in a loader they run is contained.

A process confines itself with `confine(policy)` as the first thing it does, before any
library is imported (a library may start threads, and neither layer below reaches a
thread that already exists: `confine` refuses to run in a process that has more than
one). From then on, for the rest of its life and for every thread and child it starts:

- **Files** (Landlock): read only where Python, its packages and the system's libraries
  live, `/proc`, `/sys`, a few files of `/etc` and `/dev`, and the job's input;
  write only under the job's workspace. No file may be executed (execve).
- **Other processes** (Landlock): none outside this one's domain (the daemon, the other
  ranks, anything else) may be traced or have its memory read; from ABI 6 none may be
  signalled, nor reached through an abstract unix socket.
- **io_uring** (seccomp): refused, since its operations would bypass the filter below.
- **Network**: closed (`close_network()`; at once with `keep_network=False`): a seccomp
  filter synchronized to every thread refuses `socket()` for every family, `connect`,
  `bind` and `listen` (EPERM), and Landlock (ABI 4) refuses TCP bind and connect
  (EACCES). Connections made before, such as a world's gloo mesh, keep working.

A rank joins its world (gloo connects over loopback, through a FileStore in the
workspace) between `confine` and `close_network`, and opens the user's program only
after the second.

Without Landlock (kernels before 5.13, or built or booted without it, or a seccomp
filter around the service that refuses its system calls) a process is not confined:
`confine` raises SandboxError, unless the policy says that running unconfined is
allowed (`[daemon] allow_unconfined_gdat`, or AOE_GDAT_UNCONFINED=1 for an `aoe tune`
without a daemon), in which case the returned `Confinement` says why it is not
confined, for the log and the job's result.

Plain ctypes over the five system calls, not libseccomp or a Landlock binding: the
filter is a dozen BPF instructions, libseccomp is a system library that a deployment may
lack, and the Landlock binding on PyPI is a development release; this module must also
import nothing that starts a thread.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from aoe.errors import OptionError

__all__ = [
    "UNCONFINED_ENV",
    "UNCONFINED_SETTING",
    "Confinement",
    "Policy",
    "SandboxError",
    "close_network",
    "confine",
    "enter",
    "landlock_abi",
]

#: What an operator sets to let programs load unconfined where the kernel cannot confine
#: them: the daemon's setting, and the environment of an `aoe tune` without a daemon.
UNCONFINED_SETTING = "[daemon] allow_unconfined_gdat = true"
UNCONFINED_ENV = "AOE_GDAT_UNCONFINED"

# Landlock (include/uapi/linux/landlock.h); the system call numbers are the same on
# every architecture.
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_REMOVE_DIR = 1 << 4
_FS_REMOVE_FILE = 1 << 5
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_DIR = 1 << 7
_FS_MAKE_REG = 1 << 8
_FS_MAKE_SOCK = 1 << 9
_FS_MAKE_FIFO = 1 << 10
_FS_MAKE_BLOCK = 1 << 11
_FS_MAKE_SYM = 1 << 12
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1

#: The rights that may be granted on a file (the others only on a directory).
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_READ = _FS_READ_FILE | _FS_READ_DIR
_WRITE = (
    _READ
    | _FS_WRITE_FILE
    | _FS_TRUNCATE
    | _FS_MAKE_REG
    | _FS_MAKE_DIR
    | _FS_REMOVE_FILE
    | _FS_REMOVE_DIR
    | _FS_REFER
)
_DEVICE = _FS_READ_FILE | _FS_WRITE_FILE | _FS_IOCTL_DEV

_PR_SET_NO_NEW_PRIVS = 38

# seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h)
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_X32_SYSCALL_BIT = 0x40000000


@dataclass(frozen=True)
class _Arch:
    audit: int
    seccomp: int
    network: tuple[int, ...]  # socket, connect, bind, listen
    io_uring: tuple[int, ...] = (425, 426, 427)
    x32: bool = False


_ARCHES = {
    "x86_64": _Arch(0xC000003E, 317, (41, 42, 49, 50), x32=True),
    "aarch64": _Arch(0xC00000B7, 277, (198, 203, 200, 201)),
}

#: Files of /etc that the C library and Python read (name service, time zone, loader).
_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "nsswitch.conf",
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "gai.conf",
    "resolv.conf",
)
#: Device nodes every process may read (null also written).
_DEV_READ = ("/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")
#: Device nodes and shared memory an accelerator's runtime opens, by kind.
_DEVICES = {
    "cuda": ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"),
    "cann": ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
}
_DEVICE_PREFIX = {"cuda": "nvidia", "cann": "davinci"}


class SandboxError(OptionError):
    """The process could not be confined, and running unconfined was not allowed."""


@dataclass(frozen=True)
class Policy:
    """What a confined process may touch beyond the system's read-only files."""

    #: files or folders it may read (the job's input)
    read: tuple[str, ...] = ()
    #: folders it may read and write (the job's workspace)
    write: tuple[str, ...] = ()
    #: the accelerator kind whose device nodes it may use: "", "cuda" or "cann"
    devices: str = ""
    #: keep the network until close_network() (a rank joining its world); else closed at once
    keep_network: bool = False
    #: run unconfined (saying so) where the kernel cannot confine; else SandboxError
    unconfined_ok: bool = False

    def to_arg(self) -> str:
        return json.dumps(
            {
                "read": list(self.read),
                "write": list(self.write),
                "devices": self.devices,
                "keep_network": self.keep_network,
                "unconfined_ok": self.unconfined_ok,
            }
        )

    @classmethod
    def from_arg(cls, text: str) -> Policy:
        doc = json.loads(text)
        return cls(
            read=tuple(str(p) for p in doc["read"]),
            write=tuple(str(p) for p in doc["write"]),
            devices=str(doc["devices"]),
            keep_network=bool(doc["keep_network"]),
            unconfined_ok=bool(doc["unconfined_ok"]),
        )


@dataclass(frozen=True)
class Confinement:
    """What `confine` applied: Landlock's ABI and the layers in force, or why none."""

    abi: int = 0
    layers: tuple[str, ...] = ()
    #: why the process is not confined ("" when it is)
    unconfined: str = ""

    @property
    def confined(self) -> bool:
        return not self.unconfined

    def describe(self) -> str:
        if self.unconfined:
            return f"unconfined: {self.unconfined}"
        return f"confined (Landlock ABI {self.abi}: {', '.join(self.layers)})"


# --------------------------------------------------------------------------- system calls

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _syscall(nr: int, *args: object) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def landlock_abi() -> tuple[int, str]:
    """(Landlock's ABI version on this kernel, "") or (0, why there is none)."""
    try:
        return _syscall(
            _SYS_LANDLOCK_CREATE_RULESET,
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(_CREATE_RULESET_VERSION),
        ), ""
    except OSError as exc:
        why = {
            errno.ENOSYS: "this kernel has no Landlock (Linux 5.13 or later, built with it)",
            errno.EOPNOTSUPP: "Landlock is not enabled on this kernel (add landlock to the lsm= boot parameter)",
            errno.EPERM: "a seccomp filter around this process refuses Landlock's system calls "
            "(systemd: allow them with SystemCallFilter=, as deploy/systemd/aoed.service does)",
        }.get(exc.errno or 0, f"Landlock is unavailable: {exc.strerror}")
        return 0, why


def _no_new_privs() -> None:
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")


def _restrict(attr: _RulesetAttr, rules: Iterable[tuple[str, int]]) -> None:
    """Create a ruleset handling `attr`, grant each (path, rights) beneath it (paths that
    do not exist are skipped), and restrict this thread (and what it starts) to it."""
    fd = _syscall(
        _SYS_LANDLOCK_CREATE_RULESET,
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
        ctypes.c_uint32(0),
    )
    try:
        for path, rights in rules:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not os.path.isdir(f"/proc/self/fd/{target}"):
                    rights &= _FILE_RIGHTS
                rights &= attr.handled_access_fs
                if not rights:
                    continue
                beneath = _PathBeneathAttr(rights, target)
                try:
                    _syscall(
                        _SYS_LANDLOCK_ADD_RULE, fd, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0
                    )
                except OSError as exc:
                    raise OSError(exc.errno, f"Landlock rule for {path}: {exc.strerror}") from None
            finally:
                os.close(target)
        _syscall(_SYS_LANDLOCK_RESTRICT_SELF, fd, 0)
    finally:
        os.close(fd)


def _filesystem_rights(abi: int) -> int:
    handled = (1 << 13) - 1  # ABI 1: execute through make_sym
    if abi >= 2:
        handled |= _FS_REFER
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV
    return handled


def _seccomp(denied: Iterable[int], *, all_threads: bool) -> None:
    """A seccomp filter answering EPERM to the system calls `denied` (on this
    architecture; another one's are killed), on this thread or on every thread."""
    arch = _ARCHES[os.uname().machine]
    denied = sorted(set(denied))
    prog: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch.audit),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if arch.x32:  # x32 system calls reach the same kernel functions under other numbers
        prog.append((_JGE_K, len(denied) + 1, 0, _X32_SYSCALL_BIT))
    for i, nr in enumerate(denied):
        prog.append((_JEQ_K, len(denied) - i, 0, nr))
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    prog.append((_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    filters = (_SockFilter * len(prog))(*(_SockFilter(*ins) for ins in prog))
    fprog = _SockFprog(len(prog), filters)
    flags = _SECCOMP_FILTER_FLAG_TSYNC if all_threads else 0
    ret = _syscall(arch.seccomp, _SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
    if ret:  # TSYNC: the thread that could not be synchronized
        raise OSError(errno.EBUSY, f"seccomp: thread {ret} could not take the filter")


# --------------------------------------------------------------------------- the policy


def _python_paths() -> list[str]:
    """Where this interpreter, its packages and aoe/aoed themselves are read from."""
    import importlib.util

    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    roots.add(os.path.dirname(os.path.realpath(sys.executable)))
    roots.update(p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p))
    roots.update(p for p in sys.path if p.endswith(".zip"))
    # What the operator put on the path (plugins installed there), but not sys.path[0],
    # the working folder of a `python -m` process.
    roots.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    for name in ("aoe", "aoed"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.update(spec.submodule_search_locations)
    # A root of "/" (sys.path[0] is the working folder, which may be /) would open all.
    return sorted(os.path.realpath(r) for r in roots if r and os.path.realpath(r) != "/")


def _system_paths() -> list[str]:
    libs = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return [
        "/usr",
        "/lib",
        "/lib64",
        "/lib32",
        "/opt",
        "/proc",
        "/sys",
        *(f"/etc/{name}" for name in _ETC),
        *_DEV_READ,
        *libs,
    ]


def _device_nodes(kind: str) -> list[str]:
    if not kind:
        return []
    prefix = _DEVICE_PREFIX[kind]
    try:
        nodes = [f"/dev/{n}" for n in os.listdir("/dev") if n.startswith(prefix)]
    except OSError:
        nodes = []
    # The runtimes' shared memory (NCCL's, HCCL's) lives in /dev/shm.
    return sorted({*nodes, *_DEVICES[kind], "/dev/shm"})


def _rules(policy: Policy) -> list[tuple[str, int]]:
    rules = [(p, _READ) for p in (*_python_paths(), *_system_paths(), *policy.read)]
    rules.append(("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE))
    # The peak-RSS count a child restarts before each request (aoed.backends._wire).
    rules.append(("/proc/self/clear_refs", _FS_WRITE_FILE))
    rules += [(p, _WRITE) for p in policy.write]
    rules += [(p, _WRITE | _DEVICE) for p in _device_nodes(policy.devices)]
    return rules


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def confine(policy: Policy) -> Confinement:
    """Confine this process for good (see the module doc). Returns what was applied, or
    why nothing was when the kernel cannot and `policy.unconfined_ok`; raises
    SandboxError naming what is missing otherwise. Must be called while this process
    has one thread (RuntimeError if not: the other threads would stay unconfined)."""
    if _threads() > 1:
        raise RuntimeError(
            f"confine() with {_threads()} threads: it must run before anything starts a thread"
        )
    abi, why = landlock_abi()
    if abi and os.uname().machine not in _ARCHES:
        abi, why = 0, f"seccomp filters are not written for {os.uname().machine}"
    if not abi:
        if policy.unconfined_ok:
            return Confinement(unconfined=why)
        raise SandboxError(
            f"{why}: programs (a .pt2) and TensorFlow SavedModels are loaded only in a "
            "confined process; run the job on a "
            f"kernel with Landlock, or set {UNCONFINED_SETTING} (a daemon) or "
            f"{UNCONFINED_ENV}=1 (aoe tune without a daemon) to load them unconfined"
        )
    arch = _ARCHES[os.uname().machine]
    layers = ["files"]
    attr = _RulesetAttr(_filesystem_rights(abi), 0, 0)
    if abi >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL
        layers.append("signals")
    if abi >= 4 and not policy.keep_network:
        attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP
    try:
        _no_new_privs()
        _restrict(attr, _rules(policy))
        denied = list(arch.io_uring)
        if not policy.keep_network:
            denied += arch.network
        _seccomp(denied, all_threads=False)
    except OSError as exc:
        # Half applied is not applied: the process must not go on to load anything.
        raise SandboxError(f"confining this process failed: {exc}") from None
    if not policy.keep_network:
        layers.append("network")
    if policy.write:  # temporary files go where writing is allowed
        os.environ["TMPDIR"] = policy.write[0]
    return Confinement(abi, tuple(layers))


def close_network() -> None:
    """Refuse new network connections from now on, on every thread of this process (see
    the module doc); connections made before keep working. Raises SandboxError."""
    abi, why = landlock_abi()
    arch = _ARCHES.get(os.uname().machine)
    if not abi or arch is None:
        raise SandboxError(f"closing the network: {why or 'unsupported architecture'}")
    try:
        _seccomp(arch.network, all_threads=True)
        if abi >= 4:  # a second layer, on this thread and those it starts
            _restrict(_RulesetAttr(0, _NET_BIND_TCP | _NET_CONNECT_TCP, 0), ())
    except OSError as exc:
        raise SandboxError(f"closing the network failed: {exc}") from None


def enter(argv: list[str]) -> Confinement | SandboxError | None:
    """Confine this process by the policy on its command line (`--sandbox JSON`, which
    is removed from `argv`): the first thing a program that loads user programs does.
    Returns what was applied, or the SandboxError when it could not be (the program
    answers every request with it), or None when the command line gives no policy."""
    if "--sandbox" not in argv:
        return None
    i = argv.index("--sandbox")
    text = argv[i + 1]
    del argv[i : i + 2]
    try:
        return confine(Policy.from_arg(text))
    except SandboxError as exc:
        return exc

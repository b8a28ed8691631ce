"""The one error hierarchy of aoe and aoed.

Every error a user can cause or meet derives from `AoedError`. Each class maps to one
process exit code (`exit_code`) and one gRPC status name (`grpc_status`), so the CLI,
the daemon and the API report the same failure the same way. Foreign errors (onnx,
onnxruntime, lmdb, OSError) are translated into these at the edge where they occur;
the message names the file, node or option at fault and says what to do.

    AoedError
    ├── OptionError        a command-line option, config key or request field is wrong
    │   └── NotFoundError  no such job, upload or daemon-side file
    ├── PermissionDeniedError
    │                      a daemon-side path outside the allowed directories, or a file
    │                      there with several hard links; a daemon socket this user may
    │                      not reach, or one not to trust (aoe.sockets)
    ├── JobStateError      the job is not in a state that allows the call (results of
    │                      a job that has not succeeded)
    ├── ModelError         a model cannot be read, checked or prepared
    ├── BankError          the knowledge bank cannot be opened, read or written
    │   ├── BankBusyError  another process is writing the bank (one writer at a time)
    │   ├── BankDamagedError
    │   │                  the bank's data file is damaged (truncated, pages LMDB cannot
    │   │                  read) or LMDB gave up on it in this process: names the file
    │   │                  and what to do (aoe.lmdbcheck)
    │   └── BankWriteError a write did not reach the bank (its disk or its map is full,
    │                      or the disk failed the write): none of it was written, and
    │                      what the bank held before is intact
    ├── DeviceError        the measuring device or its runner failed
    ├── CandidateError     one candidate failed to compile or measure (costs that candidate)
    ├── JobCancelledError  the job was cancelled
    ├── DaemonUnavailableError
    │                      no daemon answers at the address (not running, restarting,
    │                      shutting down): start aoed or pick another address
    └── ResourceExhaustedError
        │                  the daemon is at a limit (queue full, upload too large):
        │                  try later or ask for less
        └── DiskFullError  a folder the daemon writes is full, or below its free-space
                           floor (`[limits] min_free_mb`): names the folder and its
                           free space

A client (`aoe.Client`) turns each gRPC status back into the class that sends it; a
status several classes share comes back as the most general one:
INVALID_ARGUMENT as OptionError, NOT_FOUND as NotFoundError, FAILED_PRECONDITION as
BankError from the bank service (else JobStateError), UNAVAILABLE as
DaemonUnavailableError, the server's message kept.

Structured concurrency raises what failed inside an exception group; `first_error`
picks from one the error to report.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AoedError",
    "BankBusyError",
    "BankDamagedError",
    "BankError",
    "BankWriteError",
    "CandidateError",
    "DaemonUnavailableError",
    "DeviceError",
    "DiskFullError",
    "JobCancelledError",
    "JobStateError",
    "ModelError",
    "NotFoundError",
    "OptionError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "first_error",
]


class AoedError(Exception):
    """Base of every aoe/aoed error; `str(err)` is a complete one-line message."""

    exit_code = 1
    grpc_status = "INTERNAL"


class OptionError(AoedError):
    """`problems` lists every problem when a whole input was checked at once (a
    configuration file); `str(err)` is then one line that names them all."""

    exit_code = 2
    grpc_status = "INVALID_ARGUMENT"

    def __init__(self, message: str = "", problems: Sequence[str] = ()):
        self.problems = list(problems) or [message]
        if not message:
            n = len(self.problems)
            message = self.problems[0] if n == 1 else f"{n} problems: " + "; ".join(self.problems)
        super().__init__(message)


class NotFoundError(OptionError):
    """No such job, upload or daemon-side file."""

    grpc_status = "NOT_FOUND"


class PermissionDeniedError(AoedError):
    """A daemon-side path outside the allowed directories, or a model file there with
    several hard links (which may be a file from elsewhere); on the client's side, a
    daemon socket this user may not reach, or one that someone other than root or the
    daemon's user could have put there (aoe.sockets)."""

    grpc_status = "PERMISSION_DENIED"


class JobStateError(AoedError):
    """The job is not in a state that allows the call (e.g. downloading the results of
    a job that has not succeeded)."""

    grpc_status = "FAILED_PRECONDITION"


class ModelError(AoedError):
    exit_code = 3
    grpc_status = "INVALID_ARGUMENT"


class BankError(AoedError):
    exit_code = 4
    grpc_status = "FAILED_PRECONDITION"


class BankBusyError(BankError):
    """Another process holds the bank's writer lock; `holder` names it (pid, command,
    since when) as that process recorded it, or says it is unknown."""

    grpc_status = "UNAVAILABLE"

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class BankDamagedError(BankError):
    """The bank's data file is damaged: shorter than its last commit, or with pages LMDB
    cannot read (found before LMDB maps it, by aoe.lmdbcheck, or reported by LMDB); or
    LMDB gave up on the bank in this process (MDB_PANIC, after a failed write of its
    meta page). The message names the file and what to do."""


class BankWriteError(BankError):
    """A commit did not reach the bank: its disk or its map is full, or the disk failed
    the write. LMDB commits are atomic, so nothing of that write is in the bank and
    everything committed before is; the next write may succeed once there is room."""

    grpc_status = "RESOURCE_EXHAUSTED"


class DeviceError(AoedError):
    exit_code = 5
    grpc_status = "UNAVAILABLE"


class CandidateError(AoedError):
    exit_code = 6
    grpc_status = "ABORTED"


class JobCancelledError(AoedError):
    exit_code = 130
    grpc_status = "CANCELLED"


class DaemonUnavailableError(AoedError):
    """No daemon answers at the address: not running, restarting or shutting down."""

    exit_code = 7
    grpc_status = "UNAVAILABLE"


class ResourceExhaustedError(AoedError):
    """The daemon is at a limit (its queue is full, an upload is too large)."""

    exit_code = 8
    grpc_status = "RESOURCE_EXHAUSTED"


class DiskFullError(ResourceExhaustedError):
    """A folder the daemon writes is full (or below `[limits] min_free_mb`); the message
    names the folder and its free space. `folder` and `free_bytes` say the same."""

    def __init__(self, message: str, folder: str = "", free_bytes: int = -1):
        super().__init__(message)
        self.folder = folder
        self.free_bytes = free_bytes


def first_error(group: BaseExceptionGroup, *classes: type[BaseException]) -> BaseException:
    """The error to report from `group` (what a nursery raises): its first exception,
    depth first, of the first of `classes` it holds; `group` itself when it holds none."""
    for cls in classes:
        match: BaseException | None = group.subgroup(cls)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        if match is not None:
            return match
    return group

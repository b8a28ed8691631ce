"""A child process spoken to in JSON lines, owned by one trio task at a time.

`call()` sends one request (a messages.Request) and waits for its answer, whose reply
it reads strictly as the request's reply type (messages.decode). Anything that breaks the
exchange (the child exits, answers what is not the reply, the caller is cancelled, a
deadline passes) kills the child, and the next `call()` starts a fresh one: a crashed or
hung child costs the request in flight, never the caller.

Children start through exec (`python -m MODULE`), never by forking the engine, so a
process that has started gRPC can spawn them safely. Each is told its parent's pid (it
dies with it: PR_SET_PDEATHSIG, so a killed engine never leaves workers behind, stopped
or not), the cores it may run on and its address-space limit, and does not inherit the
service manager's notification or watchdog variables. Each gets a temp folder of its own
(TMPDIR), removed once it is reaped: what it or its own children leave there when they
are killed (a measurement's scratch, a runtime's caches) goes with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import msgspec
import trio

from aoe.errors import CandidateError
from aoed.engine.messages import Answer, Call, MessageError, Request, decode, encode

__all__ = ["Child", "ChildDiedError", "read_answer"]

#: Variables that address the service manager; only the daemon itself may use them.
_PRIVATE_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


class ChildDiedError(CandidateError):
    """The child process exited or broke the protocol during a request."""


def read_answer(line: bytes, request: Request, who: str) -> Answer:
    """The `Answer` on `line`, its reply decoded strictly as `request`'s reply type when
    it was served. ChildDiedError naming `who` (and the field) when it is malformed."""
    try:
        answer: Answer = decode(Answer, json.loads(line))
        if answer.ok:
            answer = msgspec.structs.replace(
                answer, reply=decode(type(request).reply, answer.reply)
            )
    except (ValueError, MessageError) as exc:
        raise ChildDiedError(f"{who} broke the protocol: {exc}") from None
    return answer


class _Process:
    """A child started from the calling thread, with trio streams on its pipes.

    Not `trio.lowlevel.open_process`: that forks from a worker thread, and a child's
    PR_SET_PDEATHSIG fires when the *thread* that forked it exits; trio retires idle
    worker threads, which then killed healthy children. Forking here, from the trio
    thread (the main thread: it lives as long as the engine), makes "the parent died"
    mean the engine died. The fork is a vfork/exec of a fresh interpreter: brief.
    """

    def __init__(self, argv: list[str], log: IO[bytes], env: dict[str, str]) -> None:
        self._popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,  # a terminal's ^C reaches the engine, which stops us
        )
        assert self._popen.stdin is not None and self._popen.stdout is not None
        self.pid = self._popen.pid
        self.stdin = trio.lowlevel.FdStream(os.dup(self._popen.stdin.fileno()))
        self.stdout = trio.lowlevel.FdStream(os.dup(self._popen.stdout.fileno()))
        self._popen.stdin.close()
        self._popen.stdout.close()
        self._pidfd = os.pidfd_open(self.pid)

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        if self._popen.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
        status = self._popen.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return status


class Child:
    def __init__(
        self,
        module: str,
        name: str,
        log_path: Path,
        *,
        cpus: Sequence[int] = (),
        memory_mb: int = 0,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        restart: bool = True,
    ):
        """`env`: variables set for the child over this process's environment.
        `restart`: a call after the child died starts a fresh one; without it (a member
        of a group that must start together, such as the ranks of a world) such a call
        raises ChildDiedError."""
        self._argv = [sys.executable, "-m", module, "--parent", str(os.getpid())]
        if cpus:
            self._argv += ["--cpus", ",".join(map(str, cpus))]
        if memory_mb:
            self._argv += ["--memory-mb", str(memory_mb)]
        self._argv += list(args)
        self._env = dict(env or {})
        self._restart = restart
        self.name = name
        self.log_path = log_path
        self._proc: _Process | None = None
        self._buf = b""
        self._seq = 0
        self._paused = False
        self.restarts = -1
        #: the running child's temp folder (its TMPDIR), made at its start
        self.tmp: Path | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def _start(self) -> _Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV} | self._env
        self._drop_tmp()  # a child that died on its own: its folder goes before the next's
        if "TMPDIR" not in self._env:
            self.tmp = Path(tempfile.mkdtemp(prefix="aoed-child-"))
            env["TMPDIR"] = str(self.tmp)
        # The child's log, opened for the fork below, which blocks the run as long.
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230
            self._proc = _Process(self._argv, log, env)
        self._buf = b""
        self.restarts += 1
        if self._paused:  # started while its pool is paused: it must not run either
            os.kill(self._proc.pid, signal.SIGSTOP)
        return self._proc

    async def start(self) -> None:
        """Start the child unless it runs. A checkpoint comes first, so a cancelled
        caller starts nothing, and each start of a loop over many children lets the
        caller's cancellation and other tasks in. OSError when it cannot be started."""
        await trio.lowlevel.checkpoint()
        if self._proc is None or self._proc.returncode is not None:
            await self._start()

    async def _readline(self, proc: _Process) -> bytes:
        while b"\n" not in self._buf:
            chunk = await proc.stdout.receive_some(1 << 16)
            if not chunk:
                status = await proc.wait()
                raise ChildDiedError(
                    f"{self.name} exited with status {status} (log: {self.log_path})"
                )
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    async def call(self, request: Request) -> Answer:
        """Send `request`; return the child's answer, its reply decoded when it was
        served. Raises ChildDiedError (the child exited, or broke the protocol: the text
        names the field of a malformed answer); kills the child when cancelled
        mid-request (the next call starts a fresh one)."""
        if self._proc is not None and self._proc.returncode is None:
            proc = self._proc
        elif self._restart or (self._proc is None and self.restarts < 0):
            proc = await self._start()
        else:
            status = self._proc.returncode if self._proc is not None else "unknown"
            await self.aclose()
            raise ChildDiedError(f"{self.name} exited with status {status} (log: {self.log_path})")
        self._seq += 1
        line = json.dumps(encode(Call(self._seq, request))).encode() + b"\n"
        try:
            await proc.stdin.send_all(line)
            while True:
                answer = read_answer(
                    await self._readline(proc), request, f"{self.name} (log: {self.log_path})"
                )
                # None: the child could not read this request (the one in flight) at all.
                if answer.id in (self._seq, None):
                    return answer
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.aclose()
            raise ChildDiedError(f"{self.name} closed its pipe (log: {self.log_path})") from None
        except BaseException:
            await self.aclose()
            raise

    def pause(self) -> None:
        """Stop the child (SIGSTOP) until `resume()`; one started meanwhile starts stopped."""
        self._paused = True
        if self._proc is not None and self._proc.returncode is None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        self._paused = False
        if self._proc is not None and self._proc.returncode is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    async def aclose(self) -> None:
        """Kill and reap the child (shielded, bounded)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            if proc.returncode is None:
                proc.kill()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            await proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    await stream.aclose()
        if proc.returncode is not None:  # reaped: nothing of it writes there any more
            self._drop_tmp()

    def _drop_tmp(self) -> None:
        tmp, self.tmp = self.tmp, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
